//! The segment log: a row per segment a host ran, with its host, fence,
//! times and outcome, for the run page's time line (`GET
//! /v1/runs/{id}/segments`). Written behind the segments, a batch a
//! second at most per host (`segment_log`), so it costs the
//! claim and close path nothing; a host that dies loses its last second of
//! rows, and a segment it was running has none (its ledger rows still show
//! its fence). It guards nothing and nothing reads it to decide anything,
//! so it is written without the lease's guard. Deleted with its run.
//!
//! A run's first segment that completes it has no row: the run row holds
//! all of it (its first claim's `started_at`, its close's `finished_at`
//! and `closed_by`), and [`Store::segments`] reads it from there. That is
//! most runs, so most runs cost the log no insert. A host of the release
//! before writes a row for it, and the row is read as it is; such a host
//! reading the log during a rolling upgrade does not show those segments
//! of new hosts.

use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::Row;

use super::{Backend, Store, StoreError};

/// One segment as its host recorded it. Times are epoch ms on the
/// database's clock: the claim's, plus the segment's length on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SegmentRecord {
    pub run_id: i64,
    pub fence: i64,
    /// The host that ran it (its lease owner id).
    pub owner: String,
    pub started_at: i64,
    pub ended_at: i64,
    /// `completed`, `failed: <kind>`, `suspended: <status>`, `lease_lost`
    /// or `abandoned`.
    pub outcome: String,
}

impl Store {
    /// Writes `rows` in one statement; a row already there is kept.
    pub async fn record_segments(&self, rows: &[SegmentRecord]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        let list = json!(rows).to_string();
        let list = list.as_str();
        self.retry(|| async move {
            let statement = match self.backend() {
                Backend::Sqlite => {
                    "INSERT INTO segments (run_id, fence, owner, started_at, ended_at, outcome) \
                     SELECT value ->> 'run_id', value ->> 'fence', value ->> 'owner', value ->> 'started_at', \
                     value ->> 'ended_at', value ->> 'outcome' FROM json_each($1) WHERE true ON CONFLICT DO NOTHING"
                }
                Backend::Postgres => {
                    "INSERT INTO segments (run_id, fence, owner, started_at, ended_at, outcome) \
                     SELECT run_id, fence, owner, started_at, ended_at, outcome FROM jsonb_to_recordset($1::text::jsonb) \
                     AS l(run_id bigint, fence bigint, owner text, started_at bigint, ended_at bigint, outcome text) \
                     ORDER BY run_id, fence ON CONFLICT DO NOTHING"
                }
            };
            sqlx::query(statement).bind(list).execute(self.writer()).await?;
            Ok(())
        })
        .await
    }

    /// The segments recorded for `run_id`, by fence, with the first segment
    /// that completed it read from the run row when it has no row of its own.
    pub async fn segments(&self, run_id: i64) -> Result<Vec<SegmentRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT run_id, fence, owner, started_at, ended_at, outcome FROM segments WHERE run_id = $1 \
             UNION ALL SELECT id, fence, closed_by, COALESCE(started_at, created_at), finished_at, 'completed' FROM runs \
             WHERE id = $1 AND status = 'completed' AND closed_by IS NOT NULL AND finished_at IS NOT NULL \
             AND fence = CASE WHEN rerun_of IS NULL THEN 1 ELSE 2 END \
             AND NOT EXISTS (SELECT 1 FROM segments s WHERE s.run_id = runs.id AND s.fence = runs.fence) \
             ORDER BY fence LIMIT 1000",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(SegmentRecord {
                    run_id: r.try_get("run_id")?,
                    fence: r.try_get("fence")?,
                    owner: r.try_get("owner")?,
                    started_at: r.try_get("started_at")?,
                    ended_at: r.try_get("ended_at")?,
                    outcome: r.try_get("outcome")?,
                })
            })
            .collect()
    }
}
