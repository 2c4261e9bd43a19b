//! The reaper's statements: find runs whose lease expired or whose
//! attempts are used up, and reap each one under the fence it was observed
//! at. The loop that calls them is in `reaper`.

use serde::Serialize;
use serde_json::json;
use sqlx::Row;

use crate::store::log::{self, kind};
use crate::store::{RunStatus, Store, StoreError, sql};

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReapReport {
    /// Runs with an expired lease and attempts left: left `running` with the
    /// expired lease for the next claim to resume (partial not promoted).
    pub resumable: Vec<i64>,
    /// Runs given up: `aborted`, with the partial salvaged as the output.
    pub aborted: Vec<i64>,
    /// Ledger rows moved from `started` to `in_doubt`.
    pub in_doubt: u64,
    /// Candidates that changed under the reaper (claimed, closed, cancelled)
    /// before it could act; it left them alone.
    pub raced: u64,
    /// Candidates whose row another session held locked past the lock
    /// timeout (PostgreSQL: a frozen host's statement); left for a later
    /// tick, so one frozen host cannot stall the reaper.
    pub locked: u64,
    /// Runs cancelled because their parent failed, was aborted or was
    /// cancelled (see [`Store::cancel_orphans`]).
    pub orphans_cancelled: usize,
    /// Runs waiting for budget that had room, woken (see
    /// [`Store::wake_budget_waiters`]).
    pub budget_woken: usize,
}

/// Where the reaper's sweeps go on from, each pass.
#[derive(Debug, Default)]
pub(crate) struct Sweeps {
    /// Budget waiters after this run id ([`Store::wake_budget_waiters`]).
    pub budget_after: std::sync::atomic::AtomicI64,
    /// Orphans of parents ended since this time (epoch ms; 0: never swept)
    /// ([`Store::cancel_orphans`]).
    pub orphans_since: std::sync::atomic::AtomicI64,
    /// When the orphan sweep last read every open child (epoch ms).
    pub orphans_all_at: std::sync::atomic::AtomicI64,
}

/// Why a run is given up, in an operator's words: how many segments in a
/// row failed against `max_attempts`, and what the last one was doing.
fn abort_error(attempt: i64, max_attempts: i64, last: Option<(&str, i64)>, in_flight: Option<(i64, &str)>) -> String {
    let segments = if attempt == 1 { "segment" } else { "segments" };
    let mut error = format!(
        "aborted after {attempt} {segments} in a row ended without finishing (max_attempts is {max_attempts})"
    );
    if let Some((owner, fence)) = last {
        error.push_str(&format!(
            ": the last one, on {owner} with fence {fence}, stopped renewing its lease \
             (its host died, froze or lost its database)"
        ));
    }
    if let Some((seq, name)) = in_flight {
        error.push_str(&format!("; call {seq} ({name}) was in flight and may or may not have happened"));
    }
    error
}

