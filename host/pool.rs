//! The worker pool: up to `workers` segments at once. One dispatcher task
//! claims runs for the free slots, several per claim statement when several
//! slots are free, and runs each claimed segment in its own task. A run is
//! claimed only when a slot is free for it, so no lease ticks while its run
//! waits. When nothing is claimable the dispatcher sleeps until work is
//! signalled (in process, and on PostgreSQL by `LISTEN`), with a slow poll
//! as the fallback that also picks up sleep timers and expired leases.
//!
//! Under load most runs are not claimed by the dispatcher at all: a segment
//! that finishes its turn claims the next run in its close statement and
//! runs it in the same slot (see [`Executor::run_claimed_then`]); the slot
//! returns to the dispatcher when a close finds nothing to claim.
//!
//! Why one claimer rather than one per slot: under load, slots free up
//! while a claim is in flight, so the next claim takes them together, one
//! round trip for several runs; and an announcement wakes one claimer,
//! never a crowd that all run the claim statement for a single run.
//!
//! Shutdown: [`WorkerPool::shutdown`] stops claiming, lets running segments
//! finish for the grace period, then stops the rest, which suspend their
//! runs as `waiting_takeover` and so release their leases. Segment futures
//! are awaited, never cancelled: a store future dropped half-way could leave
//! its pooled connection inside an open transaction.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

use crate::executor::Executor;
use crate::store::{Backend, Claimed, Store, WORK_CHANNEL};

/// Pool settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Concurrent segments. Default: 4.
    pub workers: usize,
    /// How often an idle pool looks for work without being woken (sleep
    /// timers, expired leases of dead hosts, missed notifications).
    /// Default: 1 s.
    pub poll: Duration,
    /// Most runs taken by one claim statement (never more than the free
    /// slots). Default: 16.
    pub claim_batch: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { workers: 4, poll: Duration::from_secs(1), claim_batch: 16 }
    }
}

pub struct WorkerPool {
    executor: Arc<Executor>,
    stop_claiming: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl WorkerPool {
    pub fn start(store: Store, executor: Arc<Executor>, config: PoolConfig) -> WorkerPool {
        let (stop_claiming, stopping) = watch::channel(false);
        let mut tasks = JoinSet::new();
        if store.backend() == Backend::Postgres {
            tasks.spawn(listen(store.clone(), stopping.clone()));
        }
        tasks.spawn(dispatch(store, executor.clone(), config, stopping));
        WorkerPool { executor, stop_claiming, tasks }
    }

    /// Stops claiming, waits up to `grace` for running segments, then stops
    /// the rest (they suspend as `waiting_takeover`) and waits for them.
    pub async fn shutdown(mut self, grace: Duration) {
        let _ = self.stop_claiming.send(true);
        let drained = tokio::time::timeout(grace, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(?grace, "grace period over; suspending the segments still running");
            self.executor.stop_guests();
            while self.tasks.join_next().await.is_some() {}
        }
    }
}

/// Claims runs for free slots and runs each in its own task until told to
/// stop; then waits for the running segments.
async fn dispatch(store: Store, exec: Arc<Executor>, config: PoolConfig, mut stopping: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(config.workers.max(1)));
    let mut running: JoinSet<()> = JoinSet::new();
    let mut backoff = Duration::from_millis(100);
    while !*stopping.borrow() {
        while running.try_join_next().is_some() {}
        let first = tokio::select! {
            permit = slots.clone().acquire_owned() => permit.expect("the slot semaphore is never closed"),
            _ = stopping.changed() => break,
        };
        let mut permits = vec![first];
        while permits.len() < config.claim_batch.max(1) {
            match slots.clone().try_acquire_owned() {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
        }
        match exec.claim(permits.len()).await {
            Ok(claimed) if claimed.len() == permits.len() => {
                backoff = Duration::from_millis(100);
                for (claimed, permit) in claimed.into_iter().zip(permits) {
                    spawn_segment(&mut running, &exec, claimed, permit, &stopping);
                }
            }
            Ok(claimed) => {
                backoff = Duration::from_millis(100);
                // Fewer runs than free slots: nothing else is claimable now,
                // so wait for a signal rather than ask again at once. Slots
                // beyond the runs claimed are released here.
                for (claimed, permit) in claimed.into_iter().zip(permits) {
                    spawn_segment(&mut running, &exec, claimed, permit, &stopping);
                }
                // A signal sent while the claim ran is kept as a permit of
                // the `Notify` (see `Store::signal_work`), so it is not lost.
                tokio::select! {
                    _ = store.work_signal().notified() => {}
                    _ = tokio::time::sleep(config.poll) => {}
                    _ = stopping.changed() => {}
                }
            }
            Err(e) => {
                drop(permits);
                // The database is unreachable or failing: keep the host up
                // and try again, backing off to 5 s.
                tracing::warn!(error = %e, ?backoff, "claiming failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    while running.join_next().await.is_some() {}
}

/// Runs one segment of `claimed` in its own task, holding its slot. A
/// segment that finishes its turn claims the next run in its close (one
/// round trip for both) and the task runs that one too, until a close finds
/// nothing to claim or the pool stops claiming.
fn spawn_segment(
    running: &mut JoinSet<()>,
    exec: &Arc<Executor>,
    claimed: Claimed,
    slot: OwnedSemaphorePermit,
    stopping: &watch::Receiver<bool>,
) {
    let exec = exec.clone();
    let stopping = stopping.clone();
    running.spawn(async move {
        let mut next = Some(claimed);
        while let Some(claimed) = next.take() {
            let run_id = claimed.run.id;
            let take_next = !*stopping.borrow();
            match exec.run_claimed_then(claimed, take_next).await {
                Ok((outcome, then)) => {
                    tracing::debug!(run_id, ?outcome, "segment done");
                    next = then;
                }
                Err(e) => tracing::warn!(run_id, error = %e, "segment abandoned: the database failed"),
            }
        }
        drop(slot);
    });
}

/// PostgreSQL: relays `NOTIFY leasehold_work` from other hosts to this
/// process's idle workers. Reconnects with backoff; workers poll meanwhile.
async fn listen(store: Store, mut stopping: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(200);
    while !*stopping.borrow() {
        let mut listener = match sqlx::postgres::PgListener::connect(store.url()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; polling meanwhile");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        if let Err(e) = listener.listen(WORK_CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; polling meanwhile");
            continue;
        }
        backoff = Duration::from_millis(200);
        loop {
            tokio::select! {
                msg = listener.recv() => match msg {
                    // This process's own announcements already woke a
                    // worker here.
                    Ok(n) if n.payload() == store.node() => {}
                    Ok(_) => store.work_signal().notify_one(),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                        break;
                    }
                },
                _ = stopping.changed() => return,
            }
        }
    }
}
