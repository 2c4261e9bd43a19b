//! `model.chat` and the example agents: a streamed answer mirrored into the
//! run's output, a tool call, a kv note and a question to the user; and the
//! stream cut (`retract`) after a worker dies mid-answer. The model is a
//! fake OpenAI-compatible server started by each test.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::store::log::replay_stream;
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::runtime::Runtime;
use leasehold::store::{NewRun, RunStatus, Store};
use serde_json::{Value, json};

use crate::fake_model::{FakeModel, echo, worker};
use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

fn runtime_with(names: &[&str], tool: &Sink) -> Result<Arc<Runtime>> {
    let rt = plugins::runtime()?;
    for name in names {
        let mut limits = plugins::test_limits();
        limits.http_allow = vec![tool.allow()];
        limits.max_memory_bytes = 128 << 20; // Python and JS guests
        limits.segment_budget = Duration::from_secs(20);
        rt.add_plugin(name, &plugins::example_plugin(name)?, limits)?;
    }
    Ok(rt)
}


async fn submit(store: &Store, plugin: &str, input: Value) -> Result<i64> {
    Ok(store.create_run(&NewRun::new(plugin, input.to_string())).await?.0.id)
}

async fn note(store: &Store, plugin: &str) -> Result<Option<String>> {
    Ok(sqlx::query_scalar("SELECT value FROM kv WHERE namespace = $1 AND key = 'note'")
        .bind(plugin)
        .fetch_optional(store.pool())
        .await?)
}

/// What a reader of the thread log sees once it applies `retract` events.
async fn streamed(store: &Store, run_id: i64) -> Result<String> {
    let events = store.run_events(run_id).await?;
    Ok(replay_stream(events.iter().map(|e| (e.kind.as_str(), e.payload.as_str()))).concat())
}

/// The behaviour every example agent must have, in any language: ask the
/// model, call the tool, store a note, ask the user, answer.
async fn agent_behaviour(db: &TestDb, plugin: &str) -> Result<()> {
    let (model, tool) = (FakeModel::start(echo()).await?, Sink::start().await?);
    let rt = runtime_with(&[plugin], &tool)?;
    let exec = worker(db, &rt, "worker-a", &model);
    let input = json!({ "prompt": "say \"hi\"\n", "tool_url": tool.url, "ask": true });
    let id = submit(&db.store, plugin, input).await?;

    let first = exec.run_once().await?;
    ensure!(
        first == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingInput))),
        "{plugin}: {first:?}: {:?}",
        db.store.get_run(id).await?.error
    );
    let run = db.store.get_run(id).await?;
    ensure!(run.partial == "echo: say \"hi\"\n", "{plugin}: streamed {:?}", run.partial);
    db.store.deliver_input(id, "thanks").await?;
    let second = exec.run_once().await?;
    ensure!(second == Some((id, SegmentOutcome::Completed)), "{plugin}: {second:?} {:?}", db.store.get_run(id).await?.error);

    let run = db.store.get_run(id).await?;
    let output: Value = serde_json::from_str(run.output.as_deref().unwrap_or_default())
        .with_context(|| format!("{plugin}: output {:?}", run.output))?;
    ensure!(
        output == json!({ "message": "echo: say \"hi\"\n\ntool: applied\nyou: thanks" }),
        "{plugin}: output {output}"
    );
    ensure!(run.partial == "echo: say \"hi\"\n", "{plugin}: replay streamed again: {:?}", run.partial);
    ensure!(streamed(&db.store, id).await? == run.partial, "{plugin}: thread log differs from partial");
    ensure!(note(&db.store, plugin).await?.as_deref() == Some("\"applied\""), "{plugin}: note");

    // Replay performed nothing twice.
    let chats = model.hits();
    ensure!(chats.len() == 1, "{plugin}: model called {} times", chats.len());
    ensure!(chats[0].body["stream"] == json!(true) && chats[0].body["model"] == json!("fake-1"), "{:?}", chats[0].body);
    ensure!(chats[0].authorization == "Bearer sk-test" && chats[0].key == crate::harness::key(&db.store, id, 0).await?, "{:?}", chats[0]);
    let tools = tool.hits();
    ensure!(tools.len() == 1 && tools[0].key == crate::harness::key(&db.store, id, 1).await?, "{plugin}: tool hits {tools:?}");
    Ok(())
}

