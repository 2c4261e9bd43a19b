//! `/v1/runs`: submit, list, show, deliver input, cancel, ledger.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, AppState, ErrorBody, ErrorDetail, JsonBody, Params, QueryParams};
use crate::store::{EffectRow, BudgetLimits, MAX_SUBMIT_BATCH, NewRun, Run, RunFilter, RunStatus, usd_to_nanos};

/// Longest thread id or idempotency key, in characters.
const MAX_KEY_CHARS: usize = 256;

/// A run to submit.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    /// A registered plugin's name.
    #[schema(pattern = "^[a-z0-9_-]{1,64}$", example = "testkit")]
    plugin: String,
    /// The turn's input: any JSON (the guest receives its text). Default: null.
    #[serde(default)]
    input: Value,
    /// The thread the run's events go to (1 to 256 bytes). Default: a new
    /// thread (a random UUID).
    #[schema(min_length = 1, max_length = 256, pattern = r"^[^\u0000]+$")]
    thread_id: Option<String>,
    /// Attempts before the run fails, 1 to 1000. Default: 3.
    #[schema(minimum = 1, maximum = 1000)]
    #[serde(default, deserialize_with = "whole_number")]
    max_attempts: Option<i64>,
    /// A key (1 to 256 bytes) that makes sending the same request again
    /// return the first run.
    #[schema(min_length = 1, max_length = 256, pattern = r"^[^\u0000]+$")]
    idempotency_key: Option<String>,
    /// Higher is claimed first, -1000 to 1000; within one priority, runs
    /// start in the order they became ready. Default: 0.
    #[schema(minimum = -1000, maximum = 1000)]
    #[serde(default, deserialize_with = "whole_number")]
    priority: Option<i64>,
    /// Its concurrency key (a tenant, a user, a document: 1 to 256
    /// characters, no control characters, not starting with `http:` or
    /// `model:`): its runs share the key's limit (`/v1/limits`) and take
    /// turns with other keys' runs. Default: none.
    #[schema(min_length = 1, max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]+$")]
    concurrency_key: Option<String>,
    /// What the run's tree (it and every run it spawns) may spend on
    /// `model.chat`, as the answers report it (docs/concepts.md,
    /// "Budgets"). Default: no budget.
    #[serde(default, deserialize_with = "budget_object")]
    budget: Option<BudgetRequest>,
}

/// A tree's budget: tokens, US dollars, or both (neither, `{}`: no budget
/// on a submit, no change on a run).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetRequest {
    /// Tokens, 0 to 10^12. Default: no budget in tokens (or, when set on
    /// a run, the one it has).
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 1_000_000_000_000i64)]
    #[serde(default)]
    pub(crate) tokens: Option<serde_json::Number>,
    /// US dollars, 0 to 10^6, spent at the prices `serve --model-price`
    /// gives; a call to a model with no price is denied under it.
    /// Default: no budget in dollars (or, when set on a run, the one it
    /// has).
    #[schema(minimum = 0, maximum = 1_000_000)]
    #[serde(default)]
    pub(crate) usd: Option<f64>,
}

impl BudgetRequest {
    /// Its limits, checked.
    pub(crate) fn checked(&self) -> Result<BudgetLimits, ApiError> {
        let tokens = match &self.tokens {
            None => None,
            Some(n) => match n.as_i64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15).map(|f| f as i64)) {
                Some(t) if (0..=1_000_000_000_000).contains(&t) => Some(t),
                _ => return Err(ApiError::bad_request("budget.tokens must be a whole number from 0 to 1000000000000")),
            },
        };
        let usd_nanos = match self.usd {
            None => None,
            Some(usd) => Some(usd_to_nanos(usd).ok_or_else(|| ApiError::bad_request("budget.usd must be a number from 0 to 1000000"))?),
        };
        Ok(BudgetLimits { tokens, usd_nanos })
    }
}

/// A budget from a JSON object only (serde would take a struct from an
/// array too, which the description does not allow).
pub(super) fn budget_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<BudgetRequest>, D::Error> {
    let Some(map) = Option::<serde_json::Map<String, Value>>::deserialize(d)? else { return Ok(None) };
    serde_json::from_value(Value::Object(map)).map(Some).map_err(serde::de::Error::custom)
}

/// A submit's budget, checked.
pub(super) fn check_budget(b: &Option<BudgetRequest>) -> Result<BudgetLimits, ApiError> {
    Ok(b.as_ref().map(BudgetRequest::checked).transpose()?.unwrap_or_default())
}

