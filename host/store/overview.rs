//! What an operator's pages read besides runs: who holds which leases now,
//! which runs were taken over, and how many runs each plugin version has.
//! Each read is bounded: by an index, a limit, or a window of recent ids.

use serde::Serialize;
use sqlx::Row;

use crate::store::{RunStatus, Store, StoreError, sql};

/// A run a host holds now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct HeldRun {
    pub id: i64,
    pub plugin: String,
    pub owner: String,
    pub fence: i64,
    pub attempt: i64,
    /// Epoch ms, database clock.
    pub lease_expires_at: i64,
    /// The last claim or renewal (epoch ms).
    pub heartbeat_at: Option<i64>,
}

/// A recent run whose fence is past 1: another segment (a takeover, a
/// resume after a suspension) or a cancel moved it on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct FencedRun {
    pub id: i64,
    pub plugin: String,
    pub status: RunStatus,
    pub fence: i64,
    pub attempt: i64,
    pub lease_owner: Option<String>,
    pub updated_at: i64,
}

/// Runs of one plugin version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct VersionInfo {
    pub digest: String,
    /// When this version was first registered (epoch ms).
    pub created_at: i64,
    /// The component's size in bytes.
    pub size: i64,
    /// Runs on it not finished yet (queued, running or waiting): while
    /// there are any, hosts keep the version loaded. (Not all the runs it
    /// ever had: that count is a scan of every kept run.)
    pub open_runs: i64,
}

/// How many recent runs (by id) [`Store::fenced_runs`] looks through.
pub const FENCED_WINDOW: i64 = 10_000;

impl Store {
    /// Runs leased now (`running`), by owner then id, at most `limit`.
    pub async fn held_runs(&self, limit: i64) -> Result<Vec<HeldRun>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT id, plugin, lease_owner, fence, attempt, lease_expires_at, heartbeat_at FROM runs \
             WHERE status = 'running' ORDER BY lease_owner, id LIMIT $1"
        ))
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(HeldRun {
                    id: r.try_get("id")?,
                    plugin: r.try_get("plugin")?,
                    owner: r.try_get::<Option<String>, _>("lease_owner")?.unwrap_or_default(),
                    fence: r.try_get("fence")?,
                    attempt: r.try_get("attempt")?,
                    lease_expires_at: r.try_get::<Option<i64>, _>("lease_expires_at")?.unwrap_or(0),
                    heartbeat_at: r.try_get("heartbeat_at")?,
                })
            })
            .collect()
    }

    /// Among the [`FENCED_WINDOW`] newest runs, those with a fence past 1,
    /// most recently updated first, at most `limit`.
    pub async fn fenced_runs(&self, limit: i64) -> Result<Vec<FencedRun>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT id, plugin, status, fence, attempt, lease_owner, updated_at FROM runs \
             WHERE id > (SELECT COALESCE(MAX(id), 0) FROM runs) - $2 AND fence > 1 \
             ORDER BY updated_at DESC, id DESC LIMIT $1"
        ))
        .bind(limit)
        .bind(FENCED_WINDOW)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(FencedRun {
                    id: r.try_get("id")?,
                    plugin: r.try_get("plugin")?,
                    status: r.try_get::<String, _>("status")?.parse()?,
                    fence: r.try_get("fence")?,
                    attempt: r.try_get("attempt")?,
                    lease_owner: r.try_get("lease_owner")?,
                    updated_at: r.try_get("updated_at")?,
                })
            })
            .collect()
    }

    /// Every version of plugin `name`, newest first, with its runs.
    pub async fn plugin_versions(&self, name: &str) -> Result<Vec<VersionInfo>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT v.digest, v.created_at, LENGTH(v.component) AS size, \
             (SELECT COUNT(*) FROM runs r WHERE r.plugin = v.name AND r.plugin_digest = v.digest \
              AND r.status IN ('queued', 'running', 'waiting_input', 'waiting_takeover')) AS open_runs \
             FROM plugin_versions v WHERE v.name = $1 ORDER BY v.created_at DESC, v.digest"
        ))
        .bind(name)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(VersionInfo {
                    digest: r.try_get("digest")?,
                    created_at: r.try_get("created_at")?,
                    size: r.try_get::<i64, _>("size").or_else(|_| r.try_get::<i32, _>("size").map(i64::from))?,
                    open_runs: r.try_get("open_runs")?,
                })
            })
            .collect()
    }
}
