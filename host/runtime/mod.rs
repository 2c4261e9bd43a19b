//! The Wasm runtime: one engine, a registry of compiled plugins, and the
//! host side of the `leasehold:turn` world (`wit/turn.wit`, docs/plugins.md).
//!
//! * Epoch interruption is always on, driven by one ticker thread; a
//!   segment's deadline follows its lease and its slice budget.
//! * Instances come from the pooling allocator, with bounded totals.
//! * Each plugin has [`Limits`] with documented defaults.
//! * Compiled components are cached on disk, keyed by content digest and
//!   engine compatibility, and reused across restarts.

mod budget;
mod cache;
mod calls;
mod children;
mod clocks;
mod interrupt;
mod kv_quota;
mod limits;
mod output;
mod phase;
mod random;
mod rates;
mod remote;
mod text;
mod timers;
mod wasi;

pub use limits::{GuestErrorKind, Limits};
pub use text::encode_error;
pub use output::OUTPUT_TAIL;

pub use cache::default_dir as default_cache_dir;
pub mod host;
pub mod offline;
pub mod replay;
mod stream;
pub mod waits;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use self::host::{SegmentState, TurnPre};
use crate::store::UpgradePolicy;

/// How often the epoch ticker advances. Deadlines are counted in ticks.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Runtime settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Where compiled components are cached: a private directory (created
    /// 0700). Default: [`default_cache_dir`].
    pub cache_dir: PathBuf,
    /// Most instances alive at once (pooling allocator). Default: 64.
    pub max_instances: u32,
    /// Largest linear memory the pool reserves per instance; also the
    /// ceiling of any plugin's `max_memory_bytes`. Default: 1 GiB of
    /// (virtual, lazily committed) address space.
    pub pool_max_memory_bytes: usize,
    /// The limits of a plugin registered without its own. Default:
    /// [`Limits::default`].
    pub default_limits: Limits,
    /// Compile components in a child process of this program
    /// (`<compiler> __compile`), which is killed if the registration that
    /// asked for it is dropped (an upload whose caller went away), and
    /// whose crash or memory use cannot take the host down. Default: none
    /// (in a blocking thread of this process, which runs to the end).
    pub compiler: Option<PathBuf>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            cache_dir: cache::default_dir(),
            max_instances: 64,
            pool_max_memory_bytes: 1 << 30,
            default_limits: Limits::default(),
            compiler: None,
        }
    }
}

/// Why a plugin could not be loaded. Shaped for a 422 answer.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("not a valid component: {0}")]
    Invalid(String),
    /// The component imports something the host does not provide, or does
    /// not export `run` with the right type.
    #[error("component does not implement leasehold:turn/turn: {0}")]
    Link(String),
    #[error("component cache: {0}")]
    Cache(#[from] std::io::Error),
}

/// A loaded plugin.
pub struct Plugin {
    pub name: String,
    /// `sha256:<hex>` of the component bytes.
    pub digest: String,
    pub limits: Limits,
    pub(crate) pre: TurnPre<SegmentState>,
}

/// The engine, the linker and the loaded plugins. Cheap to share (`Arc`).
pub struct Runtime {
    engine: Engine,
    linker: Linker<SegmentState>,
    cache: cache::Cache,
    /// The current version of each plugin, by name.
    plugins: RwLock<HashMap<String, Arc<Plugin>>>,
    /// Every version loaded, by (name, digest): a run keeps the version it
    /// was submitted with.
    versions: RwLock<HashMap<(String, String), Arc<Plugin>>>,
    /// Each plugin's upgrade policy, as registered (default `pinned`).
    policies: RwLock<HashMap<String, UpgradePolicy>>,
    default_limits: Limits,
    /// The child-process compiler and the engine settings it must match.
    compiler: Option<(PathBuf, u32, usize)>,
    _ticker: Ticker,
}

/// How much of each instance's linear memory and tables is reset in place
/// when the instance ends, rather than given back to the kernel and
/// faulted in again by the next instance in the slot. Either way the next
/// instance sees none of it. With Linux's `PAGEMAP_SCAN` (6.7 and later)
/// only the pages the instance touched are reset, so up to 1 MiB is kept;
/// without it the first bytes are `memset` blindly, so only 16 KiB.
/// Measured (`cargo bench --bench runtime -- instantiate_call`, the test
/// plugin): 16.3 µs with neither, 13.1 µs with 16 KiB, 7.2 µs with 1 MiB
/// and the scan, 21.1 µs with 1 MiB and no scan.
const KEEP_RESIDENT_SCANNED: usize = 1 << 20;
const KEEP_RESIDENT_BLIND: usize = 16 << 10;

