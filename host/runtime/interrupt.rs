//! Why the host stopped a guest: the reason a host call traps with.

use super::limits::GuestErrorKind;
use crate::store::StoreError;

/// Why the host stopped the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interrupt {
    /// `wait-input` with no input yet: suspend as `waiting_input`.
    WaitInput { prompt: String },
    /// `sleep`, or a WASI wait longer than the slice has left: suspend as
    /// `queued` until the timer is due.
    Sleep { delay_ms: i64 },
    /// The slice budget is used up: suspend as `waiting_takeover`.
    Slice,
    /// The host is shutting down: suspend as `waiting_takeover`.
    Shutdown,
    /// A guarded write failed: stop, write nothing else.
    LeaseLost,
    /// A recorded call differs from the one the turn now makes.
    NonDeterminism(String),
    /// A sandbox limit: host calls, emit bytes, sizes, the ledger.
    Limit { kind: GuestErrorKind, message: String },
    /// The database failed under the segment (not a lease loss). The run is
    /// left as it is; its lease expires and another segment resumes it.
    Store(String),
}

/// The error a guest trap carries; the reason is in `SegmentState::interrupt`.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by the host")]
pub struct Interrupted;

pub(crate) fn interrupt_for(e: StoreError) -> Interrupt {
    match e {
        StoreError::LeaseLost(_) => Interrupt::LeaseLost,
        other => Interrupt::Store(other.to_string()),
    }
}
