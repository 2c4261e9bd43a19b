//! `GET /v1/runs/{id}/children`: the runs a run's turn spawned (see
//! docs/concepts.md, "Child runs"), newest first, paged like `/v1/runs`.

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use utoipa::IntoParams;

use super::runs::RunsPage;
use super::{ApiError, AppState, ErrorBody, Params, QueryParams};
use crate::store::RunFilter;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ChildrenQuery {
    /// Runs per page, 1 to 1000. Default: 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// A `next_cursor` from the page before.
    cursor: Option<i64>,
}

/// `GET /v1/runs/{id}/children?limit=&cursor=`.
#[utoipa::path(get, path = "/v1/runs/{id}/children", tag = "runs",
    params(("id" = i64, Path, description = "The parent run's id."), ChildrenQuery),
    responses(
        (status = 200, description = "A page of the run's children, newest first.", body = RunsPage),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn children(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    QueryParams(q): QueryParams<ChildrenQuery>,
) -> Result<Json<RunsPage>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 1000"));
    }
    s.store.get_run(id).await?;
    let filter = RunFilter { parent: Some(id), ..RunFilter::default() };
    let (runs, cut) = s.store.runs_page(&filter, q.cursor, limit, s.config.max_page_bytes).await?;
    let next_cursor = (runs.len() as i64 == limit || cut).then(|| runs.last().map(|r| r.id)).flatten();
    Ok(Json(RunsPage { runs, next_cursor }))
}
