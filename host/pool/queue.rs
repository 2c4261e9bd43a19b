//! The local queue: runs claimed ahead of free workers (`--prefetch`),
//! its pace, and the closes written behind their slots.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::store::{Backend, Claimed, Store};

/// The local queue: runs claimed ahead of free workers, highest priority
/// first, in claim order within a priority (and express claims among them
/// by [`Local::push_ahead`]'s rule), so a higher priority starts first,
/// queued or not.
///
/// A queued run's lease is running, and its segment measures its lease
/// from the claim, so the queue is kept short (`prefetch`) and a run that
/// has waited a third of its lease is given back unstarted rather than run
/// with its lease at risk, whether or not a worker is free by then (the
/// dispatcher times the oldest); so are the runs still queued at shutdown
/// ([`Store::give_back`]). A host that dies with runs queued
/// leaves them to expire and be reclaimed, as with any claim.
///
/// The queue holds about [`QUEUE_HORIZON`] of this host's work, and never
/// more than `prefetch` runs: a host with long turns queues a few, one
/// with short turns many ([`Local::target`]).
///
/// Its runs are claimed by the dispatcher, when half of it is free, without
/// counting an attempt: a run counts one when its segment starts, so a host
/// that dies with runs queued costs them nothing.
///
/// It also bounds the closes written behind their slots: each holds one of
/// `closing`'s permits.
pub(super) struct Local {
    queue: std::sync::Mutex<std::collections::VecDeque<(Claimed, Instant)>>,
    /// Longest a queued run may wait: a third of the lease.
    max_wait: Duration,
    /// The queue's length, at most.
    prefetch: usize,
    /// Segments ended, which the pace counts.
    ended: std::sync::atomic::AtomicU64,
    pace: std::sync::Mutex<Pace>,
    /// Permits for closes behind their slots ([`closes_behind_max`]).
    pub(super) closing: Arc<Semaphore>,
    closing_max: u32,
    /// Woken when the queue has room for a claim of its own: half of it is
    /// free.
    pub(super) room_grew: tokio::sync::Notify,
    /// Closes behind their slots now.
    pub(super) behind: std::sync::atomic::AtomicUsize,
    /// The last claim found less than it asked for, and the pool now waits
    /// for a wake-up, its poll or a free slot.
    pub(super) waiting_for_work: std::sync::atomic::AtomicBool,
}