/// An integer, also written as a float with no fraction (`3.0`), as JSON
/// Schema's `integer` allows.
pub(super) fn whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else { return Ok(None) };
    if let Some(i) = n.as_i64() {
        return Ok(Some(i));
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
        _ => Err(serde::de::Error::custom(format!("expected an integer, not {n}"))),
    }
}

pub(super) fn check_concurrency_key(key: &Option<String>) -> Result<(), ApiError> {
    key.as_deref().map_or(Ok(()), |k| crate::store::concurrency::check_key(k).map_err(ApiError::bad_request))
}

pub(super) fn check_priority(p: Option<i64>) -> Result<i64, ApiError> {
    crate::store::priority::check(p.unwrap_or(0)).map_err(ApiError::bad_request)
}

fn check_key(what: &str, v: &Option<String>) -> Result<(), ApiError> {
    if let Some(v) = v
        && (v.is_empty() || v.chars().count() > MAX_KEY_CHARS || v.contains('\0'))
    {
        return Err(ApiError::bad_request(format!(
            "{what} must be 1 to {MAX_KEY_CHARS} characters without NUL characters"
        )));
    }
    Ok(())
}

const TRACEPARENT: &str = "A W3C trace context: the run's trace goes on from this span (docs/operations.md, \"Tracing\"). \
    A malformed one is ignored, as the W3C specification asks: the run starts a trace of its own.";

/// The submit's W3C `traceparent`, written as version 00; `None` when it
/// has none or a malformed one (the specification says to start a new
/// trace then, not to refuse the request).
fn trace_parent(headers: &HeaderMap) -> Option<String> {
    let value = headers.get("traceparent")?.to_str().ok()?;
    crate::traces::Parent::parse(value).map(|p| p.header())
}

/// `POST /v1/runs`: 201 with the new run; 200 with the existing run when the
/// `idempotency_key` was seen before with the same request (409 if not).
#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = Submit,
    params(("traceparent" = Option<String>, Header, description = TRACEPARENT)),
    responses(
        (status = 201, description = "The new run.", body = Run),
        (status = 200, description = "The run this idempotency key made before.", body = Run),
        (status = 404, description = "No plugin of that name.", body = ErrorBody),
        (status = 409, description = "The idempotency key was used with another request.", body = ErrorBody),
    ))]
pub async fn submit(State(s): State<AppState>, headers: HeaderMap, JsonBody(req): JsonBody<Submit>) -> Result<Response, ApiError> {
    check_key("thread_id", &req.thread_id)?;
    check_key("idempotency_key", &req.idempotency_key)?;
    if let Some(n) = req.max_attempts
        && !(1..=1000).contains(&n)
    {
        return Err(ApiError::bad_request("max_attempts must be between 1 and 1000"));
    }
    let priority = check_priority(req.priority)?;
    check_concurrency_key(&req.concurrency_key)?;
    let budget = check_budget(&req.budget)?;
    if !crate::plugins::valid_name(&req.plugin) {
        return Err(ApiError::not_found(format!("no plugin named {:?}", req.plugin)));
    }
    // Its version is read by the statement that writes the run.
    if !s.store.plugin_exists(&req.plugin).await? {
        return Err(ApiError::not_found(format!("no plugin named {:?}", req.plugin)));
    }
    let digest = NewRun::CURRENT_VERSION.to_string();
    // The guest receives the input as JSON text.
    let input = req.input.to_string();
    let new = NewRun {
        plugin: req.plugin.clone(),
        plugin_digest: digest,
        input: input.clone(),
        thread_id: req.thread_id.clone(),
        max_attempts: req.max_attempts,
        idempotency_key: req.idempotency_key.clone(),
        priority,
        concurrency_key: req.concurrency_key.clone(),
        budget_tokens: budget.tokens,
        budget_usd_nanos: budget.usd_nanos,
        trace_parent: trace_parent(&headers),
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
    // The trace its segments go on in: the submitter's, or the run's own.
    let trace_id = match run.trace_parent.as_deref().and_then(crate::traces::Parent::parse) {
        Some(parent) => parent.trace,
        None => crate::traces::ids::run_trace(&s.store.database_id().await?, run.id),
    };
    tracing::info!(run_id = run.id, plugin = %run.plugin, thread_id = %run.thread_id, %trace_id, "run submitted");
    Ok((StatusCode::CREATED, Json(run)).into_response())
}

/// Runs to submit in one commit.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    /// 1 to 1,000 runs, each with an `idempotency_key`.
    #[schema(value_type = Vec<BatchRun>, min_items = 1, max_items = 1000)]
    runs: Vec<Submit>,
}

