//! The per-minute rollup the dashboard's charts draw (migration
//! 0026/0023): a few rows a minute, so that a chart of the last hour reads
//! a few hundred rows however many runs the database holds. The loop that
//! keeps it is `rollup` (the host's module).
//!
//! - `finished:STATUS`: runs that ended in the minute, counted once the
//!   minute is [`GRACE_MS`] over, by one host: the first to insert the
//!   minute's `counted` row, in the transaction that writes the counts.
//! - `queued`, `running`: sampled by that host then, with a `sampled` row
//!   (the newest minute only: an older one's cannot be known afterwards).
//! - `wait:I`: first claims whose wait from submit fell in bucket `I`,
//!   added up from what every host observed.

use crate::store::{Store, StoreError, sql};

pub const MINUTE_MS: i64 = 60_000;
/// A minute's finished runs are counted this long after it ends: a close
/// stamped inside the minute has committed by then.
pub const GRACE_MS: i64 = 10_000;
/// Minutes not yet counted are counted this far back (an hour), so a host
/// that starts after a gap fills the chart's hour.
pub const BACKFILL_MINUTES: i64 = 60;

impl Store {
    /// Counts the minutes of the last hour that are over and not counted
    /// yet, each in a transaction of its own; `now` is epoch ms on the
    /// database's clock. Returns how many this call counted.
    pub async fn count_minutes(&self, now: i64) -> Result<usize, StoreError> {
        let newest = (now - GRACE_MS - MINUTE_MS).div_euclid(MINUTE_MS) * MINUTE_MS;
        let oldest = newest - (BACKFILL_MINUTES - 1) * MINUTE_MS;
        let counted: Vec<i64> = sqlx::query_scalar(sql!(self, "SELECT minute FROM stats_minutes WHERE series = 'counted' AND minute >= $1"))
            .bind(oldest)
            .fetch_all(self.pool())
            .await?;
        let mut done = 0;
        for minute in (oldest..=newest).step_by(MINUTE_MS as usize).filter(|m| !counted.contains(m)) {
            let sample = minute == newest;
            let counted_now = self
                .retry(|| async move {
                    let mut tx = self.writer().begin().await?;
                    let claimed = sqlx::query(sql!(
                        self,
                        "INSERT INTO stats_minutes (minute, series, n) VALUES ($1, 'counted', 1) ON CONFLICT (minute, series) DO NOTHING"
                    ))
                    .bind(minute)
                    .execute(&mut *tx)
                    .await?;
                    if claimed.rows_affected() == 0 {
                        return Ok(false);
                    }
                    sqlx::query(sql!(
                        self,
                        "INSERT INTO stats_minutes (minute, series, n) \
                         SELECT $1, 'finished:' || status, COUNT(*) FROM runs WHERE finished_at >= $1 AND finished_at < $2 GROUP BY status"
                    ))
                    .bind(minute)
                    .bind(minute + MINUTE_MS)
                    .execute(&mut *tx)
                    .await?;
                    if sample {
                        // `sampled` says a status with no row had none.
                        sqlx::query(sql!(
                            self,
                            "INSERT INTO stats_minutes (minute, series, n) SELECT $1, 'sampled', 1 UNION ALL \
                             SELECT $1, status, COUNT(*) FROM runs WHERE status IN ('queued', 'running') GROUP BY status"
                        ))
                        .bind(minute)
                        .execute(&mut *tx)
                        .await?;
                    }
                    tx.commit().await?;
                    Ok(true)
                })
                .await?;
            done += usize::from(counted_now);
        }
        Ok(done)
    }

    /// Adds first claims' waits: `(minute, bucket, count)` rows.
    pub async fn add_waits(&self, waits: &[(i64, usize, u64)]) -> Result<(), StoreError> {
        if waits.is_empty() {
            return Ok(());
        }
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            for (minute, bucket, n) in waits {
                sqlx::query(sql!(
                    self,
                    "INSERT INTO stats_minutes (minute, series, n) VALUES ($1, $2, $3) \
                     ON CONFLICT (minute, series) DO UPDATE SET n = stats_minutes.n + excluded.n"
                ))
                .bind(*minute)
                .bind(format!("wait:{bucket}"))
                .bind(*n as i64)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// The rollup's rows of the minutes from `since` (epoch ms): (minute,
    /// series, n), by minute.
    pub async fn stats_minutes(&self, since: i64) -> Result<Vec<(i64, String, i64)>, StoreError> {
        Ok(sqlx::query_as(sql!(self, "SELECT minute, series, n FROM stats_minutes WHERE minute >= $1 ORDER BY minute, series"))
            .bind(since)
            .fetch_all(self.pool())
            .await?)
    }

    /// Deletes the rollup's rows older than `keep_ms` (on the database's clock).
    pub async fn forget_old_minutes(&self, keep_ms: i64) -> Result<u64, StoreError> {
        self.retry(|| async move {
            let done = sqlx::query(sql!(self, "DELETE FROM stats_minutes WHERE minute < {now} - $1"))
                .bind(keep_ms)
                .execute(self.writer())
                .await?;
            Ok(done.rows_affected())
        })
        .await
    }
}
