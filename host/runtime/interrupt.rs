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
    /// An effect's rate limit (`key`) has no room within the wait allowed
    /// in place: suspend as `queued` for `delay_ms`, then make the call
    /// again (nothing was recorded for it).
    Rate { key: String, delay_ms: i64 },
    /// `await-children` with the wait not yet met: suspend as `queued`
    /// until the children end or the deadline passes.
    AwaitChildren(crate::store::ChildWait),
    /// `wait-for` with nothing delivered to its name yet: suspend as
    /// `queued` until input arrives or the deadline passes.
    WaitNamed(crate::store::NamedWait),
    /// A `model.chat` would spend past its tree's budget: suspend as
    /// `queued` until the budget has room for the call's `tokens` and
    /// `usd_nanos`, then make the call again (nothing was recorded for it).
    Budget { tokens: i64, usd_nanos: Option<i64> },
    /// The slice budget is used up: suspend as `waiting_takeover`.
    Slice,
    /// The host is shutting down: suspend as `waiting_takeover`.
    Shutdown,
    /// An operator paused the run (`store::pause`): suspend as
    /// `waiting_takeover`, which the pause holds until resumed.
    Pause,
    /// A guarded write failed: stop, write nothing else.
    LeaseLost,
    /// A recorded call differs from the one the turn now makes.
    NonDeterminism(Divergence),
    /// Offline replay only (`SegmentInit::offline`): the turn reached a
    /// call the ledger has no outcome for, so replay stops there and
    /// performs nothing.
    Frontier(NextCall),
    /// A sandbox limit: host calls, emit bytes, sizes, the ledger.
    Limit { kind: GuestErrorKind, message: String },
    /// The database failed under the segment (not a lease loss). The run is
    /// left as it is; its lease expires and another segment resumes it.
    Store(String),
}

/// A call as the ledger recorded it or as the turn makes it now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CallView {
    pub name: String,
    /// The request's first 1,024 bytes; `None` for a row recorded before
    /// the ledger kept requests.
    pub request: Option<String>,
    /// The turn's emit position at the call.
    pub emit_pos: i64,
}

/// The first call where a turn leaves its recorded ledger.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Divergence {
    pub seq: i64,
    pub recorded: CallView,
    /// The call the turn makes instead; `None` when it ended there.
    pub now: Option<CallView>,
    /// What differs, in a sentence (the run's error says this).
    pub why: String,
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

/// Where an offline replay stopped: the first call with no recorded
/// outcome.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NextCall {
    pub seq: i64,
    pub call: CallView,
    /// Why it has no outcome: not recorded at all, or started by a segment
    /// that died before it learnt the result.
    pub why: String,
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
