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
//! guest has returned it starts a queued run, and the close (with the next
//! claim it carries, which refills the queue) is written behind it. So the
//! closes waiting to be written are not bounded by the slots, and a batch
//! of closes fills with every turn that ended while the last was written,
//! as a job queue's batched completions do. At most [`closes_behind_max`]
//! closes are behind their slots at once.
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
    /// Most runs claimed ahead of free workers and held in a local queue,
    /// so a worker that frees finds a run already leased and leaves its
    /// close to be written behind it (see [`Local`]); the queue holds
    /// about a second of the workers' pace, up to this. Default: 0, off
    /// (with it on, the fault-injection suite's long mode saw dead hosts'
    /// runs taken over late; see docs/operations.md).
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
///
/// The queue holds about [`QUEUE_HORIZON`] of this host's work, and never
/// more than `prefetch` runs: a host with long turns queues a few, one
/// with short turns many ([`Local::target`]).
///
/// It also bounds the closes written behind their slots: each holds one of
/// `closing`'s permits, and a close that will claim a run for the queue is
/// counted in `wanting` until it is written, so the queue and the claims on
/// their way to it stay within the target.
struct Local {
    queue: std::sync::Mutex<std::collections::VecDeque<(Claimed, Instant)>>,
    /// Longest a queued run may wait: a third of the lease.
    max_wait: Duration,
    /// The queue's length, with `wanting`, at most.
    prefetch: usize,
    /// Segments ended, which the pace counts.
    ended: std::sync::atomic::AtomicU64,
    pace: std::sync::Mutex<Pace>,
    /// Closes behind their slots that claim a run for the queue.
    wanting: std::sync::atomic::AtomicUsize,
    /// Permits for closes behind their slots ([`closes_behind_max`]).
    closing: Arc<Semaphore>,
    closing_max: u32,
    /// Woken when a run joins the queue from a close behind its slot.
    pushed: tokio::sync::Notify,
    /// Woken when the queue has room for a claim of its own: half of it is
    /// free, counting the claims on their way.
    room_grew: tokio::sync::Notify,
    /// Closes behind their slots now.
    behind: std::sync::atomic::AtomicUsize,
}

impl Local {
    fn new(lease_ttl: Duration, prefetch: usize, closes_behind: usize) -> Local {
        let closing_max = if prefetch == 0 { 0 } else { closes_behind.min(Semaphore::MAX_PERMITS) as u32 };
        Local {
            queue: Default::default(),
            max_wait: lease_ttl / 3,
            prefetch,
            ended: Default::default(),
            // Until a pace is measured, the whole of `prefetch`.
            pace: std::sync::Mutex::new(Pace {
                since: Instant::now(),
                ended: 0,
                per_sec: (prefetch as f64) / QUEUE_HORIZON.as_secs_f64(),
                target: prefetch,
            }),
            wanting: Default::default(),
            closing: Arc::new(Semaphore::new(closing_max as usize)),
            closing_max,
            pushed: tokio::sync::Notify::new(),
            room_grew: tokio::sync::Notify::new(),
            behind: Default::default(),
        }
    }

    fn len(&self) -> usize {
        self.queue.lock().expect("local queue lock").len()
    }

    /// How many runs the queue should hold, with the claims on their way:
    /// what the workers get through in [`QUEUE_HORIZON`] at their pace (a
    /// moving average over windows of at least [`PACE_WINDOW`]), at most
    /// `prefetch`. A target that grows wakes the dispatcher to fill it.
    fn target(&self) -> usize {
        if self.prefetch == 0 {
            return 0;
        }
        let mut pace = self.pace.lock().expect("pace lock");
        let elapsed = pace.since.elapsed();
        if elapsed >= PACE_WINDOW {
            let ended = self.ended.load(Ordering::Relaxed);
            let per_sec = (ended - pace.ended) as f64 / elapsed.as_secs_f64();
            // Half the last window, half the ones before: a window that a
            // long turn's end missed does not empty the queue.
            pace.per_sec = (pace.per_sec + per_sec) / 2.0;
            let target = ((pace.per_sec * QUEUE_HORIZON.as_secs_f64()).round() as usize).min(self.prefetch);
            if target > pace.target {
                self.room_grew.notify_one();
            }
            (pace.since, pace.ended, pace.target) = (Instant::now(), ended, target);
        }
        pace.target
    }

    /// Room in the queue, less the claims on their way to it, and the
    /// target it is room under (one reading of the pace for both).
    fn room(&self) -> (usize, usize) {
        let target = self.target();
        (target.saturating_sub(self.len() + self.wanting.load(Ordering::Relaxed)), target)
    }

    /// Counts a segment that ended, for the pace.
    fn ended(&self) {
        self.ended.fetch_add(1, Ordering::Relaxed);
    }

    /// A close that is to claim a run for the queue, if it has room.
    fn reserve(&self) -> bool {
        let room = self.room().0 > 0;
        if room {
            self.wanting.fetch_add(1, Ordering::Relaxed);
        }
        room
    }

    fn unreserve(&self, reserved: bool) {
        if reserved {
            self.wanting.fetch_sub(1, Ordering::Relaxed);
            self.freed();
        }
    }

