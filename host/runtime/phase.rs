//! What a segment is doing outside wasm, for the executor's slice timer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// What a segment is doing outside wasm, shared with the executor's slice
/// timer: a guest blocked in a remote call gets the grace past its budget;
/// one in a database write is never cut (the write is the protocol's, and
/// the lease deadline bounds it); anything else is stopped at the budget.
#[derive(Clone, Default)]
pub(crate) struct Phase(Arc<AtomicU8>);

/// Phase 0 (the default) is the guest's own: wasm or a WASI call.
impl Phase {
    pub(crate) const REMOTE: u8 = 1;
    pub(crate) const DATABASE: u8 = 2;

    pub(crate) fn get(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }

    /// Enters phase `p` until the guard is dropped (then the phase before).
    pub(super) fn enter(&self, p: u8) -> PhaseGuard {
        PhaseGuard { phase: self.0.clone(), before: self.0.swap(p, Ordering::SeqCst) }
    }
}

pub(super) struct PhaseGuard {
    phase: Arc<AtomicU8>,
    before: u8,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        self.phase.store(self.before, Ordering::SeqCst);
    }
}
