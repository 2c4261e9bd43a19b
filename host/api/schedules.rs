//! `/v1/schedules` (docs/operations.md, "Schedules"): make, list, show,
//! change, pause, delete and backfill schedules. Their times are
//! `schedules`' (the host's module); the ticks are recorded by every
//! host's ticker (`schedules::ticker`, `store::ticks`).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::runs::{BudgetRequest, budget_object, check_budget, check_concurrency_key, check_priority, whole_number};
use super::{ApiError, AppState, ErrorBody, JsonBody, Params, QueryParams};
use crate::schedules::{Spec, format_span, parse_span};
use crate::store::schedules::check_id;
use crate::store::{Overlap, Schedule, Tick};

/// Most times one backfill records.
/// How far back a backfill reaches with `--retention 0`: 366 days.
const MAX_BACKFILL_SPAN_MS: i64 = 366 * 86_400_000;
/// Scheduled times a schedule's view shows ahead.
const UPCOMING: usize = 5;
/// Ticks `GET /v1/schedules/{id}` shows, newest first.
const RECENT: i64 = 20;
/// Catch-up window when none is given.
const DEFAULT_CATCHUP: &str = "1h";
/// Changes retried when a tick moves the schedule on first.
const CHANGE_TRIES: usize = 10;

/// A schedule to make. Give `cron` or `interval`, not both.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSchedule {
    /// Its name, 1 to 128 of `A-Z a-z 0-9 . _ -`. Default: `schedule-`
    /// and 12 random hex digits.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,128}$", example = "nightly-report")]
    id: Option<String>,
    /// A registered plugin's name; each run is on its version current at
    /// the tick.
    #[schema(pattern = "^[a-z0-9_-]{1,64}$", example = "testkit")]
    plugin: String,
    /// Each run's input: any JSON. Default: null.
    #[serde(default)]
    input: Value,
    /// A cron expression: 5 fields (minute hour day month weekday), or 6
    /// with seconds first, or `@hourly`, `@daily`, `@weekly`, `@monthly`,
    /// `@yearly`.
    #[schema(example = "30 2 * * *", max_length = 256)]
    cron: Option<String>,
    /// An interval instead, at least 1s (`30s`, `5m`, `1h30m`), counted
    /// from the Unix epoch.
    #[schema(example = "15m", max_length = 64)]
    interval: Option<String>,
    /// The IANA time zone of `cron`'s wall-clock times. Default: `UTC`.
    #[schema(example = "Europe/Berlin", max_length = 64)]
    time_zone: Option<String>,
    /// What a tick does while the last run is open. Default: `skip`.
    overlap: Option<Overlap>,
    /// A tick found later than this after its time (the service was down)
    /// is recorded as skipped instead of run late; at least `5s`.
    /// Default: `1h`.
    #[schema(example = "5m", max_length = 64)]
    catchup_window: Option<String>,
    /// Each run waits a further 0 to this long before it may start, so
    /// that many schedules on one time do not start at once. Default: `0`.
    #[schema(example = "30s", max_length = 64)]
    jitter: Option<String>,
    /// Its runs' priority, -1000 to 1000. Default: 0.
    #[schema(minimum = -1000, maximum = 1000)]
    #[serde(default, deserialize_with = "whole_number")]
    priority: Option<i64>,
    /// Its runs' concurrency key. Default: none.
    #[schema(min_length = 1, max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]+$")]
    concurrency_key: Option<String>,
    /// Its runs' attempts, 1 to 1000. Default: 3.
    #[schema(minimum = 1, maximum = 1000)]
    #[serde(default, deserialize_with = "whole_number")]
    max_attempts: Option<i64>,
    /// Each run's budget (as a submit's). Default: none.
    #[serde(default, deserialize_with = "budget_object")]
    budget: Option<BudgetRequest>,
    /// Made paused: no ticks until resumed. Default: false.
    paused: Option<bool>,
    /// A note for operators (1 to 1000 characters).
    #[schema(max_length = 1000)]
    note: Option<String>,
}

