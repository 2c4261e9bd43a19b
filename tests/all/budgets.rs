//! Token budgets shared by a run's tree (docs/concepts.md, "Budgets"): the
//! spend is the usage committed `model.chat` rows report, so a replay
//! costs nothing; a call that would overspend waits (`waiting_for:
//! "budget"`) until the budget is raised. Both backends, a fake model that
//! reports `USAGE_TOKENS` per answer.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::plugins::PluginSettings;
use leasehold::store::{ModelGrant, NewRun, RunFilter, RunStatus};
use serde_json::{Value, json};

use crate::fake_model::{FakeModel, USAGE_TOKENS, echo, worker};
use crate::harness::{TestDb, both};
use crate::plugins;

/// Registers testkit (granted any model, at most 20 tokens an answer) and
/// fanout (which may spawn testkit); returns a host maker.
async fn hosts<'a>(db: &'a TestDb, model: &'a FakeModel) -> Result<impl Fn(&str) -> Executor + 'a> {
    let rt = plugins::runtime()?;
    let grant = ModelGrant { models: vec!["*".into()], max_tokens: 20 };
    let testkit = PluginSettings { model: grant, ..PluginSettings::default() };
    leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, testkit).await?;
    let fanout = PluginSettings { spawn_allow: vec!["testkit".into()], ..PluginSettings::default() };
    leasehold::plugins::register(&db.store, &rt, "fanout", plugins::rust_plugin("fanout")?, fanout).await?;
    Ok(move |owner: &str| worker(db, &rt, owner, model))
}

fn chats(n: usize) -> Value {
    let ops: Vec<Value> = (0..n).map(|i| json!({ "op": "chat", "prompt": format!("q{i}") })).collect();
    json!({ "mode": "script", "ops": ops })
}

async fn submit(db: &TestDb, plugin: &str, input: Value, budget: i64) -> Result<i64> {
    let new = NewRun { budget_tokens: Some(budget), ..NewRun::new(plugin, input.to_string()) };
    Ok(db.store.create_run(&new).await?.0.id)
}