    /// Tells the dispatcher when the queue is half free, so it tops it up
    /// with one claim statement though no slot is free.
    fn freed(&self) {
        let (room, target) = self.room();
        if room > 0 && room * 2 >= target {
            self.room_grew.notify_one();
        }
    }

    /// Waits for every close behind its slot to be written.
    async fn closes_written(&self) {
        let _all = self.closing.acquire_many(self.closing_max).await;
    }

    fn push(&self, claimed: Claimed) {
        self.queue.lock().expect("local queue lock").push_back((claimed, Instant::now()));
        crate::metrics::global().prefetched.fetch_add(1, Ordering::Relaxed);
    }

    fn pop(&self) -> Option<(Claimed, Instant)> {
        let popped = self.queue.lock().expect("local queue lock").pop_front();
        if popped.is_some() {
            crate::metrics::global().prefetched.fetch_sub(1, Ordering::Relaxed);
            self.freed();
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

/// About how much work the local queue holds: a second of what the
/// workers get through. Long turns then queue a few runs (another host
/// may be idle), short ones enough that a worker never waits for a claim.
const QUEUE_HORIZON: Duration = Duration::from_secs(1);

/// The shortest time over which the workers' pace is measured: 250 ms.
const PACE_WINDOW: Duration = Duration::from_millis(250);

/// The workers' pace: segments ended by `since`, their moving rate, and
/// the queue's target.
struct Pace {
    since: Instant,
    ended: u64,
    per_sec: f64,
    target: usize,
}

/// Most closes behind their slots at once: a full batch for each of the
/// backend's batch writers and one more waiting (PostgreSQL 3 × 64,
/// SQLite 2 × 32), however few the workers, so that batches fill.
fn closes_behind_max(backend: Backend) -> usize {
    crate::store::closes_max_batch(backend) * (crate::store::close_writers(backend) + 1)
}

/// Claims runs for free slots (and, with `prefetch`, for the local queue)
/// and runs each in its own task until told to stop; then gives back the
/// queued runs and waits for the running segments.
async fn dispatch(store: Store, exec: Arc<Executor>, config: PoolConfig, local: Arc<Local>, mut stopping: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(config.workers.max(1)));
    let mut running: JoinSet<()> = JoinSet::new();
    let mut backoff = Duration::from_millis(100);
    let batch = config.claim_batch.max(1);
    while !*stopping.borrow() {
        while running.try_join_next().is_some() {}
        let (room, target) = local.room();
        // A free slot; with room in the local queue, claim without one. A
        // queue less than half empty is left to the closes behind their
        // slots, which refill it a run each: topping it up here would be a
        // claim statement for a run or two.
        let first = if room > 0 && room * 2 >= target {
            slots.clone().try_acquire_owned().ok()
        } else {
            tokio::select! {
                permit = slots.clone().acquire_owned() => Some(permit.expect("the slot semaphore is never closed")),
                _ = local.room_grew.notified(), if config.prefetch > 0 => continue,
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
                    // it is not lost. Runs this claim queued may have found
                    // every slot busy and the slots gone idle since, having
                    // looked at the queue before they came: a slot that
                    // frees takes them.
                    let queued = local.len() > 0;
                    tokio::select! {
                        _ = store.work_signal().notified() => {}
                        _ = local.pushed.notified() => {}
                        _ = slots.clone().acquire_owned(), if queued => {}
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
            let closing = if go_on { local.closing.clone().try_acquire_owned().ok() } else { None };
            next = match closing {
                Some(permit) => behind(&exec, &store, &local, claimed, permit, &stopping).await,
                None => {
                    let run_id = claimed.run.id;
                    // With runs queued here, the close claims nothing more.
                    let take_next = go_on && local.len() == 0;
                    settled(&local, run_id, Ok(exec.run_claimed_then(claimed, take_next).await))
                }
            };
            if next.is_none() && !*stopping.borrow() {
                next = local.take(&store).await;
            }
        }
        drop(slot);
    });
}

/// One segment whose close may be written behind its slot: runs it in a
/// task of its own and, once its guest has returned, returns a queued run
/// for the slot if there is one, leaving the segment to finish (its close,
/// and the run that claims for the queue) under `permit`. With nothing
/// queued, waits for the segment and returns the run its close claimed.
async fn behind(
    exec: &Arc<Executor>,
    store: &Store,
    local: &Arc<Local>,
    claimed: Claimed,
    permit: OwnedSemaphorePermit,
    stopping: &watch::Receiver<bool>,
) -> Option<Claimed> {
    let run_id = claimed.run.id;
    // Claims for the queue if it has room; with nothing queued, this run's
    // own next run is the one its slot takes.
    let reserved = local.reserve();
    let take_next = reserved || local.len() == 0;
    let (done, guest_returned) = tokio::sync::oneshot::channel();
    let exec = exec.clone();
    let mut segment = tokio::spawn(async move { exec.run_claimed_signalling(claimed, take_next, Some(done)).await });
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
        // The run this close claims, if any, is this slot's, not the queue's.
        local.unreserve(reserved);
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
        let got = settled(&local, run_id, segment.await);
        gauge.fetch_sub(1, Ordering::Relaxed);
        local.behind.fetch_sub(1, Ordering::Relaxed);
        local.unreserve(reserved);
        if let Some(claimed) = got {
            local.push(claimed);
            local.pushed.notify_one();
        }
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
