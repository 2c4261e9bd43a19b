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

impl Store {
    /// What `namespace` holds now (zero for one never written).
    pub async fn kv_usage(&self, namespace: &str) -> Result<KvUsage, StoreError> {
        Ok(self.kv_room(namespace, None).await?.usage)
    }

    /// `namespace`'s usage and, with `key`, what that key holds now.
    pub async fn kv_room(&self, namespace: &str, key: Option<&str>) -> Result<KvRoom, StoreError> {
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