both! {
    async fn a_tree_that_would_overspend_waits_for_budget_and_goes_on_after_a_raise(db) {
        let model = FakeModel::start(echo()).await?;
        let host = hosts(db, &model).await?;
        // Two children of two calls each: 4,000 tokens; the budget is
        // 1,500, so two calls go out and the rest wait.
        let root = submit(db, "fanout", json!({ "inputs": [chats(2), chats(2)] }), 1_500).await?;
        host("host-a").drain().await?;
        ensure!(model.hits().len() == 2, "{} calls went out", model.hits().len());
        let budget = db.store.budget(root).await?;
        ensure!(budget.spent == 2 * USAGE_TOKENS && budget.tokens == Some(1_500), "{budget:?}");
        let (kids, _) = db.store.runs_page(&RunFilter { parent: Some(root), ..RunFilter::default() }, None, 10, i64::MAX).await?;
        let waiting = kids.iter().filter(|k| k.waiting_for.as_deref() == Some("budget")).count();
        ensure!(waiting >= 1, "no child waits for budget: {:?}", kids.iter().map(|k| (k.status, k.waiting_for.clone())).collect::<Vec<_>>());
        ensure!(db.store.get_run(root).await?.waiting_for.as_deref() == Some("children"), "the root does not wait for its children");
        // Nothing is claimable until the raise.
        ensure!(host("host-a").run_once().await?.is_none(), "a run waiting for budget was claimed");
        let raised = db.store.set_budget(kids[0].id, Some(10_000)).await?;
        ensure!(raised.holder_id == root, "the raise went to {} not the root {root}", raised.holder_id);
        host("host-a").drain().await?;
        let done = db.store.get_run(root).await?;
        ensure!(done.status == RunStatus::Completed, "the root is {:?}: {:?}", done.status, done.error);
        ensure!(model.hits().len() == 4, "{} calls", model.hits().len());
        let budget = db.store.budget(root).await?;
        ensure!(budget.spent == 4 * USAGE_TOKENS && budget.held == 0, "{budget:?}");
        Ok(())
    }

    async fn a_childs_share_caps_its_subtree_under_the_roots_budget(db) {
        let model = FakeModel::start(echo()).await?;
        let host = hosts(db, &model).await?;
        // Each child may spend 1,500 of the root's 10,000: two calls each
        // go out, the third waits on the child's share, not the root's.
        let input = json!({ "inputs": [chats(3), chats(3)], "options": { "budget": { "tokens": 1_500 } } });
        let root = submit(db, "fanout", input, 10_000).await?;
        host("host-a").drain().await?;
        ensure!(model.hits().len() == 4, "{} calls went out", model.hits().len());
        let (mut kids, _) = db.store.runs_page(&RunFilter { parent: Some(root), ..RunFilter::default() }, None, 10, i64::MAX).await?;
        kids.sort_by_key(|k| k.id);
        for k in &kids {
            ensure!(k.waiting_for.as_deref() == Some("budget"), "child {} waits for {:?}", k.id, k.waiting_for);
            let b = db.store.budget(k.id).await?;
            ensure!(b.holder_id == k.id && b.tokens == Some(1_500) && b.spent == 2 * USAGE_TOKENS, "{b:?}");
        }
        let tree = db.store.budget(root).await?;
        ensure!(tree.holder_id == root && tree.spent == 4 * USAGE_TOKENS, "{tree:?}");
        // Raising the first child's share lets it finish; the second still waits.
        db.store.set_budget(kids[0].id, Some(5_000)).await?;
        host("host-a").drain().await?;
        ensure!(db.store.get_run(kids[0].id).await?.status == RunStatus::Completed, "the first child did not finish");
        ensure!(db.store.get_run(kids[1].id).await?.waiting_for.as_deref() == Some("budget"), "the second child stopped waiting");
        ensure!(db.store.budget(root).await?.tokens == Some(10_000), "the root's budget moved");
        Ok(())
    }

    async fn a_replayed_call_costs_nothing_and_a_resumed_run_gets_no_fresh_budget(db) {
        let model = FakeModel::start(echo()).await?;
        let host = hosts(db, &model).await?;
        // A call, a wait in the turn (host A dies there), then two more
        // calls: with the budget at 2,010 the second fits and the third
        // does not, unless the replayed first were charged again (then the
        // second would not fit either).
        let ops = json!({ "mode": "script", "ops": [
            { "op": "chat", "prompt": "one" }, { "op": "wasi-sleep", "ms": 3000 },
            { "op": "chat", "prompt": "two" }, { "op": "chat", "prompt": "three" },
        ] });
        let id = submit(db, "testkit", ops, 2_010).await?;
        let a = host("host-a");
        let dying = tokio::spawn(async move { a.run_once().await });
        let start = Instant::now();
        while model.hits().is_empty() || db.store.budget(id).await?.spent == 0 {
            ensure!(start.elapsed() < Duration::from_secs(20) && !dying.is_finished(), "the first call never settled");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        dying.abort();
        let _ = dying.await;
        db.backdate_lease(id, 60_000).await?;
        let resumed = host("host-b").run_once().await?;
        ensure!(resumed == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{resumed:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.waiting_for.as_deref() == Some("budget"), "waiting for {:?}", run.waiting_for);
        ensure!(model.hits().len() == 2, "{} calls went out", model.hits().len());
        let budget = db.store.budget(id).await?;
        ensure!(budget.spent == 2 * USAGE_TOKENS && budget.held == 0, "{budget:?}");
        db.store.set_budget(id, Some(3_100)).await?;
        host("host-b").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed, "{:?}: {:?}", run.status, run.error);
        ensure!(db.store.budget(id).await?.spent == 3 * USAGE_TOKENS, "spent");
        Ok(())
    }
}
