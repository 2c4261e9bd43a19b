//! The ticker: every host runs it, none leads. A pass reads the schedules
//! due on the database's clock and, for each, records every time that has
//! come (up to [`MAX_TICKS`] a pass) and moves its `next_at` on, in one
//! transaction that first takes the schedule's row (compare-and-set on its
//! version: a host that finds it moved on writes nothing). Then it starts
//! the buffered ticks whose open runs have ended.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use super::{Spec, format_span};
use crate::store::ticks::{Due, Outcome, jitter};
use crate::store::{Store, StoreError};

/// Most times one pass records for one schedule, one record each (times
/// not missed: started, skipped or buffered by their overlap policy).
pub const MAX_TICKS: usize = 1000;

/// Most missed times one pass walks into one record: a day of a schedule
/// of every second is one pass (86,400), a longer downtime a few.
pub const MAX_MISSED_WALK: i64 = 100_000;

/// Ticker settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct TickerConfig {
    /// Most schedules one pass ticks. Default: 100.
    pub batch: i64,
    /// Longest wait between passes: how soon a schedule made or changed on
    /// another host is ticked. A pass also comes when the next known tick
    /// is due. Default: 1 s.
    pub poll: Duration,
}

impl Default for TickerConfig {
    fn default() -> Self {
        TickerConfig { batch: 100, poll: Duration::from_secs(1) }
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    pub started: usize,
    pub skipped: usize,
    pub buffered: usize,
    /// Schedules another host (or a change) moved on first.
    pub lost: usize,
    /// Schedules whose tick failed (tried again next pass).
    pub failed: usize,
    /// When the next known tick is due (epoch ms), if any.
    pub next_due: Option<i64>,
}

/// One pass at `now` (epoch ms): the database's clock in [`run`], any
/// time in a test.
pub async fn tick_at(store: &Store, config: &TickerConfig, now: i64) -> Result<Pass, StoreError> {
    let (due, soonest) = store.due_schedules(now, config.batch).await?;
    // A full batch leaves more due: the next pass comes at once.
    let more = due.len() as i64 >= config.batch;
    let mut pass = Pass { next_due: if more { Some(now) } else { soonest }, ..Pass::default() };
    for s in due {
        let (dues, next_at) = match Spec::of(&s) {
            Ok(spec) => due_times(&s, &spec, now),
            // A zone the database of this host lacks, say: recorded, and the
            // schedule stops (next_at null) rather than failing every pass.
            Err(e) => {
                tracing::warn!(schedule = %s.id, error = %e, "a schedule's times do not read; it stops");
                let at = s.next_at.unwrap_or(now);
                (vec![Due::at(at, Some(format!("the schedule does not read: {e}")), 0)], None)
            }
        };
        match store.tick_schedule(&s, &dues, next_at).await {
            // One schedule's failure (a lock wait given up, say) must not
            // hold up the others: it is due again next pass.
            Err(e) => {
                tracing::warn!(schedule = %s.id, error = %e, "schedules: a tick failed; it is tried again next pass");
                pass.failed += 1;
            }
            Ok(None) => pass.lost += 1,
            Ok(Some(ticks)) => {
                for t in &ticks {
                    match t.outcome {
                        Outcome::Started => pass.started += 1,
                        Outcome::Skipped => pass.skipped += t.times as usize,
                        Outcome::Buffered => pass.buffered += 1,
                    }
                }
                if let Some(next) = next_at {
                    pass.next_due = Some(pass.next_due.map_or(next, |n| n.min(next)));
                }
            }
        }
    }
    pass.started += store.release_buffered(config.batch).await?.len();
    let m = crate::metrics::global();
    m.ticks_started.fetch_add(pass.started as u64, Ordering::Relaxed);
    m.ticks_skipped.fetch_add(pass.skipped as u64, Ordering::Relaxed);
    m.ticks_buffered.fetch_add(pass.buffered as u64, Ordering::Relaxed);
    if pass.skipped > 0 {
        tracing::info!(started = pass.started, skipped = pass.skipped, buffered = pass.buffered, "schedules ticked");
    }
    Ok(pass)
}

/// One pass on the database's clock.
pub async fn tick(store: &Store, config: &TickerConfig) -> Result<Pass, StoreError> {
    let now = store.now_ms().await?;
    tick_at(store, config, now).await
}

/// Schedule `s`'s times from its `next_at` up to `now`, and the
/// `next_at` after them: first the run of those older than its catch-up
/// window, as one missed record (at most [`MAX_MISSED_WALK`] of them a
/// pass), then the rest, each its own (at most [`MAX_TICKS`]).
fn due_times(s: &crate::store::Schedule, spec: &Spec, now: i64) -> (Vec<Due>, Option<i64>) {
    let mut dues = Vec::new();
    let mut at = s.next_at;
    let missed = |t: i64| now - t > s.catchup_window_ms;
    if let Some(first) = at.filter(|t| *t <= now && missed(*t)) {
        let (mut last, mut times) = (first, 1);
        at = spec.next_after(first);
        while let Some(t) = at.filter(|t| missed(*t) && times < MAX_MISSED_WALK) {
            (last, times) = (t, times + 1);
            at = spec.next_after(t);
        }
        let late = now - first;
        let reason = format!("{} late, past the catch-up window of {}", format_span(late), format_span(s.catchup_window_ms));
        dues.push(Due { at: first, missed: Some(reason), jitter_ms: 0, through: (times > 1).then_some(last), times });
        if at.is_some_and(|t| missed(t)) {
            // The walk's cap: the next pass goes on from here.
            return (dues, at);
        }
    }
    while let Some(t) = at.filter(|t| *t <= now && dues.len() < MAX_TICKS) {
        dues.push(Due::at(t, None, jitter(s, t)));
        at = spec.next_after(t);
    }
    (dues, at)
}

/// Ticks until `stop` turns true: after each pass, when the next known
/// tick is due or after `config.poll`, whichever is sooner. A failed pass
/// (a database hiccup) is logged; it must not take the service down.
pub async fn run(store: Store, config: TickerConfig, mut stop: watch::Receiver<bool>) {
    loop {
        let wait = match tick(&store, &config).await {
            Ok(pass) => match (pass.next_due, store.now_ms().await) {
                (Some(next), Ok(now)) => Duration::from_millis((next - now).max(0) as u64).min(config.poll),
                _ => config.poll,
            },
            Err(e) => {
                tracing::warn!(error = %e, "schedules: a ticker pass failed");
                config.poll
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait.max(Duration::from_millis(5))) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
