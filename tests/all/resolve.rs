//! Effects an operator resolves by hand (docs/operations.md, "Resolving an
//! effect by hand"): the outcome of a call in doubt or failed is written,
//! with who and when, and the run goes on as if the call had returned it.
//! Both backends.

use std::sync::Arc;

use anyhow::{Result, ensure};
use leasehold::executor::Executor;
use leasehold::store::{Completion, EffectCall, EffectClass, EffectState, NewRun, Outcome, Resolution, RunStatus, StoreError, Suspend};
use serde_json::{Value, json};

use crate::harness::{TTL, TestDb, both};
use crate::plugins;
use crate::sink::Sink;

fn worker(db: &TestDb, rt: &Arc<leasehold::runtime::Runtime>, owner: &str) -> Executor {
    crate::harness::executor(db, rt, owner)
}

fn call(seq: i64, name: &str) -> EffectCall {
    EffectCall { seq, name: name.into(), request_hash: format!("h{seq}"), request: String::new(), emit_pos: 0 }
}

fn conflict(r: Result<impl std::fmt::Debug, StoreError>, says: &str) -> Result<()> {
    match r {
        Err(StoreError::Conflict { message, .. }) if message.contains(says) => Ok(()),
        other => anyhow::bail!("expected a conflict saying {says:?}, got {other:?}"),
    }
}

