//! `POST /v1/runs/{id}/pause` and `/resume` (docs/operations.md, "Pausing
//! a run"; `store::pause`): a paused run is not claimed, and a running one
//! stops at its next slice point.

use axum::Json;
use axum::extract::State;

use super::runs::Cancel;
use super::{ApiError, AppState, ErrorBody, JsonBody, Params};
use crate::store::Run;

/// `POST /v1/runs/{id}/pause` with `{}`.
#[utoipa::path(post, path = "/v1/runs/{id}/pause", tag = "runs", request_body = Cancel,
    params(("id" = i64, Path, description = "The run's id.")),
    responses(
        (status = 200, description = "The run, paused (`paused_at` set); a running one stops at its next slice point.", body = Run),
        (status = 404, description = "No such run.", body = ErrorBody),
        (status = 409, description = "The run has finished.", body = ErrorBody),
    ))]
pub async fn pause(State(s): State<AppState>, Params(id): Params<i64>, JsonBody(Cancel {}): JsonBody<Cancel>) -> Result<Json<Run>, ApiError> {
    let run = s.store.pause_run(id).await?;
    tracing::info!(run_id = id, status = %run.status, "run paused");
    Ok(Json(run))
}

/// `POST /v1/runs/{id}/resume` with `{}`.
#[utoipa::path(post, path = "/v1/runs/{id}/resume", tag = "runs", request_body = Cancel,
    params(("id" = i64, Path, description = "The run's id.")),
    responses(
        (status = 200, description = "The run, resumed (due when it would have been unpaused); one not paused is as it was.", body = Run),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn resume(State(s): State<AppState>, Params(id): Params<i64>, JsonBody(Cancel {}): JsonBody<Cancel>) -> Result<Json<Run>, ApiError> {
    let run = s.store.resume_run(id).await?;
    tracing::info!(run_id = id, status = %run.status, "run resumed");
    Ok(Json(run))
}