/// The engine for `max_instances` and `pool_max_memory_bytes` (see
/// [`RuntimeConfig`]): the host's, and the compiler child's, which must
/// match for its output to load (the pool's settings do not change
/// compiled code, so the two may differ in `PAGEMAP_SCAN` only).
pub fn engine(max_instances: u32, pool_max_memory_bytes: usize) -> wasmtime::Result<Engine> {
    match Engine::new(&engine_config(max_instances, pool_max_memory_bytes, true)) {
        Ok(engine) => Ok(engine),
        // The kernel has no PAGEMAP_SCAN.
        Err(_) => Engine::new(&engine_config(max_instances, pool_max_memory_bytes, false)),
    }
}

fn engine_config(max_instances: u32, pool_max_memory_bytes: usize, pagemap_scan: bool) -> Config {
    let mut pool = PoolingAllocationConfig::default();
    // Per component instance: a Rust or C guest is 1 to 4 core instances
    // with one memory; componentize-py's Python guest is 38 core instances
    // with 10 memories. The totals leave room for that.
    let (keep, scan) = if pagemap_scan {
        (KEEP_RESIDENT_SCANNED, wasmtime::Enabled::Yes)
    } else {
        (KEEP_RESIDENT_BLIND, wasmtime::Enabled::No)
    };
    pool.total_component_instances(max_instances)
        .max_core_instances_per_component(64)
        .max_memories_per_component(16)
        .max_tables_per_component(64)
        .total_core_instances(max_instances * 48)
        .total_memories(max_instances * 12)
        .total_tables(max_instances * 48)
        .max_memory_size(pool_max_memory_bytes)
        .total_stacks(max_instances)
        .linear_memory_keep_resident(keep)
        .table_keep_resident(keep)
        .pagemap_scan(scan);
    let mut wasm = Config::new();
    wasm.epoch_interruption(true)
        .wasm_component_model(true)
        .max_wasm_stack(Limits::default().max_wasm_stack)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    wasm
}

/// The compiler child's work (`leasehold __compile`): a component's bytes on
/// stdin, its compiled form on stdout, the reason on stderr and a failure
/// status if it is not a valid component.
pub fn compile_stdio(max_instances: u32, pool_max_memory_bytes: usize) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let engine = engine(max_instances, pool_max_memory_bytes)?;
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes)?;
    let compiled = engine.precompile_component(&bytes)?;
    std::io::stdout().write_all(&compiled)?;
    Ok(())
}

impl Runtime {
    pub fn new(config: RuntimeConfig) -> anyhow::Result<Runtime> {
        let engine = engine(config.max_instances, config.pool_max_memory_bytes)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        host::add_to_linker(&mut linker)?;
        let cache = cache::Cache::new(&engine, config.cache_dir)?;
        let ticker = Ticker::start(engine.clone());
        Ok(Runtime {
            engine,
            linker,
            cache,
            plugins: RwLock::new(HashMap::new()),
            versions: RwLock::new(HashMap::new()),
            policies: RwLock::new(HashMap::new()),
            default_limits: config.default_limits.clone(),
            compiler: config.compiler.map(|c| (c, config.max_instances, config.pool_max_memory_bytes)),
            _ticker: ticker,
        })
    }

    /// Sets how `name`'s runs in flight take its current version.
    pub fn set_upgrade_policy(&self, name: &str, policy: UpgradePolicy) {
        self.policies.write().expect("plugin registry lock").insert(name.to_string(), policy);
    }

    /// `name`'s upgrade policy; `pinned` unless set.
    pub fn upgrade_policy(&self, name: &str) -> UpgradePolicy {
        self.policies.read().expect("plugin registry lock").get(name).copied().unwrap_or_default()
    }

