//! The renewer: keeps a segment's lease from its claim until its last
//! write returns, and tells the segment at once when the database refuses
//! a renewal.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crate::clock::Monotonic;
use crate::store::{Lease, Store, StoreError};

/// How long a segment past its local lease deadline waits for one last
/// renewal before it stops its guest. 2 s.
pub(super) const LAST_CHANCE: Duration = Duration::from_secs(2);

/// Aborts the task when dropped (a `JoinHandle` dropped detaches it).
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the renewer shares with the running segment: one allocation a
/// segment (it was seven, one per field).
#[derive(Clone)]
pub(super) struct LeaseWatch(Arc<Watched>);

pub(super) struct Watched {
    /// Set when a renewal is refused; read by the epoch callback.
    pub(super) lost: AtomicBool,
    /// Wakes the segment's select at once when the lease is lost.
    pub(super) lost_now: tokio::sync::Notify,
    /// The lease deadline, in ms after `start`; moved on by each renewal.
    pub(super) deadline_ms: AtomicI64,
    pub(super) clock: Monotonic,
    pub(super) start: Instant,
    /// No renewal after this many ms after `start`; the segment moves it
    /// as it goes (see [`Cover`]).
    pub(super) until_ms: AtomicI64,
    /// Set once the segment's last write is on its way: a renewal it beats
    /// is refused, which is no news.
    pub(super) closing: AtomicBool,
    /// Set when a renewal finds the run paused (`store::pause`); read by
    /// the epoch callback, which stops the guest at its next slice point.
    /// Its own `Arc`: this host's pause hub holds it too.
    pub(super) paused: Arc<AtomicBool>,
}

impl std::ops::Deref for LeaseWatch {
    type Target = Watched;
    fn deref(&self) -> &Watched {
        &self.0
    }
}

impl LeaseWatch {
    /// Whether the lease is still live by this worker's clock: not lost,
    /// and its deadline not passed (a host frozen past it sees it passed
    /// as it wakes).
    pub(super) fn live(&self) -> crate::runtime::host::LeaseLive {
        let watch = self.clone();
        Arc::new(move || !watch.lost.load(Ordering::Relaxed) && (watch.clock.since(watch.start).as_millis() as i64) < watch.deadline_ms.load(Ordering::Relaxed))
    }


    /// Renewals stop `more` from now (on this watch's clock);
    /// `Duration::MAX`: not before the segment ends.
    pub(super) fn renew_for(&self, more: Duration) {
        let until = self.clock.since(self.start).saturating_add(more);
        self.until_ms.store(i64::try_from(until.as_millis()).unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    /// The lease was refused: the guest stops at its next epoch tick, and
    /// the segment's select wakes at once (`notify_one` keeps a permit if
    /// it is not waiting yet).
    fn lose(&self) {
        self.lost.store(true, Ordering::Relaxed);
        self.lost_now.notify_one();
    }
}

/// How long renewals cover a segment before its guest starts: resolving
/// and compiling its plugin (a cold Python or JS component takes seconds),
/// the upgrade check, reconciling its ledger. 60 s.
pub(super) const PREPARE_COVER: Duration = Duration::from_secs(60);

/// A segment's lease cover: renews its lease from the claim (its first
/// renewal comes when the lease has as long left as right after a
/// renewal, however long the run waited in the local queue) until dropped
/// after the segment's last write. Renewals stop at the watch's
/// `until_ms`, which the segment sets for each phase: [`PREPARE_COVER`]
/// before the guest, its budget and grace while it runs, and no bound
/// while its close is written (the store bounds each of its waits).
/// Without it a close written behind its slot, or stuck behind another
/// session's lock, outlived its lease and another host took the finished
/// run.
pub(super) struct Cover {
    pub(super) watch: LeaseWatch,
    _renewer: AbortOnDrop,
}

impl Cover {
    /// Starts renewing `lease`, which has `lease_left` of its `ttl` left.
    pub(super) fn start(store: &Store, lease: &Lease, ttl: Duration, every: Duration, lease_left: Duration, clock: Monotonic) -> Cover {
        let start = clock.now();
        let watch = LeaseWatch(Arc::new(Watched {
            lost: AtomicBool::default(),
            lost_now: tokio::sync::Notify::default(),
            deadline_ms: AtomicI64::new(lease_left.as_millis() as i64),
            clock,
            start,
            until_ms: AtomicI64::new(PREPARE_COVER.as_millis() as i64),
            closing: AtomicBool::default(),
            paused: Arc::default(),
        }));
        // As if renewed every `every` since the claim.
        let first = (lease_left + every).saturating_sub(ttl);
        // Aborted on drop too: a segment future dropped mid-call (its task
        // aborted) must not leave a task renewing a lease nobody uses.
        let renewer = AbortOnDrop(tokio::spawn(renew_loop(store.clone(), lease.clone(), ttl, every, first, watch.clone())));
        Cover { watch, _renewer: renewer }
    }
}

/// What one renewal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Renewal {
    /// Renewed: the local deadline moved on.
    Renewed,
    /// It failed (not refused): the next one tries again.
    Failed,
    /// Refused: the lease is someone else's; `lost` is set.
    Lost,
}

/// One renewal, the renewer's tick: asks the database for `ttl` more and
/// moves `deadline_ms` on, or sets `lost` if it refuses.
pub(super) async fn renew_once(store: &Store, lease: &Lease, ttl: Duration, watch: &LeaseWatch) -> Renewal {
    let asked_at = watch.clock.since(watch.start).as_millis() as i64;
    // Its own task: aborting the renewer (the segment ended) never drops
    // a renewal half-way, and a refused one is always counted.
    let (db, held) = (store.clone(), lease.clone());
    let renewed = match tokio::spawn(async move { db.renew_seeing_pause(&held, ttl, false).await }).await {
        Ok(r) => r,
        Err(e) => Err(StoreError::Config(format!("renewal task failed: {e}"))),
    };
    match renewed {
        Ok((_, paused)) => {
            // Only raised here: an answer read before a pause on this host
            // committed must not lower the flag that pause set (a run
            // resumed meanwhile is only suspended and claimed again).
            if paused {
                watch.paused.store(true, Ordering::Relaxed);
            }
            // The new expiry is ttl after the database's now, which is
            // no earlier than when we asked.
            watch.deadline_ms.store(asked_at + ttl.as_millis() as i64, Ordering::Relaxed);
            Renewal::Renewed
        }
        Err(StoreError::LeaseLost(_)) => {
            if watch.closing.load(Ordering::Relaxed) {
                tracing::debug!(run_id = lease.run_id, fence = lease.fence, "a renewal came after the segment's close");
            } else {
                tracing::warn!(run_id = lease.run_id, fence = lease.fence, "lease lost; stopping the guest");
            }
            watch.lose();
            Renewal::Lost
        }
        Err(e) => {
            // Keep trying until the lease runs out; the epoch callback
            // stops the guest at the deadline.
            tracing::warn!(run_id = lease.run_id, error = %e, "lease renewal failed; retrying");
            Renewal::Failed
        }
    }
}

/// How long a segment whose claim did not count its attempt runs its
/// guest before it counts it in a renewal of its own: 10 ms. A turn
/// that returns first counts it in its close instead (or, when it
/// suspends, in a renewal then), so a short turn costs its run no
/// row version more than its claim and its close. A host that dies
/// within it has not counted the attempt, as one that dies before a
/// renewal sent at once has landed.
pub(super) const CHARGE_AFTER: Duration = Duration::from_millis(10);

/// A segment's attempt, counted in a renewal [`CHARGE_AFTER`] into its
/// guest unless the guest returns first ([`Charge::settle`]). The guest's
/// slice timer fires it ([`Charge::fire`]): a turn shorter than that
/// costs no task and no timer of its own.
#[derive(Default)]
pub(super) struct Charge {
    /// The renewal, once fired.
    sent: Option<tokio::task::JoinHandle<Result<(i64, bool), StoreError>>>,
}

/// What became of a segment's [`Charge`] when its guest returned.
pub(super) enum Charged {
    /// Nothing counted it yet: the segment's last write must.
    Not,
    /// Its renewal was sent, with this result.
    Sent(Result<(i64, bool), StoreError>),
}

impl Charge {
    /// Sends the renewal that counts the attempt of `lease`'s segment
    /// (see [`charge`]), in a task of its own (it is never dropped
    /// half-way); once. Nothing is cloned before it fires.
    pub(super) fn fire(&mut self, store: &Store, lease: &Lease, ttl: Duration, watch: &LeaseWatch) {
        if self.sent.is_none() {
            let (store, lease, watch) = (store.clone(), lease.clone(), watch.clone());
            self.sent = Some(tokio::spawn(async move { charge(&store, &lease, ttl, &watch).await }));
        }
    }

