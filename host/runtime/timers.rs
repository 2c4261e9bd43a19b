//! Durable timers (`sleep`, and WASI waits longer than the slice has left):
//! the wake time is recorded from the database's clock, so a resumed
//! segment waits only for what is left of it, and a replay returns once it
//! is due.

use super::host::{Interrupt, SegmentState, detached};
use super::phase::Phase;
use crate::store::{EffectCall, LocalOp};

impl SegmentState {
    /// The database's clock, read detached.
    pub(super) async fn db_now(&mut self) -> wasmtime::Result<i64> {
        let _db = self.phase.enter(Phase::DATABASE);
        let db = self.db.clone();
        match detached(async move { db.now_ms().await }).await {
            Ok(now) => Ok(now),
            Err(e) => self.store_failed(e),
        }
    }

    /// A durable timer at `call`: on replay, returns once its recorded wake
    /// time has come (and suspends again until then); on new ground,
    /// records the wake time and suspends. `Ok` means the timer is done.
    pub(super) async fn timer(&mut self, call: EffectCall, ms: i64) -> wasmtime::Result<()> {
        let _db = self.phase.enter(Phase::DATABASE);
        if let Some(row) = self.replayed(&call).await? {
            if self.offline {
                return Ok(()); // replay does not wait
            }
            let wake_at: i64 = row.result.as_deref().and_then(|r| r.parse().ok()).unwrap_or(0);
            let now = self.db_now().await?;
            if now >= wake_at {
                return Ok(());
            }
            return self.stop(Interrupt::Sleep { delay_ms: wake_at - now });
        }
        if self.offline {
            return self.frontier(&call, "not recorded");
        }
        self.room(20)?;
        // Record the wake time first, so a segment that dies here still
        // wakes on time rather than sleeping again from scratch.
        let now = self.db_now().await?;
        let op = LocalOp::Record { value: now.saturating_add(ms).to_string() };
        self.flush_stream().await?;
        if let Err(e) = self.local(&call, op).await {
            return self.store_failed(e);
        }
        self.settled += 1;
        self.wrote(&call, 20);
        self.stop(Interrupt::Sleep { delay_ms: ms })
    }
}