both! {
    async fn an_unkeyed_call_in_doubt_resolved_by_hand_lets_its_failed_run_complete_with_that_result(db) {
        let sink = Sink::start().await?;
        sink.hold(true);
        let rt = plugins::runtime()?;
        let mut limits = plugins::test_limits();
        limits.http_allow = vec![sink.allow()];
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
        let input = json!({ "mode": "http", "url": sink.url, "keyed": false, "fail_in_doubt": true });
        let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        // Host A dies with the call in flight; B finds it in doubt, and the
        // turn fails the run.
        crate::harness::kill_when(db, worker(db, &rt, "host-a"), id, async || Ok(!sink.hits().is_empty())).await?;
        sink.hold(false);
        worker(db, &rt, "host-b").drain().await?;
        let failed = db.store.get_run(id).await?;
        ensure!(failed.status == RunStatus::Failed, "{:?}: {:?}", failed.status, failed.error);
        ensure!(db.store.effects(id).await?[0].state == EffectState::InDoubt, "the row is not in doubt");

        // The operator checked by hand: it happened. Through the API.
        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        leasehold::effects::http::install_tls();
        let http = reqwest::Client::new();
        let post = async |path: String, body: Value| -> Result<(u16, Value)> {
            let resp = http.post(format!("{base}{path}")).json(&body).send().await?;
            Ok((resp.status().as_u16(), resp.json().await?))
        };
        let result = json!({ "status": 200, "headers": {}, "body": "done by hand" });
        for bad in [json!({}), json!({ "result": 1, "error": "x" }), json!({ "error": "" }), json!({ "result": 1, "by": "" }), json!({ "result": 1, "by": "a\nb" })] {
            let (status, e) = post(format!("/v1/runs/{id}/effects/0/resolve"), bad.clone()).await?;
            ensure!(status == 400 && e["error"]["message"].is_string(), "{bad}: {status} {e}");
        }
        let (status, e) = post(format!("/v1/runs/{id}/effects/7/resolve"), json!({ "result": 1 })).await?;
        ensure!(status == 404, "a missing row: {status} {e}");
        let (status, done) = post(format!("/v1/runs/{id}/effects/0/resolve"), json!({ "result": result, "by": "alice" })).await?;
        ensure!(status == 200, "{status} {done}");
        ensure!(done["effect"]["state"] == "committed" && done["effect"]["resolved_by"] == "alice" && done["effect"]["resolved_at"].is_i64(), "{done}");
        ensure!(done["run"]["status"] == "queued" && done["run"]["fence"].as_i64() > Some(failed.fence), "the run was not queued again: {done}");

        worker(db, &rt, "host-b").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed, "{:?}: {:?}", run.status, run.error);
        let output: Value = serde_json::from_str(run.output.as_deref().unwrap_or("null"))?;
        ensure!(output == result, "the turn got {output} for the call");
        ensure!(sink.hits().len() == 1, "the call was made again: {:?}", sink.hits());
        let events = db.store.events_after(&run.thread_id, 0, 1000).await?;
        ensure!(events.iter().any(|e| e.kind == "resolved" && e.payload.contains("alice")), "no resolved event");
        // The thread keeps both of its ends, in order: the failure the
        // resolve undid, then the completion.
        let messages: Vec<Value> = events.iter().filter(|e| e.kind == "message").map(|e| serde_json::from_str(&e.payload)).collect::<Result<_, _>>()?;
        let said: Vec<&str> = messages.iter().map(|m| m["status"].as_str().unwrap_or("")).collect();
        ensure!(said == ["failed", "completed"], "the thread's messages say {said:?}: {messages:?}");
        ensure!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1) && events[0].seq == 1, "the log has gaps: {:?}", events.iter().map(|e| e.seq).collect::<Vec<_>>());
        // An ended run's rows stay as they are.
        let (status, e) = post(format!("/v1/runs/{id}/effects/0/resolve"), json!({ "error": "no" })).await?;
        ensure!(status == 409, "{status} {e}");
        server.stop().await;
        Ok(())
    }

    async fn only_the_last_row_not_committed_of_a_run_not_running_may_be_resolved(db) {
        let s = &db.store;
        let id = s.create_run(&NewRun::new("p", "{}")).await?.0.id;
        let a = s.claim("a", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        s.begin_effect(&a.lease, &call(0, "http.unkeyed"), EffectClass::Unkeyed).await?;
        conflict(s.resolve_effect(id, 0, &Resolution::Result("1".into()), "op").await, "running")?;
        s.begin_effect(&a.lease, &call(1, "http"), EffectClass::Keyed).await?;
        s.complete_effect(&a.lease, 1, &Completion::Committed("{}".into())).await?;
        s.begin_effect(&a.lease, &call(2, "http.unkeyed"), EffectClass::Unkeyed).await?;
        s.suspend(&a.lease, &Suspend::Sleep { delay_ms: 60_000 }).await?;
        let asleep = s.get_run(id).await?;
        conflict(s.resolve_effect(id, 0, &Resolution::Result("1".into()), "op").await, "later")?;
        conflict(s.resolve_effect(id, 1, &Resolution::Result("1".into()), "op").await, "committed")?;
        ensure!(matches!(s.resolve_effect(id, 9, &Resolution::Result("1".into()), "op").await, Err(StoreError::EffectNotFound { .. })), "a missing row");
        let (row, run) = s.resolve_effect(id, 2, &Resolution::Result("\"ok\"".into()), "op").await?;
        ensure!(row.state == EffectState::Committed && row.result.as_deref() == Some("\"ok\"") && row.resolved_by.as_deref() == Some("op"), "{row:?}");
        // A sleeping run goes on sleeping; its fence moves, so no segment of
        // before writes again.
        ensure!(run.status == RunStatus::Queued && run.not_before == asleep.not_before && run.fence == asleep.fence + 1, "{run:?}");
        ensure!(s.complete_effect(&a.lease, 2, &Completion::Committed("{}".into())).await.is_err_and(|e| e.is_lease_lost()), "the old lease still writes");
        // A completed run's rows stay as they are.
        let done = s.create_run(&NewRun::new("p", "{}")).await?.0.id;
        let b = s.claim("b", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        ensure!(b.lease.run_id == done, "claimed {} not {done}", b.lease.run_id);
        s.begin_effect(&b.lease, &call(0, "http.unkeyed"), EffectClass::Unkeyed).await?;
        s.close(&b.lease, &Outcome::Completed { output: "\"x\"".into() }).await?;
        conflict(s.resolve_effect(done, 0, &Resolution::Error("{}".into()), "op").await, "ended")?;
        Ok(())
    }

    async fn a_model_chat_result_with_bad_usage_is_refused(db) {
        let s = &db.store;
        let id = s.create_run(&NewRun { budget_tokens: Some(10_000), ..NewRun::new("p", "{}") }).await?.0.id;
        let a = s.claim("a", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        s.begin_effect(&a.lease, &call(0, "model.chat"), EffectClass::Keyed).await?;
        s.suspend(&a.lease, &Suspend::Sleep { delay_ms: 60_000 }).await?;
        for bad in [json!({ "total_tokens": -500 }), json!({ "total_tokens": "abc" }), json!({ "total_tokens": 1.5 }), json!("lots")] {
            let result = json!({ "content": "x", "usage": bad }).to_string();
            let refused = s.resolve_effect(id, 0, &Resolution::Result(result), "op").await;
            ensure!(matches!(refused, Err(StoreError::Config(_))), "usage {bad} was taken: {:?}", refused.map(|(r, _)| r.state));
        }
        ensure!(s.budget(id).await?.spent == 0);
        let good = json!({ "content": "x", "usage": { "total_tokens": 700 } }).to_string();
        s.resolve_effect(id, 0, &Resolution::Result(good), "op").await?;
        ensure!(s.budget(id).await?.spent == 700, "{:?}", s.budget(id).await?);
        Ok(())
    }
}
