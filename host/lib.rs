//! leasehold: a WebAssembly-plugin workflow host.
//!
//! The layers, bottom to top (no module imports one above it; see
//! `docs/design.md`):
//!
//! - [`store`]: every SQL statement: runs and leases, claims, closes,
//!   suspensions and input, the effect ledger, local effects and `kv`, the
//!   thread log, the reaper's statements, group commit, and the few
//!   dialect differences. Leaves beside it: [`metrics`] (counters),
//!   [`traces`] (OpenTelemetry), [`redact`] (secrets), [`clock`] (log
//!   timestamps).
//! - [`effects`] and [`runtime`]: the guest's side. The providers and
//!   `EffectError` are the effects'; the runtime (Wasmtime, the host
//!   functions, replay, the sandbox's limits) uses them. [`plugins`] is the
//!   registry over both.
//! - The worker: [`executor`] (one segment of a run), [`pool`], and the
//!   [`maintenance`] services beside them (the reaper, the cleaner, the
//!   vacuum, the rollup, the segment log).
//! - The edges: [`api`] (HTTP), and the binary's CLI and `serve`.
//! - [`bench`](mod@bench), apart.

pub mod api;
pub mod bench;
pub mod clock;
pub mod effects;
pub mod executor;
pub mod maintenance;
pub mod metrics;
pub mod plugins;
pub mod pool;
pub mod redact;
pub mod runtime;
pub mod schedules;
pub mod versions;
pub mod store;
pub mod traces;

pub use store::{Backend, Store, StoreError, StoreOptions};
