//! `GET /v1/threads/{id}/events`: the durable thread log, as JSON or, with
//! `Accept: text/event-stream`, as a live stream of server-sent events
//! resumable with `Last-Event-ID`. Each event's SSE `id` is its sequence
//! number in the thread and its data carries the run id and fence.
//!
//! An open stream reads the database only when its thread has new events:
//! this host's writes wake it in process ([`crate::store::hub`]), and one
//! task per host looks for other hosts' events on every watched thread at
//! once ([`watch_other_hosts`]). Streams are capped in number.

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use std::time::Duration;

use tokio::sync::watch;

use super::{ApiError, AppState, Params, QueryParams};
use crate::store::{Event, Store};

/// Events per database read.
const PAGE: i64 = 500;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Events after this seq. Default: 0 (from the first).
    after: Option<i64>,
    /// Events per page (JSON only), 1 to 10000. Default: 500.
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<i64>,
}

/// One event of a thread's log. In a stream, each is one server-sent event
/// whose `id` is `seq`, whose `event` is `kind` and whose data is this.
#[derive(Serialize, ToSchema)]
pub struct EventView {
    thread_id: String,
    /// The event's number in its thread, from 1, without gaps.
    seq: i64,
    run_id: i64,
    /// The fence of the segment that wrote it (0 outside a lease).
    fence: i64,
    /// `submitted`, `delta`, `message`, `suspended`, `input`, `cancelled`
    /// or `retract`.
    kind: String,
    /// The kind's JSON payload (see docs/api.md).
    payload: Value,
    created_at: i64,
}

/// A page of a thread's log.
#[derive(Serialize, ToSchema)]
pub struct EventsPage {
    events: Vec<EventView>,
}

pub fn to_view(e: &Event) -> EventView {
    EventView {
        thread_id: e.thread_id.clone(),
        seq: e.seq,
        run_id: e.run_id,
        fence: e.fence,
        kind: e.kind.clone(),
        payload: serde_json::from_str::<Value>(&e.payload).unwrap_or(Value::Null),
        created_at: e.created_at,
    }
}

/// `GET /v1/threads/{id}/events`: JSON, or a stream with `Accept:
/// text/event-stream`.
#[utoipa::path(get, path = "/v1/threads/{id}/events", tag = "events",
    params(
        ("id" = String, Path, min_length = 1, max_length = 256, pattern = r"^[^\u0000]+$", description = "The thread's id."),
        ("Last-Event-ID" = Option<i64>, Header, nullable = false, description = "Resume a stream after this seq (overrides `after`)."),
        EventsQuery,
    ),
    responses(
        (status = 200, description = "The thread's events after `after`: a JSON page, or with \
            `Accept: text/event-stream` a live stream of them as server-sent events.",
            content(
                (EventsPage = "application/json"),
                (String = "text/event-stream"),
            )),
    ))]
pub async fn events(
    State(s): State<AppState>,
    Params(thread): Params<String>,
    QueryParams(q): QueryParams<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if thread.chars().count() > 256 || thread.contains('\0') {
        return Err(ApiError::bad_request("thread id must be at most 256 characters without NUL characters"));
    }
    let last_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().parse::<i64>().map_err(|_| ApiError::bad_request("Last-Event-ID must be an event seq")))
        .transpose()?;
    let after = last_id.or(q.after).unwrap_or(0);
    let wants_stream = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if !wants_stream {
        let limit = q.limit.unwrap_or(PAGE);
        if !(1..=10_000).contains(&limit) {
            return Err(ApiError::bad_request("limit must be between 1 and 10000"));
        }
        let events = s.store.events_page(&thread, after, limit, s.config.max_page_bytes).await?;
        return Ok(Json(EventsPage { events: events.iter().map(to_view).collect() }).into_response());
    }
    let Ok(permit) = s.streams.clone().try_acquire_owned() else {
        return Ok(super::busy(
            format!("this host has {} event streams open, its cap; try again shortly", s.config.max_streams),
        ));
    };
    let stream = async_stream(s, thread, after, permit);
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

/// The events of `thread` after `after`, as they are written, until
/// shutdown. Holds its stream's `permit`.
fn async_stream(
    s: AppState,
    thread: String,
    after: i64,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> impl futures::Stream<Item = Result<SseEvent, Infallible>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(16);
    tokio::spawn(async move {
        let _permit = permit;
        let mut watch = s.store.hub().watch(&thread);
        let mut after = after;
        let mut shutdown = s.shutdown.clone();
        loop {
            if *shutdown.borrow() {
                return;
            }
            match s.store.events_page(&thread, after, PAGE, s.config.max_page_bytes).await {
                Ok(events) if !events.is_empty() => {
                    for e in events {
                        after = e.seq;
                        let sse = SseEvent::default().id(e.seq.to_string()).event(e.kind.clone()).data(serde_json::to_string(&to_view(&e)).unwrap_or_default());
                        if tx.send(sse).await.is_err() {
                            return; // the reader went away
                        }
                    }
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "event stream read failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            }
            tokio::select! {
                _ = watch.changed() => {}
                _ = shutdown.changed() => {}
                _ = tx.closed() => return,
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) })
}

/// Looks, every `every`, for events other hosts wrote to the threads this
/// host's streams watch, in one query for all of them, and wakes the
/// streams of those that moved on. Ends at shutdown.
pub(crate) async fn watch_other_hosts(store: Store, every: Duration, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let watched = store.hub().watched();
        if watched.is_empty() {
            continue;
        }
        match store.thread_heads(&watched).await {
            Ok(heads) => store.hub().heads(&heads),
            Err(e) => tracing::debug!(error = %e, "reading thread heads failed; retrying"),
        }
    }
}