    pub fn default_limits(&self) -> &Limits {
        &self.default_limits
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Validates, compiles (or loads from the cache) and registers a plugin
    /// as the current version of `name`. Earlier versions stay loaded for
    /// the runs that use them.
    pub fn add_plugin(
        &self,
        name: &str,
        bytes: &[u8],
        limits: Limits,
    ) -> Result<Arc<Plugin>, PluginError> {
        let plugin = self.load_version(name, bytes, limits)?;
        self.plugins.write().expect("plugin registry lock").insert(name.to_string(), plugin.clone());
        Ok(plugin)
    }

    /// Loads one version of `name` (for the runs submitted with it)
    /// without making it the current one.
    pub fn load_version(
        &self,
        name: &str,
        bytes: &[u8],
        limits: Limits,
    ) -> Result<Arc<Plugin>, PluginError> {
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(bytes)));
        let component = match self.cache.load(&self.engine, &digest)? {
            Some(c) => c,
            None => {
                // Compiling validates; a core module or garbage fails here.
                let compiled = self
                    .engine
                    .precompile_component(bytes)
                    .map_err(|e| PluginError::Invalid(format!("{e:#}")))?;
                self.cached(&digest, &compiled)?
            }
        };
        self.link(name, digest, component, limits)
    }

    /// [`Runtime::add_plugin`] (`current`) or [`Runtime::load_version`],
    /// for async callers: compiles off the async threads, in the compiler
    /// child when one is configured, so dropping the returned future stops
    /// the compilation.
    pub async fn load_async(self: &Arc<Self>, name: &str, bytes: Vec<u8>, limits: Limits, current: bool) -> Result<Arc<Plugin>, PluginError> {
        let Some((compiler, instances, memory)) = self.compiler.clone() else {
            let (rt, n) = (self.clone(), name.to_string());
            let load = move || if current { rt.add_plugin(&n, &bytes, limits) } else { rt.load_version(&n, &bytes, limits) };
            return tokio::task::spawn_blocking(load)
                .await
                .map_err(|e| PluginError::Invalid(format!("compiler task failed: {e}")))?;
        };
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
        let cached = {
            let (rt, d) = (self.clone(), digest.clone());
            tokio::task::spawn_blocking(move || rt.cache.load(&rt.engine, &d))
                .await
                .map_err(|e| PluginError::Invalid(format!("cache task failed: {e}")))??
        };
        let component = match cached {
            Some(c) => c,
            None => {
                let compiled = compile_in_child(&compiler, instances, memory, bytes).await?;
                let (rt, d) = (self.clone(), digest.clone());
                tokio::task::spawn_blocking(move || rt.cached(&d, &compiled))
                    .await
                    .map_err(|e| PluginError::Invalid(format!("cache task failed: {e}")))??
            }
        };
        let plugin = self.link(name, digest, component, limits)?;
        if current {
            self.plugins.write().expect("plugin registry lock").insert(name.to_string(), plugin.clone());
        }
        Ok(plugin)
    }

    /// Stores a compiled component in the cache and loads it back from the
    /// bytes the cache recorded.
    fn cached(&self, digest: &str, compiled: &[u8]) -> Result<Component, PluginError> {
        self.cache.store(digest, compiled)?;
        self.cache
            .load(&self.engine, digest)?
            .ok_or_else(|| PluginError::Invalid("cache write did not stick".into()))
    }

    /// Links a compiled component against the host and registers it as
    /// version `digest` of `name`.
    fn link(&self, name: &str, digest: String, component: Component, limits: Limits) -> Result<Arc<Plugin>, PluginError> {
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Link(format!("{e:#}")))?;
        let pre = TurnPre::new(pre).map_err(|e| PluginError::Link(format!("{e:#}")))?;
        let plugin = Arc::new(Plugin {
            name: name.to_string(),
            digest: digest.clone(),
            limits,
            pre,
        });
        self.versions
            .write()
            .expect("plugin registry lock")
            .insert((name.to_string(), digest), plugin.clone());
        Ok(plugin)
    }

    /// Unloads every version that is neither current nor in `keep` (as
    /// `(name, digest)`); returns how many. A run on an unloaded version
    /// loads it again from the database when it resumes.
    pub fn retain_versions(&self, keep: &std::collections::HashSet<(String, String)>) -> usize {
        let current: std::collections::HashSet<(String, String)> = self
            .plugins
            .read()
            .expect("plugin registry lock")
            .values()
            .map(|p| (p.name.clone(), p.digest.clone()))
            .collect();
        let mut versions = self.versions.write().expect("plugin registry lock");
        let before = versions.len();
        versions.retain(|key, _| current.contains(key) || keep.contains(key));
        before - versions.len()
    }

    /// How many versions are loaded, current ones included.
    pub fn loaded_versions(&self) -> usize {
        self.versions.read().expect("plugin registry lock").len()
    }

    /// The current version of `name`.
    pub fn plugin(&self, name: &str) -> Option<Arc<Plugin>> {
        self.plugins.read().expect("plugin registry lock").get(name).cloned()
    }

    /// Version `digest` of `name`, if this runtime has loaded it.
    pub fn version(&self, name: &str, digest: &str) -> Option<Arc<Plugin>> {
        self.versions.read().expect("plugin registry lock").get(&(name.to_string(), digest.to_string())).cloned()
    }

    pub fn plugins(&self) -> Vec<Arc<Plugin>> {
        let mut all: Vec<_> = self.plugins.read().expect("plugin registry lock").values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// Instantiates `plugin` and calls `run(input)` once, with no lease
    /// renewal and no slice deadline: for benches of the bare guest path
    /// (the executor adds renewal and deadlines around the same calls).
    #[doc(hidden)]
    pub async fn call_bare(
        &self,
        plugin: &Plugin,
        init: host::SegmentInit,
        input: &str,
    ) -> (wasmtime::Result<Result<String, String>>, SegmentState) {
        let mut store = self.store(plugin, init);
        store.set_epoch_deadline(u64::MAX / 2);
        let result = async {
            let turn = plugin.pre.instantiate_async(&mut store).await?;
            turn.call_run(&mut store, input).await
        }
        .await;
        (result, store.into_data())
    }

    /// A wasmtime store for one segment of `plugin`, with its limits.
    pub(crate) fn store(&self, plugin: &Plugin, init: host::SegmentInit) -> wasmtime::Store<SegmentState> {
        let mut store = wasmtime::Store::new(&self.engine, SegmentState::new(init));
        store.limiter(|s| &mut s.limiter);
        store.set_hostcall_fuel(plugin.limits.max_hostcall_bytes);
        store
    }

    /// Compiles `bytes` without caching; for benches that measure compilation.
    pub fn compile_uncached(&self, bytes: &[u8]) -> wasmtime::Result<Component> {
        Component::new(&self.engine, bytes)
    }
}

