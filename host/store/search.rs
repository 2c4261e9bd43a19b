//! `GET /v1/runs?q=`: the text search over runs, bounded.
//!
//! `q=` matches inside inputs, outputs and errors, which no index serves,
//! so a search reads runs newest first until its page is full. Unbounded,
//! a search for text no run holds reads the whole table in one statement,
//! and goes on reading after its request has timed out: a query whose
//! future is dropped runs on in the database (PostgreSQL notices the
//! closed socket only when it next writes to it; SQLite's statement runs
//! to its end on its thread). So a search reads windows of [`WINDOW`] ids,
//! one statement each, and starts no window once its time `budget` is
//! spent: the page then ends early (even empty) and its `next_cursor` says
//! where the next page goes on.

use std::time::{Duration, Instant};

use crate::store::{Run, RunFilter, Store, StoreError};

/// Run ids one statement of a text search reads: 5,000.
pub const WINDOW: i64 = 5_000;

/// A page of runs, newest first, and where the next page starts (the
/// `cursor` to pass back); `None` on the last.
#[derive(Debug)]
pub struct RunsPage {
    pub runs: Vec<Run>,
    pub next_cursor: Option<i64>,
}

/// What a run weighs against a page's byte cap (as `runs_page` counts it).
fn weight(r: &Run) -> i64 {
    (r.input.len() + r.partial.len() + r.output.as_ref().map_or(0, String::len) + r.error.as_ref().map_or(0, String::len)) as i64
}

impl Store {
    /// A page of runs matching `filter`, older than `before`: at most
    /// `limit` and about `max_bytes` (see [`Store::runs_page`]). With
    /// `filter.text`, read a window of [`WINDOW`] ids at a time, starting
    /// no window after `budget`.
    pub async fn search_runs(
        &self,
        filter: &RunFilter,
        before: Option<i64>,
        limit: i64,
        max_bytes: i64,
        budget: Duration,
    ) -> Result<RunsPage, StoreError> {
        let started = Instant::now();
        let page = |runs: Vec<Run>, more: bool| {
            let next_cursor = if more { runs.last().map(|r| r.id) } else { None };
            RunsPage { runs, next_cursor }
        };
        if filter.text.as_deref().is_none_or(str::is_empty) {
            let (runs, cut) = self.runs_page(filter, before, limit, max_bytes).await?;
            let full = runs.len() as i64 == limit || cut;
            return Ok(page(runs, full));
        }
        let mut before = before.unwrap_or(i64::MAX);
        let mut runs: Vec<Run> = Vec::new();
        loop {
            let top: Option<i64> = sqlx::query_scalar(crate::store::sql!(self, "SELECT MAX(id) FROM runs WHERE id < $1"))
                .bind(before)
                .fetch_one(self.pool())
                .await?;
            let Some(top) = top else {
                return Ok(page(runs, false));
            };
            let from = top.saturating_sub(WINDOW - 1);
            let left = max_bytes.saturating_sub(runs.iter().map(weight).sum());
            let (found, cut) = self.runs_page_from(filter, Some(before), from, limit - runs.len() as i64, left.max(1)).await?;
            runs.extend(found);
            if runs.len() as i64 == limit || cut {
                return Ok(page(runs, true));
            }
            if from <= 1 {
                return Ok(page(runs, false));
            }
            before = from;
            if started.elapsed() >= budget {
                // Time is up with the page short: go on from this window's
                // lower edge next time.
                return Ok(RunsPage { runs, next_cursor: Some(from) });
            }
        }
    }
}
