//! Replay and the stream, on both backends: whatever deaths and failures a
//! turn meets, a reader of its thread that applies `retract` events sees
//! exactly the final output's stream; recorded failures, refusals and
//! "in progress" answers replay as they happened. The guest is testkit's
//! `script` mode, the model a fake, the remote side a counting sink.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::effects::model::ModelConfig;
use leasehold::store::log::replay_stream;
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::runtime::{Limits, Runtime};
use leasehold::store::{EffectState, NewRun, RunStatus, Store};
use serde_json::{Value, json};

use crate::fake_model::{FAIL, FakeModel, Script};
use crate::harness::{kill_when, TestDb, both};
use crate::plugins;
use crate::sink::Sink;

fn runtime(allow: Vec<String>) -> Result<Arc<Runtime>> {
    let rt = plugins::runtime()?;
    let limits = Limits { http_allow: allow, segment_budget: Duration::from_secs(20), ..plugins::test_limits() };
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    Ok(rt)
}

fn worker(db: &TestDb, rt: &Arc<Runtime>, owner: &str, model: Option<&FakeModel>) -> Executor {
    let model = model.map(|m| {
        let mut config = ModelConfig::new(&m.base_url);
        config.timeout = Duration::from_secs(20);
        Arc::new(config)
    });
    let config = ExecutorConfig { model, ..crate::harness::worker(owner) };
    Executor::new(db.store.clone(), rt.clone(), config)
}

async fn submit(store: &Store, ops: Value) -> Result<i64> {
    Ok(store.create_run(&NewRun::new("testkit", json!({ "mode": "script", "ops": ops }).to_string())).await?.0.id)
}

/// What a reader of the thread log sees once it applies `retract` events.
async fn streamed(store: &Store, run_id: i64) -> Result<String> {
    let events = store.run_events(run_id).await?;
    Ok(replay_stream(events.iter().map(|e| (e.kind.as_str(), e.payload.as_str()))).concat())
}

