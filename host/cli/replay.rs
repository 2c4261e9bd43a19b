//! `leasehold replay`: runs a component against a run's recorded ledger,
//! offline, performing nothing (see `leasehold::runtime::offline`), and
//! reports the first divergence. Exit status: 0 for a clean replay, 1 for
//! a divergence, a turn the replay had to stop, or an error (with its
//! `error:` line), 2 for bad arguments (clap).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use leasehold::runtime::offline::{self, Outcome, Recording, Report};
use leasehold::runtime::{Plugin, Runtime, RuntimeConfig};
use leasehold::store::{EffectRow, Run, RunStatus, Store, StoreOptions};
use serde::{Deserialize, Serialize};

/// The format name an export file carries.
pub const EXPORT_FORMAT: &str = "leasehold-run-export/1";

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// The run to replay, read from the database.
    #[arg(required_unless_present = "ledger")]
    run_id: Option<i64>,
    /// Replay a ledger exported with `leasehold runs export` instead (needs
    /// --component).
    #[arg(long, conflicts_with = "run_id", requires = "component")]
    ledger: Option<PathBuf>,
    /// The component to replay (a .wasm file). Default: the version the
    /// run started with, from the database.
    #[arg(long)]
    component: Option<PathBuf>,
    #[command(flatten)]
    offline: Offline,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Where an offline replay reads runs and caches components, and how long
/// a turn may compute: `replay` and `plugins upgrade --check` share these.
#[derive(clap::Args)]
pub struct Offline {
    /// The database to read runs from. Nothing is written to it, and it is
    /// not migrated. [default: sqlite://leasehold.db]
    #[arg(long, env = "LEASEHOLD_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Compiled components are cached here, as `serve --cache-dir`.
    /// [default: ~/.cache/leasehold/components]
    #[arg(long, env = "LEASEHOLD_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Wall time a turn may compute before its replay stops it. Default: 30 s.
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
}

impl Offline {
    fn url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| "sqlite://leasehold.db".into())
    }
}

/// What `leasehold runs export` writes: the run as the API shows it (its
/// random secret is never shown) and its whole ledger.
#[derive(Serialize, Deserialize)]
pub struct Export {
    pub format: String,
    pub run: serde_json::Value,
    pub effects: Vec<EffectRow>,
}

/// Runs `leasehold replay`; `Ok(false)` when the replay is not clean.
pub async fn replay(args: ReplayArgs) -> Result<bool> {
    let (recording, digest_bytes) = match (&args.ledger, args.run_id) {
        (Some(file), _) => (from_export(file)?, None),
        (None, Some(id)) => from_database(&args.offline.url(), id, args.component.is_none()).await?,
        (None, None) => bail!("name a run (RUN_ID) or an exported ledger (--ledger FILE)"),
    };
    let bytes = match (&args.component, digest_bytes) {
        (Some(file), _) => std::fs::read(file).with_context(|| format!("reading {}", file.display()))?,
        (None, Some(bytes)) => bytes,
        (None, None) => bail!("--component FILE.wasm is needed"),
    };
    let (rt, plugin) = load(bytes, args.offline.cache_dir.clone()).await?;
    let report = offline::replay(&rt, &plugin, recording, Duration::from_millis(args.offline.timeout_ms)).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", describe(&report));
    }
    Ok(report.clean())
}

/// A runtime holding just the component `bytes`.
async fn load(bytes: Vec<u8>, cache_dir: Option<PathBuf>) -> Result<(Arc<Runtime>, Arc<Plugin>)> {
    // The user's private component cache, as `serve` uses by default.
    let mut config = RuntimeConfig { max_instances: 1, ..RuntimeConfig::default() };
    if let Some(dir) = cache_dir {
        config.cache_dir = dir;
    }
    let rt = Arc::new(Runtime::new(config)?);
    let loaded = {
        let rt = rt.clone();
        tokio::task::spawn_blocking(move || rt.load_version("replay", &bytes, leasehold::runtime::Limits::default())).await?
    };
    let plugin = loaded.context("loading the component")?;
    Ok((rt, plugin))
}

/// Connects to an existing database at `url`: no migrations, and a SQLite
/// file that is not there is an error rather than a new database.
pub(crate) async fn existing(url: &str) -> Result<Store> {
    if let Some(path) = url.strip_prefix("sqlite://") {
        let path = path.split('?').next().unwrap_or(path);
        if !Path::new(path).exists() {
            bail!("no database at {path} (give --database-url or LEASEHOLD_DATABASE_URL)");
        }
    }
    let opts = StoreOptions { migrate: false, max_connections: Some(2), ..StoreOptions::default() };
    Store::connect_with(url, opts).await.context("connecting to the database")
}

/// What replay needs of `run`, with its ledger read from `store`.
async fn recording(store: &Store, run: Run) -> Result<Recording> {
    let id = run.id;
    let effects = store.effects(id).await.with_context(|| format!("reading run {id}'s ledger (has `leasehold serve` migrated this database?)"))?;
    Ok(Recording::of(run, effects))
}

