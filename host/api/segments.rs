//! `GET /v1/runs/{id}/segments`: the segments hosts recorded for a run
//! (`store::segments`), for the run page's time line: each one's host,
//! fence, times and outcome.

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::{ApiError, AppState, ErrorBody, Params};
use crate::store::segments::SegmentRecord;

/// A run's recorded segments, by fence.
#[derive(Serialize, ToSchema)]
pub struct Segments {
    /// At most 1,000. A segment whose host died while running it has no
    /// record (its ledger rows still carry its fence), and a record is
    /// written up to a second after its segment ends.
    segments: Vec<SegmentRecord>,
}

/// `GET /v1/runs/{id}/segments`.
#[utoipa::path(get, path = "/v1/runs/{id}/segments", tag = "runs",
    params(("id" = i64, Path, description = "The run's id.")),
    responses(
        (status = 200, description = "The run's recorded segments, by fence.", body = Segments),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn segments(State(s): State<AppState>, Params(id): Params<i64>) -> Result<Json<Segments>, ApiError> {
    s.store.get_run(id).await?;
    Ok(Json(Segments { segments: s.store.segments(id).await? }))
}
