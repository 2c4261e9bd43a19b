//! The mixed load: every capability at once, on three `leasehold serve`
//! processes sharing one database, while hosts are killed and frozen
//! (SIGSTOP) for shorter and longer than their lease, and each rule where
//! two capabilities meet is checked from outside, from what the outside
//! services saw and from the API, over the whole history (as a Jepsen
//! checker does), not sampled:
//!
//! * keys with limits: runs of two keys call a sink that records each
//!   call's start and end; `limit_exceeded` is the most distinct runs of a
//!   key at the sink at once, less its limit;
//! * trees that spawn, with token budgets, against a fake model that
//!   reports usage (and never more than a call's hold): `budget_exceeded`
//!   is the tokens the model reported for a tree (once per idempotency
//!   key, as a provider that honours them charges), less its budget; half
//!   the trees get a raise at the end and must then finish;
//! * named waits, with deliveries before and after the wait, some sent
//!   twice under one idempotency key: each must return its own input;
//! * pauses and cancels of whole trees while they spawn;
//! * a schedule ticking every second: `ticks_twice` (a time with two
//!   runs) and `ticks_missed` (a time between the first and last seen with
//!   no record), from its ticks read every 300 ms;
//! * reruns of finished runs, and resolves of unkeyed calls left in doubt
//!   by a death (the run, on one attempt, aborted): each must then finish;
//! * retention of 4 s, so finished runs, and tick records, go while the
//!   load runs;
//! * `stuck`: at the end, runs neither finished nor waiting for something
//!   that can still happen (input not delivered, a child still open, a
//!   budget truly spent);
//! * as in the fault-injection suite: `lost`, `duplicate_effects` (an
//!   unkeyed call that reached its sink twice) and `stale_writes` (the
//!   audit triggers).
//!
//! Every figure must be 0. Settings (environment):
//! `LEASEHOLD_CHAOS_MIX_SEED` (default random; printed, and it replays the
//! same load and faults), `LEASEHOLD_CHAOS_MIX_RUNS` (60) and
//! `LEASEHOLD_CHAOS_MIX_FAULTS` (6). The long mode is
//! `LEASEHOLD_CHAOS_MIX_RUNS=600 LEASEHOLD_CHAOS_MIX_FAULTS=40`. Each run
//! ends with one JSON line on stderr, also written to `target/chaos/`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use axum::extract::{Path as UrlPath, State};
use axum::http::HeaderMap;
use leasehold::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::harness::TestDb;
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc};

const HOSTS: usize = 3;
const TTL_MS: u64 = 3000;
const KEY_LIMITS: [(&str, i64); 2] = [("mix-a", 1), ("mix-b", 2)];
/// Tokens the fake model reports for each answer: within any call's hold
/// (its prompt over four and the grant's 64 answer tokens).
const ANSWER_TOKENS: i64 = 40;
/// Each tree's budget: room for 5 of its 9 calls.
const TREE_BUDGET: i64 = 200;
const SCHEDULE_EVERY_MS: i64 = 1000;

fn env_num(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    seed: u64,
    runs: usize,
    faults: usize,
}

impl Settings {
    fn from_env() -> Settings {
        Settings {
            seed: env_num("LEASEHOLD_CHAOS_MIX_SEED").unwrap_or_else(rand::random),
            runs: env_num("LEASEHOLD_CHAOS_MIX_RUNS").unwrap_or(60) as usize,
            faults: env_num("LEASEHOLD_CHAOS_MIX_FAULTS").unwrap_or(6) as usize,
        }
    }
}

