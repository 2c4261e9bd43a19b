//! The worker pool: up to `workers` segments at once. One dispatcher task
//! claims runs for the free slots, several per claim statement when several
//! slots are free, and runs each claimed segment in its own task. Without
//! `prefetch` a run is claimed only when a slot is free for it, so no lease
//! ticks while its run waits; with it, up to `prefetch` more runs wait
//! leased in a short local queue ([`Local`]), and a slot that frees takes
//! one without a round trip. When nothing is claimable the dispatcher sleeps until work is
//! signalled (in process, and on PostgreSQL by `LISTEN`), with a slow poll
//! as the fallback that also picks up sleep timers and expired leases.
//!
//! Under load most runs are not claimed by the dispatcher at all: a segment
//! that finishes its turn claims the next run in its close statement and
//! runs it in the same slot (see [`Executor::run_claimed_then`]), unless
//! runs are queued locally, which go first; the slot returns to the
//! dispatcher when a close finds nothing to claim.
//!
//! Why one claimer rather than one per slot: under load, slots free up
//! while a claim is in flight, so the next claim takes them together, one
//! round trip for several runs; and an announcement wakes one claimer,
//! never a crowd that all run the claim statement for a single run.
//!
//! Shutdown: [`WorkerPool::shutdown`] stops claiming, lets running segments
//! finish for the grace period, then stops the rest, which suspend their
//! runs as `waiting_takeover` and so release their leases; queued runs are
//! given back unstarted. Segment futures
//! are awaited, never cancelled: a store future dropped half-way could leave
//! its pooled connection inside an open transaction.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

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
    /// slots plus the room in the local queue). Default: 16.
    pub claim_batch: usize,
    /// Runs claimed ahead of free workers and held in a local queue, so a
    /// worker that frees finds a run already leased (see [`Local`]).
    /// Default: 0, none.
    pub prefetch: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { workers: 4, poll: Duration::from_secs(1), claim_batch: 16, prefetch: 0 }
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

/// The local queue: runs claimed ahead of free workers, oldest first.
///
/// A queued run's lease is running, and its segment measures its lease
/// from the claim, so the queue is kept short (`prefetch`) and a run that
/// waited more than a third of its lease is given back unstarted rather
/// than run with its lease at risk; so are the runs still queued at
/// shutdown ([`Store::give_back`]). A host that dies with runs queued
/// leaves them to expire and be reclaimed, as with any claim.
struct Local {
    queue: std::sync::Mutex<std::collections::VecDeque<(Claimed, Instant)>>,
    /// Longest a queued run may wait: a third of the lease.
    max_wait: Duration,
}

impl Local {
    fn new(lease_ttl: Duration) -> Local {
        Local { queue: Default::default(), max_wait: lease_ttl / 3 }
    }

    fn len(&self) -> usize {
        self.queue.lock().expect("local queue lock").len()
    }

    fn push(&self, claimed: Claimed) {
        self.queue.lock().expect("local queue lock").push_back((claimed, Instant::now()));
        crate::metrics::global().prefetched.fetch_add(1, Ordering::Relaxed);
    }

    fn pop(&self) -> Option<(Claimed, Instant)> {
        let popped = self.queue.lock().expect("local queue lock").pop_front();
        if popped.is_some() {
            crate::metrics::global().prefetched.fetch_sub(1, Ordering::Relaxed);
        }
        popped
    }

    /// The oldest queued run that may still start, its lease budget cut by
    /// its wait; older ones are given back.
    async fn take(&self, store: &Store) -> Option<Claimed> {
        loop {
            let (mut claimed, at) = self.pop()?;
            let waited = at.elapsed();
            if waited > self.max_wait {
                give_back(store, &claimed).await;
                continue;
            }
            // A segment's lease budget runs from its claim (`heartbeat_at`):
            // it has what it waited here less.
            if let Some(h) = claimed.run.heartbeat_at.as_mut() {
                *h += waited.as_millis() as i64;
            }
            return Some(claimed);
        }
    }

    /// Gives back every queued run (shutdown).
    async fn give_back_all(&self, store: &Store) {
        loop {
            let Some((claimed, _)) = self.pop() else { return };
            give_back(store, &claimed).await;
        }
    }
}