/// A change: each field given replaces the schedule's. Changing its times
/// (`cron`, `interval`, `time_zone`) or resuming it moves its next tick
/// to the first time after now.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleChange {
    #[schema(pattern = "^[a-z0-9_-]{1,64}$")]
    plugin: Option<String>,
    input: Option<Value>,
    /// A cron expression (the interval is dropped).
    #[schema(max_length = 256)]
    cron: Option<String>,
    /// An interval (the cron expression is dropped).
    #[schema(max_length = 64)]
    interval: Option<String>,
    #[schema(max_length = 64)]
    time_zone: Option<String>,
    overlap: Option<Overlap>,
    #[schema(max_length = 64)]
    catchup_window: Option<String>,
    #[schema(max_length = 64)]
    jitter: Option<String>,
    #[schema(minimum = -1000, maximum = 1000)]
    #[serde(default, deserialize_with = "whole_number")]
    priority: Option<i64>,
    /// A concurrency key, or `""` for none.
    #[schema(max_length = 256, pattern = r"^(?!http:|model:)[^\u0000-\u001f\u007f-\u009f]*$")]
    concurrency_key: Option<String>,
    #[schema(minimum = 1, maximum = 1000)]
    #[serde(default, deserialize_with = "whole_number")]
    max_attempts: Option<i64>,
    /// Replaces the budget (`{}`: none).
    #[serde(default, deserialize_with = "budget_object")]
    budget: Option<BudgetRequest>,
    /// true pauses it, false resumes it.
    paused: Option<bool>,
    /// A note, or `""` for none.
    #[schema(max_length = 1000)]
    note: Option<String>,
}

/// A schedule, with its next times.
#[derive(Serialize, ToSchema)]
pub struct ScheduleView {
    #[serde(flatten)]
    schedule: Schedule,
    /// Each run's input.
    input: Value,
    /// The interval as given back (`15m`), for a schedule with one.
    interval: Option<String>,
    catchup_window: String,
    jitter: String,
    /// Its next scheduled times (epoch ms), up to 5; empty while paused.
    upcoming: Vec<i64>,
    /// Its latest ticks, newest first: the runs it started, and the ticks
    /// it skipped and why (`GET /v1/schedules/{id}` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    recent: Option<Vec<Tick>>,
}

fn view(s: Schedule, recent: Option<Vec<Tick>>) -> ScheduleView {
    let upcoming = match (&s.next_at, s.paused, Spec::of(&s)) {
        (Some(next), false, Ok(spec)) => std::iter::once(*next).chain(spec.upcoming(*next, UPCOMING - 1)).collect(),
        _ => Vec::new(),
    };
    ScheduleView {
        input: serde_json::from_str(&s.input).unwrap_or(Value::String(s.input.clone())),
        interval: s.interval_ms.map(format_span),
        catchup_window: format_span(s.catchup_window_ms),
        jitter: format_span(s.jitter_ms),
        upcoming,
        recent,
        schedule: s,
    }
}

fn span(what: &str, text: &str, max_ms: i64) -> Result<i64, ApiError> {
    if text.len() > 64 {
        return Err(ApiError::bad_request(format!("{what} is at most 64 characters")));
    }
    let ms = parse_span(text).map_err(|e| ApiError::bad_request(format!("{what}: {e}")))?;
    if ms > max_ms {
        return Err(ApiError::bad_request(format!("{what} is at most {}", format_span(max_ms))));
    }
    Ok(ms)
}

/// A year: the longest interval, catch-up window or jitter.
const YEAR_MS: i64 = 366 * 86_400_000;
/// The shortest catch-up window: a tick is ticked milliseconds after its
/// time while a host is up, but a busy database may take seconds.
const MIN_CATCHUP_MS: i64 = 5000;

fn catchup(text: &str) -> Result<i64, ApiError> {
    let ms = span("catchup_window", text, YEAR_MS)?;
    if ms < MIN_CATCHUP_MS {
        return Err(ApiError::bad_request("catchup_window is at least 5s"));
    }
    Ok(ms)
}