/// What one submit of the load is.
#[derive(Debug, Clone)]
enum Kind {
    /// `steps` calls to the key sink under `key`.
    Keyed { key: &'static str, steps: u64 },
    /// A fanout of three children of three chats each under a budget;
    /// `raise`: the budget is raised at the end; `pause` and `cancel` ms
    /// after its submit.
    Tree { raise: bool, pause_ms: Option<u64>, cancel_ms: Option<u64> },
    /// An `approval` run; its input is delivered `deliver_ms` after its
    /// submit (before or after its wait begins), `twice` under one key.
    Named { sleep_ms: u64, deliver_ms: u64, twice: bool },
    /// One unkeyed call to a slow sink on one attempt: a death in it
    /// leaves the call in doubt and the run aborted, to be resolved.
    Unkeyed,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill(usize),
    /// SIGSTOP for `ms`, then SIGCONT.
    Freeze(usize, u64),
    /// Freezes, past its lease, a host running an unkeyed call on its one
    /// attempt, if one does: the call is left in doubt for a resolve.
    FreezeHolder,
}

fn plan(s: &Settings) -> (Vec<Kind>, Vec<(u64, Fault)>) {
    let mut rng = StdRng::seed_from_u64(s.seed);
    let load = (0..s.runs)
        .map(|_| match rng.random_range(0..100) {
            0..30 => Kind::Keyed { key: KEY_LIMITS[rng.random_range(0..2)].0, steps: rng.random_range(1..=3) },
            30..55 => Kind::Tree {
                raise: rng.random_bool(0.5),
                pause_ms: rng.random_bool(0.25).then(|| rng.random_range(0..400)),
                cancel_ms: rng.random_bool(0.15).then(|| rng.random_range(0..400)),
            },
            55..80 => Kind::Named { sleep_ms: rng.random_range(0..800), deliver_ms: rng.random_range(0..1200), twice: rng.random_bool(0.4) },
            _ => Kind::Unkeyed,
        })
        .collect();
    // Faults spread over the load's time (about 150 ms a run).
    let span = (s.runs as u64 * 150).max(3000);
    let mut faults: Vec<(u64, Fault)> = (0..s.faults)
        .map(|_| {
            let at = rng.random_range(500..span);
            let host = rng.random_range(0..HOSTS);
            let fault = match rng.random_range(0..4) {
                0 => Fault::Kill(host),
                1 => Fault::FreezeHolder,
                // Shorter than the lease: the host comes back still holding it.
                2 => Fault::Freeze(host, rng.random_range(500..TTL_MS - 1000)),
                // Longer: its runs (and keys' slots) are taken over first.
                _ => Fault::Freeze(host, rng.random_range(TTL_MS + 1000..TTL_MS * 2 + 1000)),
            };
            (at, fault)
        })
        .collect();
    faults.sort_by_key(|f| f.0);
    (load, faults)
}

// ---------------------------------------------------------------- outside services

/// One call the key sink saw: its key, its run, and when it started and
/// ended (the sink holds each for a while).
#[derive(Debug, Clone)]
struct KeyCall {
    key: String,
    run: i64,
    start: Instant,
    end: Instant,
}

#[derive(Clone, Default)]
struct Seen {
    calls: Arc<Mutex<Vec<KeyCall>>>,
    /// Unkeyed calls by their tag, with how many arrived.
    unkeyed: Arc<Mutex<HashMap<String, u64>>>,
    /// Model answers: idempotency key -> (tree, tokens).
    answers: Arc<Mutex<HashMap<String, (String, i64)>>>,
}

/// The run id in an idempotency key (`<database>:<run>:<seq>`).
fn run_of(key: &str) -> i64 {
    key.split(':').nth(1).and_then(|r| r.parse().ok()).unwrap_or(-1)
}

async fn key_call(State(seen): State<Seen>, UrlPath(key): UrlPath<String>, headers: HeaderMap) -> &'static str {
    let run = run_of(headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or(""));
    let start = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    seen.calls.lock().unwrap().push(KeyCall { key, run, start, end: Instant::now() });
    "ok"
}

async fn unkeyed_call(State(seen): State<Seen>, body: String) -> &'static str {
    let tag = serde_json::from_str::<Value>(&body).ok().and_then(|b| b["tag"].as_str().map(str::to_string)).unwrap_or_default();
    *seen.unkeyed.lock().unwrap().entry(tag).or_default() += 1;
    tokio::time::sleep(Duration::from_millis(800)).await;
    "ok"
}

