//! The renewer: keeps a segment's lease while its guest runs, and tells
//! the segment at once when the database refuses a renewal.

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

/// What the renewer shares with the running segment.
pub(super) struct LeaseWatch {
    /// Set when a renewal is refused; read by the epoch callback.
    pub(super) lost: Arc<AtomicBool>,
    /// Wakes the segment's select at once when the lease is lost.
    pub(super) lost_now: Arc<tokio::sync::Notify>,
    /// The lease deadline, in ms after `start`; moved on by each renewal.
    pub(super) deadline_ms: Arc<AtomicI64>,
    pub(super) clock: Monotonic,
    pub(super) start: Instant,
    /// No renewal after this long (the segment's budget plus its grace).
    pub(super) until: Duration,
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
    let renewed = match tokio::spawn(async move { db.renew(&held, ttl).await }).await {
        Ok(r) => r,
        Err(e) => Err(StoreError::Config(format!("renewal task failed: {e}"))),
    };
    match renewed {
        Ok(_) => {
            // The new expiry is ttl after the database's now, which is
            // no earlier than when we asked.
            watch.deadline_ms.store(asked_at + ttl.as_millis() as i64, Ordering::Relaxed);
            Renewal::Renewed
        }
        Err(StoreError::LeaseLost(_)) => {
            tracing::warn!(run_id = lease.run_id, fence = lease.fence, "lease lost; stopping the guest");
            watch.lost.store(true, Ordering::Relaxed);
            // notify_one keeps a permit if the select is not waiting yet.
            watch.lost_now.notify_one();
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

/// Renews `lease` every `every` until aborted, or until `until` after the
/// segment started: a lease is never renewed without bound. A refused
/// renewal sets `lost`; a lease that runs out before a renewal lands is
/// caught by the epoch callback and the segment's timer through
/// `deadline_ms`.
pub(super) async fn renew_loop(store: Store, lease: Lease, ttl: Duration, every: Duration, watch: LeaseWatch) {
    loop {
        tokio::time::sleep(every).await;
        if watch.clock.since(watch.start) >= watch.until {
            return;
        }
        if renew_once(&store, &lease, ttl, &watch).await == Renewal::Lost {
            return;
        }
    }
}
