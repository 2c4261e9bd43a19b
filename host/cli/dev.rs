//! `leasehold dev DIR`: `serve` on a SQLite database of the project's own
//! (`DIR/target/leasehold-dev.db`), watching a plugin project made by
//! `leasehold new`: whenever one of its files changes it runs the project's
//! `build.sh` and registers the new component as the plugin's current
//! version, and it prints each of the plugin's runs as it goes (status,
//! streamed text, output or error).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use leasehold::plugins::PluginSettings;
use leasehold::runtime::Runtime;
use leasehold::store::{RunStatus, Store};
use tokio::sync::watch;

/// How often the project's files and the plugin's runs are looked at.
const POLL: Duration = Duration::from_millis(300);

#[derive(clap::Args)]
pub struct DevArgs {
    /// The plugin project (from `leasehold new`): it has a build.sh that
    /// writes NAME.wasm. [default: .]
    #[arg(default_value = ".")]
    dir: PathBuf,
    /// The plugin's name. Default: the directory's name.
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    serve: crate::config::ServeOptions,
}

/// The project being watched.
pub struct Project {
    pub dir: PathBuf,
    pub name: String,
    pub settings: PluginSettings,
}

/// The `serve` settings and project `dev` runs with.
pub fn resolve(args: DevArgs) -> Result<(crate::config::Serve, Project)> {
    let dir = std::fs::canonicalize(&args.dir).with_context(|| format!("opening {}", args.dir.display()))?;
    if !dir.join("build.sh").is_file() {
        bail!("{} has no build.sh: make a project with `leasehold new NAME --lang LANG`", dir.display());
    }
    let name = match args.name {
        Some(n) => n,
        None => dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string(),
    };
    if !leasehold::plugins::valid_name(&name) {
        bail!("{name:?} is not a plugin name (1 to 64 of a-z, 0-9, '-', '_'): give --name");
    }
    let mut options = args.serve;
    if options.database_url.is_none() {
        std::fs::create_dir_all(dir.join("target"))?;
        options.database_url = Some(format!("sqlite://{}", dir.join("target/leasehold-dev.db").display()));
    }
    let serve = options.resolve(None)?;
    let settings = PluginSettings { http_allow: serve.http_allow.clone(), spawn_allow: serve.spawn_allow_for(&name), model: serve.model_grant.clone(), ..PluginSettings::default() };
    Ok((serve, Project { dir, name, settings }))
}

/// Builds and registers the project whenever it changes, and prints its
/// runs, until `stop`.
pub async fn watch(store: Store, runtime: Arc<Runtime>, project: Project, mut stop: watch::Receiver<bool>) {
    let mut built: Option<SystemTime> = None;
    let mut runs: HashMap<i64, (RunStatus, usize)> = HashMap::new();
    loop {
        let newest = newest(&project.dir);
        if newest.is_some() && newest != built {
            built = newest;
            match build(&project).await {
                Ok(bytes) => match leasehold::plugins::register(&store, &runtime, &project.name, bytes, project.settings.clone()).await {
                    Ok(plugin) => println!("dev: registered {} {}", project.name, plugin.digest),
                    Err(e) => println!("dev: {} was built but not registered: {e}", project.name),
                },
                Err(e) => println!("dev: build failed: {e:#}"),
            }
        }
        if let Err(e) = show_runs(&store, &project.name, &mut runs).await {
            tracing::warn!(error = %e, "dev: reading runs failed");
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The newest modification time of the project's own files (not its build
/// output, dependencies or components).
fn newest(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // Lock files are written by the build itself.
            let skip = ["target", "node_modules", "__pycache__", "Cargo.lock", "package-lock.json"];
            if name.starts_with('.') || skip.contains(&name.as_ref()) || name.ends_with(".wasm") {
                continue;
            }
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                stack.push(path);
            } else if let Ok(t) = meta.modified() {
                newest = newest.max(Some(t));
            }
        }
    }
    newest
}

async fn build(project: &Project) -> Result<Vec<u8>> {
    println!("dev: building {}", project.dir.display());
    let out = tokio::process::Command::new(project.dir.join("build.sh")).current_dir(&project.dir).output().await?;
    if !out.status.success() {
        bail!("build.sh exited with {}:\n{}{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    let file = project.dir.join(format!("{}.wasm", project.name));
    std::fs::read(&file).with_context(|| format!("build.sh wrote no {}", file.display()))
}

/// Prints what changed in the plugin's latest runs since the last look.
async fn show_runs(store: &Store, name: &str, seen: &mut HashMap<i64, (RunStatus, usize)>) -> Result<()> {
    let mut latest = store.list_runs(None, Some(name), None, 20).await?;
    latest.reverse();
    for run in latest {
        let (status, shown) = seen.get(&run.id).copied().unwrap_or((RunStatus::Queued, 0));
        let mut shown = shown;
        if run.partial.len() > shown && run.partial.is_char_boundary(shown) {
            for line in run.partial[shown..].lines() {
                println!("run {} | {line}", run.id);
            }
            shown = run.partial.len();
        }
        if !seen.contains_key(&run.id) || run.status != status {
            match run.status {
                RunStatus::Completed => println!("run {} completed: {}", run.id, run.output.as_deref().unwrap_or("")),
                RunStatus::Failed | RunStatus::Aborted => {
                    println!("run {} {}: {}", run.id, run.status.as_str(), run.error.as_deref().unwrap_or(""))
                }
                other => println!("run {} {}", run.id, other.as_str()),
            }
        }
        seen.insert(run.id, (run.status, shown));
    }
    Ok(())
}
