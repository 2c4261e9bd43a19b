//! `POST /v1/runs/{id}/effects/{seq}/resolve`: an operator writes the
//! outcome of a call in doubt or failed, and the run goes on from it
//! (docs/operations.md, "Resolving an effect by hand"; `store::resolve`).

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiError, AppState, ErrorBody, JsonBody, Params};
use crate::effects::EffectError;
use crate::store::{EffectRow, Resolution, Run};

/// The longest `by`, in characters.
const MAX_BY_CHARS: usize = 200;

/// What the call did: `result` (it happened, and returned this) or `error`
/// (it did not, and fails with this message), one of the two.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveRequest {
    /// The call's result: the JSON value it returns (the turn receives it
    /// as JSON text, as from the provider).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<serde_json::Value>)]
    result: Option<serde_json::Value>,
    /// The call failed with this message (the turn sees a `failed` error).
    #[schema(min_length = 1, max_length = 10_000)]
    error: Option<String>,
    /// Who resolved it, recorded with the row (1 to 200 characters, no
    /// control characters). Default: `api`.
    #[schema(min_length = 1, max_length = 200)]
    by: Option<String>,
}

/// `Some(value)` for a field that is there, `null` included.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

/// The row as resolved, and its run as it now stands.
#[derive(Serialize, ToSchema)]
pub struct Resolved {
    effect: EffectRow,
    run: Run,
}

/// `POST /v1/runs/{id}/effects/{seq}/resolve`.
#[utoipa::path(post, path = "/v1/runs/{id}/effects/{seq}/resolve", tag = "runs", request_body = ResolveRequest,
    params(("id" = i64, Path, description = "The run."), ("seq" = i64, Path, description = "The ledger row's position.")),
    responses(
        (status = 200, description = "Resolved: the row and the run (a failed or aborted run is queued again).", body = Resolved),
        (status = 400, description = "Neither or both of `result` and `error`, or a bad `by`.", body = ErrorBody),
        (status = 404, description = "No such run, or no row at that position.", body = ErrorBody),
        (status = 409, description = "The run is running or has ended, the row is committed, or a later row exists.", body = ErrorBody),
    ))]
pub async fn resolve(
    State(s): State<AppState>,
    Params((id, seq)): Params<(i64, i64)>,
    JsonBody(req): JsonBody<ResolveRequest>,
) -> Result<Json<Resolved>, ApiError> {
    let resolution = match (req.result, req.error) {
        (Some(result), None) => Resolution::Result(result.to_string()),
        (None, Some(error)) if !error.is_empty() && error.chars().count() <= 10_000 && !error.contains('\0') => {
            Resolution::Error(crate::runtime::encode_error(&EffectError::Failed(error)))
        }
        (None, Some(_)) => return Err(ApiError::bad_request("error must be a message of 1 to 10000 characters without NUL characters")),
        _ => return Err(ApiError::bad_request("give exactly one of `result` (the call happened) and `error` (it did not)")),
    };
    let by = req.by.unwrap_or_else(|| "api".to_string());
    let chars = by.chars().count();
    if chars == 0 || chars > MAX_BY_CHARS || by.chars().any(char::is_control) {
        return Err(ApiError::bad_request(format!("by must be 1 to {MAX_BY_CHARS} characters without control characters")));
    }
    let (effect, run) = s.store.resolve_effect(id, seq, &resolution, &by).await?;
    tracing::info!(run_id = id, seq, by, state = effect.state.as_str(), run_status = %run.status, "effect resolved by hand");
    Ok(Json(Resolved { effect, run }))
}
