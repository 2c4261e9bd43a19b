//! `GET /v1/threads/{id}/events`: the durable thread log, as JSON or, with
//! `Accept: text/event-stream`, as a live stream of server-sent events
//! resumable with `Last-Event-ID`. Each event's SSE `id` is its sequence
//! number in the thread and its data carries the run id and fence.

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiError, AppState, Params, QueryParams};
use crate::store::Event;

/// Events per database read.
const PAGE: i64 = 500;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    after: Option<i64>,
    limit: Option<i64>,
}

pub fn to_json(e: &Event) -> Value {
    json!({
        "thread_id": e.thread_id,
        "seq": e.seq,
        "run_id": e.run_id,
        "fence": e.fence,
        "kind": e.kind,
        "payload": serde_json::from_str::<Value>(&e.payload).unwrap_or(Value::Null),
        "created_at": e.created_at,
    })
}

pub async fn events(
    State(s): State<AppState>,
    Params(thread): Params<String>,
    QueryParams(q): QueryParams<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if thread.len() > 256 || thread.contains('\0') {
        return Err(ApiError::bad_request("thread id must be at most 256 bytes without NUL characters"));
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
        let events = s.store.events_after(&thread, after, limit).await?;
        return Ok(Json(json!({ "events": events.iter().map(to_json).collect::<Vec<_>>() })).into_response());
    }
    let stream = futures::stream::unfold((s, thread, after, Vec::<Event>::new()), |(s, thread, mut after, mut buf)| async move {
        loop {
            if let Some(e) = (!buf.is_empty()).then(|| buf.remove(0)) {
                after = e.seq;
                let sse = SseEvent::default().id(e.seq.to_string()).event(e.kind.clone()).data(to_json(&e).to_string());
                return Some((Ok::<_, Infallible>(sse), (s, thread, after, buf)));
            }
            if *s.shutdown.borrow() {
                return None;
            }
            match s.store.events_after(&thread, after, PAGE).await {
                Ok(events) if !events.is_empty() => buf = events,
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "event stream read failed; retrying"),
            }
            if buf.is_empty() {
                let mut shutdown = s.shutdown.clone();
                tokio::select! {
                    _ = tokio::time::sleep(s.config.stream_poll) => {}
                    _ = shutdown.changed() => {}
                }
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}
