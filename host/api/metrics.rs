//! `GET /metrics`: Prometheus text. This host's counters (live), runs
//! failed by guest error kind, and the gauges the database holds (runs by
//! status, ledger rows by state), cached for [`super::ApiConfig::metrics_ttl`]
//! so a scrape costs no table scan.

use std::fmt::Write;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState};
use crate::runtime::GuestErrorKind;
use crate::store::Gauges;

/// `GET /metrics`: Prometheus text (docs/operations.md lists the metrics).
#[utoipa::path(get, path = "/metrics", tag = "service",
    responses((status = 200, description = "This host's counters and the database's gauges, in Prometheus' text format.",
        content_type = "text/plain", body = String)))]
pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let metrics = crate::metrics::global();
    let mut text = metrics.render_counters();
    let _ = writeln!(
        text,
        "# HELP leasehold_guest_errors_total Runs failed by a guest error, by kind.\n# TYPE leasehold_guest_errors_total counter"
    );
    for kind in GuestErrorKind::ALL {
        let _ = writeln!(text, "leasehold_guest_errors_total{{kind=\"{}\"}} {}", kind.as_str(), metrics.guest_errors(kind.as_str()));
    }
    text.push_str(&render_gauges(&cached_gauges(&state, state.config.metrics_ttl).await?));
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// The database's gauges, read again if the copy this host keeps is older
/// than `ttl`: one table scan per `ttl` however many callers ask.
pub(super) async fn cached_gauges(state: &AppState, ttl: std::time::Duration) -> Result<Gauges, ApiError> {
    let mut gauges = state.gauges.lock().await;
    match gauges.as_ref() {
        // The counts as read; `now_ms` advanced by the time since on this
        // host's monotonic clock, so it stays the database's now (clients
        // set their clocks from it) and an age computed from it keeps
        // growing while the counts are reused.
        Some((at, g)) if at.elapsed() < ttl => {
            let mut g = g.clone();
            g.now_ms += i64::try_from(at.elapsed().as_millis()).unwrap_or(i64::MAX);
            Ok(g)
        }
        _ => {
            let fresh = state.store.gauges().await?;
            *gauges = Some((std::time::Instant::now(), fresh.clone()));
            Ok(fresh)
        }
    }
}

/// The database's gauges, in the text format.
fn render_gauges(gauges: &Gauges) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP leasehold_runs Runs in the database, by status.\n# TYPE leasehold_runs gauge");
    for (status, n) in &gauges.runs {
        let _ = writeln!(out, "leasehold_runs{{status=\"{status}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP leasehold_effects Ledger rows in the database, by state (in_doubt: outcome unknown).\n# TYPE leasehold_effects gauge"
    );
    for (state, n) in &gauges.effects {
        let _ = writeln!(out, "leasehold_effects{{state=\"{}\"}} {n}", state.as_str());
    }
    let _ = writeln!(
        out,
        "# HELP leasehold_queued_runs_by_key Queued runs of the concurrency keys with the most (at most 20 keys).\n\
         # TYPE leasehold_queued_runs_by_key gauge"
    );
    for (key, n) in &gauges.queued_by_key {
        let _ = writeln!(out, "leasehold_queued_runs_by_key{{key=\"{}\"}} {n}", label(key));
    }
    let age = gauges.oldest_finished.map_or(0.0, |at| (gauges.now_ms - at).max(0) as f64 / 1000.0);
    let _ = writeln!(
        out,
        "# HELP leasehold_oldest_finished_run_age_seconds How long ago the oldest finished run still kept finished (0: none).\n\
         # TYPE leasehold_oldest_finished_run_age_seconds gauge\nleasehold_oldest_finished_run_age_seconds {age}"
    );
    out
}

/// `v` as a Prometheus label value: backslash, quote and newline escaped
/// (a key is operator or client text).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
