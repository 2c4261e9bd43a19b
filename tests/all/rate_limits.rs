//! Rate limits on effects (docs/flow-control.md): calls to a limited target
//! are spaced by its rate across hosts (each host a store handle of its
//! own, so its own view of the limited keys), a provider's `429
//! Retry-After` holds every host, a model's tokens a minute hold from the
//! usage its answers report, and replay charges nothing. The clocks
//! themselves are checked at the store.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::runtime::Runtime;
use leasehold::store::rates::{Admission, MAX_HOLD, check_rate_key, check_rates};
use leasehold::store::{NewRun, RunStatus, Store};
use serde_json::{Value, json};

use crate::fake_model::{FakeModel, USAGE_TOKENS, echo};
use crate::harness::{TestDb, both};
use crate::plugins;

/// A target that records when each request arrived and answers the first
/// `throttle` of them `429` with `Retry-After: 2`.
struct Target {
    url: String,
    allow: String,
    key: String,
    arrivals: Arc<Mutex<Vec<Instant>>>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Shared {
    arrivals: Arc<Mutex<Vec<Instant>>>,
    throttle: usize,
}

async fn hit(State(s): State<Shared>) -> impl IntoResponse {
    let n = {
        let mut arrivals = s.arrivals.lock().unwrap();
        arrivals.push(Instant::now());
        arrivals.len()
    };
    if n <= s.throttle {
        return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")], "slow down").into_response();
    }
    (StatusCode::OK, "ok").into_response()
}

impl Target {
    async fn start(throttle: usize) -> Result<Target> {
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new()
            .route("/effect", axum::routing::post(hit))
            .with_state(Shared { arrivals: arrivals.clone(), throttle });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Target {
            url: format!("http://127.0.0.1:{port}/effect"),
            allow: format!("127.0.0.1:{port}"),
            key: format!("http:127.0.0.1:{port}"),
            arrivals,
            server,
        })
    }

