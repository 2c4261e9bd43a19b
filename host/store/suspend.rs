//! Statements 5 and 6, and input: a segment's deliberate suspension
//! (`wait-input`, `sleep`, a slice, a shutdown), the delivery of input to
//! a waiting run, and a cancel.

use serde_json::json;
use sqlx::Row;

use crate::store::guard::rejected;
use crate::store::log::{self, kind};
use crate::store::{Lease, Run, RunStatus, Store, StoreError, Suspend, sql};

impl Store {
    /// Statement 5: releases the lease without finishing the turn.
    ///
    /// `attempt` is reset to 0 in the same write: `max_attempts` bounds
    /// consecutive *failed* segments (a death, a lost lease), and a segment
    /// that suspends on purpose (`wait-input`, `sleep`, a slice that made
    /// progress, a shutdown hand-over) did not fail, whether or not it
    /// wrote a ledger row. (A slice that made no progress is not suspended:
    /// the executor fails the run as a timeout.)
    pub async fn suspend(&self, lease: &Lease, how: &Suspend) -> Result<RunStatus, StoreError> {
        self.suspend_after(lease, how, true).await
    }

    /// [`Store::suspend`] for a segment that `progressed` (settled a call
    /// or held a put) or not. One that did not neither fails nor clears
    /// the failures before it: only the attempt its own claim counted is
    /// given back, so a call that kills its host every time it goes out,
    /// between suspensions that replay up to it, still uses the run's
    /// attempts up (a saturated rate key's suspensions, say).
    pub async fn suspend_after(&self, lease: &Lease, how: &Suspend, progressed: bool) -> Result<RunStatus, StoreError> {
        let (status, delay, prompt, rate) = match how {
            Suspend::WaitInput { prompt } => (RunStatus::WaitingInput, 0, Some(prompt.as_str()), None),
            Suspend::Takeover => (RunStatus::WaitingTakeover, 0, None, None),
            Suspend::Sleep { delay_ms } => (RunStatus::Queued, (*delay_ms).max(0), None, None),
            Suspend::Rate { delay_ms, key } => (RunStatus::Queued, (*delay_ms).max(0), None, Some(key.as_str())),
            Suspend::Children(wait) => return self.suspend_for_children(lease, wait, progressed).await,
            Suspend::Named(wait) => return self.suspend_named(lease, wait, progressed).await,
            Suspend::Budget { tokens, usd_nanos } => return self.suspend_for_budget(lease, *tokens, *usd_nanos, progressed).await,
        };
        let status = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let row = sqlx::query(sql!(
                self,
                "UPDATE runs SET status = $4, lease_owner = NULL, lease_expires_at = NULL, \
                 not_before = {now} + $5, \
                 pending_input = CASE WHEN $4 = 'waiting_input' THEN NULL ELSE pending_input END, \
                 waiting_for = NULL, attempt = CASE WHEN $6 THEN 0 WHEN attempt > 0 THEN attempt - 1 ELSE 0 END, updated_at = {now} \
                 WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' AND lease_expires_at >= {clock} \
                 RETURNING thread_id, not_before"
            ))
            .bind(lease.run_id)
            .bind(&lease.owner)
            .bind(lease.fence)
            .bind(status.as_str())
            .bind(delay)
            .bind(progressed)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| rejected(lease))?;
            let thread_id: String = row.try_get("thread_id")?;
            let not_before: i64 = row.try_get("not_before")?;
            let mut payload = json!({ "status": status, "prompt": prompt, "not_before": not_before });
            if let Some(key) = rate {
                payload["rate"] = json!(key);
            }
            log::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::SUSPENDED, &payload)
                .await?;
            tx.commit().await?;
            Ok((status, thread_id))
        })
        .await?;
        let (status, thread) = status;
        self.hub().wake(&thread);
        if status == RunStatus::WaitingTakeover {
            // A host shutting down hands its runs over: other hosts take
            // them at once, not at their poll.
            self.signal_work(true).await;
        }
        Ok(status)
    }

    /// Gives back a run claimed but never started (a worker pool's local
    /// queue at shutdown): `waiting_takeover`, claimable by any host at
    /// once, and the attempt its claim counted (`charged`) returned, since
    /// nothing ran. No event: a reader of the thread saw nothing of this
    /// claim. Guarded by (owner, fence) like every lease-holder write.
    pub async fn give_back(&self, lease: &Lease, charged: bool) -> Result<(), StoreError> {
        self.faults().before_give_back().await;
        let rows = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    "UPDATE runs SET status = 'waiting_takeover', lease_owner = NULL, lease_expires_at = NULL, \
                     attempt = CASE WHEN attempt > 0 THEN attempt - $4 ELSE 0 END, updated_at = {now} \
                     WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' AND lease_expires_at >= {clock}"
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(i64::from(charged))
                .execute(self.writer())
                .await?
                .rows_affected())
            })
            .await?;
        if rows == 0 {
            return Err(rejected(lease));
        }
        // Other hosts too: an idle one takes it at once, not at its poll.
        self.signal_work(true).await;
        Ok(())
    }

    /// Gives back a paused run whose segment was about to start (its lease
    /// taken over after a death, or it was paused while it sat in a local
    /// queue), before its guest starts: the attempt its claim counted
    /// (`charged`) is returned, and a run never started before (`first`)
    /// is `queued` again with no `started_at`, as its pause found it; any
    /// other `waiting_takeover`. Its pause holds it until resumed. False,
    /// writing nothing, if the run is not paused (resumed since) and its
    /// lease holds: run it. No event: nothing of this segment happened.
    pub async fn give_back_paused(&self, lease: &Lease, charged: bool, first: bool) -> Result<bool, StoreError> {
        let rows = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    concat!(
                        "UPDATE runs SET status = CASE WHEN $5 THEN 'queued' ELSE 'waiting_takeover' END, \
                         started_at = CASE WHEN $5 THEN NULL ELSE started_at END, lease_owner = NULL, lease_expires_at = NULL, \
                         attempt = CASE WHEN attempt > 0 THEN attempt - $4 ELSE 0 END, updated_at = {now} WHERE ",
                        crate::store::guard::guarded!(),
                        " AND paused_at IS NOT NULL"
                    )
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(i64::from(charged))
                .bind(first)
                .execute(self.writer())
                .await?
                .rows_affected())
            })
            .await?;
        self.hub().forget_paused(lease.run_id);
        Ok(rows > 0)
    }

    /// Delivers input to a `waiting_input` run, making it claimable.
    ///
    /// Not a lease-holder write: a waiting run has no lease. It is guarded by
    /// state instead (`waiting_input`, no owner, no input yet), so a second
    /// delivery is a `Conflict`, never an overwrite.
    pub async fn deliver_input(&self, run_id: i64, input: &str) -> Result<Run, StoreError> {
        let run = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let run = deliver_unnamed_in(self, &mut tx, run_id, input).await?;
            tx.commit().await?;
            Ok(run)
        })
        .await?;
        self.input_delivered(run).await
    }

    /// After a delivery commits: wakes the run's readers and the workers.
    pub(crate) async fn input_delivered(&self, mut run: Run) -> Result<Run, StoreError> {
        self.hub().wake(&run.thread_id);
        self.signal_work(true).await;
        // Delivered: a failed read leaves the shown partial short.
        if let Err(e) = self.unfold(&mut run).await {
            tracing::warn!(run = run.id, error = %e, "reading a run's streamed output failed");
        }
        Ok(run)
    }

    /// Statement 6: cancels a run that is not terminal, and every run
    /// below it (its children, theirs…) that is not either, in one
    /// statement (see [`Store::cancel_subtree`]). Bumps each fence, so
    /// every later write of a segment still running fails its guard.
    pub async fn cancel(&self, run_id: i64) -> Result<Run, StoreError> {
        let runs = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let runs = self.cancel_subtree(&mut tx, run_id).await?;
            if runs.first().is_none_or(|r| r.id != run_id) {
                drop(tx);
                let run = self.get_run(run_id).await?;
                return Err(StoreError::Conflict {
                    run_id,
                    status: run.status,
                    message: "run is already finished",
                });
            }
            tx.commit().await?;
            Ok(runs)
        })
        .await?;
        for run in &runs {
            self.hub().wake(&run.thread_id);
        }
        if runs[0].parent_id.is_some() {
            // Its end may have woken its parent (store::children).
            self.signal_work(true).await;
        }
        Ok(runs.into_iter().next().expect("the cancelled run is first"))
    }
}

/// [`Store::deliver_input`]'s statements on `conn`.
pub(crate) async fn deliver_unnamed_in(store: &Store, conn: &mut sqlx::AnyConnection, run_id: i64, input: &str) -> Result<Run, StoreError> {
    let row = sqlx::query(sql!(
        store,
        "UPDATE runs SET pending_input = $2, updated_at = {now} \
         WHERE id = $1 AND status = 'waiting_input' AND pending_input IS NULL \
         AND lease_owner IS NULL RETURNING {runs}"
    ))
    .bind(run_id)
    .bind(input)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        let status: Option<String> = sqlx::query_scalar(sql!(store, "SELECT status FROM runs WHERE id = $1"))
            .bind(run_id)
            .fetch_optional(&mut *conn)
            .await?;
        let status: RunStatus = status.ok_or(StoreError::RunNotFound(run_id))?.parse()?;
        return Err(StoreError::Conflict {
            run_id,
            status,
            message: if status == RunStatus::WaitingInput { "input was already delivered" } else { "run is not waiting for input" },
        });
    };
    let run = Run::from_row(&row)?;
    log::append(store, conn, &run.thread_id, run.id, run.fence, kind::INPUT, &json!({ "input": input })).await?;
    Ok(run)
}
