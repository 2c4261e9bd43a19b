//! Retention: finished runs (`completed`, `failed`, `aborted`,
//! `cancelled`) older than the retention period are deleted with their
//! ledger rows and events, oldest first, a small batch per transaction, so
//! no statement holds locks for long; a thread goes with its last run; kv
//! data stays. A tree goes whole: a run is deleted only once every run of
//! its tree (its root and every run below it) is finished and past
//! retention, since an open run still counts on its tree's finished runs
//! (their spend against its budget, the `parent_id` chain its budget and
//! a cascade cancel walk). Several hosts may clean at once: on PostgreSQL
//! each takes the runs it deletes with `SKIP LOCKED`, so two never wait
//! on one another. The cut-off comes from the database's clock.

use serde_json::json;
use sqlx::Row;

use crate::store::{Backend, Store, StoreError, sql};

/// No run of run `r`'s tree is open or inside retention (`$1`): its
/// members through `runs_root`, its root through the primary key. A run
/// with no tree costs one empty probe.
macro_rules! tree_past {
    () => {
        " AND NOT EXISTS (SELECT 1 FROM runs o WHERE o.root_id = COALESCE(r.root_id, r.id) \
          AND (o.finished_at IS NULL OR o.finished_at >= {now} - $1)) \
          AND NOT EXISTS (SELECT 1 FROM runs t WHERE t.id = r.root_id \
          AND (t.finished_at IS NULL OR t.finished_at >= {now} - $1))"
    };
}

/// What one batch deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub runs: u64,
    pub effects: u64,
    pub events: u64,
    pub threads: u64,
}

