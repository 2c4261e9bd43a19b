//! `/v1/limits`: concurrency keys' limits and pauses (docs/flow-control.md).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, AppState, ErrorBody, JsonBody, Params, QueryParams};
use crate::store::concurrency::{KeyLimit, check_concurrency, check_key};

/// Most keys a page of `GET /v1/limits` holds.
const MAX_PAGE: i64 = 1000;

/// A key's limit.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetLimit {
    /// The most of the key's runs that run at once, 1 to 1000000; null or
    /// absent: no limit (its runs still take turns with other keys').
    #[schema(minimum = 1, maximum = 1000000)]
    #[serde(default, deserialize_with = "super::runs::whole_number")]
    concurrency: Option<i64>,
    /// While true its runs stay queued: none is claimed, and a running one
    /// finishes its segment and then waits. Default: false.
    #[serde(default)]
    paused: bool,
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Keys after this one, by key (the last key of the previous page).
    #[param(max_length = 256)]
    after: Option<String>,
    /// Keys per page, 1 to 1000. Default: 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// A page of keys, by key.
#[derive(Serialize, ToSchema)]
pub struct LimitsPage {
    limits: Vec<KeyLimit>,
    /// The `after` of the next page; null on the last.
    next: Option<String>,
}

fn key_of(key: &str) -> Result<(), ApiError> {
    check_key(key).map_err(ApiError::bad_request)
}

/// `PUT /v1/limits/{key}` with `{"concurrency": N, "paused": false}`.
#[utoipa::path(put, path = "/v1/limits/{key}", tag = "limits", request_body = SetLimit,
    params(("key" = String, Path, min_length = 1, max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]+$", description = "The concurrency key: 1 to 256 characters, no control characters, not starting with `http:` or `model:`.")),
    responses(
        (status = 200, description = "The key with its new limit and its runs now.", body = KeyLimit),
        (status = 400, description = "A bad key or limit.", body = ErrorBody),
        (status = 415, description = "The body is not said to be JSON (Content-Type: application/json).", body = ErrorBody),
    ))]
pub async fn put(
    State(s): State<AppState>,
    Params(key): Params<String>,
    JsonBody(req): JsonBody<SetLimit>,
) -> Result<Json<KeyLimit>, ApiError> {
    key_of(&key)?;
    if let Some(n) = req.concurrency {
        check_concurrency(n).map_err(ApiError::bad_request)?;
    }
    let limit = s.store.set_limit(&key, req.concurrency, req.paused).await?;
    tracing::info!(key, concurrency = ?req.concurrency, paused = req.paused, "limit set");
    Ok(Json(limit))
}

/// `GET /v1/limits/{key}`: its limit, and how many of its runs are queued
/// and running now.
#[utoipa::path(get, path = "/v1/limits/{key}", tag = "limits",
    params(("key" = String, Path, min_length = 1, max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]+$", description = "The concurrency key: 1 to 256 characters, no control characters, not starting with `http:` or `model:`.")),
    responses(
        (status = 200, description = "The key.", body = KeyLimit),
        (status = 404, description = "The key has neither a limit nor runs.", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(key): Params<String>) -> Result<Json<KeyLimit>, ApiError> {
    key_of(&key)?;
    s.store.limit(&key).await?.map(Json).ok_or_else(|| ApiError::not_found(format!("no key {key:?}")))
}

/// `GET /v1/limits`: the keys with a limit, paused, or with runs to claim.
#[utoipa::path(get, path = "/v1/limits", tag = "limits", params(ListQuery),
    responses((status = 200, description = "A page of keys.", body = LimitsPage)))]
pub async fn list(State(s): State<AppState>, QueryParams(q): QueryParams<ListQuery>) -> Result<Json<LimitsPage>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!("limit must be between 1 and {MAX_PAGE}")));
    }
    let after = q.after.unwrap_or_default();
    if after.chars().count() > 256 {
        return Err(ApiError::bad_request("after is at most 256 characters"));
    }
    let limits = s.store.limits(&after, limit).await?;
    let next = (limits.len() as i64 == limit).then(|| limits.last().map(|l| l.key.clone())).flatten();
    Ok(Json(LimitsPage { limits, next }))
}

/// `DELETE /v1/limits/{key}`: clears its limit and pause.
#[utoipa::path(delete, path = "/v1/limits/{key}", tag = "limits",
    params(("key" = String, Path, min_length = 1, max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]+$", description = "The concurrency key: 1 to 256 characters, no control characters, not starting with `http:` or `model:`.")),
    responses(
        (status = 204, description = "Cleared: its runs are claimed without a limit."),
        (status = 404, description = "The key had no limit and was not paused.", body = ErrorBody),
    ))]
pub async fn remove(State(s): State<AppState>, Params(key): Params<String>) -> Result<StatusCode, ApiError> {
    key_of(&key)?;
    if s.store.remove_limit(&key).await? {
        tracing::info!(key, "limit removed");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("key {key:?} has no limit")))
    }
}
