//! Group commit of closes (PostgreSQL).
//!
//! A close is the one statement a short turn costs while there is a queue
//! (its tail, its puts, its final status and the next claim; see
//! [`Store::close_and_claim`]). On a small machine most of that
//! statement's cost is being a statement: the round trip, starting its
//! executor nodes, the commit. So a close made while [`WRITERS`] batches
//! are in flight waits, and the waiting closes go together as one statement
//! ([`Store::close_batch`]) with one commit. A close on a quiet host goes
//! at once.
//!
//! Each close keeps its own (owner, fence) guard inside the batch: one
//! that fails it writes nothing and gets [`StoreError::LeaseLost`], and
//! the others are written. A batch's closes that claim a next run share
//! one owner and lease length (a host's workers all do). When a batch
//! fails as a whole, each of its closes is tried on its own, so every
//! caller gets its own result and its own error.
//!
//! SQLite has one writer, and a close there is already one transaction of
//! function calls, so its closes are not queued.

use std::time::Duration;

use crate::ledger::HeldPut;
use crate::store::group;
use crate::store::{Claimed, Lease, Outcome, Store, StoreError};

/// Most closes written by one statement.
pub(crate) const MAX_BATCH: usize = 32;

/// Batches in flight at once: one. Batches grow with the load (up to
/// [`MAX_BATCH`]), so one writer keeps up with more workers by writing
/// more closes per statement. Measured with `bench e2e` (5000 runs, 8
/// workers, 3 rounds, 2 cores, 4 submit batches in flight): one close per
/// statement ran at 739 and 800 runs/s; two batches in flight wrote about
/// 2.5 closes per statement and ran at 947 and 973; one in flight wrote
/// about 4 and ran at 1009 and 1040. (Those runs also carried a bench
/// bug that added up to a second to each peak. Measured again without it,
/// 5000 runs, 8 workers: one in flight gave ratios 0.537 and 0.526, two
/// gave 0.525 and 0.529, no difference; with 64 workers batches hold
/// about 31 closes.)
pub(crate) const WRITERS: usize = 1;

/// One close: [`Store::close_and_claim`]'s arguments, owned.
#[derive(Debug, Clone)]
pub(crate) struct Close {
    pub lease: Lease,
    pub deltas: Vec<String>,
    pub puts: Vec<HeldPut>,
    pub outcome: Outcome,
    /// Owner and lease length of the next run to claim in the same
    /// statement; `None`: claim nothing.
    pub next: Option<(String, Duration)>,
}

/// Closes waiting to be group-committed.
pub(crate) type Queue = group::Queue<Close, Option<Claimed>>;

/// Queues `close` and returns its result once its batch is written.
pub(crate) async fn close(store: &Store, close: Close) -> Result<Option<Claimed>, StoreError> {
    store
        .closes
        .push(close, WRITERS, || {
            // Its own task: a caller that gives up must not stop the batch
            // that carries other callers' closes.
            tokio::spawn(group::write_batches::<Close>(store.clone()));
        })
        .await
}

/// The next batch: queued closes in order, leaving queued any that wants
/// its next run for another owner or lease length than the batch's.
fn take(store: &Store) -> Vec<(Close, group::Reply<Option<Claimed>>)> {
    let mut next: Option<(String, Duration)> = None;
    store.closes.take(MAX_BATCH, |close| match (&close.next, &next) {
        (None, _) => true,
        (Some(want), None) => {
            next = Some(want.clone());
            true
        }
        (Some(want), Some(taken)) => want == taken,
    })
}

impl group::Batched for Close {
    type Out = Option<Claimed>;
    const WHAT: &'static str = "closes";

    fn queue(store: &Store) -> &std::sync::Arc<Queue> {
        &store.closes
    }

    fn take(store: &Store) -> Vec<(Close, group::Reply<Option<Claimed>>)> {
        take(store)
    }

    fn write<'a>(
        store: &'a Store,
        closes: &'a [Close],
    ) -> impl Future<Output = Result<Vec<Result<Option<Claimed>, StoreError>>, StoreError>> + Send + 'a {
        store.close_batch(closes)
    }

    fn written(store: &Store, n: usize) {
        store.closes.count(n);
    }

    fn answer(&self, reply: group::Reply<Option<Claimed>>, result: Result<Option<Claimed>, StoreError>) {
        if let Err(Ok(Some(orphan))) = reply.send(result) {
            // Its worker stopped waiting (its task was aborted): nobody runs
            // the run claimed for it, which waits for its lease to expire and
            // is then claimed again, as after a crash.
            tracing::warn!(
                closed = self.lease.run_id,
                run_id = orphan.run.id,
                "a worker stopped before taking the run claimed with its close; it is claimable again when its lease expires"
            );
        }
    }
}