impl Store {
    /// Deletes up to `batch` runs that finished more than `older_than_ms`
    /// ago (by the database's clock), with their ledger rows and events,
    /// and the threads they leave empty, in one transaction.
    pub async fn delete_finished(&self, older_than_ms: i64, batch: i64) -> Result<Deleted, StoreError> {
        // Nothing past retention, the usual case: one read, and no write
        // transaction every few seconds on every host.
        let any: Option<i64> = sqlx::query_scalar(sql!(
            self,
            concat!("SELECT r.id FROM runs r WHERE r.finished_at IS NOT NULL AND r.finished_at < {now} - $1", tree_past!(), " LIMIT 1")
        ))
        .bind(older_than_ms)
        .fetch_optional(self.pool())
        .await?;
        if any.is_none() {
            return Ok(Deleted::default());
        }
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let pick = match self.backend() {
                Backend::Sqlite => sql!(
                    self,
                    concat!(
                        "SELECT r.id, r.thread_id FROM runs r WHERE r.finished_at IS NOT NULL AND r.finished_at < {now} - $1",
                        tree_past!(),
                        " ORDER BY r.finished_at LIMIT $2"
                    )
                ),
                Backend::Postgres => sql!(
                    self,
                    concat!(
                        "SELECT r.id, r.thread_id FROM runs r WHERE r.finished_at IS NOT NULL AND r.finished_at < {now} - $1",
                        tree_past!(),
                        " ORDER BY r.finished_at LIMIT $2 FOR UPDATE OF r SKIP LOCKED"
                    )
                ),
            };
            let rows = sqlx::query(pick).bind(older_than_ms).bind(batch).fetch_all(&mut *tx).await?;
            if rows.is_empty() {
                return Ok(Deleted::default());
            }
            let mut ids = Vec::with_capacity(rows.len());
            let mut threads = Vec::with_capacity(rows.len());
            for row in &rows {
                ids.push(row.try_get::<i64, _>("id")?);
                threads.push(row.try_get::<String, _>("thread_id")?);
            }
            threads.sort();
            threads.dedup();
            let (ids, threads) = (json!(ids).to_string(), json!(threads).to_string());
            let statements: [&'static str; 4] = match self.backend() {
                Backend::Sqlite => [
                    "DELETE FROM effects WHERE run_id IN (SELECT value FROM json_each($1))",
                    "DELETE FROM events WHERE run_id IN (SELECT value FROM json_each($1))",
                    "DELETE FROM runs WHERE id IN (SELECT value FROM json_each($1)) AND finished_at IS NOT NULL",
                    "DELETE FROM threads WHERE id IN (SELECT value FROM json_each($1)) \
                     AND NOT EXISTS (SELECT 1 FROM runs WHERE runs.thread_id = threads.id)",
                ],
                Backend::Postgres => [
                    "DELETE FROM effects WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                    "DELETE FROM events WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                    "DELETE FROM runs WHERE id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb)) \
                     AND finished_at IS NOT NULL",
                    "DELETE FROM threads WHERE id IN (SELECT value FROM jsonb_array_elements_text($1::jsonb)) \
                     AND NOT EXISTS (SELECT 1 FROM runs WHERE runs.thread_id = threads.id)",
                ],
            };
            let mut counts = [0u64; 4];
            for (i, statement) in statements.into_iter().enumerate() {
                let list = if i == 3 { &threads } else { &ids };
                if i == 3 && self.backend() == Backend::Postgres {
                    // The threads first, in their own statement: a submit
                    // to one commits before this lock is granted, and the
                    // delete's snapshot, taken after, sees its run. (One
                    // statement's snapshot predates its lock waits, and it
                    // deleted the thread of a run just submitted to it.)
                    sqlx::query(
                        "SELECT id FROM threads WHERE id IN (SELECT value FROM jsonb_array_elements_text($1::jsonb)) \
                         ORDER BY id FOR UPDATE",
                    )
                    .bind(list.as_str())
                    .execute(&mut *tx)
                    .await?;
                }
                counts[i] = sqlx::query(statement).bind(list.as_str()).execute(&mut *tx).await?.rows_affected();
            }
            // Deliveries and answer links no wait took: they go with their run.
            let leftovers: [&'static str; 5] = match self.backend() {
                Backend::Sqlite => [
                    "DELETE FROM inbox WHERE run_id IN (SELECT value FROM json_each($1))",
                    "DELETE FROM answer_links WHERE run_id IN (SELECT value FROM json_each($1))",
                    "DELETE FROM segments WHERE run_id IN (SELECT value FROM json_each($1))",
                    "DELETE FROM budget_holds WHERE run_id IN (SELECT value FROM json_each($1))",
                    "DELETE FROM input_deliveries WHERE run_id IN (SELECT value FROM json_each($1))",
                ],
                Backend::Postgres => [
                    "DELETE FROM segments WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                    "DELETE FROM inbox WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                    "DELETE FROM answer_links WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                    "DELETE FROM budget_holds WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                    "DELETE FROM input_deliveries WHERE run_id IN (SELECT value::bigint FROM jsonb_array_elements_text($1::jsonb))",
                ],
            };
            for statement in leftovers {
                sqlx::query(statement).bind(ids.as_str()).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(Deleted { effects: counts[0], events: counts[1], runs: counts[2], threads: counts[3] })
        })
        .await
    }

    /// When the oldest finished run still kept finished (epoch ms).
    pub async fn oldest_finished(&self) -> Result<Option<i64>, StoreError> {
        Ok(sqlx::query_scalar("SELECT MIN(finished_at) FROM runs WHERE finished_at IS NOT NULL")
            .fetch_one(self.pool())
            .await?)
    }

    /// SQLite: gives up to 2,000 free pages back to the file system when
    /// the database was created with incremental auto-vacuum (new ones
    /// are); otherwise freed pages are reused by later writes, so the file
    /// stops growing anyway. A no-op on PostgreSQL (vacuum reclaims space).
    pub async fn give_back_space(&self) -> Result<(), StoreError> {
        if self.backend() != Backend::Sqlite {
            return Ok(());
        }
        // A PRAGMA takes no bound parameters: the count is fixed here.
        self.retry(|| async { Ok(sqlx::query("PRAGMA incremental_vacuum(2000)").execute(self.writer()).await?) }).await?;
        Ok(())
    }
}
