//! The measuring half of `leasehold bench harness-adapter`: leasehold as an
//! adapter of the public PostgreSQL job-queue benchmark harness
//! (`benches/harness/`). The binary serves a host in the same process (so
//! the harness's SIGKILL of a replica kills a host); this module reads the
//! harness's settings from its environment, submits runs of a no-op plugin
//! through the public API's batch submit, and prints the harness's JSONL
//! on stdout: one descriptor, then every `SAMPLE_EVERY_S` the pickup
//! percentiles over 30 s, the enqueue and completion rates over the tick,
//! and (replica 0 only) the queue depth.
//!
//! A run's pickup is its submit (`created_at`, the database's clock) to the
//! first start of its turn on a worker, wait in the local queue included,
//! and for a run a killed host had claimed but not started, that host's
//! lease ([`crate::metrics::set_start_tap`]); one machine, one clock, 1 ms
//! resolution. A completion is a segment that completed its run
//! on this replica ([`crate::metrics::Metrics::segments_completed`]), so a
//! run counts once whichever replica finishes it.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use crate::store::{Store, StoreError};

/// The harness's name for the system.
pub const SYSTEM: &str = "leasehold";
/// The plugin the adapter registers: `target/plugins/testkit.wasm` under
/// this name, each run one WASI sleep of `JOB_WORK_MS`.
pub const PLUGIN: &str = "harness-noop";
/// The tables a run's submit, claim and close write, whose dead tuples the
/// harness watches (`benches/harness/adapter.json` lists the same).
pub const EVENT_TABLES: [&str; 4] = ["public.runs", "public.threads", "public.events", "public.segments"];
/// The pickup percentiles' window.
pub const WINDOW: Duration = Duration::from_secs(30);

/// The harness's settings (its adapter guide names them), from the
/// environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `PRODUCER_RATE`, runs/s. Default: 100.
    pub rate: u64,
    /// `PRODUCER_RATE_CONTROL_FILE`: the current rate, re-read each tick
    /// (a `high-load` phase rewrites it). Default: none.
    pub rate_file: Option<PathBuf>,
    /// `PRODUCER_BATCH_MAX`: most runs in one batch submit. Default: 128.
    pub batch_max: usize,
    /// `PRODUCER_BATCH_MS`: the producer's tick when it paces itself.
    /// Default: 25.
    pub batch_ms: u64,
    /// `PRODUCER_PACING=harness`: the harness sends `ENQUEUE <n>` lines on
    /// stdin and the adapter submits n runs per line; else the adapter
    /// paces itself on elapsed wall-clock time. Default: adapter.
    pub harness_paced: bool,
    /// `WORKER_COUNT`: the host's workers. Default: 8.
    pub workers: usize,
    /// `JOB_PAYLOAD_BYTES`: about this many bytes of input per run.
    /// Default: 256.
    pub payload_bytes: usize,
    /// `JOB_WORK_MS`: each turn's WASI sleep. Default: 1.
    pub work_ms: u64,
    /// `SAMPLE_EVERY_S`. Default: 5.
    pub sample_every_s: u64,
    /// `BENCH_INSTANCE_ID`: this replica. Only replica 0 produces the
    /// queue-wide gauges. Default: 0.
    pub instance: u32,
}

