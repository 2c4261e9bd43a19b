//! Budgets, the segment's side (see `store::budgets`): a `model.chat`
//! about to go out holds its estimate of its tree's budget first; one that
//! would go past the budget is not made, and the run waits for a raise. Replay never comes here: a recorded call returns its
//! outcome and costs nothing.

use super::host::{Interrupt, SegmentState, detached};
use super::phase::Phase;
use crate::effects::{EffectError, Remote};
use crate::store::{EffectCall, Hold};

impl SegmentState {
    /// Holds `remote`'s estimate (a chat's prompt and `max_tokens`, and
    /// their price) of its tree's budget, if the tree has one, and asks the
    /// provider to report usage, which is what the tree is charged.
    /// `Ok(Ok(true))`: held, to be released once the call settles;
    /// `Ok(Err(_))`: refused (an unpriced model under a budget in dollars).
    pub(super) async fn hold_budget(&mut self, remote: &mut Remote, call: &EffectCall) -> wasmtime::Result<Result<bool, EffectError>> {
        let Remote::Chat { request } = remote else { return Ok(Ok(false)) };
        let (prompt, answer) = request.estimate();
        let usd = self.model.as_ref().and_then(|m| m.prices.estimate(request.model(), (prompt, answer)));
        let model = request.model().to_string();
        let _db = self.phase.enter(Phase::DATABASE);
        let (db, lease, seq, tokens) = (self.db.clone(), self.lease.clone(), call.seq, prompt + answer);
        let hold = match detached(async move { db.hold_budget(&lease, seq, tokens, usd).await }).await {
            Ok(hold) => hold,
            Err(e) => return self.store_failed(e),
        };
        match hold {
            Hold::Unlimited => Ok(Ok(false)),
            Hold::Held => Ok(Ok(true)),
            Hold::Unpriced { holder } => Ok(Err(EffectError::Denied(format!(
                "model.chat: run {holder}'s budget is in dollars and model {model:?} has no price on this host (serve --model-price)"
            )))),
            Hold::Over { holder, unit, spent, held, limit } => {
                tracing::info!(run_id = self.lease.run_id, holder, unit, spent, held, limit, tokens, usd_nanos = usd, "model.chat would overspend a budget over it; waiting for a raise");
                crate::metrics::global().budget_waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.stop(Interrupt::Budget { tokens, usd_nanos: usd })
            }
        }
    }

    /// Records a call the budget refused: as a fresh call's outcome, or
    /// as a re-issued one's (its `started` row settles as failed).
    pub(super) async fn refuse_budget(&mut self, call: &EffectCall, refusal: EffectError, reissue: bool) -> wasmtime::Result<Result<String, EffectError>> {
        if reissue { self.refuse_reissue(call, refusal).await } else { self.refuse(call, refusal).await }
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
