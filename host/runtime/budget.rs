//! Token budgets, the segment's side (see `store::budgets`): a
//! `model.chat` about to go out holds its estimate of its tree's budget
//! first; one that would go past the budget is not made, and the run
//! waits for a raise. Replay never comes here: a recorded call returns its
//! outcome and costs nothing.

use super::host::{Interrupt, SegmentState, detached};
use super::phase::Phase;
use crate::effects::{Remote, rate};
use crate::store::{EffectCall, Hold};

impl SegmentState {
    /// Holds `remote`'s estimate (a chat's prompt and `max_tokens`) of its
    /// tree's budget, if the tree has one, and asks the provider to report
    /// usage, which is what the tree is charged. `Ok(true)`: held, to be
    /// released once the call settles.
    pub(super) async fn hold_budget(&mut self, remote: &mut Remote, call: &EffectCall) -> wasmtime::Result<bool> {
        if !matches!(remote, Remote::Chat { .. }) {
            return Ok(false);
        }
        let _db = self.phase.enter(Phase::DATABASE);
        let (db, lease, seq, tokens) = (self.db.clone(), self.lease.clone(), call.seq, rate::reserve(remote));
        let hold = match detached(async move { db.hold_budget(&lease, seq, tokens).await }).await {
            Ok(hold) => hold,
            Err(e) => return self.store_failed(e),
        };
        match hold {
            Hold::Unlimited => Ok(false),
            Hold::Held => {
                if let Remote::Chat { request } = remote {
                    request.ask_usage();
                }
                Ok(true)
            }
            Hold::Over { holder, spent, held, limit } => {
                let tokens = rate::reserve(remote);
                tracing::info!(run_id = self.lease.run_id, holder, spent, held, limit, tokens, "model.chat would overspend a budget over it; waiting for a raise");
                crate::metrics::global().budget_waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.stop(Interrupt::Budget)
            }
        }
    }

    /// After a held call settled: drops its hold and lets the tree's runs
    /// waiting for budget look again. A failed write is logged: the hold
    /// no longer counts once the call has its outcome.
    pub(super) async fn release_budget(&mut self, seq: i64) {
        let _db = self.phase.enter(Phase::DATABASE);
        let (db, run) = (self.db.clone(), self.lease.run_id);
        if let Err(e) = detached(async move { db.release_budget(run, seq).await }).await {
            tracing::warn!(run_id = run, seq, error = %e, "releasing a budget hold failed");
        }
    }
}