    /// As the guest returns: [`Charged::Not`] if it was never fired, else
    /// the renewal's result.
    pub(super) async fn settle(self) -> Charged {
        match self.sent {
            None => Charged::Not,
            Some(task) => match task.await {
                Ok(result) => Charged::Sent(result),
                // A panic counted nothing.
                Err(_) => Charged::Not,
            },
        }
    }
}

/// Counts the attempt of a segment whose claim did not (a run claimed for
/// a local queue) in a renewal: on success the lease deadline moves on as
/// after any renewal; refused, the lease is lost and the guest stops.
async fn charge(store: &Store, lease: &Lease, ttl: Duration, watch: &LeaseWatch) -> Result<(i64, bool), StoreError> {
    let (db, held, watch) = (store.clone(), lease.clone(), watch.clone());
    let asked_at = watch.clock.since(watch.start).as_millis() as i64;
    {
        let charged = db.renew_seeing_pause(&held, ttl, true).await;
        match &charged {
            Ok((_, paused)) => {
                if *paused {
                    watch.paused.store(true, Ordering::Relaxed);
                }
                watch.deadline_ms.fetch_max(asked_at + ttl.as_millis() as i64, Ordering::Relaxed);
            }
            Err(StoreError::LeaseLost(_)) => {
                tracing::warn!(run_id = held.run_id, fence = held.fence, "lease lost as the segment started; stopping the guest");
                watch.lose();
            }
            Err(e) => tracing::warn!(run_id = held.run_id, error = %e, "counting the segment's attempt failed; its renewals go on"),
        }
        charged
    }
}

/// Renews `lease` after `first`, then every `every`, until aborted; never
/// past `until_ms` after the segment started: a lease is never renewed
/// without bound. A refused renewal sets `lost`; a lease that runs out
/// before a renewal lands is caught by the epoch callback and the
/// segment's timer through `deadline_ms`.
pub(super) async fn renew_loop(store: Store, lease: Lease, ttl: Duration, every: Duration, first: Duration, watch: LeaseWatch) {
    let mut wait = first;
    loop {
        tokio::time::sleep(wait).await;
        wait = every;
        // Past it, no renewal; a later phase may move it on.
        if watch.clock.since(watch.start).as_millis() as i64 >= watch.until_ms.load(Ordering::Relaxed) {
            continue;
        }
        if renew_once(&store, &lease, ttl, &watch).await == Renewal::Lost {
            return;
        }
    }
}