/// A run of a batch: as [`Submit`], with `idempotency_key` required (so
/// that sending the batch again cannot run anything twice). The
/// description's only; a batch is read as `Submit`s.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct BatchRun {
    #[schema(pattern = "^[a-z0-9_-]{1,64}$")]
    plugin: String,
    input: Option<Value>,
    #[schema(min_length = 1, max_length = 256, pattern = r"^[^\u0000]+$")]
    thread_id: Option<String>,
    #[schema(minimum = 1, maximum = 1000)]
    max_attempts: Option<i64>,
    #[schema(min_length = 1, max_length = 256, pattern = r"^[^\u0000]+$")]
    idempotency_key: String,
    #[schema(minimum = -1000, maximum = 1000)]
    priority: Option<i64>,
    #[schema(min_length = 1, max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]+$")]
    concurrency_key: Option<String>,
}

/// One result per run of a batch, in order.
#[derive(Serialize, ToSchema)]
pub struct BatchResults {
    results: Vec<BatchResult>,
}

/// A run of a batch: written (or found by its key), or refused.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum BatchResult {
    Run {
        /// False when the idempotency key found a run made before.
        created: bool,
        run: Box<Run>,
    },
    Refused {
        error: ErrorDetail,
    },
}

/// `POST /v1/runs:batch`: up to [`MAX_SUBMIT_BATCH`] runs in one commit,
/// each with its own `idempotency_key` (so a batch whose answer was lost can
/// be sent again) and its own thread. 200 with one result per run, in
/// order: `{"created": true|false, "run": …}`, or `{"error": …}` for a run
/// whose key was used before with a different request (it writes nothing).
/// A batch with any invalid run writes nothing and gets 4xx naming the run.
#[utoipa::path(post, path = "/v1/runs:batch", tag = "runs", request_body = Batch,
    params(("traceparent" = Option<String>, Header, description = TRACEPARENT)),
    responses(
        (status = 200, description = "One result per run, in order.", body = BatchResults),
        (status = 404, description = "A run names no registered plugin.", body = ErrorBody),
    ))]
pub async fn submit_batch(State(s): State<AppState>, headers: HeaderMap, JsonBody(req): JsonBody<Batch>) -> Result<Json<BatchResults>, ApiError> {
    if req.runs.is_empty() || req.runs.len() > MAX_SUBMIT_BATCH {
        return Err(ApiError::bad_request(format!(
            "runs must hold 1 to {MAX_SUBMIT_BATCH} runs, not {}",
            req.runs.len()
        )));
    }
    let mut news = Vec::with_capacity(req.runs.len());
    let trace = trace_parent(&headers);
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
        let priority = check_priority(r.priority).map_err(at)?;
        check_concurrency_key(&r.concurrency_key).map_err(at)?;
        let budget = check_budget(&r.budget).map_err(at)?;
        if !(crate::plugins::valid_name(&r.plugin) && s.store.plugin_exists(&r.plugin).await?) {
            return Err(at(ApiError::not_found(format!("no plugin named {:?}", r.plugin))));
        }
        news.push(NewRun {
            plugin: r.plugin.clone(),
            // Read by the statement that writes the batch: one version for all.
            plugin_digest: NewRun::CURRENT_VERSION.to_string(),
            input: r.input.to_string(),
            thread_id: r.thread_id.clone(),
            max_attempts: r.max_attempts,
            idempotency_key: r.idempotency_key.clone(),
            priority,
            concurrency_key: r.concurrency_key.clone(),
            budget_tokens: budget.tokens,
            budget_usd_nanos: budget.usd_nanos,
            trace_parent: trace.clone(),
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
            BatchResult::Run { created, run: Box::new(run) }
        } else {
            BatchResult::Refused {
                error: ErrorDetail {
                    code: "idempotency_conflict".into(),
                    message: format!("idempotency_key was already used for run {} with a different request", run.id),
                },
            }
        });
    }
    let created = results.iter().filter(|r| matches!(r, BatchResult::Run { created: true, .. })).count();
    let trace_id = trace.as_deref().and_then(crate::traces::Parent::parse).map(|p| p.trace.to_string());
    tracing::info!(runs = results.len(), created, trace_id = trace_id.as_deref(), "batch submitted");
    Ok(Json(BatchResults { results }))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only runs with this status.
    #[param(value_type = Option<RunStatus>)]
    status: Option<String>,
    /// Only runs of this plugin. Each text filter: at most 1024
    /// characters, without NUL characters.
    #[param(max_length = 1024, pattern = r"^[^\u0000]*$")]
    plugin: Option<String>,
    /// Only runs of this thread.
    #[param(max_length = 1024, pattern = r"^[^\u0000]*$")]
    thread: Option<String>,
    /// Only the children of this run (the runs its turn spawned).
    parent: Option<i64>,
    /// Only runs whose input, output or error holds this text (ignoring
    /// ASCII case). Scans newest first.
    #[param(max_length = 1024, pattern = r"^[^\u0000]*$")]
    q: Option<String>,
    /// Runs per page, 1 to 1000. Default: 50.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// A `next_cursor` from the page before.
    cursor: Option<i64>,
}

