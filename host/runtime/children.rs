//! The host functions of `leasehold:turn/children` (0.2.0): `spawn` and
//! `await-children`, recorded in the ledger like every call (see
//! `store::children` for how they are written).
//!
//! * `spawn` is one ledger row, written with the child in one
//!   transaction: its result is the child's id, so a replay returns the
//!   same child and never makes a second.
//! * `await-children` with a timeout records its deadline first (call
//!   `children.deadline`, of the database's clock), so a resumed wait
//!   keeps it and a deadline passes once. Its outcome, once the wait is
//!   met, is recorded as the row of `children.await`: a replay gets the
//!   same outcomes, whatever the children did since.

use serde::Deserialize;
use serde_json::json;

use super::host::leasehold::turn::children::{AwaitMode, ChildOutcome, ChildResult, Host};
use super::host::{Interrupt, SegmentState, WitEffectError, detached};
use super::phase::Phase;
use super::text::decode_error;
use crate::effects::EffectError;
use crate::store::{ChildEnd, ChildState, ChildWait, EffectState, LocalOp, Spawn, usd_to_nanos};

/// Most children one `await-children` may list.
pub const MAX_AWAITED: usize = 10_000;

/// Most attempts a spawn may give its child.
const MAX_CHILD_ATTEMPTS: i64 = 100;

/// Deepest a tree may grow: a run this many levels below its root may not
/// spawn. A plugin granted to spawn itself cannot nest without end.
pub const MAX_TREE_DEPTH: i64 = 32;

/// `spawn`'s `options`, as JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpawnOptions {
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    concurrency_key: Option<String>,
    #[serde(default)]
    max_attempts: Option<i64>,
    #[serde(default)]
    detached: bool,
    #[serde(default)]
    budget: Option<BudgetShare>,
}

/// A share of the tree's budget given to a child (`{"tokens": N}`,
/// `{"usd": X}`, or both).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BudgetShare {
    #[serde(default)]
    tokens: Option<i64>,
    #[serde(default)]
    usd: Option<f64>,
}

impl Host for SegmentState {
    async fn spawn(&mut self, plugin: String, input: String, options: String) -> wasmtime::Result<Result<u64, WitEffectError>> {
        Ok(self.spawn_call(plugin, input, options).await?.map_err(WitEffectError::from))
    }

    async fn await_children(
        &mut self,
        ids: Vec<u64>,
        mode: AwaitMode,
        timeout_ms: Option<u64>,
    ) -> wasmtime::Result<Result<Vec<ChildResult>, WitEffectError>> {
        let any = matches!(mode, AwaitMode::Any);
        let states = self.await_call(ids, any, timeout_ms).await?;
        Ok(states.map(|s| s.into_iter().map(child_result).collect()).map_err(WitEffectError::from))
    }
}

fn child_result(state: ChildState) -> ChildResult {
    let outcome = match state.end {
        ChildEnd::Completed { output } => ChildOutcome::Completed(output),
        ChildEnd::Failed { error } => ChildOutcome::Failed(error),
        ChildEnd::Aborted { error } => ChildOutcome::Aborted(error),
        ChildEnd::Cancelled => ChildOutcome::Cancelled,
        ChildEnd::Pending => ChildOutcome::Pending,
    };
    ChildResult { id: u64::try_from(state.id).unwrap_or_default(), outcome }
}

impl SegmentState {
    /// Whether this plugin may spawn runs of `plugin`.
    fn may_spawn(&self, plugin: &str) -> bool {
        self.limits.spawn_allow.iter().any(|p| p == "*" || p == plugin)
    }

