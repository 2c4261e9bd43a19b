//! Fault hooks: places in the store's write paths where a test makes a
//! write late, or its connection die at a chosen moment, to check what the
//! protocol does then. Unset (always, outside tests) each costs one atomic
//! load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The store's fault hooks, shared by its clones ([`crate::store::Store::faults`]).
/// Default: none set.
#[derive(Debug, Default)]
pub struct Faults {
    close_delay_ms: AtomicU64,
    guest_delay_ms: AtomicU64,
}

impl Faults {
    /// Holds every close (statement 4) this long before it is queued to be
    /// written, as a close stuck behind another session's lock would be.
    /// `Duration::ZERO` clears it.
    pub fn delay_closes(&self, by: Duration) {
        self.close_delay_ms.store(by.as_millis() as u64, Ordering::Relaxed);
    }

    /// Holds every segment this long before its guest starts, as a cold
    /// compile of a large component would. `Duration::ZERO` clears it.
    pub fn delay_guests(&self, by: Duration) {
        self.guest_delay_ms.store(by.as_millis() as u64, Ordering::Relaxed);
    }

    pub(crate) async fn before_close(&self) {
        delay(&self.close_delay_ms).await
    }

    #[doc(hidden)]
    pub async fn before_guest(&self) {
        delay(&self.guest_delay_ms).await
    }
}

async fn delay(ms: &AtomicU64) {
    let ms = ms.load(Ordering::Relaxed);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}
