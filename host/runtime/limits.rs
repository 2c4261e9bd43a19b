//! What a plugin may use (its sandbox limits) and how a guest fails when
//! it goes past them.

use std::time::Duration;

use serde::Serialize;

/// Per-plugin sandbox limits. Every field documents its default.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Linear memory per instance. Default: 256 MiB (a Python guest needs
    /// about 40 MiB to start).
    pub max_memory_bytes: usize,
    /// Wasm stack. Default: 1 MiB.
    pub max_wasm_stack: usize,
    /// Host calls per segment (the host-call "fuel"). Default: 100,000.
    pub max_host_calls: u64,
    /// Bytes one turn may emit in total. Default: 4 MiB.
    pub max_emit_bytes: usize,
    /// Emits (each one an event of the run's thread) one turn may make in
    /// all. Default: 100,000.
    pub max_emits: u64,
    /// Bytes of the final output (or error). Default: 1 MiB.
    pub max_output_bytes: usize,
    /// Bytes of one effect request or result. Default: 1 MiB.
    pub max_effect_bytes: usize,
    /// How long one segment may run before it is sliced (suspended as
    /// `waiting_takeover` and resumed by replay). Enforced by a timer as
    /// well as by epochs, so a guest blocked in a WASI or host call is
    /// stopped like a computing one. Default: 30 s.
    pub segment_budget: Duration,
    /// How long past its budget a segment lets a host call in flight (an
    /// `http` request, a model's answer) finish before it stops the guest
    /// anyway; its lease is not renewed past the budget plus this.
    /// Default: 5 s.
    pub slice_grace: Duration,
    /// Hosts the `http` providers may reach: `host` (its scheme's default
    /// port only), `host:port` or `scheme://host:port`; any other is
    /// `denied`. Default: none.
    pub http_allow: Vec<String>,
    /// What `model.chat` may be asked for. Default: nothing (denied).
    pub model: crate::store::ModelGrant,
    /// Plugins whose runs `spawn` may start (`*`: any). Default: none
    /// (denied).
    pub spawn_allow: Vec<String>,
    /// Bytes the guest may pass to the host in one call (strings and lists
    /// the host copies in): past it, the guest traps as a `limit` error
    /// before anything is copied. Default: 2 MiB.
    pub max_hostcall_bytes: usize,
    /// Bytes of one `wait-input` prompt. Default: 4 KiB.
    pub max_prompt_bytes: usize,
    /// `log` lines per segment; later ones are dropped (and counted in
    /// `leasehold_guest_log_lines_dropped_total`). Default: 1,000.
    pub max_log_lines: u64,
    /// Bytes of one `log` line; longer ones are cut. Default: 4 KiB.
    pub max_log_bytes: usize,
    /// Bytes of WASI random per call. Default: 1 MiB.
    pub max_random_bytes: u64,
    /// WASI resources (pollables, streams) alive at once. Default: 10,000.
    pub max_resources: usize,
    /// Bytes of one `kv.put` value (each `kv.get` of it is recorded in the
    /// ledger). Default: 64 KiB.
    pub max_kv_value_bytes: usize,
    /// What the plugin's kv namespace may hold over all its runs (a
    /// plugin setting). Default: 256 MiB in 100,000 keys.
    pub kv: crate::store::KvQuota,
    /// Rows in a run's ledger, over all its segments; past it the run fails
    /// as `ledger-too-large`. Default: 50,000.
    pub max_ledger_rows: u64,
    /// Runs a tree may spawn in all (its root not counted); past it a
    /// `spawn` is `denied`. A host setting (`--tree-max-runs`). Default:
    /// 10,000.
    pub tree_max_runs: u64,
    /// Spawned runs of a tree open at once; past it a `spawn` is `denied`
    /// until some finish. A host setting (`--tree-max-open`). Default: 1,000.
    pub tree_max_open: u64,
    /// Bytes of names and results in a run's ledger. Default: 64 MiB.
    pub max_ledger_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_memory_bytes: 256 << 20,
            max_wasm_stack: 1 << 20,
            max_host_calls: 100_000,
            max_emit_bytes: 4 << 20,
            max_emits: 100_000,
            max_output_bytes: 1 << 20,
            max_effect_bytes: 1 << 20,
            segment_budget: Duration::from_secs(30),
            slice_grace: Duration::from_secs(5),
            http_allow: Vec::new(),
            model: crate::store::ModelGrant::default(),
            spawn_allow: Vec::new(),
            max_hostcall_bytes: 2 << 20,
            max_prompt_bytes: 4 << 10,
            max_log_lines: 1_000,
            max_log_bytes: 4 << 10,
            max_random_bytes: 1 << 20,
            max_resources: 10_000,
            max_kv_value_bytes: 64 << 10,
            kv: crate::store::KvQuota::default(),
            max_ledger_rows: 50_000,
            tree_max_runs: 10_000,
            tree_max_open: 1_000,
            max_ledger_bytes: 64 << 20,
        }
    }
}