/// A page of runs, newest first.
#[derive(Serialize, ToSchema)]
pub struct RunsPage {
    pub(crate) runs: Vec<Run>,
    /// Pass as `cursor` for the next page; null on the last. A text search
    /// (`q`) that ran out of time returns a short page, even an empty one,
    /// with a cursor to go on from.
    pub(crate) next_cursor: Option<i64>,
}

/// `GET /v1/runs?status=&plugin=&thread=&q=&limit=&cursor=`: newest first,
/// at most `limit` (default 50, at most 1000) and about `max_page_bytes`;
/// `next_cursor` pages on. `q` reads a window of runs at a time and starts
/// none after a third of the request timeout (`store::search`).
#[utoipa::path(get, path = "/v1/runs", tag = "runs", params(ListQuery),
    responses((status = 200, description = "A page of runs, newest first.", body = RunsPage)))]
pub async fn list(State(s): State<AppState>, QueryParams(q): QueryParams<ListQuery>) -> Result<Json<RunsPage>, ApiError> {
    let status = match q.status.as_deref() {
        None => None,
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
    let given = |name: &str, v: Option<String>| -> Result<Option<String>, ApiError> {
        let v = v.filter(|v| !v.is_empty());
        if v.as_ref().is_some_and(|v| v.contains('\0') || v.chars().count() > 1024) {
            return Err(ApiError::bad_request(format!("{name} must be at most 1024 characters without NUL characters")));
        }
        Ok(v)
    };
    let filter = RunFilter {
        status,
        plugin: given("plugin", q.plugin)?,
        thread: given("thread", q.thread)?,
        parent: q.parent,
        text: given("q", q.q)?,
    };
    // A page ends early when its rows reach the byte cap, or when a text
    // search has used a third of the request's time; the cursor pages on.
    let budget = s.config.request_timeout / 3;
    let page = s.store.search_runs(&filter, q.cursor, limit, s.config.max_page_bytes, budget).await?;
    Ok(Json(RunsPage { runs: page.runs, next_cursor: page.next_cursor }))
}

/// `GET /v1/runs/{id}`.
#[utoipa::path(get, path = "/v1/runs/{id}", tag = "runs", params(("id" = i64, Path, description = "The run's id.")),
    responses(
        (status = 200, description = "The run.", body = Run),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(id): Params<i64>) -> Result<Json<Run>, ApiError> {
    let mut run = s.store.get_run(id).await?;
    run.reruns = s.store.reruns_of(id).await?;
    Ok(Json(run))
}

/// Input for a run waiting for it.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// A string is delivered as it is; any other JSON as its text.
    input: Value,
    /// The wait it is for (`wait-for` in the turn): kept in the run's inbox
    /// until the turn reaches that wait, even if it has not yet. 1 to 128
    /// of a-z, 0-9, '.', '_', '-'. Without it, the input is for the run's
    /// unnamed `wait-input`, which must be waiting now.
    #[schema(pattern = r"^[a-z0-9._-]{1,128}$")]
    name: Option<String>,
    /// A retry with the same key delivers nothing again (200 with the run
    /// as it stands), even after a wait took the first; the same key with
    /// another name or input is a 409 (`idempotency_conflict`). 1 to 256
    /// characters, without NUL.
    #[schema(min_length = 1, max_length = 256, pattern = r"^[^\u0000]+$")]
    idempotency_key: Option<String>,
}

/// `POST /v1/runs/{id}/input`: a string is delivered as it is, any other
/// JSON as its text. With a `name`, to the run's inbox under that name
/// (409 if input delivered to that name is still untaken, or the run has
/// finished); without one, to its unnamed wait (409 unless the run waits
/// for input).
#[utoipa::path(post, path = "/v1/runs/{id}/input", tag = "runs", request_body = Input,
    params(("id" = i64, Path, description = "The run's id.")),
    responses(
        (status = 200, description = "The run, with the input pending.", body = Run),
        (status = 404, description = "No such run.", body = ErrorBody),
        (status = 409, description = "The run is not waiting for input, has finished, or has untaken input for that name.", body = ErrorBody),
    ))]
