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
//! With a local queue, a slot does not wait for its close either: once its
//! guest has returned it starts a queued run, and the close (which claims
//! nothing) is written behind it. So the closes waiting to be written are
//! not bounded by the slots, and a batch of closes fills with every turn
//! that ended while the last was written, as a job queue's batched
//! completions do. At most [`closes_behind_max`] closes are behind their
//! slots at once. The dispatcher refills the queue, one claim statement
//! when half of it is free; those runs count their attempts when their
//! segments start, not when they are claimed ([`Claimed::charged`]).
//!
//! Why one claimer rather than one per slot: under load, slots free up
//! while a claim is in flight, so the next claim takes them together, one
//! round trip for several runs; and an announcement wakes one claimer,
//! never a crowd that all run the claim statement for a single run.
//!
//! Shutdown: [`WorkerPool::shutdown`] stops claiming, lets running segments
//! finish for the grace period, then stops the rest, which suspend their
//! runs as `waiting_takeover` and so release their leases; closes behind
//! their slots are written, and queued runs are given back unstarted.
//! Segment futures
//! are awaited, never cancelled: a store future dropped half-way could leave
//! its pooled connection inside an open transaction.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

use crate::executor::Executor;
use crate::store::{Backend, Claimed, Store, WORK_CHANNEL};

mod claim_size;
mod express;
mod queue;

use queue::{Local, closes_behind_max};

/// Pool settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Concurrent segments. Default: 4.
    pub workers: usize,
    /// How often an idle pool looks for work without being woken (sleep
    /// timers, expired leases of dead hosts, missed notifications).
    /// Default: 1 s.
    pub poll: Duration,
    /// Runs the first claim statement takes; while claims come back full
    /// and unkeyed it doubles, up to 256 (`claim_size`). A claim never
    /// takes more than the free slots plus the room in the local queue.
    /// Default: 16.
    pub claim_batch: usize,
    /// Most runs claimed ahead of free workers and held in a local queue,
    /// so a worker that frees finds a run already leased and leaves its
    /// close to be written behind it (see [`Local`]); the queue holds
    /// about a second of the workers' pace, up to this. 0 turns it off.
    /// Default: [`PoolConfig::default_prefetch`], 64 for 4 workers.
    pub prefetch: usize,
}

impl PoolConfig {
    /// The default `prefetch` for `workers` on `backend`. PostgreSQL: four
    /// runs a worker, at least 64 (no-op turns at serve's 4 workers
    /// drained 3.4–3.7 times as fast with it, and as fast at 64; see
    /// docs/benchmarks.md). SQLite: 64 below 8 workers, else none: its one
    /// writer shares the cores with the turns, and each queued run's
    /// segment costs it a renewal (its attempt), which pays only while the
    /// workers alone leave batches nearly empty (4 workers: 1.4–1.5 times
    /// as fast with it; 8: 0.93–0.99; 16: 0.66–0.70). The pace keeps the queue short for
    /// long turns either way.
    pub fn default_prefetch(workers: usize, backend: Backend) -> usize {
        match backend {
            Backend::Postgres => (4 * workers).max(64),
            Backend::Sqlite if workers < 8 => 64,
            Backend::Sqlite => 0,
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { workers: 4, poll: Duration::from_secs(1), claim_batch: 16, prefetch: 64 }
    }
}

pub struct WorkerPool {
    executor: Arc<Executor>,
    stop_claiming: watch::Sender<bool>,
    tasks: JoinSet<()>,
    local: Arc<Local>,
}

impl WorkerPool {
    pub fn start(store: Store, executor: Arc<Executor>, config: PoolConfig) -> WorkerPool {
        let (stop_claiming, stopping) = watch::channel(false);
        let mut tasks = JoinSet::new();
        if store.backend() == Backend::Postgres {
            tasks.spawn(listen(store.clone(), stopping.clone()));
        }
        let local = Arc::new(Local::new(executor.config().lease_ttl, config.prefetch, closes_behind_max(store.backend())));
        tasks.spawn(dispatch(store, executor.clone(), config, local.clone(), stopping));
        WorkerPool { executor, stop_claiming, tasks, local }
    }

    /// Closes being written behind the workers that made them, now.
    pub fn closes_behind(&self) -> usize {
        self.local.behind.load(Ordering::Relaxed)
    }

