//! Guest components for tests. `scripts/test` builds them once for the
//! whole suite and says so in `LEASEHOLD_TEST_PLUGINS_BUILT=1`; without
//! it (a bare `cargo test`), each test process builds them once.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, Result, bail};
use leasehold::runtime::{Limits, Runtime, RuntimeConfig};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `scripts/build-plugins` has built every Rust guest for this
/// run (under nextest each test is a process of its own: a `cargo build`
/// per test would serialise them on cargo's lock).
fn prebuilt() -> bool {
    std::env::var_os("LEASEHOLD_TEST_PLUGINS_BUILT").is_some_and(|v| v == "1")
}

/// Builds `plugins/<name>` (a Rust guest) for wasm32-wasip2 and returns the
/// component's bytes.
pub fn rust_plugin(name: &str) -> Result<Vec<u8>> {
    static BUILT: Mutex<Vec<(String, Vec<u8>)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, bytes)) = built.iter().find(|(n, _)| n == name) {
        return Ok(bytes.clone());
    }
    let target_dir = root().join("target/plugins");
    let file = format!("{}.wasm", name.replace('-', "_"));
    let path: PathBuf = target_dir.join("wasm32-wasip2/release").join(file);
    if prebuilt() {
        let bytes = std::fs::read(&path).with_context(|| format!("reading {} (built by scripts/build-plugins)", path.display()))?;
        built.push((name.to_string(), bytes.clone()));
        return Ok(bytes);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2", "--manifest-path"])
        .arg(root().join("plugins").join(name).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .output()
        .context("running cargo to build a test plugin")?;
    if !out.status.success() {
        bail!(
            "building plugins/{name} failed (is the wasm32-wasip2 target installed? \
             `rustup target add wasm32-wasip2`, or run ./scripts/test):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    built.push((name.to_string(), bytes.clone()));
    Ok(bytes)
}

/// An example agent component: `agent-rust` is built here; the others
/// (`agent-py`, `agent-js`, `agent-c`) by `scripts/build-plugins`, which
/// `scripts/test` runs first, into `target/plugins/<name>.wasm`.
pub fn example_plugin(name: &str) -> Result<Vec<u8>> {
    if name == "agent-rust" {
        return rust_plugin(name);
    }
    let path = root().join("target/plugins").join(format!("{name}.wasm"));
    std::fs::read(&path).with_context(|| {
        format!("reading {}: build the example plugins first with ./scripts/build-plugins", path.display())
    })
}

/// A runtime sized for tests, sharing one compiled-component cache.
pub fn runtime() -> Result<Arc<Runtime>> {
    static CACHE: OnceLock<PathBuf> = OnceLock::new();
    let cache_dir = CACHE.get_or_init(|| root().join("target/component-cache")).clone();
    Ok(Arc::new(Runtime::new(RuntimeConfig {
        cache_dir,
        max_instances: 8,
        pool_max_memory_bytes: 256 << 20,
        ..RuntimeConfig::default()
    })?))
}

/// [`runtime`] with `limits` as the host's defaults.
pub fn runtime_with(limits: Limits) -> Result<Arc<Runtime>> {
    let cache_dir = root().join("target/component-cache");
    Ok(Arc::new(Runtime::new(RuntimeConfig {
        cache_dir,
        max_instances: 8,
        pool_max_memory_bytes: 256 << 20,
        default_limits: limits,
        ..RuntimeConfig::default()
    })?))
}

/// The test plugin's limits: small enough that hostile modes end quickly,
/// and a slice budget far above what any test turn computes, so a loaded
/// machine never slices a turn a test expects to finish in one segment.
/// Tests of slicing set their own budget. `model.chat` is granted for any
/// model (the tests' endpoints are fakes); tests of the grant set their own.
pub fn test_limits() -> Limits {
    Limits {
        max_memory_bytes: 32 << 20,
        max_emit_bytes: 256 << 10,
        max_output_bytes: 64 << 10,
        segment_budget: std::time::Duration::from_secs(10),
        model: leasehold::store::ModelGrant::any(),
        ..Limits::default()
    }
}

pub fn hostile_wat(name: &str) -> Result<Vec<u8>> {
    Ok(std::fs::read(root().join("plugins/hostile").join(name))?)
}

/// The test plugin's second version (`--features v2`: its `steps` mode
/// makes a different second call), built into `target/plugins/v2`.
pub fn testkit_v2() -> Result<Vec<u8>> {
    static BUILT: OnceLock<Vec<u8>> = OnceLock::new();
    if let Some(bytes) = BUILT.get() {
        return Ok(bytes.clone());
    }
    let target_dir = root().join("target/plugins/v2");
    let path = target_dir.join("wasm32-wasip2/release/testkit.wasm");
    if prebuilt() {
        let bytes = std::fs::read(&path).with_context(|| format!("reading {} (built by scripts/build-plugins)", path.display()))?;
        return Ok(BUILT.get_or_init(|| bytes).clone());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2", "--features", "v2", "--manifest-path"])
        .arg(root().join("plugins/testkit/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .output()
        .context("running cargo to build the test plugin's v2")?;
    if !out.status.success() {
        bail!("building plugins/testkit --features v2 failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(BUILT.get_or_init(|| bytes).clone())
}