pub async fn input(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    JsonBody(req): JsonBody<Input>,
) -> Result<Json<Run>, ApiError> {
    let input = match req.input {
        Value::String(s) => s,
        other => other.to_string(),
    };
    if input.contains('\0') {
        return Err(ApiError::bad_request("input must not contain NUL characters"));
    }
    if let Some(name) = &req.name
        && !crate::runtime::waits::valid_wait_name(name)
    {
        return Err(ApiError::bad_request("name must be 1 to 128 of a-z, 0-9, '.', '_', '-'"));
    }
    check_key("idempotency_key", &req.idempotency_key)?;
    if let Some(key) = &req.idempotency_key {
        let (run, delivery) = s.store.deliver_once(id, req.name.as_deref(), &input, key).await?;
        match delivery {
            crate::store::Delivery::New => tracing::info!(run_id = id, name = ?req.name, "input delivered"),
            crate::store::Delivery::Repeat => tracing::info!(run_id = id, name = ?req.name, "a delivery repeated; delivered once"),
            crate::store::Delivery::Mismatch => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_conflict",
                    format!("idempotency_key was already used for another delivery to run {id}"),
                ));
            }
        }
        return Ok(Json(run));
    }
    if let Some(name) = &req.name {
        let run = s.store.deliver_named(id, name, &input).await?;
        tracing::info!(run_id = id, name = %name, "input delivered to a named wait");
        return Ok(Json(run));
    }
    let run = s.store.deliver_input(id, &input).await?;
    tracing::info!(run_id = id, "input delivered");
    Ok(Json(run))
}

/// A cancel's body: a JSON object, `{}`; its fields are ignored. (A body
/// at all, so that the request must be JSON, which another web page's
/// form cannot send.)
#[derive(Deserialize, ToSchema)]
pub struct Cancel {}

/// `POST /v1/runs/{id}/cancel` with `{}`: 409 if the run has finished.
#[utoipa::path(post, path = "/v1/runs/{id}/cancel", tag = "runs", request_body = Cancel,
    params(("id" = i64, Path, description = "The run's id.")),
    responses(
        (status = 200, description = "The cancelled run.", body = Run),
        (status = 404, description = "No such run.", body = ErrorBody),
        (status = 409, description = "The run has finished.", body = ErrorBody),
    ))]
pub async fn cancel(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    JsonBody(Cancel {}): JsonBody<Cancel>,
) -> Result<Json<Run>, ApiError> {
    let run = s.store.cancel(id).await?;
    tracing::info!(run_id = id, fence = run.fence, "run cancelled");
    Ok(Json(run))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EffectsQuery {
    /// Rows after this seq. Default: from the first.
    after: Option<i64>,
    /// Rows per page, 1 to 10000. Default: 1000.
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<i64>,
}

/// A page of a run's ledger, by seq.
#[derive(Serialize, ToSchema)]
pub struct EffectsPage {
    effects: Vec<EffectRow>,
    /// Pass as `after` for the next page; null on the last.
    next_after: Option<i64>,
}

/// `GET /v1/runs/{id}/effects?after=&limit=`: the ledger rows after seq
/// `after`, by seq: at most `limit` (default 1000, at most 10000) and
/// about `max_page_bytes`; `next_after` pages on.
#[utoipa::path(get, path = "/v1/runs/{id}/effects", tag = "runs",
    params(("id" = i64, Path, description = "The run's id."), EffectsQuery),
    responses(
        (status = 200, description = "A page of the run's ledger.", body = EffectsPage),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn effects(
    State(s): State<AppState>,
    Params(id): Params<i64>,
    QueryParams(q): QueryParams<EffectsQuery>,
) -> Result<Json<EffectsPage>, ApiError> {
    let limit = q.limit.unwrap_or(1000);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 10000"));
    }
    s.store.get_run(id).await?;
    let (rows, cut) = s.store.effects_capped(id, q.after.unwrap_or(-1), limit, s.config.max_page_bytes).await?;
    let next_after = (rows.len() as i64 == limit || cut).then(|| rows.last().map(|r| r.seq)).flatten();
    Ok(Json(EffectsPage { effects: rows, next_after }))
}
