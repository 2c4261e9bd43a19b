//! Performing a remote effect once it is admitted and its `started` row
//! written: the call, and what its answer means for the segment.

use std::time::Duration;

use super::host::{EffectError, Interrupt, SegmentState};
use super::rates::Ticket;
use crate::effects::{self, RemoteFailure};

impl SegmentState {
    /// Performs a remote effect. A re-issue answered "in progress" (the
    /// dead segment's own request may still be running) is not a result:
    /// it is tried again under the same key, backing off, while the slice
    /// has time; then the segment ends with the call still in doubt.
    pub(super) async fn remote_until_answered(
        &mut self,
        remote: effects::Remote,
        ctx: &effects::RemoteCtx,
        ticket: &Ticket,
    ) -> wasmtime::Result<Result<String, EffectError>> {
        let mut backoff = Duration::from_millis(100);
        let mut remote = Some(remote);
        loop {
            let Some(this) = remote.take() else { unreachable!("a remote effect is performed once per round") };
            // Its started row was written under the lease; a host frozen
            // since (past the lease, by its own clock) sends nothing: the
            // run may be another's now, and a key's slot with it.
            if self.lease_live.as_ref().is_some_and(|live| !live()) {
                tracing::info!(run_id = ctx.run_id, seq = ctx.seq, "the lease ran out before the call went out; not sending it");
                return self.stop(Interrupt::LeaseLost);
            }
            let again = this.again();
            let answer = effects::perform_remote(this, ctx, self.model.as_deref(), &self.egress, &mut self.stream).await;
            match answer {
                Ok(result) => return Ok(Ok(result)),
                Err(RemoteFailure::Effect(error)) => return Ok(Err(error)),
                Err(RemoteFailure::Throttled { error, retry_after }) => {
                    self.hold_rate(ticket, retry_after).await;
                    return Ok(Err(error));
                }
                Err(RemoteFailure::InProgress(answer)) => {
                    let left = self.limits.segment_budget.saturating_sub(self.started.elapsed());
                    if let Some((_, _, detail)) = &mut self.in_flight {
                        *detail = Some(format!(
                            "it was re-issued under its idempotency key and the remote side still answered {answer}"
                        ));
                    }
                    if backoff >= left {
                        return self.stop(Interrupt::Slice);
                    }
                    tracing::debug!(run_id = ctx.run_id, seq = ctx.seq, %answer, ?backoff, "re-issue in progress elsewhere; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    // Another request to the provider: admitted and charged.
                    self.admit_again(ticket).await?;
                    remote = Some(again);
                }
            }
        }
    }
}
