//! Budgets shared by a run's tree (docs/concepts.md, "Budgets"), in tokens
//! and in dollars: the spend is the usage (and the cost, at the host's
//! prices) committed `model.chat` rows record, so a replay costs nothing; a
//! call that would overspend waits (`waiting_for: "budget"`) until the
//! budget is raised. Both backends, a fake model that reports
//! `USAGE_TOKENS` per answer, half prompt and half answer.


use anyhow::{Result, ensure};
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::plugins::PluginSettings;
use leasehold::effects::prices::Prices;
use leasehold::store::{BudgetLimits, Claimed, Hold, ModelGrant, NewRun, RunFilter, RunStatus, Suspend};
use serde_json::{Value, json};

use crate::fake_model::{FakeModel, USAGE_TOKENS, echo, priced_worker, worker};
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

fn tokens(n: i64) -> BudgetLimits {
    BudgetLimits { tokens: Some(n), usd_nanos: None }
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
        let raised = db.store.set_budget(kids[0].id, tokens(10_000)).await?;
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
        db.store.set_budget(kids[0].id, tokens(5_000)).await?;
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
        // Killed once the first call has settled (charged).
        crate::harness::kill_when(db, host("host-a"), id, async || Ok(!model.hits().is_empty() && db.store.budget(id).await?.spent > 0)).await?;
        let resumed = host("host-b").run_once().await?;
        ensure!(resumed == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{resumed:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.waiting_for.as_deref() == Some("budget"), "waiting for {:?}", run.waiting_for);
        ensure!(model.hits().len() == 2, "{} calls went out", model.hits().len());
        let budget = db.store.budget(id).await?;
        ensure!(budget.spent == 2 * USAGE_TOKENS && budget.held == 0, "{budget:?}");
        db.store.set_budget(id, tokens(3_100)).await?;
        host("host-b").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed, "{:?}: {:?}", run.status, run.error);
        ensure!(db.store.budget(id).await?.spent == 3 * USAGE_TOKENS, "spent");
        Ok(())
    }
}

/// `fake-1` at $1 per million prompt tokens and $3 per million answer
/// tokens: each fake answer (500 and 500) costs $0.002.
const PRICES: &str = "fake-1=1/3";
const ANSWER_NANOS: i64 = 2_000_000;

both! {
    async fn a_budget_in_dollars_is_spent_at_the_hosts_prices_and_waits_for_a_raise(db) {
        let model = FakeModel::start(echo()).await?;
        let rt = plugins::runtime()?;
        let grant = ModelGrant { models: vec!["*".into()], max_tokens: 20 };
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, PluginSettings { model: grant, ..PluginSettings::default() }).await?;
        let prices = Prices::parse(&[PRICES]).map_err(anyhow::Error::msg)?;
        let host = |owner: &str| priced_worker(db, &rt, owner, &model, prices.clone());
        // $0.003: the first call fits, the second fits on what the first
        // held (its estimate), and the third finds $0.004 spent.
        let new = NewRun { budget_usd_nanos: Some(3_000_000), ..NewRun::new("testkit", chats(3).to_string()) };
        let id = db.store.create_run(&new).await?.0.id;
        host("host-a").drain().await?;
        ensure!(model.hits().len() == 2, "{} calls went out", model.hits().len());
        let run = db.store.get_run(id).await?;
        ensure!(run.waiting_for.as_deref() == Some("budget"), "{:?} waiting for {:?}", run.status, run.waiting_for);
        let budget = db.store.budget(id).await?;
        let nanos = |usd: f64| (usd * 1e9).round() as i64;
        ensure!(nanos(budget.spent_usd) == 2 * ANSWER_NANOS && budget.usd == Some(0.003) && budget.tokens.is_none(), "{budget:?}");
        ensure!(budget.held_usd == 0.0 && budget.spent == 2 * USAGE_TOKENS, "{budget:?}");
        // Each committed call recorded what it cost, at the price of then.
        let ledger = db.store.effects(id).await?;
        let costs: Vec<i64> = ledger.iter().filter_map(|e| serde_json::from_str::<Value>(e.result.as_deref()?).ok()?["cost_usd_nanos"].as_i64()).collect();
        ensure!(costs == [ANSWER_NANOS, ANSWER_NANOS], "recorded costs {costs:?}");
        // A raise in dollars leaves the (absent) token budget alone.
        let raised = db.store.set_budget(id, BudgetLimits { tokens: None, usd_nanos: Some(10_000_000) }).await?;
        ensure!(raised.usd == Some(0.01) && raised.tokens.is_none(), "{raised:?}");
        host("host-a").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed, "{:?}: {:?}", run.status, run.error);
        ensure!(nanos(db.store.budget(id).await?.spent_usd) == 3 * ANSWER_NANOS, "spent");
        Ok(())
    }

    async fn a_model_without_a_price_is_denied_under_a_budget_in_dollars_only(db) {
        let model = FakeModel::start(echo()).await?;
        let rt = plugins::runtime()?;
        let grant = ModelGrant { models: vec!["*".into()], max_tokens: 20 };
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, PluginSettings { model: grant, ..PluginSettings::default() }).await?;
        // `fake-1`, the model the calls name, has no price here.
        let prices = Prices::parse(&["other=1/1"]).map_err(anyhow::Error::msg)?;
        let host = priced_worker(db, &rt, "host-a", &model, prices);
        let in_dollars = NewRun { budget_usd_nanos: Some(1_000_000_000), ..NewRun::new("testkit", chats(1).to_string()) };
        let denied = db.store.create_run(&in_dollars).await?.0.id;
        let in_tokens = NewRun { budget_tokens: Some(100_000), ..NewRun::new("testkit", chats(1).to_string()) };
        let allowed = db.store.create_run(&in_tokens).await?.0.id;
        host.drain().await?;
        let out = db.store.get_run(denied).await?;
        ensure!(out.status == RunStatus::Completed, "{:?}: {:?}", out.status, out.error);
        let said = out.output.unwrap_or_default();
        ensure!(said.contains("denied") && said.contains("has no price"), "the turn was told {said}");
        ensure!(model.hits().len() == 1, "{} calls went out (the denied one must not)", model.hits().len());
        // The refusal is recorded: a replay takes the same branch.
        let ledger = db.store.effects(denied).await?;
        ensure!(ledger.iter().any(|e| e.name == "model.chat" && e.result.as_deref().is_some_and(|r| r.contains("no price"))), "{ledger:?}");
        ensure!(db.store.get_run(allowed).await?.status == RunStatus::Completed, "the run under a token budget did not complete");
        Ok(())
    }
}

