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

use crate::store::{Backend, Store, StoreError, sql};

/// The rollup's counts: a minute's finished runs by status (`$1`, `$2`:
/// its bounds), and the runs queued and running now, each through an index
/// (SQLite: `runs_finished`, `runs_status`, `runs_lease`), never a scan of
/// `runs`.
#[doc(hidden)]
pub fn count_sql(store: &Store) -> [&'static str; 3] {
    match store.backend() {
        Backend::Sqlite => [
            "SELECT status, COUNT(*) FROM runs INDEXED BY runs_finished WHERE finished_at >= $1 AND finished_at < $2 GROUP BY status",
            // The repeated term lets SQLite use the partial index `status <> 'running'`.
            "SELECT COUNT(*) FROM runs INDEXED BY runs_status WHERE status = 'queued' AND status <> 'running'",
            "SELECT COUNT(*) FROM runs INDEXED BY runs_lease WHERE status = 'running'",
        ],
        Backend::Postgres => [
            "SELECT status, COUNT(*) FROM runs WHERE finished_at >= $1 AND finished_at < $2 GROUP BY status",
            "SELECT COUNT(*) FROM runs WHERE status = 'queued'",
            "SELECT COUNT(*) FROM runs WHERE status = 'running'",
        ],
    }
}

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
            // Counted before the write transaction, through indexes: on
            // SQLite a count inside it held the only writer (claims,
            // renewals) for as long as it read.
            let [finished_sql, queued_sql, running_sql] = count_sql(self);
            let finished: Vec<(String, i64)> =
                sqlx::query_as(finished_sql).bind(minute).bind(minute + MINUTE_MS).fetch_all(self.pool()).await?;
            let sampled: Option<(i64, i64)> = if sample {
                let queued: i64 = sqlx::query_scalar(queued_sql).fetch_one(self.pool()).await?;
                let running: i64 = sqlx::query_scalar(running_sql).fetch_one(self.pool()).await?;
                Some((queued, running))
            } else {
                None
            };
            let (finished, sampled) = (&finished, &sampled);
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
                    let mut rows: Vec<(String, i64)> = finished.iter().map(|(status, n)| (format!("finished:{status}"), *n)).collect();
                    if let Some((queued, running)) = sampled {
                        // `sampled` says a status with no row had none.
                        rows.push(("sampled".into(), 1));
                        rows.extend([("queued".to_string(), *queued), ("running".to_string(), *running)].into_iter().filter(|(_, n)| *n > 0));
                    }
                    for (series, n) in &rows {
                        sqlx::query(sql!(self, "INSERT INTO stats_minutes (minute, series, n) VALUES ($1, $2, $3)"))
                            .bind(minute)
                            .bind(series)
                            .bind(n)
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
