//! The on-disk cache of compiled components, keyed by content digest and by
//! the engine's compatibility hash (wasmtime version and settings), so a
//! restart loads a plugin in milliseconds instead of recompiling it.
//!
//! A cache entry is native code, so it is only ever run if this host wrote
//! it: the directory is private (created 0700; one owned by another user or
//! writable by others is refused), and each compiled file is checked
//! against the hash recorded beside it when it was written, which also
//! names the component and engine it was compiled for, before it is
//! deserialized. A file that fails the check is deleted and the component
//! compiled (and validated) again.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

pub(super) struct Cache {
    dir: PathBuf,
    engine_key: String,
}

/// The default cache directory: `$XDG_CACHE_HOME/leasehold/components`,
/// else `$HOME/.cache/leasehold/components`, else `.leasehold-cache` in the
/// working directory. Never the shared temporary directory, where another
/// local user could plant a file first.
pub fn default_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    match (env("XDG_CACHE_HOME"), env("HOME")) {
        (Some(cache), _) => cache.join("leasehold/components"),
        (None, Some(home)) => home.join(".cache/leasehold/components"),
        (None, None) => PathBuf::from(".leasehold-cache"),
    }
}

/// Creates `dir` (0700) if it is missing, and checks that it is this
/// user's and that no one else may write to it.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let meta = std::fs::metadata(dir)?;
    let me = rustix::process::geteuid().as_raw();
    let refuse = |why: String| Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, why));
    if meta.uid() != me {
        return refuse(format!(
            "refusing the component cache {}: it is owned by uid {}, not this user (uid {me}); \
             use a directory of this user's (--cache-dir)",
            dir.display(),
            meta.uid()
        ));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o022 != 0 {
        return refuse(format!(
            "refusing the component cache {}: it is writable by others (mode {mode:o}); `chmod 700` it",
            dir.display()
        ));
    }
    Ok(())
}

impl Cache {
    pub(super) fn new(engine: &Engine, dir: PathBuf) -> std::io::Result<Cache> {
        private_dir(&dir)?;
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

    /// What is recorded beside a compiled file: its hash, and the component
    /// and engine it was compiled for.
    fn record(&self, digest: &str, compiled: &[u8]) -> String {
        format!("{} {digest} {}\n", hex::encode(Sha256::digest(compiled)), self.engine_key)
    }

    /// The cached component for `digest`, if this host compiled one and it
    /// is unchanged since.
    pub(super) fn load(&self, engine: &Engine, digest: &str) -> std::io::Result<Option<Component>> {
        let path = self.path(digest);
        let record_path = path.with_extension("sha256");
        let (Ok(record), Ok(compiled)) = (std::fs::read_to_string(&record_path), std::fs::read(&path)) else {
            return Ok(None);
        };
        if record != self.record(digest, &compiled) {
            tracing::warn!(path = %path.display(), "discarding a cached component that does not match the hash recorded when it was written");
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(&record_path);
            return Ok(None);
        }
        // SAFETY: deserializing runs native code compiled earlier. These
        // bytes are the ones this host wrote for this component and engine
        // (their hash is the one it recorded, in a directory only this user
        // can write), and they are deserialized from memory, so the file
        // cannot change between the check and the load. Wasmtime also
        // checks the header.
        #[allow(unsafe_code)]
        let loaded = unsafe { Component::deserialize(engine, &compiled) };
        match loaded {
            Ok(c) => Ok(Some(c)),
            Err(e) => {
                // A stale or damaged entry: drop it and recompile.
                tracing::warn!(path = %path.display(), error = %e, "discarding unusable cached component");
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(&record_path);
                Ok(None)
            }
        }
    }

    /// Writes a compiled component and its record: each to a temporary
    /// file, then renamed (the compiled file first), so a crash never leaves
    /// a half-written entry behind. The temporary names are unique per
    /// write: runtimes compiling the same component at once (in one process
    /// or several) each rename complete files of their own.
    pub(super) fn store(&self, digest: &str, compiled: &[u8]) -> std::io::Result<()> {
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = self.path(digest);
        let tmp = path.with_extension(format!("tmp-{}-{n}", std::process::id()));
        std::fs::write(&tmp, compiled)?;
        std::fs::rename(&tmp, &path)?;
        let record_path = path.with_extension("sha256");
        let tmp = path.with_extension(format!("sha256-tmp-{}-{n}", std::process::id()));
        std::fs::write(&tmp, self.record(digest, compiled))?;
        std::fs::rename(&tmp, &record_path)
    }
}