/// How a guest failed, as recorded in the run's `error` (`"<kind>: …"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GuestErrorKind {
    /// The turn returned `err`.
    TurnError,
    /// Ran out of time without making progress (an infinite loop).
    Timeout,
    OutOfMemory,
    OutputTooLarge,
    /// A trap: unreachable, a bad memory access, a stack overflow…
    Trap,
    /// A recorded call differs from the one the turn now makes.
    NonDeterminism,
    /// Too many host calls in one segment.
    HostCalls,
    /// The run names a plugin this host does not have.
    UnknownPlugin,
    /// A sandbox cap: data passed in one host call, a prompt, WASI random
    /// or resources.
    Limit,
    /// The run's ledger grew past its cap in rows or bytes.
    LedgerTooLarge,
}

impl GuestErrorKind {
    /// Every kind, for counters that show each one.
    pub const ALL: [GuestErrorKind; 10] = [
        GuestErrorKind::TurnError,
        GuestErrorKind::Timeout,
        GuestErrorKind::OutOfMemory,
        GuestErrorKind::OutputTooLarge,
        GuestErrorKind::Trap,
        GuestErrorKind::NonDeterminism,
        GuestErrorKind::HostCalls,
        GuestErrorKind::UnknownPlugin,
        GuestErrorKind::Limit,
        GuestErrorKind::LedgerTooLarge,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            GuestErrorKind::TurnError => "turn-error",
            GuestErrorKind::Timeout => "timeout",
            GuestErrorKind::OutOfMemory => "out-of-memory",
            GuestErrorKind::OutputTooLarge => "output-too-large",
            GuestErrorKind::Trap => "trap",
            GuestErrorKind::NonDeterminism => "non-determinism",
            GuestErrorKind::HostCalls => "host-calls",
            GuestErrorKind::UnknownPlugin => "unknown-plugin",
            GuestErrorKind::Limit => "limit",
            GuestErrorKind::LedgerTooLarge => "ledger-too-large",
        }
    }
}

/// Linear-memory and table limits that also remember a refusal, so an
/// out-of-memory trap is classified as such. Memory is counted for the
/// instance as a whole: every memory of every core instance in it.
pub(crate) struct Limiter {
    pub max_memory: usize,
    /// Bytes of linear memory the instance holds now, all memories together.
    pub total: usize,
    pub memory_refused: bool,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false); // fails anyway; not counted
        }
        let total = self.total.saturating_sub(current).saturating_add(desired);
        if total > self.max_memory {
            self.memory_refused = true;
            // Trap rather than return -1: most guests abort on a failed grow
            // anyway, and a trap here names the cause precisely.
            return Err(wasmtime::Error::msg(format!(
                "memory limit: the instance asked for {total} bytes of linear memory in all, the limit is {}",
                self.max_memory
            )));
        }
        self.total = total;
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}