async fn give_back(store: &Store, claimed: &Claimed) {
    crate::metrics::global().prefetch_given_back.fetch_add(1, Ordering::Relaxed);
    match store.give_back(&claimed.lease).await {
        Ok(()) => tracing::debug!(run_id = claimed.run.id, "prefetched run given back unstarted"),
        // Its lease expires and it is claimed again, as after a crash.
        Err(e) => tracing::warn!(run_id = claimed.run.id, error = %e, "could not give back a prefetched run"),
    }
}

/// Claims runs for free slots (and, with `prefetch`, for the local queue)
/// and runs each in its own task until told to stop; then gives back the
/// queued runs and waits for the running segments.
async fn dispatch(store: Store, exec: Arc<Executor>, config: PoolConfig, mut stopping: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(config.workers.max(1)));
    let local = Arc::new(Local::new(exec.config().lease_ttl));
    let mut running: JoinSet<()> = JoinSet::new();
    let mut backoff = Duration::from_millis(100);
    let batch = config.claim_batch.max(1);
    while !*stopping.borrow() {
        while running.try_join_next().is_some() {}
        let room = config.prefetch.saturating_sub(local.len());
        // A free slot; with room in the local queue, claim without one.
        let first = if room > 0 {
            slots.clone().try_acquire_owned().ok()
        } else {
            tokio::select! {
                permit = slots.clone().acquire_owned() => Some(permit.expect("the slot semaphore is never closed")),
                _ = stopping.changed() => break,
            }
        };
        let mut permits: Vec<OwnedSemaphorePermit> = first.into_iter().collect();
        // A queued run goes first to a free slot.
        if let Some(permit) = permits.pop() {
            match local.take(&store).await {
                Some(claimed) => {
                    spawn_segment(&mut running, &exec, &store, &local, claimed, permit, &stopping);
                    continue;
                }
                None => permits.push(permit),
            }
        }
        while permits.len() < batch {
            match slots.clone().try_acquire_owned() {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
        }
        let want = (permits.len() + room).min(batch);
        match exec.claim(want).await {
            Ok(claimed) => {
                backoff = Duration::from_millis(100);
                let all = claimed.len() == want;
                let mut claimed = claimed.into_iter();
                // Slots first; the rest wait in the local queue. Slots
                // beyond the runs claimed are released here.
                // Permits first: `zip` takes from its first iterator before
                // it knows the second has ended, and a run taken so is lost.
                for (permit, c) in permits.into_iter().zip(claimed.by_ref()) {
                    spawn_segment(&mut running, &exec, &store, &local, c, permit, &stopping);
                }
                claimed.for_each(|c| local.push(c));
                if !all {
                    // Fewer runs than asked for: nothing else is claimable
                    // now, so wait for a signal rather than ask again at
                    // once. A signal sent while the claim ran is kept as a
                    // permit of the `Notify` (see `Store::signal_work`), so
                    // it is not lost.
                    tokio::select! {
                        _ = store.work_signal().notified() => {}
                        _ = tokio::time::sleep(config.poll) => {}
                        _ = stopping.changed() => {}
                    }
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
    local.give_back_all(&store).await;
    while running.join_next().await.is_some() {}
    // A segment that ended after the stop may have found the queue empty
    // and a run the dispatcher queued after; nothing is queued now.
    local.give_back_all(&store).await;
}

/// Runs one segment of `claimed` in its own task, holding its slot. The
/// task then runs a queued run if there is one; if not, a segment that
/// finishes its turn claims the next run in its close (one round trip for
/// both) and the task runs that one, until a close finds nothing to claim
/// or the pool stops claiming.
fn spawn_segment(
    running: &mut JoinSet<()>,
    exec: &Arc<Executor>,
    store: &Store,
    local: &Arc<Local>,
    claimed: Claimed,
    slot: OwnedSemaphorePermit,
    stopping: &watch::Receiver<bool>,
) {
    let (exec, store, local) = (exec.clone(), store.clone(), local.clone());
    let stopping = stopping.clone();
    running.spawn(async move {
        let mut next = Some(claimed);
        while let Some(claimed) = next.take() {
            let run_id = claimed.run.id;
            let go_on = !*stopping.borrow();
            // With runs queued here, the close claims nothing more.
            let take_next = go_on && local.len() == 0;
            match exec.run_claimed_then(claimed, take_next).await {
                Ok((outcome, then)) => {
                    tracing::debug!(run_id, ?outcome, "segment done");
                    next = then;
                }
                Err(e) => tracing::warn!(run_id, error = %e, "segment abandoned: the database failed"),
            }
            if next.is_none() && !*stopping.borrow() {
                next = local.take(&store).await;
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