impl Settings {
    /// Reads the settings through `var` (the environment, or a test's map).
    /// A value that does not parse, a `PRODUCER_MODE` other than `fixed` or
    /// a `SCENARIO` other than `long_horizon` is an error that names it.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        fn num<T: std::str::FromStr>(var: &impl Fn(&str) -> Option<String>, name: &str, default: T) -> Result<T, String> {
            match var(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(default),
                Some(v) => v.trim().parse().map_err(|_| format!("{name}={v:?} is not a whole number")),
            }
        }
        if let Some(scenario) = var("SCENARIO").filter(|s| s != "long_horizon") {
            return Err(format!("SCENARIO={scenario:?}: the leasehold adapter runs only long_horizon"));
        }
        if let Some(mode) = var("PRODUCER_MODE").filter(|m| m != "fixed") {
            return Err(format!("PRODUCER_MODE={mode:?}: the leasehold adapter produces at a fixed rate only (fixed)"));
        }
        let settings = Settings {
            rate: num(&var, "PRODUCER_RATE", 100)?,
            rate_file: var("PRODUCER_RATE_CONTROL_FILE").filter(|f| !f.is_empty()).map(PathBuf::from),
            batch_max: num(&var, "PRODUCER_BATCH_MAX", 128)?,
            batch_ms: num(&var, "PRODUCER_BATCH_MS", 25)?,
            harness_paced: var("PRODUCER_PACING").as_deref() == Some("harness"),
            workers: num(&var, "WORKER_COUNT", 8)?,
            payload_bytes: num(&var, "JOB_PAYLOAD_BYTES", 256)?,
            work_ms: num(&var, "JOB_WORK_MS", 1)?,
            sample_every_s: num(&var, "SAMPLE_EVERY_S", 5)?,
            instance: num(&var, "BENCH_INSTANCE_ID", 0)?,
        };
        if settings.batch_max == 0 || settings.batch_max > 1000 {
            return Err(format!("PRODUCER_BATCH_MAX={} must be 1 to 1000 (a batch submit's cap)", settings.batch_max));
        }
        if settings.workers == 0 || settings.sample_every_s == 0 || settings.batch_ms == 0 {
            return Err("WORKER_COUNT, SAMPLE_EVERY_S and PRODUCER_BATCH_MS must be positive".into());
        }
        Ok(settings)
    }

    /// The rate now: the control file's, else `PRODUCER_RATE`.
    fn current_rate(&self) -> u64 {
        self.rate_file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .and_then(|t| t.trim().parse::<f64>().ok())
            .map_or(self.rate, |r| r.max(0.0) as u64)
    }

    /// A run's input: the test plugin's script of one WASI sleep (none for
    /// 0 ms), padded to about `payload_bytes`.
    pub fn input(&self) -> Value {
        let ops = if self.work_ms > 0 { json!([{ "op": "wasi-sleep", "ms": self.work_ms }]) } else { json!([]) };
        let bare = json!({ "mode": "script", "ops": ops, "pad": "" });
        let pad = self.payload_bytes.saturating_sub(bare.to_string().len());
        json!({ "mode": "script", "ops": ops, "pad": "x".repeat(pad) })
    }
}

/// Pickup times of the tick in progress, in ms: by value, so its memory is
/// bounded by the distinct values, not the runs.
static PICKUPS: Mutex<BTreeMap<u32, u64>> = Mutex::new(BTreeMap::new());

/// The start listener the adapter installs ([`crate::metrics::set_start_tap`]).
pub fn tap(ms: i64) {
    let ms = ms.clamp(0, u32::MAX as i64) as u32;
    *PICKUPS.lock().expect("pickups lock").entry(ms).or_default() += 1;
}

/// The pickups of the last ticks, and their percentiles.
#[derive(Debug, Default)]
pub struct Window {
    ticks: VecDeque<BTreeMap<u32, u64>>,
    keep: usize,
}

impl Window {
    /// A window of `keep` ticks.
    pub fn new(keep: usize) -> Window {
        Window { ticks: VecDeque::new(), keep: keep.max(1) }
    }

    /// Ends a tick with its pickups; the oldest tick beyond the window
    /// leaves it.
    pub fn push(&mut self, tick: BTreeMap<u32, u64>) {
        self.ticks.push_back(tick);
        while self.ticks.len() > self.keep {
            self.ticks.pop_front();
        }
    }

    /// Ends a tick with the pickups [`tap`] counted since the last.
    fn roll(&mut self) {
        let tick = std::mem::take(&mut *PICKUPS.lock().expect("pickups lock"));
        self.push(tick);
    }

