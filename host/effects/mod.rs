//! Effect providers, one file each. A provider turns a guest's
//! `effect(name, request)` into either a *local* operation, applied in the
//! host's database in the same transaction as its ledger row, or a *remote*
//! one (keyed or unkeyed, see docs/concepts.md), performed between its `started`
//! and `committed` rows.
//!
//! Providers: `kv.get` / `kv.put` (local), `http` and `model.chat` (keyed)
//! and `http.unkeyed` (unkeyed). Any other name is `denied`.

pub mod http;
pub mod kv;
pub mod model;
pub mod model_grant;
pub mod prices;
pub mod rate;

use crate::store::{EffectClass, LocalOp};

/// Why an effect produced no result: the WIT `effect-error` a turn sees
/// (see `wit/turn.wit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectError {
    /// The provider ran and failed (an HTTP error status, a bad request).
    Failed(String),
    /// An unkeyed effect was started by a segment that died: it may or may
    /// not have happened.
    InDoubt(String),
    /// Refused without being performed.
    Denied(String),
}

/// What an effect call resolves to.
#[derive(Debug)]
pub enum Effect {
    Local(LocalOp),
    Remote(Remote),
}

/// A remote effect, checked and ready to perform.
#[derive(Debug, Clone)]
pub enum Remote {
    Http { name: &'static str, class: EffectClass, request: http::HttpRequest },
    Chat { request: model::ChatRequest },
}

impl Remote {
    pub fn class(&self) -> EffectClass {
        match self {
            Remote::Http { class, .. } => *class,
            Remote::Chat { .. } => EffectClass::Keyed,
        }
    }

    /// The same effect, to try again under the same key.
    pub fn again(&self) -> Remote {
        self.clone()
    }
}

/// Why a remote effect gave no result.
#[derive(Debug)]
pub enum RemoteFailure {
    /// A result the guest sees (and the ledger records).
    Effect(EffectError),
    /// A re-issue answered "in progress" (`409`, `425`): a deduplicating
    /// server is still working on the dead segment's request with this key.
    /// Not a result: the host tries again, or leaves the call in doubt. The
    /// answer, for messages.
    InProgress(String),
    /// A `429` or `503` with `Retry-After`: a result the guest sees, and
    /// every call to the same rate key, on every host, is held until then
    /// (`store::rates`).
    Throttled { error: EffectError, retry_after: std::time::Duration },
}

impl From<EffectError> for RemoteFailure {
    fn from(e: EffectError) -> RemoteFailure {
        RemoteFailure::Effect(e)
    }
}

/// Whether `status` answers a re-issue with "the first request with this
/// key is still in progress" (409 Conflict, 425 Too Early), as
/// deduplicating servers do.
pub(crate) fn in_progress(status: u16, ctx: &RemoteCtx) -> bool {
    ctx.reissue && (status == 409 || status == 425)
}

/// What a remote provider knows about the call it performs.
#[derive(Debug, Clone)]
pub struct RemoteCtx {
    pub run_id: i64,
    pub seq: i64,
    pub fence: i64,
    pub max_result_bytes: usize,
    /// `<database id>:<run_id>:<seq>` (see [`crate::store::idempotency_key`]):
    /// sent as `Idempotency-Key`.
    pub idempotency_key: String,
    /// This call re-issues one a dead segment started: an "in progress"
    /// answer (409, 425) means that one may still be running.
    pub reissue: bool,
    /// The W3C `traceparent` of the call's span (`traces`): `http` sends
    /// it unless the guest set its own.
    pub traceparent: Option<String>,
}

impl RemoteCtx {
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }
}

/// What a plugin is granted: its kv namespace, its HTTP allow-list and the
/// host's model endpoint.
pub struct Grants<'a> {
    pub namespace: &'a str,
    pub http_allow: &'a [String],
    /// Addresses `http` reaches only when an allow-list entry names them
    /// with their port: the service's own API.
    pub reserved: &'a [std::net::SocketAddr],
    pub model: Option<&'a model::ModelConfig>,
    /// What this plugin may ask of the model.
    pub model_grant: &'a crate::store::ModelGrant,
    /// Largest `kv.put` value.
    pub max_kv_value_bytes: usize,
}

/// Resolves `name` for a plugin. `Err` is a refusal, recorded like any
/// result, so replay returns it again.
pub fn resolve(name: &str, request: &str, grants: &Grants<'_>) -> Result<Effect, EffectError> {
    match name {
        "kv.get" | "kv.put" => kv::op(name, request, grants.namespace, grants.max_kv_value_bytes).map(Effect::Local),
        "http" => Ok(Effect::Remote(Remote::Http {
            name: "http",
            class: EffectClass::Keyed,
            request: http::check(name, request, grants.http_allow, grants.reserved)?,
        })),
        "http.unkeyed" => Ok(Effect::Remote(Remote::Http {
            name: "http.unkeyed",
            class: EffectClass::Unkeyed,
            request: http::check(name, request, grants.http_allow, grants.reserved)?,
        })),
        "model.chat" => Ok(Effect::Remote(Remote::Chat {
            request: model::check(request, grants.model, grants.model_grant)?,
        })),
        _ => Err(EffectError::Denied(format!("unknown effect provider {name:?}"))),
    }
}

/// Performs a remote effect. Dropping the future aborts the request (a
/// courtesy; the ledger's `started` row is what makes it safe).
/// `sink` receives streamed deltas (`model.chat`); `http` goes out
/// through `egress`.
pub async fn perform_remote(
    remote: Remote,
    ctx: &RemoteCtx,
    model: Option<&model::ModelConfig>,
    egress: &http::Egress,
    sink: &mut impl model::DeltaSink,
) -> Result<String, RemoteFailure> {
    match remote {
        Remote::Http { name, request, .. } => http::perform(name, request, ctx, egress).await,
        Remote::Chat { request } => match model {
            Some(config) => model::perform(request, config, ctx, sink).await,
            None => Err(EffectError::Denied("model.chat: no model endpoint is configured".into()).into()),
        },
    }
}
