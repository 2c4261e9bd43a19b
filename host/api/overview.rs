//! `/v1/stats` and `/v1/leases`: what the dashboard's header and its hosts
//! page show, as JSON any client may read.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::{ApiError, AppState};
use crate::store::{FencedRun, HeldRun};

/// How stale `/v1/stats` may be at most: its counts are a `GROUP BY` over
/// the whole table, shared by every caller (and by `/metrics`). 2 s.
const STATS_TTL: Duration = Duration::from_secs(2);

/// Most runs `/v1/leases` lists as held, and as fenced.
const LEASES_LIMIT: i64 = 500;
const FENCED_LIMIT: i64 = 50;

/// Counts the database holds.
#[derive(Serialize, ToSchema)]
pub struct Stats {
    /// Runs by status, every status included.
    #[schema(example = json!({"queued": 0, "running": 1, "waiting_input": 0, "waiting_takeover": 0, "completed": 9, "failed": 0, "aborted": 0, "cancelled": 0}))]
    runs: BTreeMap<String, i64>,
    /// Ledger rows by state, every state included.
    effects: BTreeMap<String, i64>,
    /// When the oldest finished run kept finished (epoch ms); null if none.
    oldest_finished_at: Option<i64>,
    /// The database's clock now (epoch ms): read with the counts, plus the
    /// time since on this host's monotonic clock.
    now: i64,
}

/// `GET /v1/stats`: runs by status and ledger rows by state, at most 2 s
/// old.
#[utoipa::path(get, path = "/v1/stats", tag = "hosts",
    responses((status = 200, description = "Counts, at most 2 s old.", body = Stats)))]
pub async fn stats(State(s): State<AppState>) -> Result<Json<Stats>, ApiError> {
    let g = super::metrics::cached_gauges(&s, STATS_TTL.min(s.config.metrics_ttl)).await?;
    Ok(Json(Stats {
        runs: g.runs.iter().map(|(st, n)| (st.as_str().to_string(), *n)).collect(),
        effects: g.effects.iter().map(|(st, n)| (st.as_str().to_string(), *n)).collect(),
        oldest_finished_at: g.oldest_finished,
        now: g.now_ms,
    }))
}

/// Who holds which runs, which runs moved past their first fence, and this
/// host's refusals.
#[derive(Serialize, ToSchema)]
pub struct Leases {
    /// The database's clock (epoch ms): count expiries down from it.
    now: i64,
    /// Every owner holding runs now, by owner, with its runs (at most 500
    /// runs in all).
    holders: Vec<Holder>,
    /// Among the 10,000 newest runs, those whose fence is past 1 (taken
    /// over, resumed, or cancelled), most recently updated first; at most 50.
    takeovers: Vec<FencedRun>,
    /// Writes this host made that the database refused by their fence
    /// since it started.
    fenced_writes_rejected: u64,
    /// Segments this host stopped since it started because their lease was
    /// lost.
    leases_lost: u64,
}

/// One owner and the runs it holds.
#[derive(Serialize, ToSchema)]
pub struct Holder {
    owner: String,
    runs: Vec<HeldRun>,
}

/// `GET /v1/leases`.
#[utoipa::path(get, path = "/v1/leases", tag = "hosts",
    responses((status = 200, description = "Leases held now and recent takeovers.", body = Leases)))]
pub async fn leases(State(s): State<AppState>) -> Result<Json<Leases>, ApiError> {
    let held = s.store.held_runs(LEASES_LIMIT).await?;
    let takeovers = s.store.fenced_runs(FENCED_LIMIT).await?;
    let now = s.store.now_ms().await?;
    let mut holders: Vec<Holder> = Vec::new();
    for run in held {
        match holders.last_mut() {
            Some(h) if h.owner == run.owner => h.runs.push(run),
            _ => holders.push(Holder { owner: run.owner.clone(), runs: vec![run] }),
        }
    }
    let metrics = crate::metrics::global();
    Ok(Json(Leases {
        now,
        holders,
        takeovers,
        fenced_writes_rejected: metrics.fenced_writes_rejected.load(Ordering::Relaxed),
        leases_lost: metrics.leases_lost.load(Ordering::Relaxed),
    }))
}
