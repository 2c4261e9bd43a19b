//! `POST /v1/runs/{id}/rerun`: a new run from a point in a run's ledger
//! (docs/operations.md, "Rerunning from a point in the ledger";
//! `store::rerun`). The prefix is replayed offline first, on the version
//! the rerun is to run: one that does not replay is refused.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use utoipa::ToSchema;

use super::{ApiError, AppState, ErrorBody, JsonBody, Params};
use crate::runtime::offline::{self, Outcome, Recording};
use crate::store::Run;

/// Where the rerun starts, and on which version.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RerunRequest {
    /// The ledger position it runs live from: the rows below it are
    /// replayed, none performed. 0 to the number of rows.
    #[schema(minimum = 0)]
    from_seq: i64,
    /// A version of the same plugin to run (its digest; the prefix must
    /// replay on it). Default: the version the run has.
    plugin_digest: Option<String>,
}

/// `POST /v1/runs/{id}/rerun`.
#[utoipa::path(post, path = "/v1/runs/{id}/rerun", tag = "runs", request_body = RerunRequest,
    params(("id" = i64, Path, description = "The run to rerun; it is not changed.")),
    responses(
        (status = 201, description = "The new run, queued; `rerun_of` names the old one.", body = Run),
        (status = 400, description = "A bad body.", body = ErrorBody),
        (status = 404, description = "No such run, or no such version of its plugin.", body = ErrorBody),
        (status = 409, description = "from_seq out of range, a prefix not settled or tied to children or an inbox, or one that does not replay; or a child in a tree with a budget.", body = ErrorBody),
        (status = 503, description = "`max_replays` (2) reruns are replaying their prefix on this host; try again after `Retry-After`.", body = ErrorBody),
    ))]
pub async fn rerun(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    JsonBody(req): JsonBody<RerunRequest>,
) -> Result<(StatusCode, Json<Run>), ApiError> {
    let (old, prefix) = s.store.rerun_prefix(id, req.from_seq).await?;
    // Each replays a ledger offline in the request: bounded, as uploads are.
    let Ok(_replaying) = s.replays.clone().try_acquire_owned() else {
        return Err(ApiError::busy(format!(
            "{} reruns are replaying their prefix, this host's most at once; try again shortly",
            s.config.max_replays
        )));
    };
    let digest = req.plugin_digest.clone().unwrap_or_else(|| old.plugin_digest.clone());
    let no_version = || ApiError::not_found(format!("plugin {:?} has no version {digest:?}", old.plugin));
    let plugin = match crate::plugins::resolve(&s.store, &s.runtime, &old.plugin, &digest).await {
        Ok(Some(plugin)) => plugin,
        Ok(None) => return Err(no_version()),
        Err(crate::plugins::RegisterError::Store(e)) => return Err(e.into()),
        Err(e) => return Err(ApiError::new(StatusCode::CONFLICT, "refused", format!("plugin {:?} version {digest:?} cannot be loaded: {e}", old.plugin))),
    };
    let recording = Recording {
        run_id: old.id,
        input: old.input.clone(),
        created_at_ms: old.created_at,
        secret: old.secret.clone(),
        effects: prefix,
        emit_pos: 0,
        output: None,
        partial: String::new(),
    };
    let report = offline::replay(&s.runtime, &plugin, recording, s.config.request_timeout / 2).await?;
    let refused = |why: String| Err(ApiError::new(StatusCode::CONFLICT, "refused", format!("the ledger below {} does not replay on version {}: {why}", req.from_seq, plugin.digest)));
    match &report.outcome {
        Outcome::Diverged { divergence } => return refused(format!("call {}: {}", divergence.seq, divergence.why)),
        Outcome::Stopped { reason } => return refused(reason.clone()),
        Outcome::Returned { .. } | Outcome::Failed { .. } | Outcome::Frontier { .. } => {}
    }
    // Without a version asked for, the rerun keeps the run's own (even
    // none: a run that takes whatever version is current).
    let run = s.store.rerun(&old, req.from_seq, req.plugin_digest.as_deref().unwrap_or(&old.plugin_digest)).await?;
    tracing::info!(run_id = run.id, rerun_of = id, from_seq = req.from_seq, digest = %plugin.digest, "run rerun from a ledger position");
    Ok((StatusCode::CREATED, Json(run)))
}
