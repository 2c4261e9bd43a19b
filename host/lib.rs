//! leasehold: a WebAssembly-plugin workflow host.
//!
//! This crate holds the host: the run [`store`] and its lease protocol
//! ([`lease`]), the thread log ([`events`]), the effect [`ledger`], the
//! [`reaper`] and the claim benchmark ([`bench`]). DESIGN.md is the contract.

/// A run is claimable (DESIGN.md §2, statement 1) when it is open (`queued`,
/// `waiting_takeover`, `waiting_input` with its input delivered) or
/// `running`, has attempts left, and its *eligible time* has passed:
/// `not_before` for an open run, just after `lease_expires_at` for a running
/// one. One partial expression index, `runs_claim (eligible_at!(), id)` with
/// `claimable!()` as its predicate, serves the whole claim as one range scan:
/// finished and waiting runs are not in it, in-flight runs sort after `now`,
/// and expired leases and open runs come out in the order they became
/// eligible, so neither can starve the other.
///
/// Queries that should use the index repeat these texts verbatim (both
/// planners match partial-index predicates and index expressions by text).
/// So does PostgreSQL's `leasehold_claimable` (migration 0004), written
/// out in SQL; the claim plan tests fail if it stops matching the index.
#[doc(hidden)]
#[macro_export]
macro_rules! claimable {
    () => {
        "(status IN ('queued','waiting_takeover','running') \
          OR (status = 'waiting_input' AND pending_input IS NOT NULL))"
    };
}

/// See [`claimable!`]. `+ 1` makes `eligible <= now` mean
/// `lease_expires_at < now` for a running run.
#[doc(hidden)]
#[macro_export]
macro_rules! eligible_at {
    () => {
        "(CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END)"
    };
}

pub mod api;
pub mod bench;
pub mod bench_e2e;
pub mod clock;
pub mod effects;
pub mod events;
pub mod executor;
pub mod lease;
pub mod ledger;
pub mod metrics;
pub mod plugins;
pub mod pool;
pub mod progress;
pub mod reaper;
pub mod redact;
pub mod runtime;
pub mod store;

pub use store::{Backend, Store, StoreError, StoreOptions};