/// `n` raw `model.chat` calls whose requests turn usage off.
fn chats_without_usage(n: usize) -> Value {
    let request = json!({ "messages": [{ "role": "user", "content": "q0" }], "stream_options": null }).to_string();
    let ops: Vec<Value> = (0..n).map(|_| json!({ "op": "effect", "name": "model.chat", "request": request })).collect();
    json!({ "mode": "script", "ops": ops })
}

both! {
    async fn a_guest_cannot_turn_usage_off_to_make_its_calls_free(db) {
        let model = FakeModel::start(echo()).await?;
        let host = hosts(db, &model).await?;
        // Each answer reports 1,000 tokens: with 2,500 the third call still
        // fits (2,000 spent and its estimate), the fourth does not.
        let id = submit(db, "testkit", chats_without_usage(5), 2_500).await?;
        host("host-a").drain().await?;
        let hits = model.hits();
        ensure!(hits.iter().all(|h| h.body["stream_options"]["include_usage"] == true), "usage was not asked for");
        ensure!(hits.len() == 3, "{} calls went out", hits.len());
        let budget = db.store.budget(id).await?;
        ensure!(budget.spent == 3 * USAGE_TOKENS, "{budget:?}");
        ensure!(db.store.get_run(id).await?.waiting_for.as_deref() == Some("budget"), "the fourth call did not wait");
        Ok(())
    }

    async fn an_answer_without_usage_is_charged_its_estimate(db) {
        let model = FakeModel::start_without_usage(echo()).await?;
        let host = hosts(db, &model).await?;
        // Each call's estimate: its messages (32 bytes) over four, plus one,
        // and the grant's 20 answer tokens: 29. Three fit in 100.
        let id = submit(db, "testkit", chats(5), 100).await?;
        host("host-a").drain().await?;
        ensure!(model.hits().len() == 3, "{} calls went out", model.hits().len());
        let budget = db.store.budget(id).await?;
        ensure!(budget.spent == 3 * 29, "{budget:?}");
        let ledger = db.store.effects(id).await?;
        let estimated = ledger.iter().filter(|e| e.result.as_deref().is_some_and(|r| r.contains("\"estimated\":true"))).count();
        ensure!(estimated == 3, "{estimated} rows say they were estimated: {ledger:?}");
        Ok(())
    }
}