    /// What `spawn` asks for, checked; `Err` is the refusal to record.
    fn checked_spawn(&self, plugin: &str, input: &str, options: &str) -> Result<Spawn, EffectError> {
        if !self.may_spawn(plugin) {
            return Err(EffectError::Denied(format!(
                "spawn: plugin {plugin:?} is not on this plugin's spawn_allow list"
            )));
        }
        if serde_json::from_str::<serde::de::IgnoredAny>(input).is_err() {
            return Err(EffectError::Denied("spawn: the input is not JSON".into()));
        }
        let options = if options.trim().is_empty() { "{}" } else { options };
        let o: SpawnOptions =
            serde_json::from_str(options).map_err(|e| EffectError::Denied(format!("spawn: options: {e}")))?;
        if let Some(priority) = o.priority {
            crate::store::priority::check(priority).map_err(|e| EffectError::Denied(format!("spawn: {e}")))?;
        }
        if let Some(key) = &o.concurrency_key {
            crate::store::concurrency::check_key(key).map_err(|e| EffectError::Denied(format!("spawn: {e}")))?;
        }
        let max_attempts = o.max_attempts.unwrap_or(crate::store::NewRun::DEFAULT_MAX_ATTEMPTS);
        if !(1..=MAX_CHILD_ATTEMPTS).contains(&max_attempts) {
            return Err(EffectError::Denied(format!("spawn: max_attempts must be 1 to {MAX_CHILD_ATTEMPTS}")));
        }
        let budget_tokens = o.budget.as_ref().and_then(|b| b.tokens);
        if budget_tokens.is_some_and(|t| !(0..=1_000_000_000_000).contains(&t)) {
            return Err(EffectError::Denied("spawn: budget.tokens must be 0 to 1000000000000".into()));
        }
        let budget_usd_nanos = match o.budget.as_ref().and_then(|b| b.usd) {
            None => None,
            Some(usd) => Some(usd_to_nanos(usd).ok_or_else(|| EffectError::Denied("spawn: budget.usd must be 0 to 1000000".into()))?),
        };
        Ok(Spawn {
            plugin: plugin.to_string(),
            input: input.to_string(),
            priority: o.priority,
            concurrency_key: o.concurrency_key,
            key_grants: self.limits.spawn_allow.iter().filter_map(|e| e.strip_prefix("key:")).map(str::to_string).collect(),
            max_tree_runs: i64::try_from(self.limits.tree_max_runs).unwrap_or(i64::MAX),
            max_tree_open: i64::try_from(self.limits.tree_max_open).unwrap_or(i64::MAX),
            max_attempts,
            detached: o.detached,
            budget_tokens,
            budget_usd_nanos,
            trace_parent: None,
        })
    }

    async fn spawn_call(&mut self, plugin: String, input: String, options: String) -> wasmtime::Result<Result<u64, EffectError>> {
        self.charge()?;
        let size = plugin.len() + input.len() + options.len();
        let oversized = size > self.limits.max_effect_bytes;
        let request = if oversized {
            format!("<{size} bytes>")
        } else {
            json!({ "plugin": plugin, "input": input, "options": options }).to_string()
        };
        let call = self.call("spawn", &request);
        if let Some(row) = self.replayed(&call).await? {
            return Ok(match row.state {
                EffectState::Committed => Ok(row.result.as_deref().and_then(|r| r.parse().ok()).unwrap_or_default()),
                EffectState::Failed => Err(decode_error(row.result.as_deref().unwrap_or(""))),
                // Never left so: the row is written committed with the child.
                _ => Err(EffectError::InDoubt(format!("spawn (call {}) has no recorded outcome", call.seq))),
            });
        }
        if self.offline {
            return self.frontier(&call, "not recorded: the turn spawns a child here");
        }
        if oversized {
            let error = EffectError::Denied(format!(
                "spawn: a request of {size} bytes is over the {}-byte cap",
                self.limits.max_effect_bytes
            ));
            return Ok(self.refuse(&call, error).await?.map(|_| 0));
        }
        let spawn = match self.checked_spawn(&plugin, &input, &options) {
            // The child's trace goes on from this call's span.
            Ok(spawn) => Spawn { trace_parent: self.trace.as_ref().map(|t| t.call_header(call.seq)), ..spawn },
            Err(error) => return Ok(self.refuse(&call, error).await?.map(|_| 0)),
        };
        let depth = {
            let _db = self.phase.enter(Phase::DATABASE);
            let (db, run) = (self.db.clone(), self.lease.run_id);
            match detached(async move { db.depth(run).await }).await {
                Ok(depth) => depth,
                Err(e) => return self.store_failed(e),
            }
        };
        if depth >= MAX_TREE_DEPTH {
            let error = EffectError::Denied(format!(
                "spawn: this run is {depth} levels below its root; a tree may be at most {MAX_TREE_DEPTH} deep"
            ));
            return Ok(self.refuse(&call, error).await?.map(|_| 0));
        }
        self.room(20)?;
        let _db = self.phase.enter(Phase::DATABASE);
        let started_ns = crate::traces::now_ns();
        self.flush_stream().await?;
        let (db, lease, c) = (self.db.clone(), self.lease.clone(), call.clone());
        match detached(async move { db.spawn_child(&lease, &c, &spawn).await }).await {
            Ok(Some((_, child))) => {
                self.settled += 1;
                self.wrote(&call, 20);
                if let Some(trace) = &self.trace {
                    trace.call(call.seq, "spawn", crate::traces::Kind::Internal, started_ns, vec![("leasehold.child", child.id.into())], None);
                }
                tracing::debug!(run_id = self.lease.run_id, child = child.id, plugin = %child.plugin, "spawned a child run");
                Ok(Ok(u64::try_from(child.id).unwrap_or_default()))
            }
            Ok(None) => {
                let error = EffectError::Denied(format!("spawn: no plugin is registered as {plugin:?}"));
                Ok(self.refuse(&call, error).await?.map(|_| 0))
            }
            // A tree at its caps, or a key the child may not take: recorded,
            // so a replay takes the same branch.
            Err(crate::store::StoreError::Refused(why)) => Ok(self.refuse(&call, EffectError::Denied(format!("spawn: {why}"))).await?.map(|_| 0)),
            Err(e) => self.store_failed(e),
        }
    }