impl Local {
    pub(super) fn new(lease_ttl: Duration, prefetch: usize, closes_behind: usize) -> Local {
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
            closing: Arc::new(Semaphore::new(closing_max as usize)),
            closing_max,
            waiting_for_work: Default::default(),
            room_grew: tokio::sync::Notify::new(),
            behind: Default::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
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

    /// Room in the queue, and the target it is room under (one reading of
    /// the pace for both).
    pub(super) fn room(&self) -> (usize, usize) {
        let target = self.target();
        (target.saturating_sub(self.len()), target)
    }

    /// Counts a segment that ended, for the pace; a target that grows
    /// wakes the dispatcher to fill the queue.
    pub(super) fn ended(&self) {
        self.ended.fetch_add(1, Ordering::Relaxed);
        self.target();
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
    pub(super) async fn closes_written(&self) {
        let _all = self.closing.acquire_many(self.closing_max).await;
    }

    /// Queues `claimed` after the queued runs of its priority or higher
    /// (scanned from the back: one comparison while every run has one
    /// priority).
    pub(super) fn push(&self, claimed: Claimed) {
        let mut queue = self.queue.lock().expect("local queue lock");
        let p = claimed.run.priority;
        let at = queue.iter().rposition(|(q, _)| q.run.priority >= p).map_or(0, |i| i + 1);
        queue.insert(at, (claimed, Instant::now()));
        crate::metrics::global().prefetched.fetch_add(1, Ordering::Relaxed);
    }

    /// The priority of the run the queue would start next, if any.
    pub(super) fn front_priority(&self) -> Option<i64> {
        self.queue.lock().expect("local queue lock").front().map(|(q, _)| q.run.priority)
    }

    /// Room under the queue's bound (`prefetch`), whatever its target.
    pub(super) fn hard_room(&self) -> usize {
        self.prefetch.saturating_sub(self.len())
    }

    /// Gives back the last queued runs (the lowest priority, the newest)
    /// beyond `prefetch`: an express claim at the bound takes one run, and
    /// the queue lets its last one go.
    pub(super) async fn trim(&self, store: &Store) {
        loop {
            let last = {
                let mut queue = self.queue.lock().expect("local queue lock");
                if queue.len() <= self.prefetch {
                    return;
                }
                queue.pop_back()
            };
            if let Some((claimed, _)) = last {
                crate::metrics::global().prefetched.fetch_sub(1, Ordering::Relaxed);
                give_back(store, &claimed).await;
            }
        }
    }

    /// Queues a run of an express claim (a submit of a keyed or
    /// prioritized run woke the dispatcher while the queue was full) where
    /// the claim's order puts it among the queued runs: after those of a
    /// higher priority; within its priority, keys (and runs without one,
    /// as one more) take turns, so a run whose key has `c` runs queued
    /// goes before the first queued run that has more than `c` of its own
    /// key's ahead of it. A key with nothing queued here goes in the first
    /// round; a key's own runs keep their order.
    pub(super) fn push_ahead(&self, claimed: Claimed) {
        let mut queue = self.queue.lock().expect("local queue lock");
        let (priority, key) = (claimed.run.priority, claimed.run.concurrency_key.clone());
        let own = queue.iter().filter(|(q, _)| q.run.priority == priority && q.run.concurrency_key == key).count();
        let mut rounds: std::collections::HashMap<Option<&str>, usize> = Default::default();
        let at = queue
            .iter()
            .position(|(q, _)| {
                if q.run.priority != priority {
                    return q.run.priority < priority;
                }
                let round = rounds.entry(q.run.concurrency_key.as_deref()).or_default();
                *round += 1;
                *round - 1 > own
            })
            .unwrap_or(queue.len());
        queue.insert(at, (claimed, Instant::now()));
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
    pub(super) async fn take(&self, store: &Store) -> Option<Claimed> {
        loop {
            let (mut claimed, at) = self.pop()?;
            let waited = at.elapsed();
            if waited > self.max_wait {
                give_back(store, &claimed).await;
                continue;
            }
            crate::metrics::global().local_queue_wait.observe(waited);
            // A segment's lease budget runs from its claim (`heartbeat_at`):
            // it has what it waited here less.
            if let Some(h) = claimed.run.heartbeat_at.as_mut() {
                *h += waited.as_millis() as i64;
            }
            return Some(claimed);
        }
    }

    /// How long until the oldest queued run has waited `max_wait`, if any
    /// is queued. (Not always the front: express claims queue ahead.)
    pub(super) fn stale_in(&self) -> Option<Duration> {
        let queue = self.queue.lock().expect("local queue lock");
        // A millisecond past it, so the wait ends with the run stale, not just short of it.
        queue.iter().map(|(_, at)| *at).min().map(|at| self.max_wait.saturating_sub(at.elapsed()) + Duration::from_millis(1))
    }

    /// Gives back the queued runs that have waited more than `max_wait`,
    /// though no worker is free to look at them: a host whose workers are
    /// all busy for longer than a lease would otherwise let them expire
    /// queued, unstarted and claimable by no one until then.
    pub(super) async fn give_back_stale(&self, store: &Store) {
        loop {
            let stale = {
                let mut queue = self.queue.lock().expect("local queue lock");
                match queue.iter().position(|(_, at)| at.elapsed() > self.max_wait) {
                    Some(i) => queue.remove(i),
                    None => None,
                }
            };
            let Some((claimed, _)) = stale else { return };
            crate::metrics::global().prefetched.fetch_sub(1, Ordering::Relaxed);
            give_back(store, &claimed).await;
            self.freed();
        }
    }

    /// Gives back every queued run (shutdown), all at once and for at
    /// most [`GIVE_BACK_BOUND`]: one after another, with the database down
    /// (each waiting out its connection timeout), a full queue held the
    /// shutdown for hours. A run not given back expires and is claimed
    /// again, as after a crash. Each give-back is one statement, so one
    /// dropped half-way leaves no transaction open.
    pub(super) async fn give_back_all(&self, store: &Store) {
        let mut queued = Vec::new();
        while let Some((claimed, _)) = self.pop() {
            queued.push(claimed);
        }
        if queued.is_empty() {
            return;
        }
        let all = futures::future::join_all(queued.iter().map(|c| give_back(store, c)));
        if tokio::time::timeout(GIVE_BACK_BOUND, all).await.is_err() {
            tracing::warn!(
                runs = queued.len(),
                bound = ?GIVE_BACK_BOUND,
                "giving back the queued runs took too long; those not given back are claimed again when their leases expire"
            );
        }
    }
}

pub(super) async fn give_back(store: &Store, claimed: &Claimed) {
    crate::metrics::global().prefetch_given_back.fetch_add(1, Ordering::Relaxed);
    match store.give_back(&claimed.lease, claimed.charged).await {
        Ok(()) => tracing::debug!(run_id = claimed.run.id, "prefetched run given back unstarted"),
        // Its lease expires and it is claimed again, as after a crash.
        Err(e) => tracing::warn!(run_id = claimed.run.id, error = %e, "could not give back a prefetched run"),
    }
}

/// Longest the queued runs are given back for at shutdown: 10 s.
const GIVE_BACK_BOUND: Duration = Duration::from_secs(10);

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
/// SQLite 2 × 128), however few the workers, so that batches fill.
pub(super) fn closes_behind_max(backend: Backend) -> usize {
    crate::store::closes_max_batch(backend) * (crate::store::close_writers(backend) + 1)
}