/// Sets `s`'s times from `cron`/`interval`/`time_zone` and checks them.
fn set_times(s: &mut Schedule, cron: Option<String>, interval: Option<String>, tz: Option<String>) -> Result<Spec, ApiError> {
    match (cron, interval) {
        (Some(_), Some(_)) => return Err(ApiError::bad_request("give cron or interval, not both")),
        (Some(c), None) => {
            if c.len() > 256 {
                return Err(ApiError::bad_request("cron is at most 256 characters"));
            }
            (s.cron, s.interval_ms) = (Some(c), None);
        }
        (None, Some(i)) => (s.cron, s.interval_ms) = (None, Some(span("interval", &i, YEAR_MS)?)),
        (None, None) => {}
    }
    if let Some(tz) = tz {
        if tz.len() > 64 {
            return Err(ApiError::bad_request("time_zone is at most 64 characters"));
        }
        s.time_zone = tz;
    }
    if s.cron.is_none() && s.interval_ms.is_none() {
        return Err(ApiError::bad_request("give cron (a cron expression) or interval (such as 15m)"));
    }
    Spec::of(s).map_err(|e| ApiError::bad_request(format!("{}: {e}", if s.cron.is_some() { "cron" } else { "interval" })))
}

fn check_note(note: &Option<String>) -> Result<(), ApiError> {
    match note {
        Some(n) if n.chars().count() > 1000 => Err(ApiError::bad_request("note is at most 1000 characters")),
        _ => Ok(()),
    }
}

fn check_attempts(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        Some(n) if !(1..=1000).contains(&n) => Err(ApiError::bad_request("max_attempts must be between 1 and 1000")),
        _ => Ok(()),
    }
}

async fn check_plugin(s: &AppState, plugin: &str) -> Result<(), ApiError> {
    if !crate::plugins::valid_name(plugin) || !s.store.plugin_exists(plugin).await? {
        return Err(ApiError::not_found(format!("no plugin named {plugin:?}")));
    }
    Ok(())
}

async fn found(s: &AppState, id: &str) -> Result<Schedule, ApiError> {
    check_id(id).map_err(ApiError::bad_request)?;
    s.store.schedule(id).await?.ok_or_else(|| ApiError::not_found(format!("no schedule {id:?}")))
}

/// `POST /v1/schedules`.
#[utoipa::path(post, path = "/v1/schedules", tag = "schedules", request_body = NewSchedule,
    responses(
        (status = 201, description = "The schedule, with its next times.", body = ScheduleView),
        (status = 400, description = "A bad expression, interval, time zone or field.", body = ErrorBody),
        (status = 404, description = "No plugin of that name.", body = ErrorBody),
        (status = 409, description = "A schedule of that id exists, or the host's `max_schedules` (10,000) do.", body = ErrorBody),
    ))]
pub async fn create(State(s): State<AppState>, JsonBody(req): JsonBody<NewSchedule>) -> Result<(StatusCode, Json<ScheduleView>), ApiError> {
    let id = req.id.unwrap_or_else(|| format!("schedule-{:012x}", rand::random::<u64>() >> 16));
    check_id(&id).map_err(ApiError::bad_request)?;
    check_attempts(req.max_attempts)?;
    check_concurrency_key(&req.concurrency_key)?;
    check_note(&req.note)?;
    let budget = check_budget(&req.budget)?;
    let mut sched = Schedule {
        id,
        plugin: req.plugin,
        input: req.input.to_string(),
        cron: None,
        interval_ms: None,
        time_zone: "UTC".into(),
        overlap: req.overlap.unwrap_or_default(),
        catchup_window_ms: catchup(req.catchup_window.as_deref().unwrap_or(DEFAULT_CATCHUP))?,
        jitter_ms: span("jitter", req.jitter.as_deref().unwrap_or("0"), YEAR_MS)?,
        priority: check_priority(req.priority)?,
        concurrency_key: req.concurrency_key,
        max_attempts: req.max_attempts.unwrap_or(crate::store::NewRun::DEFAULT_MAX_ATTEMPTS),
        budget_tokens: budget.tokens,
        budget_usd_nanos: budget.usd_nanos,
        paused: req.paused.unwrap_or(false),
        note: req.note.filter(|n| !n.is_empty()),
        next_at: None,
        version: 0,
        created_at: 0,
        updated_at: 0,
    };
    let spec = set_times(&mut sched, req.cron, req.interval, req.time_zone)?;
    check_plugin(&s, &sched.plugin).await?;
    sched.next_at = spec.next_after(s.store.now_ms().await?);
    if sched.next_at.is_none() {
        return Err(ApiError::bad_request("cron: the expression matches no time in the next 30 years"));
    }
    // A bound on the work every host's ticker does each pass.
    let count = s.store.count_schedules().await?;
    if count >= s.config.max_schedules as i64 {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "refused",
            format!("there are {count} schedules, this service's most (--max-schedules {}): delete one first", s.config.max_schedules),
        ));
    }
    let made = s.store.create_schedule(&sched).await?;
    tracing::info!(schedule = %made.id, plugin = %made.plugin, cron = ?made.cron, interval_ms = ?made.interval_ms, "schedule made");
    Ok((StatusCode::CREATED, Json(view(made, None))))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Schedules after this id (the last of the previous page).
    #[param(max_length = 128)]
    after: Option<String>,
    /// Schedules per page, 1 to 1000. Default: 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// A page of schedules, by id.
