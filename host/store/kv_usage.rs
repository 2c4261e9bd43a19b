//! What each plugin's kv namespace holds, and the quota it may hold: the
//! `kv_usage` table, kept by triggers on `kv` (migration `kv_usage`), so a
//! put's check reads one row, never the namespace.

use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::store::{Backend, Store, StoreError};

/// How much a plugin's kv namespace may hold, over all its runs; a
/// `kv.put` that would take it past either cap is refused (and the
/// refusal recorded in the run's ledger). Every field documents its
/// default.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KvQuota {
    /// Bytes of keys and values. Default: 256 MiB.
    #[serde(default = "KvQuota::default_max_bytes")]
    pub max_bytes: u64,
    /// Keys. Default: 100,000.
    #[serde(default = "KvQuota::default_max_keys")]
    pub max_keys: u64,
}

impl KvQuota {
    fn default_max_bytes() -> u64 {
        256 << 20
    }

    fn default_max_keys() -> u64 {
        100_000
    }
}

impl Default for KvQuota {
    fn default() -> Self {
        KvQuota { max_bytes: KvQuota::default_max_bytes(), max_keys: KvQuota::default_max_keys() }
    }
}

/// What a namespace holds: its keys, and the bytes of its keys and values.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct KvUsage {
    pub keys: i64,
    pub bytes: i64,
}

/// What a put of one key needs to know: the namespace's usage, and the
/// bytes the key holds now (`None`: a new key).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvRoom {
    pub usage: KvUsage,
    pub stored: Option<i64>,
}

/// How long a usage read serves this process's segments as the start of
/// their quota estimates: 1 s.
pub const KV_SEEN_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// Each namespace's usage as this process last read it, plus what its
/// segments have put since (each put counted as a new key), and when it
/// was read: where a segment's quota estimate starts, so one read a second
/// serves every segment of the host instead of one read a segment (see
/// `runtime::kv_quota`).
#[derive(Debug, Default)]
pub(crate) struct Seen {
    usage: std::sync::Mutex<std::collections::HashMap<String, (KvUsage, std::time::Instant)>>,
    /// Reads of a namespace's usage this store has made.
    reads: std::sync::atomic::AtomicU64,
}

impl Store {
    /// `namespace`'s usage as this process last read it plus its puts
    /// since, if it was read within [`KV_SEEN_FRESH`].
    pub fn kv_seen(&self, namespace: &str) -> Option<KvUsage> {
        let seen = self.kv_seen.usage.lock().expect("kv seen lock");
        seen.get(namespace).filter(|(_, at)| at.elapsed() < KV_SEEN_FRESH).map(|(usage, _)| *usage)
    }

    /// Records a read of `namespace`'s usage (with this process's puts
    /// that it already holds).
    pub fn kv_seen_read(&self, namespace: &str, usage: KvUsage) {
        self.kv_seen.usage.lock().expect("kv seen lock").insert(namespace.to_string(), (usage, std::time::Instant::now()));
    }

    /// Counts a put of `bytes` (key and value) into `namespace`, as a new
    /// key, in what this process has seen.
    pub fn kv_seen_put(&self, namespace: &str, bytes: i64) {
        if let Some((usage, _)) = self.kv_seen.usage.lock().expect("kv seen lock").get_mut(namespace) {
            *usage = KvUsage { keys: usage.keys + 1, bytes: usage.bytes + bytes };
        }
    }

    /// What `namespace` holds now (zero for one never written).
    pub async fn kv_usage(&self, namespace: &str) -> Result<KvUsage, StoreError> {
        Ok(self.kv_room(namespace, None).await?.usage)
    }

    /// How many times this store (and its clones) has read a namespace's
    /// usage: once a segment's first put at most, and fewer when the
    /// host's last read serves (see [`KV_SEEN_FRESH`]).
    pub fn kv_usage_reads(&self) -> u64 {
        self.kv_seen.reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `namespace`'s usage and, with `key`, what that key holds now.
    pub async fn kv_room(&self, namespace: &str, key: Option<&str>) -> Result<KvRoom, StoreError> {
        self.kv_seen.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let statement = match self.backend() {
            Backend::Postgres => {
                "SELECT COALESCE((SELECT keys FROM kv_usage WHERE namespace = $1), 0) AS keys, \
                 COALESCE((SELECT bytes FROM kv_usage WHERE namespace = $1), 0) AS bytes, \
                 (SELECT octet_length(key) + octet_length(value) FROM kv WHERE namespace = $1 AND key = $2)::bigint AS stored"
            }
            Backend::Sqlite => {
                "SELECT COALESCE((SELECT keys FROM kv_usage WHERE namespace = $1), 0) AS keys, \
                 COALESCE((SELECT bytes FROM kv_usage WHERE namespace = $1), 0) AS bytes, \
                 (SELECT length(CAST(key AS BLOB)) + length(CAST(value AS BLOB)) FROM kv \
                 WHERE namespace = $1 AND key = $2) AS stored"
            }
        };
        let row = sqlx::query(statement).bind(namespace).bind(key.unwrap_or("")).fetch_one(self.pool()).await?;
        let stored = if key.is_some() { row.try_get::<Option<i64>, _>("stored")? } else { None };
        Ok(KvRoom { usage: KvUsage { keys: row.try_get("keys")?, bytes: row.try_get("bytes")? }, stored })
    }
}
