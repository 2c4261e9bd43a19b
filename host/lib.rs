//! leasehold: a WebAssembly-plugin workflow host.
//!
//! This crate holds the host: the run [`store`] and its lease protocol
//! ([`lease`]), the thread log ([`events`]), the effect [`ledger`], the
//! [`reaper`] and the claim benchmark ([`bench`]). DESIGN.md is the contract.

/// The claim has two paths (DESIGN.md §2, statement 1), each served by its
/// own partial index so a claim never scans finished or in-flight runs:
///
/// * `claim_open!`: open runs (`queued`, `waiting_takeover`, `waiting_input`
///   with input delivered) whose `not_before` has passed, oldest eligibility
///   first. Index `runs_claim_open (not_before, id)` has this predicate.
/// * `claim_expired!`: `running` runs whose lease expired. Index `runs_lease`.
///
/// Both require attempts left. `{now}` is the database clock. The index
/// predicates are repeated verbatim so both planners can match them.
#[doc(hidden)]
#[macro_export]
macro_rules! claim_open {
    () => {
        "(status IN ('queued','waiting_takeover') \
              OR (status = 'waiting_input' AND pending_input IS NOT NULL)) \
         AND not_before <= {now} AND attempt < max_attempts"
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! claim_expired {
    () => {
        "status = 'running' AND lease_expires_at < {now} AND attempt < max_attempts"
    };
}

pub mod bench;
pub mod events;
pub mod lease;
pub mod ledger;
pub mod reaper;
pub mod store;

pub use store::{Backend, Store, StoreError, StoreOptions};