/// A worker dies mid-answer; another resumes the run (after, with `gaps`,
/// two claims that never reached a guest) and retracts the half answer.
async fn dying_mid_answer(db: &TestDb, gaps: bool) -> Result<()> {
    // The dead segment streams two chunks of one answer; the re-issued
    // call (same idempotency key) streams another.
    let script: crate::fake_model::Script = Arc::new(|n, _| {
        let words: &[&str] = if n == 0 { &["dead ", "half ", "answer"] } else { &["the ", "whole ", "answer"] };
        words.iter().map(|w| w.to_string()).collect()
    });
    let (model, tool) = (FakeModel::start_holding(script, 2).await?, Sink::start().await?);
    let rt = runtime_with(&["agent-rust"], &tool)?;
    model.hold(true);
    let input = json!({ "prompt": "go", "tool_url": tool.url });
    let id = submit(&db.store, "agent-rust", input).await?;
    crate::harness::kill_when(db, worker(db, &rt, "worker-a", &model), id, async || Ok(db.store.get_run(id).await?.emit_pos >= 2)).await?;
    ensure!(db.store.get_run(id).await?.partial == "dead half ");
    model.hold(false);
    if gaps {
        let ttl = Duration::from_secs(30);
        let queued = db.store.claim("queue", ttl).await?.context("the queue's claim")?;
        db.store.give_back(&queued.lease, queued.charged).await?;
        let orphan = db.store.claim("orphan", ttl).await?.context("the orphaned claim")?;
        ensure!(orphan.lease.fence == 3, "{orphan:?}");
        db.backdate_lease(id, 60_000).await?;
    }
    let done = worker(db, &rt, "worker-b", &model).drain().await?;
    ensure!(done == vec![(id, SegmentOutcome::Completed)], "{done:?}");

    let run = db.store.get_run(id).await?;
    let fence = if gaps { 4 } else { 2 };
    ensure!(run.partial == "the whole answer", "partial {:?}", run.partial);
    ensure!(streamed(&db.store, id).await? == "the whole answer", "a reader sees a half answer");
    let events = db.store.run_events(id).await?;
    let retracts: Vec<_> = events.iter().filter(|e| e.kind == "retract").collect();
    ensure!(retracts.len() == 1, "{events:?}");
    let cut: Value = serde_json::from_str(&retracts[0].payload)?;
    ensure!(cut == json!({ "from": 0, "to": 2 }) && retracts[0].fence == fence, "{cut} {:?}", retracts[0]);
    let keys: Vec<_> = model.hits().iter().map(|h| (h.key.clone(), h.fence.clone())).collect();
    let key = crate::harness::key(&db.store, id, 0).await?;
    ensure!(keys == vec![(key.clone(), "1".into()), (key, fence.to_string())], "{keys:?}");
    ensure!(tool.hits().len() == 1);
    Ok(())
}