    async fn await_call(&mut self, ids: Vec<u64>, any: bool, timeout_ms: Option<u64>) -> wasmtime::Result<Result<Vec<ChildState>, EffectError>> {
        self.charge()?;
        let ids: Vec<i64> = ids.into_iter().map(|id| i64::try_from(id).unwrap_or(-1)).collect();
        // The deadline, recorded before anything else, from the database's
        // clock: a resumed wait keeps it.
        let deadline = match timeout_ms {
            None => None,
            Some(ms) => {
                let ms = i64::try_from(ms).unwrap_or(i64::MAX / 4);
                let call = self.call("children.deadline", &ms.to_string());
                Some(self.recorded_deadline(call, ms).await?)
            }
        };
        let request = json!({ "ids": ids, "mode": if any { "any" } else { "all" }, "timeout_ms": timeout_ms }).to_string();
        let call = self.call("children.await", &request);
        if let Some(row) = self.replayed(&call).await? {
            return Ok(match row.state {
                EffectState::Committed => serde_json::from_str(row.result.as_deref().unwrap_or("[]"))
                    .map_err(|e| EffectError::Failed(format!("children.await: its recorded outcome does not read: {e}"))),
                EffectState::Failed => Err(decode_error(row.result.as_deref().unwrap_or(""))),
                _ => Err(EffectError::InDoubt(format!("children.await (call {}) has no recorded outcome", call.seq))),
            });
        }
        if self.offline {
            return self.frontier(&call, "not recorded: the turn waits for its children here");
        }
        if ids.is_empty() || ids.len() > MAX_AWAITED {
            let error = EffectError::Denied(format!("children.await: list 1 to {MAX_AWAITED} children, not {}", ids.len()));
            return self.refuse(&call, error).await.map(|r| r.map(|_| Vec::new()));
        }
        let states = {
            let _db = self.phase.enter(Phase::DATABASE);
            let (db, run, list) = (self.db.clone(), self.lease.run_id, ids.clone());
            match detached(async move { db.child_states(run, &list).await }).await {
                Ok(states) => states,
                Err(e) => return self.store_failed(e),
            }
        };
        let mut found = Vec::with_capacity(ids.len());
        for (id, state) in ids.iter().zip(states) {
            match state {
                Some(end) => found.push(ChildState { id: *id, end }),
                None => {
                    let error = EffectError::Denied(format!("children.await: run {id} is not a child of this run"));
                    return self.refuse(&call, error).await.map(|r| r.map(|_| Vec::new()));
                }
            }
        }
        let done = found.iter().filter(|s| s.end.is_done()).count();
        let mut met = if any { done > 0 } else { done == found.len() };
        if let (false, Some(deadline)) = (met, deadline) {
            met = self.db_now().await? >= deadline;
        }
        if !met {
            return self.stop(Interrupt::AwaitChildren(ChildWait { seq: call.seq, ids, any, deadline }));
        }
        let value = serde_json::to_string(&found).expect("child states serialize");
        self.room(value.len())?;
        let _db = self.phase.enter(Phase::DATABASE);
        self.flush_stream().await?;
        match self.local(&call, LocalOp::Record { value }).await {
            Ok(row) => {
                self.settled += 1;
                self.wrote(&call, row.result.as_ref().map_or(0, String::len));
                Ok(Ok(found))
            }
            Err(e) => self.store_failed(e),
        }
    }

    /// The deadline recorded at `call` (epoch ms of the database's clock),
    /// or, on new ground, now plus `ms`, recorded.
    pub(super) async fn recorded_deadline(&mut self, call: crate::store::EffectCall, ms: i64) -> wasmtime::Result<i64> {
        if let Some(row) = self.replayed(&call).await? {
            return Ok(row.result.as_deref().and_then(|r| r.parse().ok()).unwrap_or(0));
        }
        if self.offline {
            return self.frontier(&call, "not recorded: the turn starts a wait for its children here");
        }
        self.room(20)?;
        let deadline = self.db_now().await?.saturating_add(ms);
        let _db = self.phase.enter(Phase::DATABASE);
        self.flush_stream().await?;
        if let Err(e) = self.local(&call, LocalOp::Record { value: deadline.to_string() }).await {
            return self.store_failed(e);
        }
        self.settled += 1;
        self.wrote(&call, 20);
        Ok(deadline)
    }
}