    fn arrivals(&self) -> Vec<Instant> {
        let mut a = self.arrivals.lock().unwrap().clone();
        a.sort();
        a
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn runtime(allow: &str) -> Result<Arc<Runtime>> {
    let rt = plugins::runtime()?;
    let mut limits = plugins::test_limits();
    limits.http_allow = vec![allow.to_string()];
    limits.segment_budget = Duration::from_secs(20);
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    Ok(rt)
}

fn executor(store: Store, rt: &Arc<Runtime>, owner: &str, model: Option<&FakeModel>) -> Executor {
    let model = model.map(|m| {
        let mut config = leasehold::effects::model::ModelConfig::new(&m.base_url);
        config.default_model = "fake-1".into();
        Arc::new(config)
    });
    let config = ExecutorConfig { model, ..crate::harness::worker(owner) };
    Executor::new(store, rt.clone(), config)
}

async fn submit(store: &Store, ops: Value) -> Result<i64> {
    Ok(store.create_run(&NewRun::new("testkit", json!({ "mode": "script", "ops": ops }).to_string())).await?.0.id)
}

async fn finished(store: &Store, ids: &[i64]) -> Result<bool> {
    for id in ids {
        if !store.get_run(*id).await?.status.is_terminal() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Runs `hosts` hosts (a store handle each) of `workers` workers until every
/// run in `ids` is finished, or fails after `within`.
async fn run_hosts(db: &TestDb, rt: &Arc<Runtime>, model: Option<&FakeModel>, hosts: usize, workers: usize, ids: &[i64], within: Duration) -> Result<()> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for h in 0..hosts {
        let store = db.another_store(4).await?;
        for w in 0..workers {
            let exec = executor(store.clone(), rt, &format!("host{h}-{w}"), model);
            let stop = stop.clone();
            tasks.spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if exec.run_once().await?.is_none() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                anyhow::Ok(())
            });
        }
    }
    let started = Instant::now();
    let done = loop {
        if finished(&db.store, ids).await? {
            break true;
        }
        if started.elapsed() > within {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    ensure!(done, "the runs did not finish within {within:?}");
    for id in ids {
        let run = db.store.get_run(*id).await?;
        ensure!(run.status == RunStatus::Completed, "run {id}: {:?} {:?}", run.status, run.error);
    }
    Ok(())
}

/// The most of `at` that fall in any window of `window`.
fn most_in_window(at: &[Instant], window: Duration) -> usize {
    (0..at.len()).map(|i| at[i..].iter().take_while(|t| **t < at[i] + window).count()).max().unwrap_or(0)
}

/// How many of the runs' segments suspended on a rate limit (the
/// `suspended` event names the key).
async fn rate_suspensions(store: &Store, ids: &[i64], key: &str) -> Result<usize> {
    let mut n = 0;
    for id in ids {
        n += store
            .run_events(*id)
            .await?
            .iter()
            .filter(|e| e.kind == "suspended" && serde_json::from_str::<Value>(&e.payload).is_ok_and(|p| p["rate"] == key))
            .count();
    }
    Ok(n)
}

#[test]
fn rate_keys_and_rates_are_checked() {
    for good in ["http:api.example.com:443", "http:[::1]:8080", "model:gpt-4o-mini", "model:org/model:latest"] {
        assert!(check_rate_key(good).is_ok(), "{good}");
    }
    for bad in ["http:api.example.com", "http::443", "http:API.example.com:443", "http:a:0", "http:a:99999", "model:", "model:a b", "tenant"] {
        assert!(check_rate_key(bad).is_err(), "{bad}");
    }
    assert!(check_rates("http:a:80", Some(60), None).is_ok());
    assert!(check_rates("model:m", None, Some(1000)).is_ok());
    assert!(check_rates("http:a:80", None, None).is_err(), "no rate at all");
    assert!(check_rates("http:a:80", Some(0), None).is_err(), "zero");
    assert!(check_rates("http:a:80", None, Some(10)).is_err(), "tokens on an http key");
}

both! {
    async fn calls_to_a_limited_key_are_spaced_by_its_rate_and_others_cost_nothing(db) {
        let s = &db.store;
        ensure!(s.admit("http:free.example:80", 1, 0, 0).await? == Admission::Go { wait_ms: 0 }, "a key without a limit");
        ensure!(s.rate("http:free.example:80").await?.is_none(), "admission wrote a row for a key without a limit");
        s.set_rate("http:api.example:443", Some(600), None).await?;
        ensure!(s.rate_keys().await?.contains("http:api.example:443"), "this host sees its own new limit at once");
        // 100 ms a call: within a 1 s window, eleven calls at most.
        let (mut go, mut waits) = (0, Vec::new());
        let started = Instant::now();
        for _ in 0..20 {
            match s.admit("http:api.example:443", 1, 0, 1000).await? {
                Admission::Go { wait_ms } => {
                    go += 1;
                    waits.push(wait_ms);
                }
                Admission::Later { wait_ms } => ensure!(wait_ms > 900, "told to come back in {wait_ms} ms"),
            }
        }
        let took = started.elapsed().as_millis() as i64;
        // Ten or eleven in the window, and one more for each 100 ms the
        // admissions themselves took (the window moves with the clock).
        ensure!(go >= 10 && go <= 11 + took / 100, "{go} of 20 calls admitted within 1 s at 600 a minute in {took} ms: {waits:?}");
        for pair in waits.windows(2) {
            // Each admitted call starts 100 ms after the one before, on the
            // database's clock, however long the admissions took.
            ensure!(pair[1] - pair[0] >= 100 - took && pair[1] > pair[0], "waits {waits:?} ({took} ms)");
        }
        let shown = s.rate("http:api.example:443").await?.context("the limit")?;
        ensure!(shown.per_minute == Some(600) && shown.wait_ms > 900 && shown.held_until.is_none(), "{shown:?}");
        ensure!(s.remove_rate("http:api.example:443").await?, "removed");
        ensure!(s.admit("http:api.example:443", 1, 0, 0).await? == Admission::Go { wait_ms: 0 }, "removed, still limited");
        Ok(())
    }

    async fn two_hosts_admitting_at_once_move_one_clock(db) {
        db.store.set_rate("http:api.example:443", Some(6000), None).await?;
        // 10 ms a call; 60 calls from two store handles at once.
        let stores = [db.another_store(4).await?, db.another_store(4).await?];
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for store in &stores {
            for _ in 0..30 {
                let store = store.clone();
                tasks.spawn(async move { store.admit("http:api.example:443", 1, 0, 60_000).await });
            }
        }
        let mut waits = Vec::new();
        while let Some(r) = tasks.join_next().await {
            match r?? {
                Admission::Go { wait_ms } => waits.push(wait_ms),
                later => anyhow::bail!("{later:?} within a one-minute window"),
            }
        }
        let took = started.elapsed().as_millis() as i64;
        let shown = db.store.rate("http:api.example:443").await?.context("the limit")?;
        // Sixty calls charged: the clock is 600 ms on from the first.
        ensure!(shown.wait_ms >= 600 - took - 20, "the clock is {} ms ahead after 60 calls in {took} ms", shown.wait_ms);
        Ok(())
    }

    async fn tokens_are_reserved_then_settled_from_the_usage(db) {
        let s = &db.store;
        // 1,000 tokens a second.
        s.set_rate("model:m", None, Some(60_000)).await?;
        // Each bound below less the time the test has taken so far (and
        // 2 ms for the two clocks' rounding): the clock of the tokens runs
        // on the database's time.
        let started = Instant::now();
        let took = || started.elapsed().as_millis() as i64 + 2;
        ensure!(s.admit("model:m", 1, 500, 0).await? == Admission::Go { wait_ms: 0 }, "first call");
        match s.admit("model:m", 1, 500, 0).await? {
            Admission::Later { wait_ms } => ensure!((500 - took()..=500).contains(&wait_ms), "waits {wait_ms} ms for 500 reserved tokens"),
            go => anyhow::bail!("{go:?} with 500 tokens reserved"),
        }
        // The answer used 100: 400 back.
        s.settle_tokens("model:m", -400).await?;
        let shown = s.rate("model:m").await?.context("the limit")?;
        ensure!(shown.wait_ms <= 100, "after settling, a call waits {} ms", shown.wait_ms);
        // Another answer used 3,000 more than it reserved.
        s.settle_tokens("model:m", 3000).await?;
        let shown = s.rate("model:m").await?.context("the limit")?;
        ensure!((3100 - took()..=3100).contains(&shown.wait_ms), "after 3,000 more tokens, a call waits {} ms", shown.wait_ms);
        Ok(())
    }

    async fn a_hold_delays_every_call_until_it_is_over_and_is_then_forgotten(db) {
        let s = &db.store;
        // Less the time taken so far, and 2 ms for the clocks' rounding.
        let started = Instant::now();
        let took = || started.elapsed().as_millis() as i64 + 2;
        s.hold("http:busy.example:443", Duration::from_secs(2)).await?;
        match s.admit("http:busy.example:443", 1, 0, 1000).await? {
            Admission::Later { wait_ms } => ensure!((2000 - took()..=2000).contains(&wait_ms), "held for {wait_ms} ms"),
            go => anyhow::bail!("{go:?} under a 2 s hold"),
        }
        let shown = s.rate("http:busy.example:443").await?.context("the hold's row")?;
        ensure!(shown.per_minute.is_none() && shown.held_until.is_some(), "{shown:?}");
        // A shorter hold does not shorten it; a huge one is cut.
        s.hold("http:busy.example:443", Duration::from_millis(10)).await?;
        let left = s.rate("http:busy.example:443").await?.context("row")?.wait_ms;
        ensure!(left >= 2000 - took() && left > 10, "a shorter hold shortened it to {left} ms");
        s.hold("http:huge.example:443", Duration::from_secs(86_400)).await?;
        let huge = s.rate("http:huge.example:443").await?.context("row")?;
        ensure!(huge.wait_ms <= MAX_HOLD.as_millis() as i64, "held for {} ms", huge.wait_ms);
        // Over: forgotten; a limit's row is kept.
        s.set_rate("http:kept.example:443", Some(60), None).await?;
        s.hold("http:spent.example:443", Duration::ZERO).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
        ensure!(s.forget_spent_holds().await? == 1, "one spent hold");
        ensure!(s.rate("http:spent.example:443").await?.is_none() && s.rate("http:kept.example:443").await?.is_some());
        Ok(())
    }

    async fn a_rate_limited_effect_spreads_its_calls_across_hosts(db) {
        let target = Target::start(0).await?;
        let rt = runtime(&target.allow)?;
        // 200 ms a call; eight runs of two calls each on two hosts.
        db.store.set_rate(&target.key, Some(300), None).await?;
        let ops = json!([{ "op": "http", "url": target.url }, { "op": "http", "url": target.url }]);
        let mut ids = Vec::new();
        for _ in 0..8 {
            ids.push(submit(&db.store, ops.clone()).await?);
        }
        run_hosts(db, &rt, None, 2, 4, &ids, Duration::from_secs(60)).await?;
        let at = target.arrivals();
        ensure!(at.len() == 16, "{} calls arrived", at.len());
        let gaps: Vec<u128> = at.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
        // Spaced 200 ms on the database's clock; each call's own latency
        // after admission (a ledger write, the request) shifts it a little.
        ensure!(gaps.iter().all(|g| *g >= 120), "calls 200 ms apart arrived {gaps:?} ms apart");
        let most = most_in_window(&at, Duration::from_secs(1));
        ensure!(most <= 6, "{most} calls in one second at 300 a minute");
        ensure!((at[15] - at[0]) >= Duration::from_millis(15 * 190), "16 calls in {:?}", at[15] - at[0]);
        // Eight runs asking at once: some found no room within the wait
        // allowed in place and suspended, freeing their workers.
        ensure!(rate_suspensions(&db.store, &ids, &target.key).await? > 0, "no run suspended on the rate");
        Ok(())
    }

    async fn a_providers_retry_after_holds_every_host(db) {
        let target = Target::start(1).await?;
        let rt = runtime(&target.allow)?;
        // A generous limit: what holds the calls is the provider's answer.
        db.store.set_rate(&target.key, Some(60_000), None).await?;
        let first = submit(&db.store, json!([{ "op": "http", "url": target.url }])).await?;
        run_hosts(db, &rt, None, 1, 1, &[first], Duration::from_secs(30)).await?;
        let output = db.store.get_run(first).await?.output.unwrap_or_default();
        ensure!(output.contains("HTTP 429"), "the throttled call's result: {output}");
        let throttled = target.arrivals()[0];
        let mut ids = Vec::new();
        for _ in 0..6 {
            ids.push(submit(&db.store, json!([{ "op": "http", "url": target.url }])).await?);
        }
        run_hosts(db, &rt, None, 2, 3, &ids, Duration::from_secs(30)).await?;
        let at = target.arrivals();
        ensure!(at.len() == 7, "{} calls arrived", at.len());
        for later in &at[1..] {
            ensure!(*later - throttled >= Duration::from_millis(1990), "a call went out {:?} after a 2 s Retry-After", *later - throttled);
        }
        for id in &ids {
            let output = db.store.get_run(*id).await?.output.unwrap_or_default();
            ensure!(output == r#"["ok"]"#, "run {id}: {output}");
        }
        Ok(())
    }

    async fn a_providers_retry_after_on_http_holds_only_the_plugin_it_answered(db) {
        let target = Target::start(1).await?;
        let rt = runtime(&target.allow)?;
        let mut limits = plugins::test_limits();
        limits.http_allow = vec![target.allow.clone()];
        rt.add_plugin("other", &plugins::rust_plugin("testkit")?, limits)?;
        db.store.set_rate(&target.key, Some(60_000), None).await?;
        let first = submit(&db.store, json!([{ "op": "http", "url": target.url }])).await?;
        run_hosts(db, &rt, None, 1, 1, &[first], Duration::from_secs(30)).await?;
        let throttled = target.arrivals()[0];
        let ops = json!({ "mode": "script", "ops": [{ "op": "http", "url": target.url }] }).to_string();
        let other = db.store.create_run(&NewRun::new("other", ops)).await?.0.id;
        run_hosts(db, &rt, None, 1, 1, &[other], Duration::from_secs(30)).await?;
        // The hold is the answered plugin's, still on; the shared key is not held.
        let hold = db.store.rate(&format!("{}@testkit", target.key)).await?.context("the plugin's hold")?;
        ensure!(hold.held_until.is_some(), "{hold:?}");
        ensure!(db.store.rate(&target.key).await?.context("limit")?.held_until.is_none(), "the shared key is held");
        let same = submit(&db.store, json!([{ "op": "http", "url": target.url }])).await?;
        run_hosts(db, &rt, None, 1, 1, &[same], Duration::from_secs(30)).await?;
        let at = target.arrivals();
        ensure!(at.len() == 3, "{} calls arrived", at.len());
        ensure!(at[1] - throttled < Duration::from_millis(1500), "another plugin's call waited {:?} for testkit's Retry-After", at[1] - throttled);
        ensure!(at[2] - throttled >= Duration::from_millis(1990), "testkit's next call went out {:?} after its 2 s Retry-After", at[2] - throttled);
        Ok(())
    }

    async fn a_reissued_call_is_charged_like_any_call(db) {
        let model = FakeModel::start_holding(echo(), 1).await?;
        model.hold(true);
        let rt = runtime("127.0.0.1:9")?;
        // One call every 10 s.
        db.store.set_rate("model:fake-1", Some(6), None).await?;
        let id = submit(&db.store, json!([{ "op": "chat", "prompt": "hi" }])).await?;
        let dying = executor(db.another_store(2).await?, &rt, "a", Some(&model));
        // The host dies mid-answer.
        crate::harness::kill_when(db, dying, id, async || Ok(!model.hits().is_empty())).await?;
        // Its slot is over.
        sqlx::query("UPDATE rate_limits SET calls_at = 0").execute(db.store.pool()).await?;
        model.hold(false);
        executor(db.another_store(2).await?, &rt, "b", Some(&model)).run_once().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed && model.hits().len() == 2, "{:?}, {} calls", run.status, model.hits().len());
        let wait = db.store.rate("model:fake-1").await?.context("limit")?.wait_ms;
        ensure!(wait > 5_000, "the re-issue moved the clock {wait} ms: it was not charged");
        Ok(())
    }

    async fn a_call_that_kills_its_host_under_a_saturated_rate_key_still_uses_its_attempts_up(db) {
        let target = Target::start(0).await?;
        let rt = runtime(&target.allow)?;
        let ops = json!({ "mode": "script", "ops": [{ "op": "http", "url": target.url }] }).to_string();
        let id = db.store.create_run(&NewRun { max_attempts: Some(2), ..NewRun::new("testkit", ops) }).await?.0.id;
        // A host takes the run and dies (as if in its call).
        db.store.claim("dead", Duration::from_secs(30)).await?.context("nothing to claim")?;
        db.backdate_lease(id, 31_000).await?;
        // The next segment finds the key held and suspends without progress.
        db.store.set_rate(&target.key, Some(60_000), None).await?;
        db.store.hold(&target.key, Duration::from_secs(60)).await?;
        executor(db.another_store(2).await?, &rt, "b", None).run_once().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Queued && run.attempt == 1, "the death was forgotten: {run:?}");
        // It dies again: its attempts are used up, and the reaper aborts it.
        sqlx::query("UPDATE runs SET not_before = 0 WHERE id = $1").bind(id).execute(db.store.pool()).await?;
        db.store.claim("dead-again", Duration::from_secs(30)).await?.context("nothing to claim")?;
        db.backdate_lease(id, 31_000).await?;
        leasehold::maintenance::reaper::tick(&db.store, &leasehold::maintenance::reaper::ReaperConfig::default()).await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Aborted, "{run:?}");
        ensure!(target.arrivals().is_empty(), "a call went out");
        Ok(())
    }

    async fn a_models_token_budget_holds_from_the_usage_its_answers_report(db) {
        let model = FakeModel::start(echo()).await?;
        let rt = runtime("127.0.0.1:9")?;
        // 1,000 tokens a second; each call reserves 4,000 for its answer,
        // which reports 1,000.
        db.store.set_rate("model:fake-1", None, Some(60_000)).await?;
        let chat = json!({ "op": "effect", "name": "model.chat", "request": json!({
            "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 4 * USAGE_TOKENS,
        }).to_string() });
        let mut ids = Vec::new();
        for _ in 0..2 {
            ids.push(submit(&db.store, json!([chat, chat, chat])).await?);
        }
        run_hosts(db, &rt, Some(&model), 2, 1, &ids, Duration::from_secs(60)).await?;
        let hits = model.hits();
        ensure!(hits.len() == 6, "{} calls", hits.len());
        ensure!(hits.iter().all(|h| h.body["stream_options"]["include_usage"] == true), "usage was not asked for");
        for id in &ids {
            let output = db.store.get_run(*id).await?.output.unwrap_or_default();
            ensure!(output.matches("total_tokens").count() == 3, "run {id}: {output}");
        }
        // Six answers of 1,000 tokens at 1,000 a second: five seconds at least.
        let at = model.arrivals();
        let span = at[5] - at[0];
        ensure!(span >= Duration::from_millis(4800), "six calls of 1,000 tokens in {span:?}");
        let most = most_in_window(&at, Duration::from_secs(1));
        ensure!(most <= 2, "{most} calls of 1,000 tokens in one second");
        // Settled from the usage: the clock stands at most a call's worth
        // ahead, not the 4,000 tokens the last call reserved.
        let wait = db.store.rate("model:fake-1").await?.context("limit")?.wait_ms;
        ensure!(wait <= 1500, "the token clock is {wait} ms ahead: the reservations were not settled");
        Ok(())
    }

    async fn replay_charges_nothing(db) {
        let target = Target::start(0).await?;
        let rt = runtime(&target.allow)?;
        // One call every 10 s: a charged replay would wait that long.
        db.store.set_rate(&target.key, Some(6), None).await?;
        let id = submit(&db.store, json!([{ "op": "http", "url": target.url }, { "op": "wait", "prompt": "go on?" }])).await?;
        let exec = executor(db.another_store(2).await?, &rt, "w", None);
        exec.run_once().await?;
        ensure!(db.store.get_run(id).await?.status == RunStatus::WaitingInput, "{:?}", db.store.get_run(id).await?.error);
        let before = db.store.rate(&target.key).await?.context("limit")?.wait_ms;
        db.store.deliver_input(id, "yes").await?;
        // The resumed segment replays the recorded call and finishes.
        exec.run_once().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed, "{:?} {:?}", run.status, run.error);
        ensure!(target.arrivals().len() == 1, "{} calls", target.arrivals().len());
        let after = db.store.rate(&target.key).await?.context("limit")?.wait_ms;
        ensure!(after <= before, "the clock moved on from {before} to {after} ms: replay was charged");
        Ok(())
    }
}