both! {
    async fn a_python_agent_hands_a_sub_question_to_a_child_agent_and_uses_its_answer(db) {
        let (model, tool) = (FakeModel::start(echo()).await?, Sink::start().await?);
        let rt = plugins::runtime()?;
        let settings = leasehold::plugins::PluginSettings {
            http_allow: vec![tool.allow()],
            model: leasehold::store::ModelGrant::any(),
            spawn_allow: vec!["agent-py".into()],
            ..Default::default()
        };
        leasehold::plugins::register(&db.store, &rt, "agent-py", plugins::example_plugin("agent-py")?, settings).await?;
        let exec = worker(db, &rt, "worker-a", &model);
        let input = json!({ "prompt": "main", "tool_url": tool.url, "delegate": "sub" });
        let id = submit(&db.store, "agent-py", input).await?;
        let done = exec.drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed, "{done:?}: the parent is {:?}: {:?}", run.status, run.error);
        let output: Value = serde_json::from_str(run.output.as_deref().unwrap_or_default())?;
        ensure!(
            output == json!({ "message": "echo: main\ntool: applied\nhelper: echo: sub\ntool: applied" }),
            "output {output}"
        );
        let filter = leasehold::store::RunFilter { parent: Some(id), ..Default::default() };
        let (kids, _) = db.store.runs_page(&filter, None, 10, i64::MAX).await?;
        ensure!(kids.len() == 1 && kids[0].status == RunStatus::Completed && kids[0].root_id == id, "children {kids:?}");
        // The parent suspended once for its child and was resumed once.
        ensure!(run.fence == 2, "the parent's fence is {}", run.fence);
        ensure!(model.hits().len() == 2 && tool.hits().len() == 2, "model {} tool {}", model.hits().len(), tool.hits().len());
        Ok(())
    }

    async fn a_rust_agent_streams_the_model_answer_calls_its_tool_and_asks_the_user(db) {
        agent_behaviour(db, "agent-rust").await
    }

    async fn a_python_agent_behaves_like_the_rust_one(db) {
        agent_behaviour(db, "agent-py").await
    }

    async fn a_javascript_agent_behaves_like_the_rust_one(db) {
        agent_behaviour(db, "agent-js").await
    }

    async fn a_c_agent_behaves_like_the_rust_one(db) {
        agent_behaviour(db, "agent-c").await
    }

    async fn a_worker_dying_mid_answer_has_its_half_answer_retracted(db) {
        dying_mid_answer(db, false).await
    }

    async fn a_half_answer_is_retracted_though_claims_that_never_ran_came_between(db) {
        // A queued run given back unstarted and an orphaned claim: two
        // fences between the dead segment's and the one that resumes it.
        dying_mid_answer(db, true).await
    }

    async fn a_graceful_suspend_replays_a_recorded_answer_without_retracting_it(db) {
        // After `wait-input` the stream is whole: nothing is cut, the model
        // is not asked again, and the resumed segment does not re-stream.
        let (model, tool) = (FakeModel::start(echo()).await?, Sink::start().await?);
        let rt = runtime_with(&["agent-rust"], &tool)?;
        let exec = worker(db, &rt, "worker-a", &model);
        let id = submit(&db.store, "agent-rust", json!({ "prompt": "x", "tool_url": tool.url, "ask": true })).await?;
        let first = exec.run_once().await?;
        ensure!(first == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingInput))), "{first:?}");
        db.store.deliver_input(id, "ok").await?;
        let second = exec.run_once().await?;
        ensure!(second == Some((id, SegmentOutcome::Completed)), "{second:?}: {:?}", db.store.get_run(id).await?.error);
        ensure!(model.hits().len() == 1, "the model was asked again");
        let events = db.store.run_events(id).await?;
        ensure!(events.iter().all(|e| e.kind != "retract"), "{events:?}");
        ensure!(events.iter().filter(|e| e.kind == "delta").count() == 2, "{events:?}");
        Ok(())
    }

    async fn model_chat_is_denied_outside_the_plugins_grant_and_sends_nothing(db) {
        let (model, tool) = (FakeModel::start(echo()).await?, Sink::start().await?);
        let cases = [
            (leasehold::store::ModelGrant::default(), "not granted to this plugin"),
            (leasehold::store::ModelGrant { models: vec!["other-model".into()], max_tokens: 4096 }, "model \"fake-1\" is not granted"),
        ];
        for (i, (grant, why)) in cases.into_iter().enumerate() {
            let rt = plugins::runtime()?;
            let mut limits = plugins::test_limits();
            limits.http_allow = vec![tool.allow()];
            limits.model = grant;
            rt.add_plugin("agent-rust", &plugins::example_plugin("agent-rust")?, limits)?;
            let exec = worker(db, &rt, &format!("w{i}"), &model);
            let id = submit(&db.store, "agent-rust", json!({ "prompt": "x", "tool_url": tool.url })).await?;
            let out = exec.run_once().await?;
            let run = db.store.get_run(id).await?;
            let error = run.error.clone().unwrap_or_default();
            ensure!(out == Some((id, SegmentOutcome::Failed(leasehold::executor::GuestErrorKind::TurnError))), "case {i}: {out:?} {error}");
            ensure!(error.contains(why), "case {i}: {error}");
            let rows = db.store.effects(id).await?;
            ensure!(rows.iter().any(|r| r.name == "model.chat" && r.state == leasehold::store::EffectState::Failed), "case {i}: the refusal is not in the ledger: {rows:?}");
        }
        ensure!(model.hits().is_empty(), "a call outside the grant reached the model: {:?}", model.hits().len());
        Ok(())
    }

    async fn model_chat_without_a_configured_endpoint_is_denied(db) {
        let tool = Sink::start().await?;
        let rt = runtime_with(&["agent-rust"], &tool)?;
        let config = crate::harness::worker("w");
        let exec = Executor::new(db.store.clone(), rt, config);
        let id = submit(&db.store, "agent-rust", json!({ "prompt": "x", "tool_url": tool.url })).await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Failed(leasehold::executor::GuestErrorKind::TurnError))), "{out:?}");
        let run = db.store.get_run(id).await?;
        let error = run.error.unwrap_or_default();
        ensure!(run.status == RunStatus::Failed && error.contains("no model endpoint is configured"), "{error}");
        ensure!(tool.hits().is_empty());
        Ok(())
    }
}
