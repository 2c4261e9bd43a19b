//! The plugin registry: components stored in the database, so that every
//! host on it can run every plugin. A host compiles a plugin when it is
//! registered or first needed, and the compiled form is cached on disk.

use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::runtime::{Limits, Plugin, PluginError, Runtime};
use crate::store::{Store, StoreError};

pub use crate::store::{PluginInfo, PluginSettings};

/// The plugin's sandbox limits: the host's defaults plus its settings.
pub fn sandbox_limits(settings: &PluginSettings, defaults: &Limits) -> Limits {
    Limits {
        http_allow: settings.http_allow.clone(),
        model: settings.model.clone(),
        kv: settings.kv,
        spawn_allow: settings.spawn_allow.clone(),
        ..defaults.clone()
    }
}

/// Why a plugin could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("invalid plugin name {0:?}: use 1 to 64 of a-z, 0-9, '-' and '_'")]
    BadName(String),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A `spawn_allow` entry: a plugin name, `*` (any plugin), or
/// `key:PREFIX` (concurrency keys starting with PREFIX, `key:*` any,
/// that its children may take besides their parent's).
pub fn check_spawn_grant(grant: &str) -> Result<(), String> {
    match grant.strip_prefix("key:") {
        Some("*") => Ok(()),
        Some(prefix) => crate::store::concurrency::check_key(prefix).map_err(|e| format!("key:{prefix}: {e}")),
        None if grant == "*" || valid_name(grant) => Ok(()),
        None => Err(format!("{grant:?} is not a plugin name, *, or key:PREFIX")),
    }
}

pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Compiles (or loads from the cache) and registers `bytes` in the runtime
/// as the current version of `name`, off the async threads: a large
/// component takes seconds.
async fn compile(runtime: &Arc<Runtime>, name: &str, bytes: Vec<u8>, limits: Limits) -> Result<Arc<Plugin>, PluginError> {
    runtime.load_async(name, bytes, limits, true).await
}

/// Compiles and links `bytes` (so a bad component is refused before it is
/// stored), then stores it under `name`, replacing an earlier version.
pub async fn register(
    store: &Store,
    runtime: &Arc<Runtime>,
    name: &str,
    bytes: Vec<u8>,
    settings: PluginSettings,
) -> Result<Arc<Plugin>, RegisterError> {
    if !valid_name(name) {
        return Err(RegisterError::BadName(name.to_string()));
    }
    let limits = sandbox_limits(&settings, runtime.default_limits());
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    // Unchanged (a restart with the same plugins directory): no rewrite of
    // the component's bytes.
    let unchanged = store.plugin_settings(name).await?.is_some_and(|(d, s)| d == digest && s == settings);
    let to_store = (!unchanged).then(|| bytes.clone());
    let plugin = compile(runtime, name, bytes, limits).await?;
    runtime.set_upgrade_policy(name, settings.upgrade);
    if let Some(bytes) = to_store {
        store.put_plugin(name, &plugin.digest, &bytes, &settings).await?;
    }
    Ok(plugin)
}

/// Registers every `*.wasm` file in `dir` under its file stem, with the
/// settings `settings` gives its name. A file that fails is logged and
/// skipped. Returns the names loaded.
pub async fn load_dir(
    store: &Store,
    runtime: &Arc<Runtime>,
    dir: &Path,
    settings: impl Fn(&str) -> PluginSettings,
) -> std::io::Result<Vec<String>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
        .collect();
    files.sort();
    let mut loaded = Vec::new();
    for path in files {
        let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_string) else { continue };
        let bytes = std::fs::read(&path)?;
        match register(store, runtime, &name, bytes, settings(&name)).await {
            Ok(p) => {
                tracing::info!(plugin = %name, digest = %p.digest, path = %path.display(), "plugin loaded");
                loaded.push(name);
            }
            Err(e) => tracing::error!(path = %path.display(), error = %e, "plugin not loaded"),
        }
    }
    Ok(loaded)
}

/// The plugin `name` at `digest`, the version a run was submitted with
/// (the current version when `digest` is empty): from the runtime, or else
/// loaded from the database and compiled. A run never runs another version
/// than its own: its ledger was recorded against that code. `None`: that
/// version is not registered. The plugin's settings (its allow-list) are
/// today's, whatever the version.
pub async fn resolve(
    store: &Store,
    runtime: &Arc<Runtime>,
    name: &str,
    digest: &str,
) -> Result<Option<Arc<Plugin>>, RegisterError> {
    if digest.is_empty() {
        if let Some(p) = runtime.plugin(name) {
            return Ok(Some(p));
        }
        let Some((bytes, settings)) = store.plugin_component(name).await? else {
            return Ok(None);
        };
        let limits = sandbox_limits(&settings, runtime.default_limits());
        let plugin = compile(runtime, name, bytes, limits).await?;
        runtime.set_upgrade_policy(name, settings.upgrade);
        return Ok(Some(plugin));
    }
    if let Some(p) = runtime.version(name, digest) {
        return Ok(Some(p));
    }
    let Some(bytes) = store.plugin_version(name, digest).await? else {
        return Ok(None);
    };
    let settings = store.plugin_settings(name).await?.map(|(_, s)| s).unwrap_or_default();
    let limits = sandbox_limits(&settings, runtime.default_limits());
    Ok(Some(runtime.load_async(name, bytes, limits, false).await?))
}