#[derive(Serialize, ToSchema)]
pub struct SchedulesPage {
    schedules: Vec<ScheduleView>,
    /// The `after` of the next page; null on the last.
    next: Option<String>,
}

/// `GET /v1/schedules`.
#[utoipa::path(get, path = "/v1/schedules", tag = "schedules", params(ListQuery),
    responses((status = 200, description = "A page of schedules, by id.", body = SchedulesPage)))]
pub async fn list(State(s): State<AppState>, QueryParams(q): QueryParams<ListQuery>) -> Result<Json<SchedulesPage>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 1000"));
    }
    let after = q.after.unwrap_or_default();
    if after.len() > 128 {
        return Err(ApiError::bad_request("after is at most 128 characters"));
    }
    let rows = s.store.schedules(&after, limit).await?;
    let next = (rows.len() as i64 == limit).then(|| rows.last().map(|r| r.id.clone())).flatten();
    Ok(Json(SchedulesPage { schedules: rows.into_iter().map(|r| view(r, None)).collect(), next }))
}

/// `GET /v1/schedules/{id}`: with its latest ticks.
#[utoipa::path(get, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = String, Path, pattern = "^[A-Za-z0-9._-]{1,128}$", description = "The schedule's id.")),
    responses(
        (status = 200, description = "The schedule, its next times and its latest ticks.", body = ScheduleView),
        (status = 404, description = "No such schedule.", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(id): Params<String>) -> Result<Json<ScheduleView>, ApiError> {
    let sched = found(&s, &id).await?;
    let recent = s.store.ticks(&id, i64::MAX, RECENT).await?;
    Ok(Json(view(sched, Some(recent))))
}

/// `PATCH /v1/schedules/{id}`.
#[utoipa::path(patch, path = "/v1/schedules/{id}", tag = "schedules", request_body = ScheduleChange,
    params(("id" = String, Path, pattern = "^[A-Za-z0-9._-]{1,128}$", description = "The schedule's id.")),
    responses(
        (status = 200, description = "The schedule as changed.", body = ScheduleView),
        (status = 400, description = "A bad field.", body = ErrorBody),
        (status = 404, description = "No such schedule, or no plugin of that name.", body = ErrorBody),
        (status = 415, description = "The body is not said to be JSON (Content-Type: application/json).", body = ErrorBody),
    ))]