impl Store {
    /// Up to `batch` reaper candidates, as (id, fence, status): `running`
    /// runs whose lease expired, and claimable-looking open runs whose
    /// attempts are used up (a segment that never gets past its replay and
    /// suspends without progress would otherwise wait forever).
    pub async fn reap_candidates(&self, batch: i64) -> Result<Vec<(i64, i64, RunStatus)>, StoreError> {
        // Two index paths (runs_lease, runs_claim) rather than one OR, so a
        // tick never scans finished runs. The second half repeats runs_claim's
        // predicate and order so both planners use it.
        let rows = sqlx::query(sql!(
            self,
            concat!(
                "SELECT id, fence, status FROM (SELECT id, fence, status FROM runs ",
                "WHERE status = 'running' AND lease_expires_at < {now} ORDER BY lease_expires_at LIMIT $1) AS expired ",
                "UNION ALL ",
                "SELECT id, fence, status FROM (SELECT id, fence, status FROM runs WHERE ",
                crate::claimable!(),
                " AND status <> 'running' AND attempt >= max_attempts ORDER BY concurrency_key, priority DESC, ",
                crate::eligible_at!(),
                ", id LIMIT $1) AS exhausted"
            )
        ))
        .bind(batch)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| Ok((row.try_get("id")?, row.try_get("fence")?, row.try_get::<String, _>("status")?.parse()?)))
            .collect()
    }

    /// Reaps one run as observed at (`fence`, `status`): the second half of a
    /// tick, public so tests can interleave other writes between observing and
    /// reaping. Does nothing (counts `raced`) if the run changed meanwhile.
    #[doc(hidden)]
    pub async fn reap_run(
        &self,
        id: i64,
        fence: i64,
        status: RunStatus,
        report: &mut ReapReport,
    ) -> Result<(), StoreError> {
        let store = self;
        let outcome = store
            .retry(|| async move {
                let mut tx = store.maint().begin().await?;
                // Re-check the candidate under the write lock, at the fence we
                // observed. A no-op write, so that it locks (PostgreSQL: the row;
                // SQLite: the database) before anything else is read.
                let row = sqlx::query(sql!(
                    store,
                    "UPDATE runs SET fence = fence WHERE id = $1 AND fence = $2 AND status = $3 \
                     AND ((status = 'running' AND lease_expires_at < {now}) \
                          OR (status <> 'running' AND attempt >= max_attempts)) \
                     RETURNING attempt, max_attempts, runs.partial || {unfolded} AS partial, thread_id, lease_owner, paused_at"
                ))
                .bind(id)
                .bind(fence)
                .bind(status.as_str())
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else {
                    return Ok(None);
                };
                let attempt: i64 = row.try_get("attempt")?;
                let max_attempts: i64 = row.try_get("max_attempts")?;
                let partial: String = row.try_get("partial")?;
                let thread_id: String = row.try_get("thread_id")?;
                let owner: Option<String> = row.try_get("lease_owner")?;
                let paused: Option<i64> = row.try_get("paused_at")?;
                let aborted = attempt >= max_attempts;
                // What the dead segment left in flight, for the abort's message.
                let in_flight: Option<(i64, String)> = if aborted && status == RunStatus::Running {
                    sqlx::query_as(sql!(
                        store,
                        "SELECT seq, name FROM effects WHERE run_id = $1 AND state = 'started' ORDER BY seq DESC LIMIT 1"
                    ))
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await?
                } else {
                    None
                };

                // Reconcile first: whatever the dead segment started is now in doubt.
                let in_doubt = sqlx::query(sql!(
                    store,
                    "UPDATE effects SET state = 'in_doubt', updated_at = {now} \
                     WHERE run_id = $1 AND state = 'started' AND fence_started <= $2"
                ))
                .bind(id)
                .bind(fence)
                .execute(&mut *tx)
                .await?
                .rows_affected();

                if aborted {
                    let last = owner.as_deref().filter(|_| status == RunStatus::Running).map(|o| (o, fence));
                    let error = abort_error(attempt, max_attempts, last, in_flight.as_ref().map(|(s, n)| (*s, n.as_str())));
                    // An empty partial salvages nothing: no output.
                    let output = (!partial.is_empty()).then_some(partial.as_str());
                    sqlx::query(sql!(
                        store,
                        "UPDATE runs SET status = 'aborted', output = $4, error = $3, \
                         partial = $5, partial_pos = emit_pos, \
                         lease_owner = NULL, lease_expires_at = NULL, finished_at = {now}, updated_at = {now} \
                         WHERE id = $1 AND fence = $2"
                    ))
                    .bind(id)
                    .bind(fence)
                    .bind(&error)
                    .bind(output)
                    .bind(&partial)
                    .execute(&mut *tx)
                    .await?;
                    let payload = json!({ "status": RunStatus::Aborted, "output": output, "error": error });
                    log::append(store, &mut tx, &thread_id, id, fence, kind::MESSAGE, &payload).await?;
                } else if status == RunStatus::Running && paused.is_some() {
                    // A paused run whose host died is parked, not left for
                    // a claim: its pause holds its `not_before` at the end
                    // of time, and its resume makes it due.
                    sqlx::query(sql!(
                        store,
                        "UPDATE runs SET status = 'waiting_takeover', lease_owner = NULL, lease_expires_at = NULL, \
                         updated_at = {now} WHERE id = $1 AND fence = $2"
                    ))
                    .bind(id)
                    .bind(fence)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(Some((aborted, in_doubt, thread_id)))
            })
            .await?;
        match outcome {
            None => report.raced += 1,
            Some((aborted, in_doubt, thread)) => {
                if aborted {
                    store.hub().wake(&thread);
                }
                report.in_doubt += in_doubt;
                if aborted {
                    report.aborted.push(id);
                } else {
                    report.resumable.push(id);
                }
            }
        }
        Ok(())
    }
}