    /// The pool's last claim found nothing more, and it now waits for a
    /// wake-up (a submit, a NOTIFY), its poll or a slot to free: idle, as
    /// far as claiming goes.
    pub fn waiting_for_work(&self) -> bool {
        self.local.waiting_for_work.load(Ordering::Relaxed)
    }

    /// How many runs the local queue aims to hold now, with the claims on
    /// their way: a second of the workers' measured pace, at most
    /// `prefetch` (0 without a queue). Reading it moves the pace on.
    pub fn queue_target(&self) -> usize {
        self.local.room().1
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
        // Its last segments' records, before the store is closed.
        self.executor.flush_segment_log().await;
    }
}

/// Claims runs for free slots (and, with `prefetch`, for the local queue)
/// and runs each in its own task until told to stop; then gives back the
/// queued runs and waits for the running segments.
async fn dispatch(store: Store, exec: Arc<Executor>, config: PoolConfig, local: Arc<Local>, mut stopping: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(config.workers.max(1)));
    let mut running: JoinSet<()> = JoinSet::new();
    let mut backoff = Duration::from_millis(100);
    let mut size = claim_size::ClaimSize::new(config.claim_batch);
    let mut express = express::Express::default();
    while !*stopping.borrow() {
        while running.try_join_next().is_some() {}
        // Queued runs that waited too long are given back whether or not a
        // worker has freed; each wait below ends when the oldest will have.
        local.give_back_stale(&store).await;
        let (room, target) = local.room();
        // A free slot; with half of the local queue free, claim without
        // one: topping it up sooner would be a claim statement for a run
        // or two.
        let first = if room > 0 && room * 2 >= target {
            slots.clone().try_acquire_owned().ok()
        } else {
            let stale = local.stale_in();
            tokio::select! {
                permit = slots.clone().acquire_owned() => Some(permit.expect("the slot semaphore is never closed")),
                _ = local.room_grew.notified(), if config.prefetch > 0 => continue,
                _ = tokio::time::sleep(stale.unwrap_or_default()), if stale.is_some() => continue,
                _ = express.due(&store, &local) => {
                    express.claim(&exec, &store, &local).await;
                    continue;
                }
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
        let batch = size.get();
        while permits.len() < batch {
            match slots.clone().try_acquire_owned() {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
        }
        let want = (permits.len() + room).min(batch);
        // The runs for free slots count their attempts now; those for the
        // queue when their segments start.
        match exec.claim_charging(want, permits.len()).await {
            Ok(claimed) => {
                backoff = Duration::from_millis(100);
                size.claimed(want, claimed.len(), claimed.iter().any(|c| c.run.concurrency_key.is_some()));
                let all = claimed.len() == want;
                let (now, queued): (Vec<Claimed>, Vec<Claimed>) = claimed.into_iter().partition(|c| c.charged);
                // Slots beyond the runs claimed are released here.
                // Permits first: `zip` takes from its first iterator before
                // it knows the second has ended, and a run taken so is lost.
                for (permit, c) in permits.into_iter().zip(now) {
                    spawn_segment(&mut running, &exec, &store, &local, c, permit, &stopping);
                }
                queued.into_iter().for_each(|c| local.push(c));
                if !all {
                    // Fewer runs than asked for: nothing else is claimable
                    // now, so wait for a signal rather than ask again at
                    // once. A signal sent while the claim ran is kept as a
                    // permit of the `Notify` (see `Store::signal_work`), so
                    // it is not lost. Runs this claim queued may have found
                    // every slot busy and the slots gone idle since, having
                    // looked at the queue before they came: a slot that
                    // frees takes them.
                    let queued = local.len() > 0;
                    let stale = local.stale_in();
                    local.waiting_for_work.store(true, Ordering::Relaxed);
                    tokio::select! {
                        _ = store.work_signal().notified() => {}
                        _ = slots.clone().acquire_owned(), if queued => {}
                        _ = tokio::time::sleep(config.poll) => {}
                        _ = tokio::time::sleep(stale.unwrap_or_default()), if stale.is_some() => {}
                        _ = stopping.changed() => {}
                    }
                    local.waiting_for_work.store(false, Ordering::Relaxed);
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
    local.closes_written().await;
    // A segment that ended after the stop may have found the queue empty
    // and a run the dispatcher queued after, and a close behind its slot
    // may have claimed one; nothing is queued now.
    local.give_back_all(&store).await;
}

/// Runs one segment of `claimed` in its own task, holding its slot. The
/// task then runs a queued run if there is one; if not, a segment that
/// finishes its turn claims the next run in its close (one round trip for
/// both) and the task runs that one, until a close finds nothing to claim
/// or the pool stops claiming. With a local queue, a segment whose guest
/// has returned while a run is queued leaves its close to be written
/// behind the slot ([`behind`]), and the slot starts the queued run.
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
            let go_on = !*stopping.borrow();
            let keyed = claimed.run.concurrency_key.is_some();
            // With runs queued, the slot may leave its close behind it and
            // start one; with none, the close claims the slot's next run.
            let queued = local.len() > 0;
            let closing = if go_on && queued { local.closing.clone().try_acquire_owned().ok() } else { None };
            next = match closing {
                Some(permit) => behind(&exec, &store, &local, claimed, permit, &stopping).await,
                None => {
                    let run_id = claimed.run.id;
                    let take_next = go_on && !queued;
                    settled(&local, run_id, Ok(exec.run_claimed_then(claimed, take_next).await))
                }
            };
            if keyed {
                // Its key's slot is free (or will be once its close is
                // written): a dispatcher that found the key full claims
                // again now rather than at its next poll.
                store.signal_work(false).await;
            }
            if *stopping.borrow() {
                // A close that ended after the stop may still have claimed
                // the next run: it is handed back unstarted, not run.
                if let Some(late) = next.take() {
                    queue::give_back(&store, &late).await;
                }
                break;
            }
            match next.take() {
                // The run its close claimed waits if a queued one outranks it.
                Some(mine) if local.front_priority() > Some(mine.run.priority) => {
                    local.push(mine);
                    next = local.take(&store).await;
                }
                Some(mine) => next = Some(mine),
                None => next = local.take(&store).await,
            }
        }
        drop(slot);
    });
}

/// One segment whose close may be written behind its slot: runs it in a
/// task of its own and, once its guest has returned, returns a queued run
/// for the slot if there is one, leaving the segment to finish (its close)
/// under `permit`. With nothing queued by then, waits for the segment. Its
/// close claims nothing: a run it claimed could not start at once, and
/// would count an attempt it had not used; the dispatcher fills the queue.
async fn behind(
    exec: &Arc<Executor>,
    store: &Store,
    local: &Arc<Local>,
    claimed: Claimed,
    permit: OwnedSemaphorePermit,
    stopping: &watch::Receiver<bool>,
) -> Option<Claimed> {
    let run_id = claimed.run.id;
    let (done, guest_returned) = tokio::sync::oneshot::channel();
    let exec = exec.clone();
    // Boxed: a segment's future is some 13 KB, which the task would
    // otherwise copy as it is spawned and again as it finishes; boxed, the
    // task moves a pointer (docs/benchmarks.md, "The host's own cost").
    let mut segment = tokio::spawn(Box::pin(async move { exec.run_claimed_signalling(claimed, false, Some(done)).await }));
    let ended = tokio::select! {
        biased;
        r = &mut segment => Some(r),
        // Sent, or dropped by a segment that ran no guest and is ending.
        _ = guest_returned => None,
    };
    let queued = match ended {
        Some(_) => None,
        None if *stopping.borrow() => None,
        None => local.take(store).await,
    };
    let Some(queued) = queued else {
        let result = match ended {
            Some(r) => r,
            None => segment.await,
        };
        drop(permit);
        return settled(local, run_id, result);
    };
    let local = local.clone();
    let gauge = &crate::metrics::global().closes_behind;
    gauge.fetch_add(1, Ordering::Relaxed);
    local.behind.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        settled(&local, run_id, segment.await);
        gauge.fetch_sub(1, Ordering::Relaxed);
        local.behind.fetch_sub(1, Ordering::Relaxed);
        drop(permit);
    });
    Some(queued)
}

/// A segment's end, logged and counted for the pace: the run its close
/// claimed, if any.
fn settled(
    local: &Local,
    run_id: i64,
    result: Result<Result<(crate::executor::SegmentOutcome, Option<Claimed>), crate::store::StoreError>, tokio::task::JoinError>,
) -> Option<Claimed> {
    local.ended();
    match result {
        Ok(Ok((outcome, then))) => {
            tracing::debug!(run_id, ?outcome, "segment done");
            then
        }
        Ok(Err(e)) => {
            tracing::warn!(run_id, error = %e, "segment abandoned: the database failed");
            None
        }
        Err(e) => {
            tracing::error!(run_id, error = %e, "segment task failed; the run is claimable again when its lease expires");
            None
        }
    }
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
