//! Counts the database holds, for `/metrics`: runs by status and ledger
//! rows by state. Each is a `GROUP BY` over a whole table, so the API
//! caches them.

use sqlx::Row;

use crate::store::{EffectState, RunStatus, Store, StoreError, sql};

/// Runs by status and ledger rows by state, every status and state
/// included (zero when there are none).
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    pub runs: Vec<(RunStatus, i64)>,
    pub effects: Vec<(EffectState, i64)>,
    /// When the oldest finished run kept finished (epoch ms), and the
    /// database's clock now.
    pub oldest_finished: Option<i64>,
    pub now_ms: i64,
    /// Queued runs of the concurrency keys with the most, at most
    /// [`TOP_KEYS`] keys.
    pub queued_by_key: Vec<(String, i64)>,
}

/// Keys `leasehold_queued_runs_by_key` shows: the busiest, so a scrape of a
/// database with a million tenants stays small.
pub const TOP_KEYS: i64 = 20;

impl Store {
    /// See [`Gauges`].
    pub async fn gauges(&self) -> Result<Gauges, StoreError> {
        let runs = sqlx::query(sql!(self, "SELECT status, COUNT(*) AS n FROM runs GROUP BY status"))
            .fetch_all(self.pool())
            .await?;
        let effects = sqlx::query(sql!(self, "SELECT state, COUNT(*) AS n FROM effects GROUP BY state"))
            .fetch_all(self.pool())
            .await?;
        let count = |rows: &[sqlx::any::AnyRow], column: &str, value: &str| {
            rows.iter()
                .find(|r| r.try_get::<String, _>(column).ok().as_deref() == Some(value))
                .and_then(|r| r.try_get::<i64, _>("n").ok())
                .unwrap_or(0)
        };
        Ok(Gauges {
            runs: RunStatus::ALL.iter().map(|s| (*s, count(&runs, "status", s.as_str()))).collect(),
            effects: EffectState::ALL.iter().map(|s| (*s, count(&effects, "state", s.as_str()))).collect(),
            oldest_finished: self.oldest_finished().await?,
            queued_by_key: sqlx::query_as(sql!(
                self,
                "SELECT concurrency_key, CAST(COUNT(*) AS BIGINT) AS n FROM runs WHERE status = 'queued' AND concurrency_key <> '' \
                 GROUP BY concurrency_key ORDER BY n DESC, concurrency_key LIMIT $1"
            ))
            .bind(TOP_KEYS)
            .fetch_all(self.pool())
            .await?,
            now_ms: self.now_ms().await?,
        })
    }
}