both! {
    async fn the_api_takes_budgets_in_tokens_dollars_or_both_and_refuses_bad_ones(db) {
        let rt = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        leasehold::effects::http::install_tls();
        let http = reqwest::Client::new();
        let send = async |path: &str, body: Option<Value>| -> Result<(u16, Value)> {
            let b = match body {
                Some(body) => http.post(format!("{base}{path}")).json(&body),
                None => http.get(format!("{base}{path}")),
            };
            let resp = b.send().await?;
            Ok((resp.status().as_u16(), resp.json().await?))
        };
        let (status, run) = send("/v1/runs", Some(json!({ "plugin": "testkit", "input": {}, "budget": { "usd": 0.25 } }))).await?;
        ensure!(status == 201, "{status} {run}");
        let id = run["id"].as_i64().unwrap_or_default();
        let (_, b) = send(&format!("/v1/runs/{id}/budget"), None).await?;
        ensure!(b["usd"] == json!(0.25) && b["tokens"].is_null() && b["spent_usd"] == json!(0.0), "{b}");
        // Setting tokens leaves the dollars as they are.
        let (status, b) = send(&format!("/v1/runs/{id}/budget"), Some(json!({ "tokens": 500 }))).await?;
        ensure!(status == 200 && b["tokens"] == json!(500) && b["usd"] == json!(0.25), "{status} {b}");
        // `{}` names no unit: no change.
        let (status, b) = send(&format!("/v1/runs/{id}/budget"), Some(json!({}))).await?;
        ensure!(status == 200 && b["usd"] == json!(0.25) && b["tokens"] == json!(500), "{status} {b}");
        for bad in [json!([null, null]), json!({ "usd": -1 }), json!({ "usd": 2e6 }), json!({ "usd": "1" }), json!({ "tokens": 1.5 }), json!({ "dollars": 1 })] {
            let (status, e) = send(&format!("/v1/runs/{id}/budget"), Some(bad.clone())).await?;
            ensure!(status == 400 && e["error"]["message"].is_string(), "{bad} got {status} {e}");
            let (status, e) = send("/v1/runs", Some(json!({ "plugin": "testkit", "input": {}, "budget": bad }))).await?;
            ensure!(status == 400 && e["error"]["message"].is_string(), "a submit with budget {bad} got {status} {e}");
        }
        let (_, b) = send(&format!("/v1/runs/{id}/budget"), None).await?;
        ensure!(b["tokens"] == json!(500) && b["usd"] == json!(0.25), "a refused body changed the budget: {b}");
        server.stop().await;
        Ok(())
    }
}

/// A root with a budget of `budget` tokens and two children, each claimed
/// (store level: the children are linked by hand, as a spawn links them).
async fn tree_of_two(db: &TestDb, budget: i64) -> Result<(i64, Claimed, Claimed)> {
    let s = &db.store;
    let root = s.create_run(&NewRun { budget_tokens: Some(budget), ..NewRun::new("p", "{}") }).await?.0.id;
    let mut kids = Vec::new();
    for _ in 0..2 {
        let id = s.create_run(&NewRun::new("p", "{}")).await?.0.id;
        sqlx::query("UPDATE runs SET parent_id = $1, root_id = $1 WHERE id = $2").bind(root).bind(id).execute(s.pool()).await?;
        kids.push(id);
    }
    let mut claimed = s.claim_batch("w", crate::harness::TTL, 3).await?;
    ensure!(claimed.len() == 3, "claimed {}", claimed.len());
    claimed.sort_by_key(|c| c.run.id);
    let b = claimed.pop().expect("b");
    let a = claimed.pop().expect("a");
    ensure!(a.run.id == kids[0] && b.run.id == kids[1]);
    Ok((root, a, b))
}

/// Whether run `id` is due now and waits for nothing.
async fn due(db: &TestDb, id: i64) -> Result<bool> {
    let run = db.store.get_run(id).await?;
    let now = db.store.now_ms().await?;
    Ok(run.status == RunStatus::Queued && run.waiting_for.is_none() && run.not_before <= now)
}