pub async fn change(
    State(s): State<AppState>,
    Params(id): Params<String>,
    JsonBody(req): JsonBody<ScheduleChange>,
) -> Result<Json<ScheduleView>, ApiError> {
    check_attempts(req.max_attempts)?;
    check_note(&req.note)?;
    if let Some(k) = req.concurrency_key.as_ref().filter(|k| !k.is_empty()) {
        check_concurrency_key(&Some(k.clone()))?;
    }
    let budget = req.budget.as_ref().map(BudgetRequest::checked).transpose()?;
    if let Some(p) = &req.plugin {
        check_plugin(&s, p).await?;
    }
    // Read, change, write if no tick came between; else again.
    for _ in 0..CHANGE_TRIES {
        let old = found(&s, &id).await?;
        let mut new = old.clone();
        let retimed = req.cron.is_some() || req.interval.is_some() || req.time_zone.is_some();
        let spec = set_times(&mut new, req.cron.clone(), req.interval.clone(), req.time_zone.clone())?;
        if let Some(p) = &req.plugin {
            new.plugin = p.clone();
        }
        if let Some(i) = &req.input {
            new.input = i.to_string();
        }
        new.overlap = req.overlap.unwrap_or(new.overlap);
        if let Some(c) = &req.catchup_window {
            new.catchup_window_ms = catchup(c)?;
        }
        if let Some(j) = &req.jitter {
            new.jitter_ms = span("jitter", j, YEAR_MS)?;
        }
        if req.priority.is_some() {
            new.priority = check_priority(req.priority)?;
        }
        if let Some(k) = &req.concurrency_key {
            new.concurrency_key = Some(k.clone()).filter(|k| !k.is_empty());
        }
        new.max_attempts = req.max_attempts.unwrap_or(new.max_attempts);
        if let Some(b) = &budget {
            (new.budget_tokens, new.budget_usd_nanos) = (b.tokens, b.usd_nanos);
        }
        if let Some(n) = &req.note {
            new.note = Some(n.clone()).filter(|n| !n.is_empty());
        }
        new.paused = req.paused.unwrap_or(new.paused);
        let resumed = old.paused && !new.paused;
        if retimed || resumed {
            // Times it had while paused or under its old expression are not
            // its to catch up.
            new.next_at = spec.next_after(s.store.now_ms().await?);
            if new.next_at.is_none() {
                return Err(ApiError::bad_request("cron: the expression matches no time in the next 30 years"));
            }
        }
        if let Some(changed) = s.store.update_schedule(&new).await? {
            tracing::info!(schedule = %id, paused = changed.paused, retimed, "schedule changed");
            return Ok(Json(view(changed, None)));
        }
    }
    Err(ApiError::busy("the schedule kept moving on under the change (ticks); try again"))
}

/// `DELETE /v1/schedules/{id}`: it and its tick records; its runs stay.
#[utoipa::path(delete, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = String, Path, pattern = "^[A-Za-z0-9._-]{1,128}$", description = "The schedule's id.")),
    responses(
        (status = 204, description = "Deleted; the runs it started are kept."),
        (status = 404, description = "No such schedule.", body = ErrorBody),
    ))]
pub async fn remove(State(s): State<AppState>, Params(id): Params<String>) -> Result<StatusCode, ApiError> {
    check_id(&id).map_err(ApiError::bad_request)?;
    if s.store.delete_schedule(&id).await? {
        tracing::info!(schedule = %id, "schedule deleted");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("no schedule {id:?}")))
    }
}

/// A time: epoch ms, or RFC 3339 text (`2026-12-06T02:30:00Z`).
#[derive(Deserialize, ToSchema, Clone)]
#[serde(untagged)]
pub enum TimeArg {
    Ms(i64),
    Text(String),
}

impl TimeArg {
    fn ms(&self, what: &str) -> Result<i64, ApiError> {
        match self {
            TimeArg::Ms(ms) => Ok(*ms),
            TimeArg::Text(t) => t
                .parse::<jiff::Timestamp>()
                .map(|t| t.as_millisecond())
                .map_err(|e| ApiError::bad_request(format!("{what}: {t:?} is neither epoch ms nor an RFC 3339 time: {e}"))),
        }
    }
}

/// Times of the past to run now, as the schedule would have.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Backfill {
    /// The first time of the range (included).
    from: TimeArg,
    /// The last (included); not after now.
    to: TimeArg,
    /// Overlap policy for these ticks. Default: the schedule's.
    overlap: Option<Overlap>,
}

/// What a backfill recorded, by time.
#[derive(Serialize, ToSchema)]
pub struct BackfillResult {
    /// One per scheduled time in the range, oldest first; a time recorded
    /// before (by a tick or a backfill) as it was.
    ticks: Vec<Tick>,
}

/// `POST /v1/schedules/{id}/backfill`.
#[utoipa::path(post, path = "/v1/schedules/{id}/backfill", tag = "schedules", request_body = Backfill,
    params(("id" = String, Path, pattern = "^[A-Za-z0-9._-]{1,128}$", description = "The schedule's id.")),
    responses(
        (status = 200, description = "The range's ticks.", body = BackfillResult),
        (status = 400, description = "A bad range: backwards, in the future, reaching back past the retention period, or over `max_backfill_ticks` (1000) times.", body = ErrorBody),
        (status = 404, description = "No such schedule.", body = ErrorBody),
        (status = 415, description = "The body is not said to be JSON (Content-Type: application/json).", body = ErrorBody),
        (status = 503, description = "Another backfill runs on this host; try again after `Retry-After`.", body = ErrorBody),
    ))]
