//! The reaper. Needs no leader: every write it makes is guarded by the
//! fence it observed, so any number of hosts may run it at once, and a
//! claim racing it either wins or loses atomically. Its statements are in
//! `store::reap`; this is the loop.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use crate::store::{RunStatus, Store, StoreError};

pub use crate::store::ReapReport;

/// Reaper settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ReaperConfig {
    /// Most runs examined per tick. Default: 500.
    pub batch: i64,
}

impl Default for ReaperConfig {
    fn default() -> Self {
        ReaperConfig { batch: 500 }
    }
}

/// Runs one reaper pass over up to `config.batch` candidates (see
/// [`Store::reap_candidates`]).
pub async fn tick(store: &Store, config: &ReaperConfig) -> Result<ReapReport, StoreError> {
    let mut report = ReapReport::default();
    for (id, fence, status) in store.reap_candidates(config.batch).await? {
        match store.reap_run(id, fence, status, &mut report).await {
            Err(e) if crate::store::is_lock_timeout(&e) => {
                tracing::warn!(run_id = id, "reaper: the run's row is locked by another session; trying it next tick");
                report.locked += 1;
            }
            other => other?,
        }
    }
    // Children of parents that failed, were aborted or cancelled
    // (store::children): their policy holds across any host's death.
    report.orphans_cancelled = store.cancel_orphans(config.batch).await?;
    // Runs waiting for budget that has room (a wake that found nobody).
    report.budget_woken = store.wake_budget_waiters(config.batch).await?;
    if !report.aborted.is_empty() || report.in_doubt > 0 || report.orphans_cancelled > 0 || report.budget_woken > 0 {
        tracing::info!(
            orphans_cancelled = report.orphans_cancelled,
            budget_woken = report.budget_woken,
            aborted = report.aborted.len(),
            resumable = report.resumable.len(),
            in_doubt = report.in_doubt,
            "reaper tick"
        );
    }
    Ok(report)
}

/// Reaps one run as observed at (`fence`, `status`); see [`Store::reap_run`].
#[doc(hidden)]
pub async fn reap_run(
    store: &Store,
    id: i64,
    fence: i64,
    status: RunStatus,
    report: &mut ReapReport,
) -> Result<(), StoreError> {
    store.reap_run(id, fence, status, report).await
}

/// Ticks every `every` until `stop` turns true. A failed tick (a database
/// hiccup) is logged; it must not take the service down.
pub async fn run(store: Store, config: ReaperConfig, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(every.max(Duration::from_millis(10)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let metrics = crate::metrics::global();
    loop {
        tokio::select! {
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            _ = interval.tick() => match tick(&store, &config).await {
                Ok(report) => {
                    metrics.reaped_resumable.fetch_add(report.resumable.len() as u64, Ordering::Relaxed);
                    metrics.reaped_aborted.fetch_add(report.aborted.len() as u64, Ordering::Relaxed);
                    if !report.resumable.is_empty() || !report.aborted.is_empty() {
                        tracing::info!(resumable = ?report.resumable, aborted = ?report.aborted, "reaped expired runs");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reaper tick failed"),
            },
        }
    }
}