    /// The nearest-rank `quantiles` of the window, in ms; `None` when it
    /// holds no pickup.
    pub fn percentiles(&self, quantiles: &[f64]) -> Option<Vec<f64>> {
        let mut all = BTreeMap::<u32, u64>::new();
        for tick in &self.ticks {
            for (v, n) in tick {
                *all.entry(*v).or_default() += n;
            }
        }
        let total: u64 = all.values().sum();
        if total == 0 {
            return None;
        }
        Some(
            quantiles
                .iter()
                .map(|q| {
                    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
                    let mut seen = 0;
                    all.iter().find(|(_, n)| {
                        seen += **n;
                        seen >= rank
                    })
                    .map_or(0.0, |(v, _)| *v as f64)
                })
                .collect(),
        )
    }
}

/// The adapter of one replica, against the host at `api`.
pub struct Adapter {
    pub settings: Settings,
    /// The host's API, `http://127.0.0.1:PORT`.
    pub api: String,
    pub token: String,
    /// For the queue depth and the schema version (a connection of its
    /// own, not the host's).
    pub store: Store,
    /// The database's name, as the harness named it.
    pub db_name: String,
}

impl Adapter {
    /// Prints the descriptor, then produces and samples until `stop`.
    pub async fn run(self, mut stop: watch::Receiver<bool>) -> Result<(), StoreError> {
        let schema: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(self.store.pool()).await?;
        emit(&json!({
            "kind": "descriptor",
            "system": SYSTEM,
            "event_tables": EVENT_TABLES,
            "extensions": [],
            "version": env!("CARGO_PKG_VERSION"),
            "schema_version": schema.map_or_else(String::new, |v| v.to_string()),
            "db_name": self.db_name,
            "started_at": now_iso(),
        }));
        let enqueued = Arc::new(AtomicU64::new(0));
        let tokens = self.settings.harness_paced.then(read_tokens);
        let producer = tokio::spawn(produce(
            self.settings.clone(),
            self.api.clone(),
            self.token.clone(),
            tokens,
            enqueued.clone(),
            stop.clone(),
        ));
        let every = Duration::from_secs(self.settings.sample_every_s);
        // The first tick on a wall-clock multiple of the period, so the
        // systems' samples line up.
        let epoch = crate::clock::wall().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let to_boundary = every - Duration::from_nanos((epoch.as_nanos() % every.as_nanos()) as u64);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + to_boundary, every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut window = Window::new(WINDOW.as_secs().div_ceil(self.settings.sample_every_s) as usize);
        let completed = || crate::metrics::global().segments_completed.load(Relaxed);
        let (mut last_enq, mut last_done, mut last_at) = (enqueued.load(Relaxed), completed(), Instant::now());
        // Pickups before the first tick belong to it.
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.changed() => break,
            }
            let dt = last_at.elapsed().as_secs_f64().max(0.001);
            last_at = Instant::now();
            let (enq, done) = (enqueued.load(Relaxed), completed());
            let (enq_rate, done_rate) = ((enq - last_enq) as f64 / dt, (done.saturating_sub(last_done)) as f64 / dt);
            (last_enq, last_done) = (enq, done);
            window.roll();
            let t = now_iso();
            let sample = |metric: &str, value: f64, window_s: f64| {
                emit(&json!({
                    "t": t, "system": SYSTEM, "kind": "adapter", "subject_kind": "adapter", "subject": "",
                    "metric": metric, "value": value, "window_s": window_s,
                }));
            };
            if let Some(p) = window.percentiles(&[0.50, 0.95, 0.99]) {
                for (metric, v) in ["claim_p50_ms", "claim_p95_ms", "claim_p99_ms"].into_iter().zip(p) {
                    sample(metric, v, WINDOW.as_secs_f64());
                }
            }
            sample("enqueue_rate", enq_rate, dt);
            sample("completion_rate", done_rate, dt);
            if self.settings.instance == 0 {
                match super::open_runs(&self.store).await {
                    Ok((running, due)) => {
                        sample("queue_depth", due as f64, 0.0);
                        sample("running_depth", running as f64, 0.0);
                        sample("total_backlog", (running + due) as f64, 0.0);
                    }
                    // The database may be restarting (a chaos phase): the
                    // gauges skip a tick, the adapter goes on.
                    Err(e) => eprintln!("[leasehold] queue depth: {e}"),
                }
                sample("producer_target_rate", self.settings.current_rate() as f64, 0.0);
            }
        }
        producer.abort();
        Ok(())
    }
}

