//! Reruns from a point in the ledger (docs/operations.md, "Rerunning from
//! a point in the ledger"): the new run replays the old one's rows below
//! `from_seq`, performing none of them, and runs the rest live; the old
//! run is not changed; a prefix that does not replay on the version asked
//! for is refused. Both backends, through the API.

use std::sync::Arc;

use anyhow::{Result, ensure};
use leasehold::executor::Executor;
use leasehold::store::{NewRun, RunStatus};
use serde_json::{Value, json};

use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

fn worker(db: &TestDb, rt: &Arc<leasehold::runtime::Runtime>) -> Executor {
    crate::harness::executor(db, rt, "host-a")
}

async fn send(base: &str, path: &str, body: Option<Value>) -> Result<(u16, Value)> {
    let http = reqwest::Client::new();
    let b = match body {
        Some(body) => http.post(format!("{base}{path}")).json(&body),
        None => http.get(format!("{base}{path}")),
    };
    let resp = b.send().await?;
    Ok((resp.status().as_u16(), resp.json().await?))
}

both! {
    async fn a_rerun_performs_only_the_calls_from_its_position_and_ends_as_a_fresh_run(db) {
        let sink = Sink::start().await?;
        let rt = plugins::runtime()?;
        let mut limits = plugins::test_limits();
        limits.http_allow = vec![sink.allow()];
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
        let input = json!({ "mode": "http-steps", "steps": 6, "url": sink.url });
        let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        worker(db, &rt).drain().await?;
        let old = db.store.get_run(id).await?;
        ensure!(old.status == RunStatus::Completed && sink.hits().len() == 6, "{:?}, {} hits", old.status, sink.hits().len());

        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let (status, new) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(json!({ "from_seq": 3 }))).await?;
        ensure!(status == 201 && new["rerun_of"] == id && new["rerun_from"] == 3, "{status} {new}");
        let new_id = new["id"].as_i64().unwrap_or_default();
        worker(db, &rt).drain().await?;
        let rerun = db.store.get_run(new_id).await?;
        ensure!(rerun.status == RunStatus::Completed, "{:?}: {:?}", rerun.status, rerun.error);
        ensure!(rerun.output == old.output && rerun.partial == old.partial, "the rerun ended otherwise: {:?} {:?} / {:?} {:?}", rerun.output, rerun.partial, old.output, old.partial);
        let live: Vec<Value> = sink.hits()[6..].iter().map(|h| serde_json::from_str(&h.body)).collect::<Result<_, _>>()?;
        ensure!(live == [json!({ "step": 3 }), json!({ "step": 4 }), json!({ "step": 5 })], "the sink saw {live:?}");
        // The old run is as it was, and names its rerun.
        let (_, shown) = send(&base, &format!("/v1/runs/{id}"), None).await?;
        ensure!(shown["reruns"] == json!([new_id]) && shown["updated_at"] == old.updated_at, "{shown}");
        ensure!(db.store.effects(id).await?.len() == 6, "the old ledger changed");

        for (body, want) in [(json!({ "from_seq": 7 }), 409), (json!({ "from_seq": -1 }), 409), (json!({ "from_seq": 1, "plugin_digest": "nope" }), 404), (json!({}), 400)] {
            let (status, e) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(body.clone())).await?;
            ensure!(status == want && e["error"]["message"].is_string(), "{body}: {status} {e}");
        }
        let (status, _) = send(&base, "/v1/runs/999999/rerun", Some(json!({ "from_seq": 0 }))).await?;
        ensure!(status == 404, "a missing run: {status}");
        server.stop().await;
        Ok(())
    }

    async fn a_prefix_that_does_not_replay_on_the_version_asked_for_is_refused(db) {
        let rt = plugins::runtime()?;
        let v1 = rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let input = json!({ "steps": 4, "prefix": "k" });
        let id = db.store.create_run(&NewRun { plugin_digest: v1.digest.clone(), ..NewRun::new("testkit", input.to_string()) }).await?.0.id;
        worker(db, &rt).drain().await?;
        // v2's second call (seq 1) differs from v1's.
        let v2 = rt.add_plugin("testkit", &plugins::testkit_v2()?, plugins::test_limits())?;
        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let (status, e) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(json!({ "from_seq": 3, "plugin_digest": v2.digest }))).await?;
        ensure!(status == 409 && e["error"]["message"].as_str().is_some_and(|m| m.contains("call 1")), "{status} {e}");
        // Below the change it replays on v2; and on its own version anywhere.
        let (status, on_v2) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(json!({ "from_seq": 1, "plugin_digest": v2.digest }))).await?;
        ensure!(status == 201 && on_v2["plugin_digest"] == v2.digest.as_str(), "{status} {on_v2}");
        let (status, on_v1) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(json!({ "from_seq": 3 }))).await?;
        ensure!(status == 201 && on_v1["plugin_digest"] == v1.digest.as_str(), "{status} {on_v1}");
        worker(db, &rt).drain().await?;
        for new in [&on_v2, &on_v1] {
            let run = db.store.get_run(new["id"].as_i64().unwrap_or_default()).await?;
            ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("did 4 steps"), "{:?} {:?} {:?}", run.status, run.output, run.error);
        }
        server.stop().await;
        Ok(())
    }

    async fn a_rerun_streams_the_answers_its_replayed_prefix_holds(db) {
        let model = crate::fake_model::FakeModel::start(crate::fake_model::echo()).await?;
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let input = json!({ "mode": "script", "ops": [{ "op": "chat", "prompt": "q0" }, { "op": "emit", "text": " and after" }, { "op": "chat", "prompt": "q1" }] });
        let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        crate::fake_model::worker(db, &rt, "host-a", &model).drain().await?;
        let old = db.store.get_run(id).await?;
        ensure!(old.status == RunStatus::Completed && old.partial.contains("q0"), "{:?} {:?}", old.status, old.partial);
        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let (status, new) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(json!({ "from_seq": 1 }))).await?;
        ensure!(status == 201, "{status} {new}");
        crate::fake_model::worker(db, &rt, "host-a", &model).drain().await?;
        let rerun = db.store.get_run(new["id"].as_i64().unwrap_or_default()).await?;
        ensure!(rerun.status == RunStatus::Completed && rerun.output == old.output, "{:?} {:?} {:?}", rerun.status, rerun.output, rerun.error);
        ensure!(rerun.partial == old.partial, "the rerun's stream {:?} is not the run's {:?}", rerun.partial, old.partial);
        ensure!(model.hits().len() == 3, "{} calls: the replayed one went out again", model.hits().len());
        server.stop().await;
        Ok(())
    }
}

both! {
    async fn a_reruns_live_part_draws_what_the_old_run_drew_there(db) {
        // The documented rule: a rerun goes on with the old run's random
        // stream, so on the same version it reproduces, not re-rolls.
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let input = json!({ "mode": "script", "ops": [
            { "op": "put-random", "key": "a" }, { "op": "random", "bytes": 16 }, { "op": "put-random", "key": "b" },
        ] });
        let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        worker(db, &rt).drain().await?;
        let old = db.store.get_run(id).await?;
        ensure!(old.status == RunStatus::Completed, "{:?}", old.error);
        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let (status, new) = send(&base, &format!("/v1/runs/{id}/rerun"), Some(json!({ "from_seq": 1 }))).await?;
        ensure!(status == 201, "{status} {new}");
        worker(db, &rt).drain().await?;
        let rerun = db.store.get_run(new["id"].as_i64().unwrap_or_default()).await?;
        ensure!(rerun.status == RunStatus::Completed && rerun.output == old.output, "{:?} / {:?}", rerun.output, old.output);
        server.stop().await;
        Ok(())
    }
}
