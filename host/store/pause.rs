//! Paused runs (docs/operations.md, "Pausing a run"). A paused run is not
//! claimed. It is held by its `not_before`, kept at the end of time: a
//! trigger on `runs` (migrations 0023 / 0020) moves any other value a
//! writer gives it (a sleep's end, a delivered input, its children's end,
//! a raised budget, a suspend) to `paused_not_before`, and resume puts
//! that back. So no waker needs to know about pauses, and none is lost
//! while a run is paused.
//!
//! A running run is marked only: its segment learns of the pause at once
//! when it runs on the host that paused it (`Hub::paused`), else from its
//! next lease renewal, and stops at its next slice point (between host
//! calls, never in one), suspending as any slice does, which the trigger
//! then holds. A segment that starts on a paused run (a lease taken over
//! after a death, a run claimed for a local queue) gives it back at once.

use serde_json::json;

use crate::store::log::{self, kind};
use crate::store::renewals::{self, Renewal};
use crate::store::{FOREVER, Lease, Run, RunStatus, Store, StoreError, sql};

impl Store {
    /// Pauses run `run_id`; pausing a paused run changes nothing. Refused
    /// for a finished run.
    pub async fn pause_run(&self, run_id: i64) -> Result<Run, StoreError> {
        let run = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let row = sqlx::query(sql!(
                    self,
                    "UPDATE runs SET paused_at = {now}, updated_at = {now}, paused_not_before = not_before, not_before = $2 \
                     WHERE id = $1 AND paused_at IS NULL AND status NOT IN ('completed','failed','aborted','cancelled') \
                     RETURNING {runs}"
                ))
                .bind(run_id)
                .bind(FOREVER)
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else {
                    drop(tx);
                    let run = self.get_run(run_id).await?;
                    if run.status.is_terminal() {
                        return Err(StoreError::Conflict { run_id, status: run.status, message: "it has finished; there is nothing to pause" });
                    }
                    return Ok(run);
                };
                let run = Run::from_row(&row)?;
                log::append(self, &mut tx, &run.thread_id, run_id, run.fence, kind::PAUSED, &json!({ "status": run.status })).await?;
                tx.commit().await?;
                Ok(run)
            })
            .await?;
        self.hub().paused(run_id, run.paused_at.is_some());
        if run.status == RunStatus::Running && run.paused_at.is_some() {
            // Perhaps in this host's local queue, its guest not started.
            self.hub().paused_leased(run_id);
        }
        self.hub().wake(&run.thread_id);
        Ok(run)
    }

    /// Resumes run `run_id`: it is due again when it would have been had it
    /// not been paused. Resuming a run that is not paused changes nothing.
    pub async fn resume_run(&self, run_id: i64) -> Result<Run, StoreError> {
        let (run, resumed) = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let row = sqlx::query(sql!(
                    self,
                    "UPDATE runs SET paused_at = NULL, not_before = COALESCE(paused_not_before, not_before), \
                     paused_not_before = NULL, updated_at = {now} WHERE id = $1 AND paused_at IS NOT NULL RETURNING {runs}"
                ))
                .bind(run_id)
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else {
                    drop(tx);
                    return Ok((self.get_run(run_id).await?, false));
                };
                let run = Run::from_row(&row)?;
                log::append(self, &mut tx, &run.thread_id, run_id, run.fence, kind::RESUMED, &json!({ "status": run.status })).await?;
                tx.commit().await?;
                Ok((run, true))
            })
            .await?;
        if resumed {
            self.hub().paused(run_id, false);
            self.hub().forget_paused(run_id);
            self.hub().wake(&run.thread_id);
            if run.status != RunStatus::Running {
                self.signal_work(true).await;
            }
        }
        Ok(run)
    }

    /// Statement 2 as the renewer sends it: [`Store::renew`] (or
    /// [`Store::renew_charging`]) that also says whether the run is paused.
    pub async fn renew_seeing_pause(&self, lease: &Lease, ttl: std::time::Duration, charge: bool) -> Result<(i64, bool), StoreError> {
        renewals::renew(self, Renewal { lease: lease.clone(), ttl, charge }).await
    }
}