pub async fn backfill(
    State(s): State<AppState>,
    Params(id): Params<String>,
    JsonBody(req): JsonBody<Backfill>,
) -> Result<Json<BackfillResult>, ApiError> {
    let sched = found(&s, &id).await?;
    let (from, to) = (req.from.ms("from")?, req.to.ms("to")?);
    if from > to {
        return Err(ApiError::bad_request("from is after to"));
    }
    let now = s.store.now_ms().await?;
    if to > now {
        return Err(ApiError::bad_request("to is in the future: a backfill is of times that have passed"));
    }
    // Tick records and runs older than the retention period may be gone:
    // a time whose record went could not be told from one never ticked.
    let keep = i64::try_from(s.config.retention.as_millis()).unwrap_or(i64::MAX);
    let earliest = if keep == 0 { now.saturating_sub(MAX_BACKFILL_SPAN_MS) } else { now.saturating_sub(keep) + (keep / 2).min(60_000) };
    if from < earliest {
        return Err(ApiError::bad_request(format!(
            "from is before {earliest}: a backfill reaches back at most the retention period ({} ms; a year with --retention 0), \
             as tick records and runs older than that may be deleted",
            if keep == 0 { MAX_BACKFILL_SPAN_MS } else { keep }
        )));
    }
    let Ok(_one) = s.backfills.clone().try_acquire_owned() else {
        return Err(ApiError::busy("another backfill runs on this host; try again shortly"));
    };
    // Times from the schedule's next tick on are the ticker's to record
    // (so a run of missed times it records never covers a backfilled one).
    let to = if sched.paused { to } else { sched.next_at.map_or(to, |next| to.min(next - 1)) };
    let spec = Spec::of(&sched).map_err(ApiError::bad_request)?;
    let most = s.config.max_backfill_ticks;
    let mut times = Vec::new();
    let mut at = from.saturating_sub(1);
    while let Some(t) = spec.next_after(at).filter(|t| *t <= to) {
        if times.len() == most {
            return Err(ApiError::bad_request(format!("the range holds more than {most} times: backfill it in parts")));
        }
        times.push(t);
        at = t;
    }
    let ticks = s.store.backfill(&sched, &times, req.overlap.unwrap_or(sched.overlap)).await?;
    tracing::info!(schedule = %id, from, to, times = ticks.len(), "schedule backfilled");
    Ok(Json(BackfillResult { ticks }))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct TicksQuery {
    /// Ticks scheduled before this time (epoch ms): the `next` of the
    /// previous page. Default: all.
    before: Option<i64>,
    /// Ticks per page, 1 to 1000. Default: 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// A page of a schedule's ticks, newest first.
#[derive(Serialize, ToSchema)]
pub struct TicksPage {
    ticks: Vec<Tick>,
    /// The `before` of the next page; null on the last.
    next: Option<i64>,
}

/// `GET /v1/schedules/{id}/ticks`: every recorded tick, newest first.
#[utoipa::path(get, path = "/v1/schedules/{id}/ticks", tag = "schedules", params(
        ("id" = String, Path, pattern = "^[A-Za-z0-9._-]{1,128}$", description = "The schedule's id."), TicksQuery),
    responses(
        (status = 200, description = "A page of ticks.", body = TicksPage),
        (status = 404, description = "No such schedule.", body = ErrorBody),
    ))]
pub async fn ticks(
    State(s): State<AppState>,
    Params(id): Params<String>,
    QueryParams(q): QueryParams<TicksQuery>,
) -> Result<Json<TicksPage>, ApiError> {
    found(&s, &id).await?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 1000"));
    }
    let ticks = s.store.ticks(&id, q.before.unwrap_or(i64::MAX), limit).await?;
    let next = (ticks.len() as i64 == limit).then(|| ticks.last().map(|t| t.scheduled_at)).flatten();
    Ok(Json(TicksPage { ticks, next }))
}