/// A fake OpenAI-compatible model: streams a short answer and reports
/// [`ANSWER_TOKENS`] of usage, recording each idempotency key's tree (the
/// `tree-N` in its prompt) once.
async fn chat(State(seen): State<Seen>, headers: HeaderMap, body: String) -> axum::response::Response {
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body: Value = serde_json::from_str(&body).unwrap_or_default();
    let prompt = body["messages"].to_string();
    let tree = prompt.split("tree-").nth(1).map(|r| r.chars().take_while(char::is_ascii_digit).collect::<String>()).unwrap_or_default();
    seen.answers.lock().unwrap().entry(key).or_insert((tree, ANSWER_TOKENS));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let event = |v: Value| format!("data: {v}\n\n");
    let text = [
        event(json!({ "choices": [{ "index": 0, "delta": { "content": "fine" }, "finish_reason": null }] })),
        event(json!({ "choices": [{ "index": 0, "delta": {}, "finish_reason": "stop" }] })),
        event(json!({ "choices": [], "usage": { "prompt_tokens": 10, "completion_tokens": ANSWER_TOKENS - 10, "total_tokens": ANSWER_TOKENS } })),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    axum::response::Response::builder().header("content-type", "text/event-stream").body(axum::body::Body::from(text)).unwrap()
}

async fn outside(seen: Seen) -> Result<(String, tokio::task::JoinHandle<()>)> {
    let app = axum::Router::new()
        .route("/k/{key}", axum::routing::post(key_call))
        .route("/unkeyed", axum::routing::post(unkeyed_call))
        .route("/v1/chat/completions", axum::routing::post(chat))
        .with_state(seen);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((format!("127.0.0.1:{}", addr.port()), server))
}

// ---------------------------------------------------------------- hosts

struct Hosts {
    procs: Vec<Mutex<Option<ServeProc>>>,
    ports: Vec<u16>,
    frozen: Vec<std::sync::atomic::AtomicBool>,
    generation: Vec<AtomicU64>,
    db_url: String,
    dir: std::path::PathBuf,
    outside: String,
    http: reqwest::Client,
}

impl Hosts {
    fn args(&self, h: usize) -> Result<ServeArgs<'_>> {
        let owner = format!("m{h}.{}", self.generation[h].load(Relaxed));
        let mut a = ServeArgs::new(&self.db_url, &self.dir, owner)?;
        a.log = self.dir.join(format!("host-{h}.log"));
        a.port = self.ports[h];
        a.lease_ttl_ms = TTL_MS;
        a.reaper_interval_ms = 500;
        a.poll_ms = 200;
        a.workers = 6;
        a.http_allow = vec![self.outside.clone()];
        a.extra = vec![
            "--spawn-allow=fanout=testkit".into(),
            "--retention=4s".into(),
            format!("--model-base-url=http://{}/v1", self.outside),
            "--model=fake-1".into(),
            "--model-allow=*".into(),
            "--model-max-tokens=64".into(),
            "--shutdown-grace-ms=1000".into(),
        ];
        Ok(a)
    }

    fn spawn(&self, h: usize) -> Result<()> {
        self.generation[h].fetch_add(1, Relaxed);
        *self.procs[h].lock().unwrap() = Some(ServeProc::spawn(&self.args(h)?)?);
        self.frozen[h].store(false, Relaxed);
        Ok(())
    }

    fn base(&self, h: usize) -> String {
        format!("http://127.0.0.1:{}", self.ports[h])
    }

    fn live(&self) -> Vec<usize> {
        (0..HOSTS).filter(|&h| self.procs[h].lock().unwrap().is_some() && !self.frozen[h].load(Relaxed)).collect()
    }

    fn pid(&self, h: usize) -> Option<u32> {
        self.procs[h].lock().unwrap().as_ref().map(ServeProc::pid)
    }

    /// Sends a request to a live host, moving on to another on a transport
    /// error or a 503, until one answers below 500. Another 5xx fails.
    async fn call(&self, req: impl Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder) -> Result<(u16, Value)> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut turn = 0usize;
        loop {
            let live = self.live();
            turn += 1;
            if let Some(&h) = live.get(turn % live.len().max(1))
                && let Ok(r) = req(&self.http, &self.base(h)).send().await
            {
                let status = r.status().as_u16();
                if status < 500 {
                    return Ok((status, r.json::<Value>().await.unwrap_or(Value::Null)));
                }
                if status != 503 && self.live().contains(&h) {
                    bail!("live host {h} answered {status}: {}", r.text().await.unwrap_or_default());
                }
            }
            ensure!(Instant::now() < deadline, "no host answered for 120 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    let status = std::process::Command::new("kill").args([sig, &pid.to_string()]).status()?;
    ensure!(status.success(), "kill {sig} {pid} failed");
    Ok(())
}

async fn inject(hosts: &Hosts, db: &TestDb, fault: Fault, counters: &Counters) -> Result<()> {
    let fault = match fault {
        Fault::FreezeHolder => {
            let owner: Option<String> = sqlx::query_scalar(
                "SELECT lease_owner FROM runs WHERE status = 'running' AND plugin = 'testkit' AND max_attempts = 1 LIMIT 1",
            )
            .fetch_optional(db.store.pool())
            .await?
            .flatten();
            let host = owner.and_then(|o| o.strip_prefix('m')?.split('.').next()?.parse::<usize>().ok());
            match host {
                Some(h) => Fault::Freeze(h, TTL_MS + 2000),
                None => return Ok(()),
            }
        }
        other => other,
    };
    match fault {
        Fault::FreezeHolder => {}
        Fault::Kill(h) => {
            if hosts.procs[h].lock().unwrap().take().is_some() {
                counters.kills.fetch_add(1, Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            hosts.spawn(h)?;
        }
        Fault::Freeze(h, ms) => {
            let Some(pid) = hosts.pid(h) else { return Ok(()) };
            hosts.frozen[h].store(true, Relaxed);
            signal(pid, "-STOP")?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            signal(pid, "-CONT")?;
            hosts.frozen[h].store(false, Relaxed);
            let counter = if ms < TTL_MS { &counters.short_freezes } else { &counters.long_freezes };
            counter.fetch_add(1, Relaxed);
        }
    }
    Ok(())
}

#[derive(Default)]
struct Counters {
    kills: AtomicU64,
    short_freezes: AtomicU64,
    long_freezes: AtomicU64,
    paused: AtomicU64,
    cancelled: AtomicU64,
    reruns: AtomicU64,
    resolved: AtomicU64,
    raised: AtomicU64,
    deliveries: AtomicU64,
}

/// A run the load submitted, with what to expect of it.
#[derive(Debug, Clone)]
struct Acked {
    id: i64,
    kind: Kind,
    /// Trees: `tree-N`; named waits: the input delivered; unkeyed: the tag.
    label: String,
}

// ---------------------------------------------------------------- the run

mod every_capability_under_faults_keeps_its_invariant {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite() -> Result<()> {
        mix(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres() -> Result<()> {
        mix(Backend::Postgres).await
    }
}

async fn mix(backend: Backend) -> Result<()> {
    crate::harness::init_logs();
    let settings = Settings::from_env();
    eprintln!("chaos mix {}: seed {} ({settings:?})", backend.name(), settings.seed);
    let (load, faults) = plan(&settings);
    let db = TestDb::new(backend).await?;
    let dir = tempfile::Builder::new().prefix("leasehold-mix").tempdir()?;
    std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
    std::fs::write(dir.path().join("fanout.wasm"), plugins::rust_plugin("fanout")?)?;
    std::fs::write(dir.path().join("approval.wasm"), plugins::rust_plugin("approval")?)?;
    let db_url = match backend {
        Backend::Sqlite => {
            // The hosts share the test's file.
            db.url().to_string()
        }
        Backend::Postgres => db.url().to_string(),
    };
    sqlx::raw_sql(match backend {
        Backend::Sqlite => crate::chaos::AUDIT_SQLITE,
        Backend::Postgres => crate::chaos::AUDIT_POSTGRES,
    })
    .execute(db.store.pool())
    .await
    .context("installing the audit triggers")?;
    sqlx::query("INSERT INTO chaos_bounds (max_lease_ms) VALUES ($1)").bind(TTL_MS as i64 + 1000).execute(db.store.pool()).await?;
    for (key, limit) in KEY_LIMITS {
        db.store.set_limit(key, Some(limit), false).await?;
    }
    let seen = Seen::default();
    let (outside_addr, server) = outside(seen.clone()).await?;
    leasehold::effects::http::install_tls();
    let hosts = Hosts {
        procs: (0..HOSTS).map(|_| Mutex::new(None)).collect(),
        ports: (0..HOSTS).map(|_| crate::serve_proc::free_port()).collect::<Result<_>>()?,
        frozen: (0..HOSTS).map(|_| Default::default()).collect(),
        generation: (0..HOSTS).map(|_| Default::default()).collect(),
        db_url,
        dir: dir.path().to_path_buf(),
        outside: outside_addr,
        http: crate::serve_proc::client(reqwest::Client::builder().timeout(Duration::from_secs(10)))?,
    };
    for h in 0..HOSTS {
        hosts.spawn(h)?;
    }
    for h in 0..HOSTS {
        crate::serve_proc::wait_healthy(&hosts.http, &hosts.base(h), Duration::from_secs(60)).await?;
    }
    let result = drive(&settings, backend, load, faults, &hosts, &db, &seen).await;
    for h in 0..HOSTS {
        if let Some(pid) = hosts.pid(h) {
            let _ = signal(pid, "-CONT");
        }
        hosts.procs[h].lock().unwrap().take();
    }
    server.abort();
    if result.is_err() {
        for h in 0..HOSTS {
            let text = std::fs::read_to_string(dir.path().join(format!("host-{h}.log"))).unwrap_or_default();
            let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).collect();
            for l in &warnings[warnings.len().saturating_sub(10)..] {
                eprintln!("chaos mix host-{h}.log: {l}");
            }
        }
        let kept = dir.keep();
        eprintln!("chaos mix {}: host logs kept in {}", backend.name(), kept.display());
    }
    db.cleanup().await?;
    result
}

async fn drive(settings: &Settings, backend: Backend, load: Vec<Kind>, faults: Vec<(u64, Fault)>, hosts: &Hosts, db: &TestDb, seen: &Seen) -> Result<()> {
    let started = Instant::now();
    let counters = Counters::default();
    let out = format!("http://{}", hosts.outside);
    // The schedule.
    let (status, body) = hosts
        .call(|http, base| {
            http.post(format!("{base}/v1/schedules")).json(&json!({
                "id": "mix", "plugin": "testkit", "input": { "steps": 1 }, "interval": "1s", "overlap": "allow_all",
            }))
        })
        .await?;
    ensure!(status == 201, "the schedule: {status} {body}");
    // Its ticks, read every 300 ms (retention deletes them as it goes).
    let ticks: Arc<Mutex<BTreeMap<i64, BTreeSet<i64>>>> = Arc::default();
    let (stop_ticks, mut ticks_stopped) = tokio::sync::watch::channel(false);
    let watcher = {
        // A short timeout: a frozen host must not hold the reads up past
        // the records' retention.
        let http = crate::serve_proc::client(reqwest::Client::builder().timeout(Duration::from_millis(800)))?;
        let (ticks, bases) = (ticks.clone(), (0..HOSTS).map(|h| hosts.base(h)).collect::<Vec<_>>());
        tokio::spawn(async move {
            let mut turn = 0;
            loop {
                turn += 1;
                if let Ok(r) = http.get(format!("{}/v1/schedules/mix/ticks?limit=50", bases[turn % bases.len()])).send().await
                    && let Ok(page) = r.json::<Value>().await
                {
                    for t in page["ticks"].as_array().into_iter().flatten() {
                        let at = t["scheduled_at"].as_i64().unwrap_or_default();
                        let mut ticks = ticks.lock().unwrap();
                        let runs = ticks.entry(at).or_default();
                        if let Some(run) = t["run_id"].as_i64() {
                            runs.insert(run);
                        }
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                    _ = ticks_stopped.wait_for(|s| *s) => return,
                }
            }
        })
    };
    // Faults, on their own schedule.
    let fault_task = async {
        for (at, fault) in &faults {
            let wait = Duration::from_millis(*at).saturating_sub(started.elapsed());
            tokio::time::sleep(wait).await;
            inject(hosts, db, *fault, &counters).await?;
        }
        anyhow::Ok(())
    };
    // The load, about one submit each 150 ms, with its timed actions.
    let reruns: Arc<Mutex<Vec<i64>>> = Arc::default();
    let load_task = async {
        let mut acked = Vec::new();
        let mut actions = tokio::task::JoinSet::new();
        let mut rng = StdRng::seed_from_u64(settings.seed ^ 0x5eed);
        for (i, kind) in load.into_iter().enumerate() {
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
            let (request, label) = match &kind {
                Kind::Keyed { key, steps } => (
                    json!({ "plugin": "testkit", "concurrency_key": key, "input": { "mode": "http-steps", "steps": steps, "url": format!("{out}/k/{key}") } }),
                    String::new(),
                ),
                Kind::Tree { .. } => {
                    let label = format!("tree-{i}");
                    let chats = |c: usize| {
                        let ops: Vec<Value> = (0..3).map(|q| json!({ "op": "chat", "prompt": format!("{label} child {c} q{q}") })).collect();
                        json!({ "mode": "script", "ops": ops })
                    };
                    (json!({ "plugin": "fanout", "budget": { "tokens": TREE_BUDGET }, "input": { "inputs": [chats(0), chats(1), chats(2)] } }), label)
                }
                Kind::Named { sleep_ms, .. } => (json!({ "plugin": "approval", "input": { "sleep_ms": sleep_ms, "timeout_ms": 120_000 } }), format!("v{i}")),
                Kind::Unkeyed => {
                    let tag = format!("u{i}");
                    let ops = json!([{ "op": "http", "url": format!("{out}/unkeyed"), "keyed": false, "body": { "tag": tag } }]);
                    (json!({ "plugin": "testkit", "max_attempts": 1, "input": { "mode": "script", "ops": ops } }), tag)
                }
            };
            let (status, run) = hosts.call(|http, base| http.post(format!("{base}/v1/runs")).json(&request)).await?;
            ensure!(status == 201, "a submit: {status} {run}");
            let id = run["id"].as_i64().context("a run id")?;
            acked.push(Acked { id, kind: kind.clone(), label: label.clone() });
            // What happens to it later, off the submit loop.
            let (http, bases) = (hosts.http.clone(), (0..HOSTS).map(|h| hosts.base(h)).collect::<Vec<_>>());
            let action = async move |delay: u64, path: String, body: Value| {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                for turn in 0..200 {
                    if let Ok(r) = http.post(format!("{}{path}", bases[turn % bases.len()])).json(&body).send().await
                        && r.status().as_u16() < 500
                    {
                        return r.status().as_u16();
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                0
            };
            match kind {
                Kind::Tree { pause_ms: Some(p), .. } => {
                    counters.paused.fetch_add(1, Relaxed);
                    actions.spawn(async move {
                        action(p, format!("/v1/runs/{id}/pause"), json!({})).await;
                        action(1000, format!("/v1/runs/{id}/resume"), json!({})).await;
                    });
                }
                Kind::Tree { cancel_ms: Some(c), .. } => {
                    counters.cancelled.fetch_add(1, Relaxed);
                    actions.spawn(async move {
                        action(c, format!("/v1/runs/{id}/cancel"), json!({})).await;
                    });
                }
                Kind::Keyed { .. } if i % 4 == 0 => {
                    // Once it finishes (retention takes it seconds later),
                    // a rerun from its second call.
                    let (http, bases, reruns) = (hosts.http.clone(), (0..HOSTS).map(|h| hosts.base(h)).collect::<Vec<_>>(), reruns.clone());
                    actions.spawn(async move {
                        for turn in 0..300 {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            let base = &bases[turn % bases.len()];
                            let Ok(r) = http.get(format!("{base}/v1/runs/{id}")).send().await else { continue };
                            let Ok(run) = r.json::<Value>().await else { continue };
                            if run["status"] == "completed" {
                                if let Ok(r) = http.post(format!("{base}/v1/runs/{id}/rerun")).json(&json!({ "from_seq": 1 })).send().await
                                    && r.status() == 201
                                    && let Ok(rerun) = r.json::<Value>().await
                                {
                                    reruns.lock().unwrap().extend(rerun["id"].as_i64());
                                }
                                return;
                            }
                        }
                    });
                }
                Kind::Named { deliver_ms, twice, .. } => {
                    counters.deliveries.fetch_add(1 + u64::from(twice), Relaxed);
                    let body = json!({ "name": "approval", "input": label, "idempotency_key": format!("d{id}") });
                    actions.spawn(async move {
                        action(deliver_ms, format!("/v1/runs/{id}/input"), body.clone()).await;
                        if twice {
                            action(0, format!("/v1/runs/{id}/input"), body).await;
                        }
                    });
                }
                _ => {}
            }
        }
        while actions.join_next().await.is_some() {}
        anyhow::Ok(acked)
    };
    // Unkeyed calls a death left in doubt, their runs aborted on their one
    // attempt: resolved by hand as the load runs (retention takes them
    // seconds after), each run then goes on and completes.
    let (stop_resolver, mut resolver_stopped) = tokio::sync::watch::channel(false);
    let resolver = async {
        loop {
            let (_, page) = hosts.call(|http, base| http.get(format!("{base}/v1/runs?status=aborted&plugin=testkit&limit=100"))).await?;
            for run in page["runs"].as_array().into_iter().flatten() {
                let id = run["id"].as_i64().unwrap_or_default();
                let (_, effects) = hosts.call(|http, base| http.get(format!("{base}/v1/runs/{id}/effects"))).await?;
                let last = effects["effects"].as_array().and_then(|e| e.last()).cloned().unwrap_or(Value::Null);
                if last["name"] != "http.unkeyed" || !(last["state"] == "in_doubt" || last["state"] == "started") {
                    continue;
                }
                let seq = last["seq"].as_i64().unwrap_or_default();
                let (status, body) = hosts
                    .call(|http, base| {
                        http.post(format!("{base}/v1/runs/{id}/effects/{seq}/resolve"))
                            .json(&json!({ "result": { "status": 200, "body": "resolved" }, "by": "chaos" }))
                    })
                    .await?;
                ensure!(status == 200 || status == 404, "resolving run {id}'s call {seq}: {status} {body}");
                if status == 200 {
                    counters.resolved.fetch_add(1, Relaxed);
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = resolver_stopped.wait_for(|s| *s) => return anyhow::Ok(()),
            }
        }
    };
    let loaded = async {
        let (faulted, acked) = tokio::join!(fault_task, load_task);
        // Let the reaper give up what the last faults left, then resolve it.
        tokio::time::sleep(Duration::from_millis(TTL_MS + 2000)).await;
        let _ = stop_resolver.send(true);
        (faulted, acked)
    };
    let ((faulted, acked), resolved) = tokio::join!(loaded, resolver);
    resolved?;
    faulted?;
    let mut acked = acked?;
    // The reruns of finished keyed runs: each must finish too.
    for id in reruns.lock().unwrap().iter() {
        counters.reruns.fetch_add(1, Relaxed);
        acked.push(Acked { id: *id, kind: Kind::Keyed { key: "rerun", steps: 0 }, label: String::new() });
    }
    // Quiet: everything finishes or waits for what can still happen.
    let quiet = settle(hosts, db, &acked, Duration::from_secs(90)).await?;
    // Half the trees get room: each must then finish.
    for a in acked.iter().filter(|a| matches!(a.kind, Kind::Tree { raise: true, .. })) {
        if finished(hosts, a.id).await?.is_some() {
            continue;
        }
        let (status, body) = hosts.call(|http, base| http.post(format!("{base}/v1/runs/{}/budget", a.id)).json(&json!({ "tokens": 100_000 }))).await?;
        ensure!(status == 200 || status == 404, "raising run {}'s budget: {status} {body}", a.id);
        counters.raised.fetch_add(1, Relaxed);
    }
    let quiet = quiet && settle(hosts, db, &acked, Duration::from_secs(60)).await?;
    let _ = stop_ticks.send(true);
    let _ = watcher.await;
    let report = check(settings, backend, &acked, hosts, db, seen, &ticks.lock().unwrap().clone(), &counters, started.elapsed(), quiet).await?;
    let line = report.json.to_string();
    eprintln!("{line}");
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/chaos");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join(format!("mix-{}-{}.json", backend.name(), settings.seed)), &line)?;
    if !report.failures.is_empty() {
        bail!("chaos mix {} (seed {}): {}", backend.name(), settings.seed, report.failures.join("; "));
    }
    Ok(())
}

/// Run `id`'s status once it has finished; `None` while it is open. A run
/// retention deleted (404) finished: only finished runs are deleted.
async fn finished(hosts: &Hosts, id: i64) -> Result<Option<String>> {
    let (status, run) = hosts.call(|http, base| http.get(format!("{base}/v1/runs/{id}"))).await?;
    if status == 404 {
        return Ok(Some("deleted".into()));
    }
    let s = run["status"].as_str().unwrap_or_default().to_string();
    Ok(["completed", "failed", "aborted", "cancelled"].contains(&s.as_str()).then_some(s))
}

/// The open runs of the database (every run of the load's trees included)
/// that wait for nothing that can still happen: a run due or running, a
/// parent waiting for children all finished, a budget waiter with room,
/// a named wait whose input sits in its inbox, a paused run.
async fn stuck(db: &TestDb) -> Result<Vec<(i64, String)>> {
    let s = &db.store;
    let rows: Vec<(i64, String, Option<String>, Option<i64>)> = sqlx::query_as(
        "SELECT id, status, waiting_for, paused_at FROM runs WHERE status NOT IN ('completed','failed','aborted','cancelled')",
    )
    .fetch_all(s.pool())
    .await?;
    let mut stuck = Vec::new();
    for (id, status, waiting, paused) in rows {
        let why = match (status.as_str(), waiting.as_deref()) {
            _ if paused.is_some() => Some("paused".to_string()),
            ("queued", Some("children")) => {
                let open: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM runs WHERE parent_id = $1 AND status NOT IN ('completed','failed','aborted','cancelled')",
                )
                .bind(id)
                .fetch_one(s.pool())
                .await?;
                (open == 0).then(|| "waits for children that have all finished".to_string())
            }
            ("queued", Some("budget")) => {
                let budget = s.budget(id).await?;
                let need: Option<i64> = sqlx::query_scalar("SELECT wait_tokens FROM runs WHERE id = $1").bind(id).fetch_one(s.pool()).await?;
                let room = budget.tokens.is_none_or(|t| budget.spent + budget.held + need.unwrap_or(1) <= t);
                room.then(|| format!("waits for budget it has: {budget:?}, needs {need:?}"))
            }
            ("queued", Some(w)) if w.starts_with("input:") => {
                let name = &w["input:".len()..];
                let pending: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM inbox WHERE run_id = $1 AND name = $2")
                    .bind(id)
                    .bind(name)
                    .fetch_one(s.pool())
                    .await?;
                (pending > 0).then(|| format!("waits on {name} with input in its inbox"))
            }
            ("waiting_input", _) => None,
            (status, waiting) => Some(format!("{status}, waiting for {waiting:?}")),
        };
        if let Some(why) = why {
            stuck.push((id, why));
        }
    }
    Ok(stuck)
}

/// Waits up to `within` until no run is stuck (every open run waits for
/// something that can still happen). True if it got there.
async fn settle(_hosts: &Hosts, db: &TestDb, _acked: &[Acked], within: Duration) -> Result<bool> {
    let deadline = Instant::now() + within;
    loop {
        if stuck(db).await?.is_empty() {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

struct Report {
    json: Value,
    failures: Vec<String>,
}

#[allow(clippy::too_many_arguments)]
async fn check(
    settings: &Settings,
    backend: Backend,
    acked: &[Acked],
    hosts: &Hosts,
    db: &TestDb,
    seen: &Seen,
    ticks: &BTreeMap<i64, BTreeSet<i64>>,
    counters: &Counters,
    elapsed: Duration,
    quiet: bool,
) -> Result<Report> {
    let mut failures = Vec::new();
    // Keys: the most distinct runs of a key at the sink at once.
    let calls = seen.calls.lock().unwrap().clone();
    let mut limit_exceeded = i64::MIN;
    let mut key_most = BTreeMap::new();
    for (key, limit) in KEY_LIMITS {
        let mine: Vec<&KeyCall> = calls.iter().filter(|c| c.key == key).collect();
        let mut most = 0;
        for c in &mine {
            let at_once: HashSet<i64> = mine.iter().filter(|o| o.start <= c.start && c.start < o.end).map(|o| o.run).collect();
            most = most.max(at_once.len() as i64);
        }
        key_most.insert(key, most);
        limit_exceeded = limit_exceeded.max(most - limit);
    }
    if limit_exceeded > 0 {
        failures.push(format!("a key's runs at the sink at once passed its limit by {limit_exceeded}: {key_most:?}"));
    }
    // Budgets: tokens the model reported per tree, once per key.
    let mut by_tree: BTreeMap<String, i64> = BTreeMap::new();
    for (tree, tokens) in seen.answers.lock().unwrap().values() {
        *by_tree.entry(format!("tree-{tree}")).or_default() += tokens;
    }
    let budget_exceeded = by_tree.values().map(|t| t - TREE_BUDGET).max().unwrap_or(i64::MIN);
    let raised: HashSet<&str> = acked.iter().filter(|a| matches!(a.kind, Kind::Tree { raise: true, .. })).map(|a| a.label.as_str()).collect();
    // A raised tree may spend what its raise allows: only its pre-raise calls count against the budget.
    let budget_exceeded_unraised = by_tree.iter().filter(|(t, _)| !raised.contains(t.as_str())).map(|(_, v)| v - TREE_BUDGET).max().unwrap_or(i64::MIN);
    if budget_exceeded_unraised > 0 {
        failures.push(format!("a tree's model calls passed its budget by {budget_exceeded_unraised} tokens"));
    }
    // Liveness.
    let stuck = stuck(db).await?;
    if !stuck.is_empty() || !quiet {
        failures.push(format!("{} runs stuck: {:?}", stuck.len(), &stuck[..stuck.len().min(5)]));
    }
    // Every acknowledged run: finished (or deleted, which only a finished
    // run is), or legitimately waiting; and what each must end as.
    let mut lost = 0;
    let mut wrong = Vec::new();
    let mut open = 0;
    for a in acked {
        let (status, run) = hosts.call(|http, base| http.get(format!("{base}/v1/runs/{}", a.id))).await?;
        if status == 404 {
            continue;
        }
        let s = run["status"].as_str().unwrap_or_default();
        let done = ["completed", "failed", "aborted", "cancelled"].contains(&s);
        if !done {
            open += 1;
            if stuck.iter().any(|(id, _)| *id == a.id) {
                lost += 1;
            }
            continue;
        }
        match &a.kind {
            Kind::Named { .. } if s == "completed" => {
                let want = json!({ "input": a.label }).to_string();
                if run["output"].as_str() != Some(want.as_str()) {
                    wrong.push(format!("named wait {} returned {:?}, not {want}", a.id, run["output"]));
                }
            }
            Kind::Keyed { .. } | Kind::Named { .. } | Kind::Unkeyed if s != "completed" => {
                wrong.push(format!("run {} ({:?}) ended {s}: {:?}", a.id, a.kind, run["error"]));
            }
            Kind::Tree { raise: true, cancel_ms: None, .. } if s != "completed" => {
                wrong.push(format!("raised tree {} ended {s}: {:?}", a.id, run["error"]));
            }
            _ => {}
        }
    }
    failures.extend(wrong.iter().take(5).cloned());
    // Schedules.
    let times: Vec<i64> = ticks.keys().copied().collect();
    let ticks_twice = ticks.values().filter(|runs| runs.len() > 1).count();
    let ticks_missed = match (times.first(), times.last()) {
        (Some(first), Some(last)) => ((last - first) / SCHEDULE_EVERY_MS + 1) as usize - times.len(),
        _ => 0,
    };
    if ticks_twice > 0 || ticks_missed > 0 || times.len() < 3 {
        failures.push(format!("schedule: {ticks_twice} times ran twice, {ticks_missed} missed, {} seen", times.len()));
    }
    // Effects.
    let duplicate_effects = seen.unkeyed.lock().unwrap().values().filter(|n| **n > 1).count();
    if duplicate_effects > 0 {
        failures.push(format!("{duplicate_effects} unkeyed calls reached their sink twice"));
    }
    let stale: Vec<(String, i64, i64, i64, i64)> =
        sqlx::query_as("SELECT tbl, run_id, row_fence, run_fence, seq FROM chaos_stale").fetch_all(db.store.pool()).await?;
    if !stale.is_empty() {
        failures.push(format!("{} stale writes: {:?}", stale.len(), &stale[..stale.len().min(3)]));
    }
    // The threads' logs: each number once, counters at or past their last.
    let log_faults = crate::harness::thread_log_faults(&db.store).await?;
    failures.extend(log_faults.iter().cloned());
    let json = json!({
        "suite": "chaos-mix",
        "seed": settings.seed,
        "backend": backend.name(),
        "runs": acked.len(),
        "kills": counters.kills.load(Relaxed),
        "short_freezes": counters.short_freezes.load(Relaxed),
        "long_freezes": counters.long_freezes.load(Relaxed),
        "trees_paused": counters.paused.load(Relaxed),
        "trees_cancelled": counters.cancelled.load(Relaxed),
        "budgets_raised": counters.raised.load(Relaxed),
        "deliveries": counters.deliveries.load(Relaxed),
        "reruns": counters.reruns.load(Relaxed),
        "resolved": counters.resolved.load(Relaxed),
        "key_calls": calls.len(),
        "key_most_at_once": key_most,
        "limit_exceeded": limit_exceeded.max(0),
        "model_calls": seen.answers.lock().unwrap().len(),
        "budget_exceeded": budget_exceeded_unraised.max(0),
        "most_tokens_over_a_raised_budget": budget_exceeded.max(0),
        "stuck": stuck.len(),
        "open_at_end": open,
        "ticks_seen": times.len(),
        "ticks_twice": ticks_twice,
        "ticks_missed": ticks_missed,
        "lost": lost,
        "duplicate_effects": duplicate_effects,
        "stale_writes": stale.len(),
        "thread_log_faults": log_faults.len(),
        "wrong_outcomes": wrong.len(),
        "elapsed_s": elapsed.as_secs(),
    });
    Ok(Report { json, failures })
}
