//! The on-disk cache of compiled components, keyed by content digest and by
//! the engine's compatibility hash (wasmtime version and settings), so a
//! restart loads a plugin in milliseconds instead of recompiling it.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;

use wasmtime::Engine;
use wasmtime::component::Component;

pub(super) struct Cache {
    dir: PathBuf,
    engine_key: String,
}

impl Cache {
    pub(super) fn new(engine: &Engine, dir: PathBuf) -> std::io::Result<Cache> {
        std::fs::create_dir_all(&dir)?;
        let mut h = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        // The compatibility hash covers the wasmtime version and the
        // engine's settings.
        let engine_key = format!("engine-{:016x}", h.finish());
        Ok(Cache { dir, engine_key })
    }

    fn path(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir.join(format!("{hex}-{}.cwasm", self.engine_key))
    }

    /// The cached component for `digest`, if this engine compiled one.
    pub(super) fn load(&self, engine: &Engine, digest: &str) -> std::io::Result<Option<Component>> {
        let path = self.path(digest);
        if !path.exists() {
            return Ok(None);
        }
        // SAFETY: deserializing runs native code compiled earlier. Only this
        // cache writes files with this name (content digest + this engine's
        // compatibility key), and `store` writes them atomically, so the file
        // is one this engine produced. Wasmtime also checks the header.
        #[allow(unsafe_code)]
        let loaded = unsafe { Component::deserialize_file(engine, &path) };
        match loaded {
            Ok(c) => Ok(Some(c)),
            Err(e) => {
                // A stale or damaged entry: drop it and recompile.
                tracing::warn!(path = %path.display(), error = %e, "discarding unusable cached component");
                let _ = std::fs::remove_file(&path);
                Ok(None)
            }
        }
    }

    /// Writes a compiled component: to a temporary file, then renamed, so a
    /// crash never leaves a half-written entry behind. The temporary name is
    /// unique per write: runtimes compiling the same component at once (in
    /// one process or several) each rename a complete file of their own.
    pub(super) fn store(&self, digest: &str, compiled: &[u8]) -> std::io::Result<()> {
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = self.path(digest);
        let tmp = path.with_extension(format!("tmp-{}-{n}", std::process::id()));
        std::fs::write(&tmp, compiled)?;
        std::fs::rename(&tmp, &path)
    }
}
