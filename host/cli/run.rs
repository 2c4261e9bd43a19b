//! `leasehold run`: one turn of a component, run to its end on a throwaway
//! SQLite database, with the same worker code `serve` runs, printing what
//! it streams and its output. For a plugin author's first test: no service,
//! no token. Child runs its turn spawns run here too, of the plugins given
//! with `--plugin` (or itself), as `--spawn-allow` grants. Exit status 0 when the run completes, 1 when it fails (its
//! error is printed) or an error stops the command.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::plugins::PluginSettings;
use leasehold::runtime::{Runtime, RuntimeConfig};
use leasehold::store::{NewRun, RunStatus, Store};

#[derive(clap::Args)]
pub struct RunArgs {
    /// The component (a .wasm file).
    file: PathBuf,
    /// The turn's input, as JSON (a bare word is a JSON string). Default: null.
    #[arg(long, default_value = "null")]
    input: String,
    /// Comma-separated hosts (host or host:port) its `http` effects may reach.
    #[arg(long, default_value = "")]
    http_allow: String,
    /// An HTTP proxy its `http` effects go through, as `serve
    /// --guest-http-proxy`. [default: none: direct]
    #[arg(long)]
    guest_http_proxy: Option<String>,
    /// Comma-separated models its `model.chat` may ask for (`*`: any); the
    /// endpoint comes from LEASEHOLD_MODEL_BASE_URL. [default: none]
    #[arg(long, default_value = "")]
    model_allow: String,
    /// The plugin name (its kv namespace). Default: the file's stem.
    #[arg(long)]
    name: Option<String>,
    /// Input to deliver, in order, each time the turn waits for input.
    #[arg(long = "answer")]
    answers: Vec<String>,
    /// Another plugin, NAME=FILE.wasm, registered beside it: runs its turn
    /// spawns (--spawn-allow) run here too. Repeat it for more.
    #[arg(long = "plugin", value_name = "NAME=FILE")]
    plugins: Vec<String>,
    /// Comma-separated plugins its turns (and the --plugin ones') may spawn
    /// as child runs (`*`: any registered here). [default: none]
    #[arg(long, default_value = "")]
    spawn_allow: String,
    /// Give up after this long. Default: 60 s.
    #[arg(long, default_value_t = 60_000)]
    timeout_ms: u64,
    /// Compiled components are cached here, as `serve --cache-dir`.
    /// [default: ~/.cache/leasehold/components]
    #[arg(long, env = "LEASEHOLD_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Print the finished run as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `leasehold run`; `Ok(false)` when the run did not complete.
pub async fn run(args: RunArgs) -> Result<bool> {
    let bytes = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let name = match &args.name {
        Some(n) => n.clone(),
        None => args.file.file_stem().and_then(|s| s.to_str()).unwrap_or("plugin").to_string(),
    };
    let input = match serde_json::from_str::<serde_json::Value>(&args.input) {
        Ok(v) => v.to_string(),
        Err(_) => serde_json::Value::String(args.input.clone()).to_string(),
    };
    let dir = private_temp_dir()?;
    let result = run_in(&args, &dir, &name, bytes, &input).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(args: &RunArgs, dir: &std::path::Path, name: &str, bytes: Vec<u8>, input: &str) -> Result<bool> {
    let store = Store::connect(&format!("sqlite://{}", dir.join("run.db").display())).await?;
    let mut config = RuntimeConfig { max_instances: 2, ..RuntimeConfig::default() };
    if let Some(d) = &args.cache_dir {
        config.cache_dir = d.clone();
    }
    let runtime = Arc::new(Runtime::new(config)?);
    let http_allow = args.http_allow.split(',').map(str::trim).filter(|h| !h.is_empty()).map(str::to_string).collect();
    let spawn_allow = args.spawn_allow.split(',').map(str::trim).filter(|h| !h.is_empty()).map(str::to_string).collect();
    let settings =
        PluginSettings { http_allow, spawn_allow, model: leasehold::store::ModelGrant::listed(&args.model_allow), ..PluginSettings::default() };
    if !leasehold::plugins::valid_name(name) {
        bail!("{name:?} is not a plugin name (1 to 64 of a-z, 0-9, '-', '_'): give --name");
    }
    for other in &args.plugins {
        let Some((other_name, file)) = other.split_once('=') else {
            bail!("--plugin {other:?}: expected NAME=FILE.wasm");
        };
        if !leasehold::plugins::valid_name(other_name) {
            bail!("--plugin {other:?}: {other_name:?} is not a plugin name (1 to 64 of a-z, 0-9, '-', '_')");
        }
        let other_bytes = std::fs::read(file).with_context(|| format!("--plugin {other:?}: reading {file}"))?;
        leasehold::plugins::register(&store, &runtime, other_name, other_bytes, settings.clone())
            .await
            .with_context(|| format!("--plugin {other:?}"))?;
    }
    leasehold::plugins::register(&store, &runtime, name, bytes, settings).await?;
    let (run, _) = store.create_run(&NewRun::new(name, input)).await?;
    let mut exec_config = ExecutorConfig { owner: "leasehold-run".into(), ..ExecutorConfig::default() };
    if let Some(proxy) = &args.guest_http_proxy {
        exec_config.egress = leasehold::effects::http::Egress::through_proxy(proxy).map_err(anyhow::Error::msg)?;
    }
    let exec = Executor::new(store.clone(), runtime, exec_config);
    let deadline = Instant::now() + Duration::from_millis(args.timeout_ms);
    let mut answers = args.answers.iter();
    let mut shown = 0;
    let finished = loop {
        exec.run_once().await?;
        let now = store.get_run(run.id).await?;
        // What it streamed since the last look.
        if now.partial.len() > shown {
            eprint!("{}", &now.partial[shown..]);
            shown = now.partial.len();
        }
        match now.status {
            RunStatus::Completed | RunStatus::Failed | RunStatus::Aborted | RunStatus::Cancelled => break now,
            RunStatus::WaitingInput if now.pending_input.is_none() => match answers.next() {
                Some(answer) => {
                    store.deliver_input(run.id, answer).await?;
                }
                None => bail!("the turn waits for input and no --answer is left"),
            },
            _ => {}
        }
        if Instant::now() > deadline {
            bail!("the run did not finish within {} ms (status {})", args.timeout_ms, now.status.as_str());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    if shown > 0 {
        eprintln!();
    }
    if args.json {
        println!("{}", serde_json::to_string(&finished)?);
    } else {
        match finished.status {
            RunStatus::Completed => println!("{}", finished.output.as_deref().unwrap_or("")),
            other => eprintln!("run {}: {}", other.as_str(), finished.error.as_deref().unwrap_or("")),
        }
    }
    Ok(finished.status == RunStatus::Completed)
}

/// A new directory for the throwaway database, readable by this user only,
/// under a name nobody can guess: a name from the pid alone could be made
/// in advance by another local user (a symlink to their own directory).
fn private_temp_dir() -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = std::env::temp_dir().join(format!("leasehold-run-{}", uuid::Uuid::new_v4().simple()));
    // Not `recursive`: a directory already there is an error, never reused.
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("creating the run's directory {}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_run_gets_a_new_private_directory() {
        use std::os::unix::fs::PermissionsExt;
        let (a, b) = (super::private_temp_dir().unwrap(), super::private_temp_dir().unwrap());
        assert_ne!(a, b, "two runs of one process shared a directory");
        for dir in [&a, &b] {
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{} has mode {mode:o}", dir.display());
            std::fs::remove_dir(dir).unwrap();
        }
    }
}