both! {
    async fn a_budget_waiter_wakes_when_the_run_holding_the_budget_is_cancelled(db) {
        let s = &db.store;
        let (_, a, b) = tree_of_two(db, 100).await?;
        ensure!(s.hold_budget(&a.lease, 0, 60, None).await? == Hold::Held);
        let over = s.hold_budget(&b.lease, 0, 60, None).await?;
        ensure!(matches!(over, Hold::Over { held: 60, .. }), "{over:?}");
        s.suspend(&b.lease, &Suspend::Budget { tokens: 60, usd_nanos: None }).await?;
        ensure!(s.get_run(b.run.id).await?.waiting_for.as_deref() == Some("budget"), "b does not wait");
        // A ends without settling its call: its hold no longer counts.
        s.cancel(a.run.id).await?;
        let budget = s.budget(b.run.id).await?;
        ensure!(budget.held == 0 && budget.spent == 0, "{budget:?}");
        ensure!(due(db, b.run.id).await?, "the waiter was not woken: {:?}", s.get_run(b.run.id).await?);
        Ok(())
    }

    async fn a_budget_waiter_whose_room_came_back_before_it_waited_is_due_at_once(db) {
        let s = &db.store;
        let (_, a, b) = tree_of_two(db, 100).await?;
        ensure!(s.hold_budget(&a.lease, 0, 60, None).await? == Hold::Held);
        ensure!(matches!(s.hold_budget(&b.lease, 0, 60, None).await?, Hold::Over { .. }));
        // A's call settles and its hold goes between B's refusal and B's
        // suspension: its wake finds nobody waiting.
        s.release_budget(a.run.id, 0).await?;
        s.suspend(&b.lease, &Suspend::Budget { tokens: 60, usd_nanos: None }).await?;
        ensure!(due(db, b.run.id).await?, "the waiter waits for room it has: {:?}", s.get_run(b.run.id).await?);
        Ok(())
    }

    async fn the_reapers_sweep_wakes_a_budget_waiter_with_room_and_no_other(db) {
        let s = &db.store;
        let (root, a, b) = tree_of_two(db, 100).await?;
        ensure!(s.hold_budget(&a.lease, 0, 60, None).await? == Hold::Held);
        s.suspend(&b.lease, &Suspend::Budget { tokens: 60, usd_nanos: None }).await?;
        ensure!(!due(db, b.run.id).await?);
        // Nothing has room: the sweep leaves it.
        ensure!(s.wake_budget_waiters(10).await? == 0 && !due(db, b.run.id).await?, "woken with no room");
        // The hold goes with no wake (as if the wake raced the wait).
        sqlx::query("DELETE FROM budget_holds WHERE root_id = $1").bind(root).execute(s.pool()).await?;
        ensure!(!due(db, b.run.id).await?);
        let report = leasehold::maintenance::reaper::tick(s, &leasehold::maintenance::reaper::ReaperConfig::default()).await?;
        ensure!(report.budget_woken == 1, "{report:?}");
        ensure!(due(db, b.run.id).await?, "the sweep did not wake it");
        Ok(())
    }
}

both! {
    async fn retention_keeps_an_open_trees_finished_children_and_their_spend(db) {
        const DAY_MS: i64 = 86_400_000;
        let model = FakeModel::start(echo()).await?;
        let host = hosts(db, &model).await?;
        let root = submit(db, "fanout", json!({ "inputs": [chats(1), { "mode": "wait" }] }), 1_500).await?;
        host("host-a").drain().await?;
        let (mut kids, _) = db.store.runs_page(&RunFilter { parent: Some(root), ..RunFilter::default() }, None, 10, i64::MAX).await?;
        kids.sort_by_key(|k| k.id);
        let (spender, waiter) = (kids[0].id, kids[1].id);
        ensure!(kids[0].status == RunStatus::Completed && kids[1].status == RunStatus::WaitingInput, "{kids:?}");
        ensure!(db.store.budget(root).await?.spent == USAGE_TOKENS);
        let age = async |sql: &str, ids: (i64, i64)| -> Result<()> {
            sqlx::query(sqlx::AssertSqlSafe(sql.to_string())).bind(ids.0).bind(2 * DAY_MS).bind(ids.1).execute(db.store.pool()).await?;
            Ok(())
        };
        // The spender finished two days ago; its tree is open.
        age("UPDATE runs SET finished_at = finished_at - $2 WHERE id = $1 AND id <> $3", (spender, 0)).await?;
        let gone = db.store.delete_finished(DAY_MS, 500).await?;
        ensure!(gone.runs == 0, "retention deleted {} runs of an open tree", gone.runs);
        ensure!(db.store.budget(root).await?.spent == USAGE_TOKENS, "the open tree got its spend back");
        // Cancelled: all finished, but the waiter only now.
        db.store.cancel(root).await?;
        age("UPDATE runs SET finished_at = finished_at - $2 WHERE (id = $1 OR root_id = $1) AND id <> $3", (root, waiter)).await?;
        ensure!(db.store.delete_finished(DAY_MS, 500).await?.runs == 0, "a tree went before its last run was past retention");
        age("UPDATE runs SET finished_at = finished_at - $2 WHERE id = $1 AND id <> $3", (waiter, 0)).await?;
        let gone = db.store.delete_finished(DAY_MS, 500).await?;
        ensure!(gone.runs == 3, "deleted {} of the tree's 3 runs", gone.runs);
        Ok(())
    }
}
