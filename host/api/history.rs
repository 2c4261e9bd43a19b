//! `GET /v1/stats/history`: the last minutes, a point per minute, from the
//! rollup every host keeps (`rollup`, `store::rollup`): runs finished by
//! status, the wait from submit to first claim (p50, p99), runs queued
//! and running. What the dashboard's charts draw.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, AppState, QueryParams};
use crate::maintenance::rollup::WAIT_BOUNDS_MS;
use crate::store::rollup::MINUTE_MS;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct HistoryQuery {
    /// Minutes back from now, 1 to 1440. Default: 60.
    #[param(minimum = 1, maximum = 1440)]
    minutes: Option<i64>,
}

/// One minute.
#[derive(Serialize, ToSchema, Debug, PartialEq)]
pub struct Minute {
    /// Its start (epoch ms, the database's clock).
    minute: i64,
    /// Runs that ended in it, by status; null until the minute is counted
    /// (10 s after it ends).
    finished: Option<BTreeMap<String, i64>>,
    /// First claims in it, and their wait from submit: the bucket bound
    /// (ms) the 50th and 99th percentiles fall in; null with no claim, or
    /// over an hour.
    started: i64,
    start_wait_p50_ms: Option<i64>,
    start_wait_p99_ms: Option<i64>,
    /// Runs queued and running when it was counted; null if not sampled.
    queued: Option<i64>,
    running: Option<i64>,
}

/// The last minutes, oldest first.
#[derive(Serialize, ToSchema)]
pub struct History {
    /// The database's clock now (epoch ms).
    now: i64,
    minutes: Vec<Minute>,
}

/// The bucket bound the `q` quantile of `counts` falls in.
fn quantile(counts: &[i64; 15], q: f64) -> Option<i64> {
    let total: i64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = (q * total as f64).ceil().max(1.0) as i64;
    let mut seen = 0;
    for (i, n) in counts.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return WAIT_BOUNDS_MS.get(i).copied();
        }
    }
    None
}

/// `GET /v1/stats/history?minutes=60`.
#[utoipa::path(get, path = "/v1/stats/history", tag = "hosts", params(HistoryQuery),
    responses((status = 200, description = "A point per minute, oldest first.", body = History)))]
pub async fn history(State(s): State<AppState>, QueryParams(q): QueryParams<HistoryQuery>) -> Result<Json<History>, ApiError> {
    let minutes = q.minutes.unwrap_or(60);
    if !(1..=1440).contains(&minutes) {
        return Err(ApiError::bad_request("minutes must be between 1 and 1440"));
    }
    let now = s.store.now_ms().await?;
    let current = now.div_euclid(MINUTE_MS) * MINUTE_MS;
    let first = current - (minutes - 1) * MINUTE_MS;
    let mut rows: BTreeMap<i64, Vec<(String, i64)>> = BTreeMap::new();
    for (minute, series, n) in s.store.stats_minutes(first).await? {
        rows.entry(minute).or_default().push((series, n));
    }
    let points = (0..minutes)
        .map(|i| first + i * MINUTE_MS)
        .map(|minute| {
            let series = rows.remove(&minute).unwrap_or_default();
            let get = |name: &str| series.iter().find(|(s, _)| s == name).map(|(_, n)| *n);
            let mut waits = [0i64; 15];
            for (s, n) in &series {
                if let Some(i) = s.strip_prefix("wait:").and_then(|i| i.parse::<usize>().ok()).filter(|i| *i < 15) {
                    waits[i] += n;
                }
            }
            let counted = get("counted").is_some();
            Minute {
                minute,
                finished: counted.then(|| {
                    ["completed", "failed", "aborted", "cancelled"]
                        .iter()
                        .map(|st| (st.to_string(), get(&format!("finished:{st}")).unwrap_or(0)))
                        .collect()
                }),
                started: waits.iter().sum(),
                start_wait_p50_ms: quantile(&waits, 0.5),
                start_wait_p99_ms: quantile(&waits, 0.99),
                queued: has_sample(&series).then(|| get("queued").unwrap_or(0)),
                running: has_sample(&series).then(|| get("running").unwrap_or(0)),
            }
        })
        .collect();
    Ok(Json(History { now, minutes: points }))
}

/// Whether the minute's counter sampled queued and running (then a status
/// with no row had none): the `sampled` row.
fn has_sample(series: &[(String, i64)]) -> bool {
    series.iter().any(|(s, _)| s == "sampled")
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_are_the_bucket_bound_they_fall_in() {
        let mut c = [0i64; 15];
        assert_eq!(quantile(&c, 0.5), None);
        c[0] = 98; // <= 10 ms
        c[5] = 1; // <= 1 s
        c[14] = 1; // over an hour
        assert_eq!(quantile(&c, 0.5), Some(10));
        assert_eq!(quantile(&c, 0.99), Some(1000));
        assert_eq!(quantile(&c, 1.0), None);
    }
}