/// `leasehold plugins upgrade NAME FILE --check`: replays every open run
/// of `name` against `file`'s component and says which would move to it
/// (their ledger replays clean) and which would stay, and why. Changes
/// nothing. `Ok(false)` when any run would stay.
pub async fn upgrade_check(name: &str, file: &Path, offline: &Offline, json: bool) -> Result<bool> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let (rt, plugin) = load(bytes, offline.cache_dir.clone()).await?;
    let store = existing(&offline.url()).await?;
    let timeout = Duration::from_millis(offline.timeout_ms);
    let mut runs = Vec::new();
    for status in [RunStatus::Running, RunStatus::WaitingTakeover, RunStatus::WaitingInput, RunStatus::Queued] {
        let mut before = None;
        loop {
            let page = store.list_runs(Some(status), Some(name), before, 1000).await?;
            before = page.last().map(|r| r.id);
            let done = page.len() < 1000;
            runs.extend(page);
            if done {
                break;
            }
        }
    }
    runs.sort_by_key(|r| r.id);
    let (mut rows, mut all_move) = (Vec::new(), true);
    for run in runs {
        let (id, status, digest) = (run.id, run.status, run.plugin_digest.clone());
        let (verdict, detail) = if digest == plugin.digest {
            ("on", "already on this version".to_string())
        } else {
            let report = offline::replay(&rt, &plugin, recording(&store, run).await?, timeout).await?;
            match &report.outcome {
                Outcome::Diverged { divergence } => ("stays", format!("diverges at call {}: {}", divergence.seq, divergence.why)),
                Outcome::Stopped { reason } => ("stays", format!("the replay stopped: {reason}")),
                _ => ("moves", format!("its {} recorded calls replay clean", report.recorded_calls)),
            }
        };
        all_move &= verdict != "stays";
        rows.push(serde_json::json!({ "run_id": id, "status": status, "digest": digest, "verdict": verdict, "detail": detail }));
    }
    if json {
        println!("{}", serde_json::json!({ "plugin": name, "digest": plugin.digest, "runs": rows }));
    } else {
        println!("{} open runs of {name} against {}", rows.len(), plugin.digest);
        for r in &rows {
            println!("{:>8}  {:<16}  {:<6}  {}", r["run_id"], r["status"].as_str().unwrap_or(""), r["verdict"].as_str().unwrap_or(""), r["detail"].as_str().unwrap_or(""));
        }
    }
    Ok(all_move)
}

/// The run and, when `want_component`, the component version it started
/// with, read from `url` without migrating or writing anything.
async fn from_database(url: &str, id: i64, want_component: bool) -> Result<(Recording, Option<Vec<u8>>)> {
    let store = existing(url).await?;
    let run = store.get_run(id).await.with_context(|| format!("reading run {id}"))?;
    let component = if want_component {
        let bytes = store.plugin_version(&run.plugin, &run.plugin_digest).await?;
        Some(bytes.with_context(|| format!("the database has no component {} of plugin {:?}; give --component", run.plugin_digest, run.plugin))?)
    } else {
        None
    };
    Ok((recording(&store, run).await?, component))
}

fn from_export(file: &Path) -> Result<Recording> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let export: Export = serde_json::from_slice(&bytes).with_context(|| format!("{} is not a run export", file.display()))?;
    if export.format != EXPORT_FORMAT {
        bail!("{}: format {:?}, expected {EXPORT_FORMAT:?}", file.display(), export.format);
    }
    let run = &export.run;
    let field = |name: &str| run.get(name).with_context(|| format!("{}: the run has no {name:?}", file.display()));
    Ok(Recording {
        run_id: field("id")?.as_i64().context("run id")?,
        input: field("input")?.as_str().context("run input")?.to_string(),
        created_at_ms: field("created_at")?.as_i64().context("run created_at")?,
        // Exports carry no secret: a turn that draws WASI random draws
        // other bytes here than it did.
        secret: None,
        effects: export.effects,
        emit_pos: field("emit_pos")?.as_i64().context("run emit_pos")?,
        output: run.get("output").and_then(|o| o.as_str()).map(str::to_string),
        partial: run.get("partial").and_then(|p| p.as_str()).unwrap_or_default().to_string(),
    })
}

/// The report as text.
fn describe(r: &Report) -> String {
    let mut out = format!(
        "run {}: replayed {} of {} recorded calls on {}\n",
        r.run_id, r.replayed_calls, r.recorded_calls, r.component
    );
    let request = |q: &Option<String>| q.clone().unwrap_or_else(|| "(not recorded)".into());
    match &r.outcome {
        Outcome::Returned { output } => {
            out += &format!("clean: the turn returns\n  output: {output}\n");
            if let Some(recorded) = r.recorded_output.as_ref().filter(|o| *o != output) {
                out += &format!("  (the run's recorded output differs: {recorded})\n");
            }
        }
        Outcome::Failed { error } => out += &format!("clean: the turn returns an error\n  error: {error}\n"),
        Outcome::Frontier { next } => {
            out += &format!(
                "clean so far: the ledger ends here; a live segment would go on with\n  call {}: {} {}\n  ({})\n",
                next.seq,
                next.call.name,
                request(&next.call.request),
                next.why
            );
            out += &format!("  stream so far: {:?}\n", r.stream);
        }
        Outcome::Diverged { divergence: d } => {
            out += &format!("DIVERGED at call {}: {}\n", d.seq, d.why);
            out += &format!("  recorded: {} {}\n", d.recorded.name, request(&d.recorded.request));
            match &d.now {
                Some(now) => out += &format!("  now:      {} {}\n", now.name, request(&now.request)),
                None => out += "  now:      (the turn ends)\n",
            }
        }
        Outcome::Stopped { reason } => out += &format!("STOPPED: {reason}\n"),
    }
    if !r.new_emits.is_empty() {
        out += &format!("  new emits past the recorded stream: {:?}\n", r.new_emits.concat());
    }
    out
}
