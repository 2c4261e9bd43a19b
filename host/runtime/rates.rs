//! Rate limits on effects, the segment's side (docs/flow-control.md). A
//! remote call whose target has a limit is admitted before its `started`
//! row is written: if its rate has room within [`WAIT_IN_PLACE`] (and the
//! slice), it is charged and goes out after that wait; if not, nothing is
//! charged or recorded and the run suspends (`queued`, its worker and its
//! concurrency slot freed) and makes the call again when it resumes.
//! Replay never comes here: a recorded call returns its outcome at once
//! and costs nothing.

use std::time::Duration;

use rand::Rng;

use super::host::{Interrupt, SegmentState, detached};
use super::phase::Phase;
use crate::effects::{EffectError, Remote, rate};
use crate::store::rates::Admission;

/// The longest a call waits for its rate in place, its worker held: a
/// longer wait suspends the run. Default: 1 s.
pub const WAIT_IN_PLACE: Duration = Duration::from_secs(1);

/// What admission gave a call: its rate key and the tokens it reserved.
pub(crate) struct Ticket {
    pub(crate) key: String,
    /// Reserved on the key's token clock, settled from the answer's usage.
    pub(crate) tokens: i64,
}

impl SegmentState {
    /// Admits `remote` under its rate limit, if its target has one, and
    /// under a provider's hold on this plugin's calls to it: waits for room
    /// in place, or suspends the run until there is room. A re-issue is a
    /// request the provider counts like any other: charged like one.
    pub(super) async fn admit(&mut self, remote: &Remote) -> wasmtime::Result<Ticket> {
        let key = rate::key_of(remote);
        let hold = rate::hold_key(&key, &self.namespace);
        let _db = self.phase.enter(Phase::DATABASE);
        let db = self.db.clone();
        let keys = match detached(async move { db.rate_keys().await }).await {
            Ok(keys) => keys,
            Err(e) => return self.store_failed(e),
        };
        let (limited, held) = (keys.contains(&key), hold != key && keys.contains(&hold));
        if held {
            // Waits out the hold; charges nothing.
            self.wait_for_room(&hold, 0, 0).await?;
        }
        if !limited {
            return Ok(Ticket { key, tokens: 0 });
        }
        let tokens = rate::reserve(remote);
        self.wait_for_room(&key, 1, tokens).await?;
        Ok(Ticket { key, tokens })
    }

    /// A re-issue answered "in progress" is tried again: each try is a
    /// request the provider counts, so each is admitted and charged a call.
    pub(super) async fn admit_again(&mut self, ticket: &Ticket) -> wasmtime::Result<()> {
        let db = self.db.clone();
        let keys = match detached(async move { db.rate_keys().await }).await {
            Ok(keys) => keys,
            Err(e) => return self.store_failed(e),
        };
        if keys.contains(&ticket.key) { self.wait_for_room(&ticket.key, 1, 0).await } else { Ok(()) }
    }

    /// Charges `calls` and `tokens` to `key` once it has room: waits in
    /// place up to [`WAIT_IN_PLACE`] (and half the slice left), or stops
    /// the guest to suspend the run until then.
    async fn wait_for_room(&mut self, key: &str, calls: i64, tokens: i64) -> wasmtime::Result<()> {
        let _db = self.phase.enter(Phase::DATABASE);
        // The wait in place must leave the slice time for the call itself.
        let left = self.limits.segment_budget.saturating_sub(self.started.elapsed()) / 2;
        let window = i64::try_from(WAIT_IN_PLACE.min(left).as_millis()).unwrap_or(0);
        let (db, k) = (self.db.clone(), key.to_string());
        let admission = match detached(async move { db.admit(&k, calls, tokens, window).await }).await {
            Ok(a) => a,
            Err(e) => return self.store_failed(e),
        };
        match admission {
            Admission::Go { wait_ms } => {
                if wait_ms > 0 {
                    crate::metrics::global().rate_waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(wait_ms as u64)).await;
                }
                Ok(())
            }
            Admission::Later { wait_ms } => {
                // Spread the runs that found the key full, so they do not
                // all come back at the same moment.
                let delay_ms = wait_ms + rand::rng().random_range(0..=wait_ms / 4);
                tracing::debug!(run_id = self.lease.run_id, key, delay_ms, "no room in the rate limit; suspending");
                crate::metrics::global().rate_suspensions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.stop(Interrupt::Rate { key: key.to_string(), delay_ms })
            }
        }
    }

    /// A provider answered `429`/`503` with `Retry-After`: holds the calls
    /// to the key (for `http`, this plugin's; see [`rate::hold_key`]), on
    /// every host, until then. A failed write is logged: the answer itself
    /// is still the call's outcome.
    pub(super) async fn hold_rate(&mut self, ticket: &Ticket, retry_after: Duration) {
        let _db = self.phase.enter(Phase::DATABASE);
        let (db, key) = (self.db.clone(), rate::hold_key(&ticket.key, &self.namespace));
        tracing::info!(run_id = self.lease.run_id, key, ?retry_after, "the provider asked to retry later; holding its calls");
        crate::metrics::global().rate_holds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shown = key.clone();
        if let Err(e) = detached(async move { db.hold(&key, retry_after).await }).await {
            tracing::warn!(key = shown, error = %e, "recording a provider's Retry-After failed");
        }
    }

    /// Settles a chat call's reserved tokens against what its answer says
    /// it used; a call that reports nothing keeps its reservation. A
    /// failed write is logged: the limit errs by one call's tokens.
    pub(super) async fn settle_rate(&mut self, ticket: &Ticket, outcome: &Result<String, EffectError>) {
        let Some(used) = outcome.as_ref().ok().and_then(|r| rate::used_tokens(r)) else { return };
        if ticket.tokens == 0 {
            return;
        }
        let _db = self.phase.enter(Phase::DATABASE);
        let (db, key, delta) = (self.db.clone(), ticket.key.clone(), used.saturating_sub(ticket.tokens));
        if let Err(e) = detached(async move { db.settle_tokens(&key, delta).await }).await {
            tracing::warn!(key = ticket.key, error = %e, "settling a call's tokens failed");
        }
    }
}
