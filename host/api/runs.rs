//! `/v1/runs`: submit, list, show, deliver input, cancel, ledger.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiError, AppState, JsonBody, Params, QueryParams};
use crate::store::{MAX_SUBMIT_BATCH, NewRun, RunStatus};

/// Longest thread id or idempotency key.
const MAX_KEY_BYTES: usize = 256;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    plugin: String,
    #[serde(default)]
    input: Value,
    thread_id: Option<String>,
    max_attempts: Option<i64>,
    idempotency_key: Option<String>,
}

fn check_key(what: &str, v: &Option<String>) -> Result<(), ApiError> {
    if let Some(v) = v
        && (v.is_empty() || v.len() > MAX_KEY_BYTES || v.contains('\0'))
    {
        return Err(ApiError::bad_request(format!(
            "{what} must be 1 to {MAX_KEY_BYTES} bytes without NUL characters"
        )));
    }
    Ok(())
}

/// `POST /v1/runs`: 201 with the new run; 200 with the existing run when the
/// `idempotency_key` was seen before with the same request (409 if not).
pub async fn submit(State(s): State<AppState>, JsonBody(req): JsonBody<Submit>) -> Result<Response, ApiError> {
    check_key("thread_id", &req.thread_id)?;
    check_key("idempotency_key", &req.idempotency_key)?;
    if let Some(n) = req.max_attempts
        && !(1..=1000).contains(&n)
    {
        return Err(ApiError::bad_request("max_attempts must be between 1 and 1000"));
    }
    if !crate::plugins::valid_name(&req.plugin) {
        return Err(ApiError::not_found(format!("no plugin named {:?}", req.plugin)));
    }
    let Some(digest) = s.store.plugin_digest(&req.plugin).await? else {
        return Err(ApiError::not_found(format!("no plugin named {:?}", req.plugin)));
    };
    // The guest receives the input as JSON text.
    let input = req.input.to_string();
    let new = NewRun {
        plugin: req.plugin.clone(),
        plugin_digest: digest,
        input: input.clone(),
        thread_id: req.thread_id.clone(),
        max_attempts: req.max_attempts,
        idempotency_key: req.idempotency_key.clone(),
    };
    let (run, created) = s.store.create_run(&new).await?;
    if !created {
        let same = run.plugin == req.plugin
            && run.input == input
            && req.thread_id.as_ref().is_none_or(|t| *t == run.thread_id);
        if !same {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_conflict",
                format!("idempotency_key was already used for run {} with a different request", run.id),
            ));
        }
        return Ok((StatusCode::OK, Json(run)).into_response());
    }
    tracing::info!(run_id = run.id, plugin = %run.plugin, thread_id = %run.thread_id, "run submitted");
    Ok((StatusCode::CREATED, Json(run)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    runs: Vec<Submit>,
}

/// `POST /v1/runs:batch`: up to [`MAX_SUBMIT_BATCH`] runs in one commit,
/// each with its own `idempotency_key` (so a batch whose answer was lost can
/// be sent again) and its own thread. 200 with one result per run, in
/// order: `{"created": true|false, "run": …}`, or `{"error": …}` for a run
/// whose key was used before with a different request (it writes nothing).
/// A batch with any invalid run writes nothing and gets 4xx naming the run.
pub async fn submit_batch(State(s): State<AppState>, JsonBody(req): JsonBody<Batch>) -> Result<Response, ApiError> {
    if req.runs.is_empty() || req.runs.len() > MAX_SUBMIT_BATCH {
        return Err(ApiError::bad_request(format!(
            "runs must hold 1 to {MAX_SUBMIT_BATCH} runs, not {}",
            req.runs.len()
        )));
    }
    let mut digests = std::collections::HashMap::new();
    let mut news = Vec::with_capacity(req.runs.len());
    for (i, r) in req.runs.iter().enumerate() {
        let at = |e: ApiError| e.prefixed(&format!("runs[{i}]: "));
        if r.idempotency_key.is_none() {
            return Err(at(ApiError::bad_request(
                "idempotency_key is required in a batch, so that sending it again cannot run anything twice",
            )));
        }
        check_key("thread_id", &r.thread_id).map_err(at)?;
        check_key("idempotency_key", &r.idempotency_key).map_err(at)?;
        if let Some(n) = r.max_attempts
            && !(1..=1000).contains(&n)
        {
            return Err(at(ApiError::bad_request("max_attempts must be between 1 and 1000")));
        }
        let digest = match digests.get(&r.plugin) {
            Some(d) => d,
            None => {
                let d = if crate::plugins::valid_name(&r.plugin) { s.store.plugin_digest(&r.plugin).await? } else { None };
                digests.entry(r.plugin.clone()).or_insert(d)
            }
        };
        let Some(digest) = digest.clone() else {
            return Err(at(ApiError::not_found(format!("no plugin named {:?}", r.plugin))));
        };
        news.push(NewRun {
            plugin: r.plugin.clone(),
            plugin_digest: digest,
            input: r.input.to_string(),
            thread_id: r.thread_id.clone(),
            max_attempts: r.max_attempts,
            idempotency_key: r.idempotency_key.clone(),
        });
    }
    let written = s.store.create_runs(&news).await?;
    let mut results = Vec::with_capacity(written.len());
    for ((run, created), (new, r)) in written.into_iter().zip(news.iter().zip(&req.runs)) {
        let same = created
            || (run.plugin == new.plugin
                && run.input == new.input
                && r.thread_id.as_ref().is_none_or(|t| *t == run.thread_id));
        results.push(if same {
            json!({ "created": created, "run": run })
        } else {
            json!({ "error": {
                "code": "idempotency_conflict",
                "message": format!("idempotency_key was already used for run {} with a different request", run.id),
            } })
        });
    }
    let created = results.iter().filter(|r| r["created"] == true).count();
    tracing::info!(runs = results.len(), created, "batch submitted");
    Ok(Json(json!({ "results": results })).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    status: Option<String>,
    plugin: Option<String>,
    limit: Option<i64>,
    cursor: Option<i64>,
}

/// `GET /v1/runs?status=&plugin=&limit=&cursor=`: newest first, at most
/// `limit` (default 50, at most 1000) and about `max_page_bytes`;
/// `next_cursor` pages on.
pub async fn list(State(s): State<AppState>, QueryParams(q): QueryParams<ListQuery>) -> Result<Json<Value>, ApiError> {
    let status = match q.status.as_deref() {
        None | Some("") => None,
        Some(st) => Some(st.parse::<RunStatus>().map_err(|_| {
            ApiError::bad_request(
                "status must be one of queued, running, waiting_input, waiting_takeover, completed, failed, aborted, cancelled",
            )
        })?),
    };
    let limit = q.limit.unwrap_or(50);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 1000"));
    }
    let plugin = q.plugin.as_deref().filter(|p| !p.is_empty());
    if plugin.is_some_and(|p| p.contains('\0')) {
        return Err(ApiError::bad_request("plugin must not contain NUL characters"));
    }
    let (runs, cut) = s.store.runs_page(status, plugin, q.cursor, limit, s.config.max_page_bytes).await?;
    // A page ends early when its rows reach the byte cap; the cursor pages on.
    let next = (runs.len() as i64 == limit || cut).then(|| runs.last().map(|r| r.id)).flatten();
    Ok(Json(json!({ "runs": runs, "next_cursor": next })))
}

pub async fn show(State(s): State<AppState>, Params(id): Params<i64>) -> Result<Response, ApiError> {
    Ok(Json(s.store.get_run(id).await?).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    input: Value,
}

/// `POST /v1/runs/{id}/input`: a string is delivered as it is, any other
/// JSON as its text. 409 unless the run is waiting for input.
pub async fn input(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    JsonBody(req): JsonBody<Input>,
) -> Result<Response, ApiError> {
    let input = match req.input {
        Value::String(s) => s,
        other => other.to_string(),
    };
    if input.contains('\0') {
        return Err(ApiError::bad_request("input must not contain NUL characters"));
    }
    let run = s.store.deliver_input(id, &input).await?;
    tracing::info!(run_id = id, "input delivered");
    Ok(Json(run).into_response())
}

/// `POST /v1/runs/{id}/cancel`: 409 if the run has finished.
pub async fn cancel(State(s): State<AppState>, Params(id): Params<i64>) -> Result<Response, ApiError> {
    let run = s.store.cancel(id).await?;
    tracing::info!(run_id = id, fence = run.fence, "run cancelled");
    Ok(Json(run).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EffectsQuery {
    after: Option<i64>,
    limit: Option<i64>,
}

/// `GET /v1/runs/{id}/effects?after=&limit=`: the ledger rows after seq
/// `after`, by seq: at most `limit` (default 1000, at most 10000) and
/// about `max_page_bytes`; `next_after` pages on.
pub async fn effects(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    QueryParams(q): QueryParams<EffectsQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = q.limit.unwrap_or(1000);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 10000"));
    }
    s.store.get_run(id).await?;
    let (rows, cut) = s.store.effects_capped(id, q.after.unwrap_or(-1), limit, s.config.max_page_bytes).await?;
    let next = (rows.len() as i64 == limit || cut).then(|| rows.last().map(|r| r.seq)).flatten();
    Ok(Json(json!({ "effects": rows, "next_after": next })))
}