/// Reads `ENQUEUE <n>` lines from stdin (a thread of its own: stdin
/// blocks); the channel closes with stdin.
fn read_tokens() -> mpsc::Receiver<usize> {
    let (tx, rx) = mpsc::channel(1024);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { return };
            if let Some(n) = line.trim().strip_prefix("ENQUEUE ").and_then(|n| n.trim().parse::<usize>().ok())
                && n > 0
                && tx.blocking_send(n).is_err()
            {
                return;
            }
        }
    });
    rx
}

/// Submits runs: n per stdin token when the harness paces, else
/// `rate × elapsed` each `batch_ms`, in batches of at most `batch_max`.
async fn produce(
    settings: Settings,
    api: String,
    token: String,
    mut tokens: Option<mpsc::Receiver<usize>>,
    enqueued: Arc<AtomicU64>,
    stop: watch::Receiver<bool>,
) {
    crate::effects::http::install_tls();
    let client = reqwest::Client::new();
    let input = settings.input();
    // Keys unique to this process: a batch sent again after an error
    // cannot make a run twice.
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let mut seq: u64 = 0;
    let (mut credit, mut last) = (0.0f64, Instant::now());
    let period = Duration::from_millis(settings.batch_ms);
    while !*stop.borrow() {
        let n = match tokens.as_mut() {
            Some(rx) => match rx.recv().await {
                Some(n) => n,
                // stdin closed: the harness is ending the run.
                None => return,
            },
            None => {
                tokio::time::sleep(period).await;
                let now = Instant::now();
                // Credit real elapsed time, not the nominal period: a
                // slow submit must not lower the offered rate.
                credit += settings.current_rate() as f64 * now.duration_since(last).as_secs_f64();
                last = now;
                let whole = credit.floor();
                credit -= whole;
                whole as usize
            }
        };
        let mut left = n;
        while left > 0 {
            let take = left.min(settings.batch_max);
            let runs: Vec<Value> = (seq..seq + take as u64)
                .map(|i| json!({ "plugin": PLUGIN, "input": input, "idempotency_key": format!("{tag}-{i}") }))
                .collect();
            seq += take as u64;
            left -= take;
            let body = json!({ "runs": runs });
            let mut backoff = Duration::from_millis(100);
            loop {
                match submit(&client, &api, &token, &body).await {
                    Ok(made) => {
                        enqueued.fetch_add(made, Relaxed);
                        break;
                    }
                    Err(e) => {
                        eprintln!("[leasehold] batch submit failed, sending it again in {backoff:?}: {e}");
                        if *stop.borrow() {
                            return;
                        }
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
    }
}

/// One batch submit: the runs it holds (made now, or found by their keys
/// from an attempt whose answer was lost).
async fn submit(client: &reqwest::Client, api: &str, token: &str, body: &Value) -> Result<u64, String> {
    let resp = client
        .post(format!("{api}/v1/runs:batch"))
        .bearer_auth(token)
        .json(body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let answer: Value = resp.json().await.map_err(|e| format!("{status}: {e}"))?;
    if !status.is_success() {
        return Err(format!("{status}: {answer}"));
    }
    let results = answer["results"].as_array().ok_or_else(|| format!("no results in {answer}"))?;
    if let Some(refused) = results.iter().find(|r| r.get("error").is_some()) {
        return Err(format!("a run was refused: {refused}"));
    }
    Ok(results.len() as u64)
}

fn emit(record: &Value) {
    println!("{record}");
}

/// Now, `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`.
fn now_iso() -> String {
    crate::clock::rfc3339(crate::clock::wall().duration_since(std::time::UNIX_EPOCH).unwrap_or_default())
}
