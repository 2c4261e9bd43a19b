//! Effect providers, one file each. A provider turns a guest's
//! `effect(name, request)` into either a *local* operation, applied in the
//! host's database in the same transaction as its ledger row, or a *remote*
//! one (keyed or unkeyed, DESIGN.md §3), performed between its `started`
//! and `committed` rows.
//!
//! Built so far: `kv.get` / `kv.put` (local). `http` and `model.chat`
//! (keyed) are the next providers to add; until then they are unknown names
//! and a guest calling them gets `denied`.

pub mod kv;

use crate::ledger::LocalOp;
use crate::runtime::host::EffectError;
use crate::store::EffectClass;

/// What an effect call resolves to.
#[derive(Debug)]
pub enum Effect {
    Local(LocalOp),
    Remote { class: EffectClass, request: String },
}

/// What a remote provider knows about the call it performs.
#[derive(Debug, Clone)]
pub struct RemoteCtx {
    pub run_id: i64,
    pub seq: i64,
    pub fence: i64,
    pub max_result_bytes: usize,
}

impl RemoteCtx {
    /// `<run_id>:<seq>`: stable across attempts, so a re-issued request is
    /// deduplicated by the remote side.
    pub fn idempotency_key(&self) -> String {
        crate::ledger::idempotency_key(self.run_id, self.seq)
    }
}

/// Resolves `name` for a plugin whose kv namespace is `namespace`.
/// `Err` is a refusal, recorded like any result.
pub fn resolve(name: &str, request: &str, namespace: &str) -> Result<Effect, EffectError> {
    match name {
        "kv.get" | "kv.put" => kv::op(name, request, namespace).map(Effect::Local),
        _ => Err(EffectError::Denied(format!("unknown effect provider {name:?}"))),
    }
}

/// Performs a remote effect. No remote provider is built yet (see the
/// module docs), so [`resolve`] never yields one and this refuses.
pub async fn perform_remote(name: &str, _request: &str, _ctx: &RemoteCtx) -> Result<String, EffectError> {
    Err(EffectError::Denied(format!("no remote provider {name:?} on this host")))
}
