//! The `auto` upgrade policy: at the start of a segment, a run on an older
//! version of its plugin moves to the version this host knows as current
//! if its recorded ledger replays clean on it (the check `leasehold
//! replay` runs, offline: same calls, same order, same requests up to the
//! recorded position). Otherwise it stays on its own version, and the
//! reason is recorded on the run (`upgrade_note`); a run is checked once
//! per current version. Under `pinned` (the default) nothing moves.

use std::sync::Arc;
use std::time::Duration;

use super::Executor;
use crate::runtime::Plugin;
use crate::runtime::offline::{self, Outcome, Recording};
use crate::store::{Lease, Run, StoreError, UpgradePolicy};

/// Wall time one check may compute before it counts as "does not replay".
const CHECK_BUDGET: Duration = Duration::from_secs(10);

impl Executor {
    /// The version the segment runs: `pinned` (the run's own), or the
    /// current one when the policy is `auto` and the run's ledger replays
    /// clean on it.
    pub(super) async fn upgrade(&self, run: &Run, lease: &Lease, pinned: Arc<Plugin>) -> Result<Arc<Plugin>, StoreError> {
        let Some(current) = self.runtime.plugin(&run.plugin) else { return Ok(pinned) };
        if current.digest == pinned.digest
            || self.runtime.upgrade_policy(&run.plugin) != UpgradePolicy::Auto
            || run.upgrade_checked.as_deref() == Some(current.digest.as_str())
        {
            return Ok(pinned);
        }
        let effects = if lease.fence == 1 { Vec::new() } else { self.store.effects(run.id).await? };
        let recorded = effects.len();
        let recording = Recording::of(run.clone(), effects);
        let report = offline::replay(&self.runtime, &current, recording, CHECK_BUDGET).await?;
        let (moved, note) = match &report.outcome {
            Outcome::Diverged { divergence } => {
                (false, format!("stays on {}: on {} it diverges at call {}: {}", pinned.digest, current.digest, divergence.seq, divergence.why))
            }
            Outcome::Stopped { reason } => (false, format!("stays on {}: replaying it on {} stopped: {reason}", pinned.digest, current.digest)),
            _ => (true, format!("moved from {} to {} at fence {}: its {recorded} recorded calls replay clean", pinned.digest, current.digest, lease.fence)),
        };
        self.store.record_upgrade(lease, moved.then_some(current.digest.as_str()), &current.digest, &note).await?;
        tracing::info!(run_id = run.id, fence = lease.fence, moved, "{note}");
        Ok(if moved { current } else { pinned })
    }
}
