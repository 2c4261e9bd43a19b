//! Express claims: a submit of a run that the claim may order ahead of
//! the runs this host already holds in its local queue (one with a
//! concurrency key, or a priority other than 0) wakes the dispatcher,
//! which claims it at once and queues it ahead ([`Local::push_ahead`])
//! rather than waiting for the queue to be half free. Without them a
//! small key's run waited behind half a queue of a large key's backlog
//! (the fairness bench: a p99 several times its p99 alone).
//!
//! At most one express claim each [`EXPRESS_GAP`], of at most
//! [`EXPRESS_RUNS`] runs: under a stream of keyed submits they cost a few
//! small claim statements a second, not one per submit.

use std::time::{Duration, Instant};

use super::queue::Local;
use crate::executor::Executor;
use crate::store::Store;

/// Shortest time between two express claims: 5 ms.
pub(super) const EXPRESS_GAP: Duration = Duration::from_millis(5);
/// Most runs an express claim takes: 8, two keys' turns on PostgreSQL (a
/// turn serves up to 4 runs), so a key served in the same claim as a
/// large one, and ordered after it, is reached.
pub(super) const EXPRESS_RUNS: usize = 8;

#[derive(Debug, Default)]
pub(super) struct Express {
    last: Option<Instant>,
}

impl Express {
    /// Resolves when an express claim is due: a keyed or prioritized run
    /// was submitted here, the local queue holds runs it could go ahead
    /// of, and the last express claim was at least [`EXPRESS_GAP`] ago.
    /// Never resolves without a queue.
    pub(super) async fn due(&self, store: &Store, local: &Local) {
        if local.len() == 0 {
            return std::future::pending().await;
        }
        if let Some(last) = self.last {
            tokio::time::sleep_until((last + EXPRESS_GAP).into()).await;
        }
        store.ahead_signal().notified().await;
    }

    /// Claims up to [`EXPRESS_RUNS`] runs for the queue, ahead of the runs
    /// the claim orders after them, and no more than the queue's bound has
    /// room for: at the bound, one run, and the queue gives back its last
    /// ([`Local::trim`]). A failed claim is left to the dispatcher's next
    /// one.
    pub(super) async fn claim(&mut self, exec: &Executor, store: &Store, local: &Local) {
        self.last = Some(Instant::now());
        crate::metrics::global().express_claims.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let want = local.hard_room().clamp(1, EXPRESS_RUNS);
        match exec.claim_charging(want, 0).await {
            Ok(claimed) => {
                claimed.into_iter().for_each(|c| local.push_ahead(c));
                local.trim(store).await;
            }
            Err(e) => tracing::debug!(error = %e, "express claim failed; the next claim finds the run"),
        }
    }
}
