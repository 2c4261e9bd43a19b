//! Effects an operator resolves by hand (docs/operations.md, "Resolving an
//! effect by hand"). A call whose outcome only a person can know (an
//! unkeyed call in doubt after a death), or one that failed and was then
//! done another way, gets its outcome written by an operator: a result
//! (it happened) or an error (it did not). The run then goes on as if the
//! call had returned that: replay reads the row like any other.
//!
//! Only the run's last row may be resolved (a row after it was made by a
//! turn that saw the old outcome, and a replay that took the new branch
//! would not match it: rerun from that position instead), only a row
//! `started`, `in_doubt` or `failed`, and only while no segment runs the
//! run. A run that had failed or was aborted is queued again, with its
//! attempts reset; one that completed or was cancelled is refused.

use serde_json::json;
use sqlx::Row;

use crate::store::log::{self, kind};
use crate::store::{Backend, EffectRow, EffectState, Run, RunStatus, Store, StoreError, sql};

/// What an operator says a call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// It happened, with this result (the text the call returns).
    Result(String),
    /// It did not: the call fails with this error (its encoded form, as
    /// the ledger keeps it).
    Error(String),
}

impl Store {
    /// Writes `resolution` as the outcome of row `seq` of run `run_id`,
    /// recorded as `by`'s, at the database's time. Moves the run's fence
    /// (no segment of before may write again) and queues a failed or
    /// aborted run again. Returns the row and the run as they now stand.
    pub async fn resolve_effect(&self, run_id: i64, seq: i64, resolution: &Resolution, by: &str) -> Result<(EffectRow, Run), StoreError> {
        let (row, run) = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let lock = match self.backend() {
                    Backend::Sqlite => sql!(self, "SELECT status, parent_id FROM runs WHERE id = $1"),
                    Backend::Postgres => sql!(self, "SELECT status, parent_id FROM runs WHERE id = $1 FOR UPDATE"),
                };
                let found = sqlx::query(lock).bind(run_id).fetch_optional(&mut *tx).await?.ok_or(StoreError::RunNotFound(run_id))?;
                let status: RunStatus = found.try_get::<String, _>("status")?.parse()?;
                let conflict = |message: &'static str| StoreError::Conflict { run_id, status, message };
                match status {
                    RunStatus::Running => return Err(conflict("a segment is running it; resolve its effects once it stops")),
                    RunStatus::Completed | RunStatus::Cancelled => return Err(conflict("it has ended; its effects can no longer be resolved")),
                    _ => {}
                }
                let reopen = matches!(status, RunStatus::Failed | RunStatus::Aborted);
                if reopen && let Some(parent) = found.try_get::<Option<i64>, _>("parent_id")? {
                    let open: Option<i64> = sqlx::query_scalar(sql!(
                        self,
                        "SELECT 1 FROM runs WHERE id = $1 AND status NOT IN ('completed','failed','aborted','cancelled')"
                    ))
                    .bind(parent)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if open.is_some() {
                        return Err(conflict("it is a child whose end its open parent has already counted"));
                    }
                }
                let row: Option<(String, String)> = sqlx::query_as(sql!(self, "SELECT state, name FROM effects WHERE run_id = $1 AND seq = $2"))
                    .bind(run_id)
                    .bind(seq)
                    .fetch_optional(&mut *tx)
                    .await?;
                // What a budget sums is checked here too: an operator's
                // result cannot refund a tree or break its sums.
                if let (Some((_, name)), Resolution::Result(result)) = (&row, resolution)
                    && name == "model.chat"
                {
                    crate::store::budgets::check_chat_result(result).map_err(StoreError::Config)?;
                }
                let state = row.map(|(state, _)| state);
                match state.as_deref().map(EffectState::parse).transpose()? {
                    None => return Err(StoreError::EffectNotFound { run_id, seq }),
                    Some(EffectState::Committed) => return Err(conflict("that effect is committed; only one started, in doubt or failed can be resolved")),
                    Some(_) => {}
                }
                let later: Option<i64> = sqlx::query_scalar(sql!(self, "SELECT seq FROM effects WHERE run_id = $1 AND seq > $2 LIMIT 1"))
                    .bind(run_id)
                    .bind(seq)
                    .fetch_optional(&mut *tx)
                    .await?;
                if later.is_some() {
                    return Err(conflict("a later effect was recorded on that one's old outcome; rerun from that position instead"));
                }
                if reopen {
                    // Its `message` event says it failed: kept as it was.
                    log::keep_message(self, &mut tx, run_id).await?;
                }
                let run = Run::from_row(
                    &sqlx::query(sql!(
                        self,
                        "UPDATE runs SET fence = fence + 1, lease_owner = NULL, lease_expires_at = NULL, updated_at = {now}, \
                         status = CASE WHEN $2 THEN 'queued' ELSE status END, \
                         not_before = CASE WHEN $2 THEN {now} ELSE not_before END, \
                         attempt = CASE WHEN $2 THEN 0 ELSE attempt END, \
                         error = CASE WHEN $2 THEN NULL ELSE error END, \
                         output = CASE WHEN $2 THEN NULL ELSE output END, \
                         finished_at = CASE WHEN $2 THEN NULL ELSE finished_at END, \
                         waiting_for = CASE WHEN $2 THEN NULL ELSE waiting_for END \
                         WHERE id = $1 RETURNING {runs}"
                    ))
                    .bind(run_id)
                    .bind(reopen)
                    .fetch_one(&mut *tx)
                    .await?,
                )?;
                let (state, text) = match resolution {
                    Resolution::Result(r) => ("committed", r),
                    Resolution::Error(e) => ("failed", e),
                };
                let row = EffectRow::from_row(
                    &sqlx::query(sql!(
                        self,
                        "UPDATE effects SET state = $3, result = $4, fence_completed = $5, resolved_by = $6, \
                         resolved_at = {now}, updated_at = {now} WHERE run_id = $1 AND seq = $2 RETURNING {effects}"
                    ))
                    .bind(run_id)
                    .bind(seq)
                    .bind(state)
                    .bind(text)
                    .bind(run.fence)
                    .bind(by)
                    .fetch_one(&mut *tx)
                    .await?,
                )?;
                if reopen && let Some(key) = &run.concurrency_key {
                    crate::store::concurrency::activate(self, &mut tx, key, &run.plugin).await?;
                }
                let payload = json!({ "seq": seq, "outcome": state, "by": by, "status": run.status });
                log::append(self, &mut tx, &run.thread_id, run_id, run.fence, kind::RESOLVED, &payload).await?;
                tx.commit().await?;
                Ok((row, run))
            })
            .await?;
        self.hub().wake(&run.thread_id);
        if run.status == RunStatus::Queued {
            self.signal_work(true).await;
        }
        Ok((row, run))
    }
}