both! {
    async fn a_chat_that_failed_mid_stream_keeps_the_streams_positions_on_replay(db) {
        // The chat streams d1, d2 and fails; the turn emits x, sleeps, and
        // emits y and z. The replay after the sleep must not take y and z
        // for deltas already written.
        let script: Script = Arc::new(|_, _| vec!["d1".into(), "d2".into(), FAIL.into()]);
        let model = FakeModel::start(script).await?;
        let rt = runtime(vec![])?;
        let exec = worker(db, &rt, "w", Some(&model));
        let ops = json!([
            { "op": "chat", "prompt": "q" },
            { "op": "emit", "text": "x" },
            { "op": "sleep", "ms": 0 },
            { "op": "emit", "text": "y" },
            { "op": "emit", "text": "z" },
        ]);
        let id = submit(&db.store, ops).await?;
        let outcomes = exec.drain().await?;
        ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "{outcomes:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.partial == "d1d2xyz", "partial {:?}", run.partial);
        ensure!(streamed(&db.store, id).await? == "d1d2xyz", "a reader sees {:?}", streamed(&db.store, id).await?);
        let chat = &db.store.effects(id).await?[0];
        ensure!(chat.state == EffectState::Failed && chat.name == "model.chat", "{chat:?}");
        ensure!(model.hits().len() == 1, "the failed chat was replayed, not asked again");
        Ok(())
    }

    async fn a_later_death_never_cuts_below_a_committed_answer(db) {
        // Segment 1 dies with an unkeyed call in flight (in doubt from then
        // on). Segment 2 sees in-doubt, gets a whole answer from the model,
        // streams a tail, and dies with a keyed call in flight. Segment 3
        // must cut only what segment 2 left unsettled, not the answer.
        let unkeyed = Sink::start().await?;
        let keyed = Sink::start().await?;
        unkeyed.hold(true);
        keyed.hold(true);
        let script: Script = Arc::new(|_, _| vec!["the ".into(), "answer".into()]);
        let model = FakeModel::start(script).await?;
        let rt = runtime(vec![unkeyed.allow(), keyed.allow()])?;
        let ops = json!([
            { "op": "http", "url": unkeyed.url, "keyed": false },
            { "op": "chat", "prompt": "q" },
            { "op": "emit", "text": " tail" },
            { "op": "http", "url": keyed.url, "keyed": true },
        ]);
        let id = submit(&db.store, ops).await?;
        kill_when(db, worker(db, &rt, "a", Some(&model)), id, async || Ok(!unkeyed.hits().is_empty())).await?;
        kill_when(db, worker(db, &rt, "b", Some(&model)), id, async || Ok(!keyed.hits().is_empty())).await?;
        keyed.hold(false);
        let outcomes = worker(db, &rt, "c", Some(&model)).drain().await?;
        ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "{outcomes:?}");

        let run = db.store.get_run(id).await?;
        ensure!(run.partial == "the answer tail", "partial {:?}", run.partial);
        let seen = streamed(&db.store, id).await?;
        ensure!(seen == "the answer tail", "a reader sees {seen:?}");
        let output: Value = serde_json::from_str(run.output.as_deref().unwrap_or("null"))?;
        ensure!(output[0].as_str().is_some_and(|o| o.starts_with("in-doubt")) && output[1] == "the answer", "{output}");
        ensure!(unkeyed.hits().len() == 1 && model.hits().len() == 1, "nothing repeated");
        Ok(())
    }

    async fn a_reissue_refused_by_todays_grants_is_recorded_before_the_turn_sees_it(db) {
        let sink = Sink::start().await?;
        sink.hold(true);
        let ops = json!([{ "op": "http", "url": sink.url, "keyed": true }]);
        let id = submit(&db.store, ops).await?;
        let allowed = runtime(vec![sink.allow()])?;
        kill_when(db, worker(db, &allowed, "a", None), id, async || Ok(!sink.hits().is_empty())).await?;
        // The host that resumes it no longer allows the sink.
        let refused = runtime(vec![])?;
        let outcomes = worker(db, &refused, "b", None).drain().await?;
        ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "{outcomes:?}");
        let row = &db.store.effects(id).await?[0];
        ensure!(row.state == EffectState::Failed && row.fence_completed == Some(2), "the refusal was not recorded: {row:?}");
        ensure!(row.result.as_deref().is_some_and(|r| r.contains("allow-list")), "{row:?}");
        // The turn took its path on the refusal.
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref().is_some_and(|o| o.contains("denied")), "{run:?}");
        ensure!(sink.hits().len() == 1);
        Ok(())
    }

    async fn an_in_progress_answer_to_a_reissue_is_not_a_result(db) {
        // The re-issue races the dead segment's own request: a
        // deduplicating server answers 409 while that one is in progress.
        // The host must try the same key again, not record the 409.
        let sink = Sink::start().await?;
        sink.hold(true);
        let rt = runtime(vec![sink.allow()])?;
        let ops = json!([{ "op": "http", "url": sink.url, "keyed": true, "body": "once" }]);
        let id = submit(&db.store, ops).await?;
        kill_when(db, worker(db, &rt, "a", None), id, async || Ok(!sink.hits().is_empty())).await?;
        sink.hold(false);
        sink.conflict_reissues(2);
        let outcomes = worker(db, &rt, "b", None).drain().await?;
        ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "{outcomes:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some(r#"["applied"]"#), "the turn saw {:?}", run.output);
        let hits = sink.hits();
        ensure!(hits.len() == 4 && hits.iter().all(|h| h.key == hits[0].key), "one key throughout: {hits:?}");
        let row = &db.store.effects(id).await?[0];
        ensure!(row.state == EffectState::Committed && row.fence_completed == Some(2), "{row:?}");
        Ok(())
    }

    async fn a_run_keeps_the_plugin_version_it_started_with(db) {
        // Submitted on version 1 (testkit), suspended, then the plugin is
        // replaced by version 2: the run must resume on version 1, whose
        // ledger it has.
        let rt = plugins::runtime()?;
        let v1 = plugins::rust_plugin("testkit")?;
        let v2 = plugins::hostile_wat("returns-v2.wat")?;
        let settings = leasehold::plugins::PluginSettings::default();
        let first = leasehold::plugins::register(&db.store, &rt, "pinned", v1, settings.clone()).await?;
        let (run, _) = db.store.create_run(&NewRun {
            plugin_digest: first.digest.clone(),
            ..NewRun::new("pinned", json!({ "mode": "wait" }).to_string())
        }).await?;
        let exec = worker(db, &rt, "w", None);
        ensure!(exec.run_once().await? == Some((run.id, SegmentOutcome::Suspended(RunStatus::WaitingInput))));
        let second = leasehold::plugins::register(&db.store, &rt, "pinned", v2, settings).await?;
        ensure!(second.digest != first.digest);
        db.store.deliver_input(run.id, "Ada").await?;
        // A host that has only ever seen version 2 resumes it, too.
        let fresh = worker(db, &plugins::runtime()?, "fresh", None);
        let out = fresh.run_once().await?;
        ensure!(out == Some((run.id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(run.id).await?);
        let done = db.store.get_run(run.id).await?;
        ensure!(done.output.as_deref() == Some("hello Ada"), "ran on the wrong version: {:?}", done.output);
        // New runs take version 2.
        let (new, _) = db.store.create_run(&NewRun {
            plugin_digest: second.digest.clone(),
            ..NewRun::new("pinned", "{}")
        }).await?;
        ensure!(fresh.run_once().await? == Some((new.id, SegmentOutcome::Completed)));
        ensure!(db.store.get_run(new.id).await?.output.as_deref() == Some("v2"));
        Ok(())
    }
}
