//! leasehold: a WebAssembly-plugin workflow host.
//!
//! This crate holds the host: the run [`store`] and its lease protocol
//! ([`lease`]), the thread log ([`events`]), the effect [`ledger`], the
//! [`reaper`] and the claim benchmark ([`bench`]). DESIGN.md is the contract.

/// The condition under which a run may be claimed (DESIGN.md §2, statement 1),
/// shared by both dialects' claim statements. `{now}` is the database clock.
///
/// The leading `status IN (…)` term is the predicate of the partial index
/// `runs_claim`, repeated verbatim so both planners can use that index: the
/// claim never scans finished runs.
#[doc(hidden)]
#[macro_export]
macro_rules! claimable {
    () => {
        "status IN ('queued','waiting_input','waiting_takeover','running') \
         AND attempt < max_attempts AND not_before <= {now} \
         AND (status IN ('queued','waiting_takeover') \
              OR (status = 'waiting_input' AND pending_input IS NOT NULL) \
              OR (status = 'running' AND lease_expires_at < {now}))"
    };
}

pub mod bench;
pub mod events;
pub mod lease;
pub mod ledger;
pub mod reaper;
pub mod store;

pub use store::{Backend, Store, StoreError, StoreOptions};