/// Runs the compiler child on `bytes` and returns the compiled component.
/// The child is killed when this future is dropped.
async fn compile_in_child(compiler: &std::path::Path, instances: u32, memory: usize, bytes: Vec<u8>) -> Result<Vec<u8>, PluginError> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(compiler)
        .args(["__compile", "--max-instances", &instances.to_string(), "--pool-max-memory-bytes", &memory.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = child.stdin.take().ok_or_else(|| PluginError::Invalid("the compiler has no stdin".into()))?;
    let feed = async move {
        stdin.write_all(&bytes).await?;
        stdin.shutdown().await
    };
    let (fed, out) = tokio::join!(feed, child.wait_with_output());
    let out = out?;
    if !out.status.success() {
        let reason = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(PluginError::Invalid(reason.strip_prefix("error: ").unwrap_or(&reason).to_string()));
    }
    fed?;
    Ok(out.stdout)
}

/// The sandbox cap a trap hit, if it was one the host sets (data copied in
/// one host call, WASI random, resources), as the run's error says it.
pub(crate) fn limit_trap(trap: &wasmtime::Error) -> Option<String> {
    for cause in trap.chain() {
        if let Some(wasmtime::component::ResourceTableError::Full) = cause.downcast_ref() {
            return Some("the guest holds more WASI resources (pollables, streams) than its cap".into());
        }
        let text = cause.to_string();
        if text.contains("fuel allocated for hostcalls has been exhausted") {
            return Some("a host call carried more data than its cap (Limits::max_hostcall_bytes)".into());
        }
        if text.starts_with("requested len") && text.contains("exceeds limit") {
            return Some(format!("WASI random: {text}"));
        }
    }
    None
}

/// The one epoch ticker: advances the engine's epoch every [`EPOCH_TICK`]
/// until dropped.
struct Ticker {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Ticker {
    fn start(engine: Engine) -> Ticker {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("leasehold-epoch".into())
            .spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            })
            .expect("spawning the epoch ticker");
        Ticker { stop }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
