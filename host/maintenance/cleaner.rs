//! The retention cleaner: deletes finished runs older than the retention
//! period, with their ledger rows and events (`store::retention`), a small
//! batch at a time, on every host without a leader, like the reaper. On
//! SQLite each batch's freed pages go back to the file system (or are
//! reused), so the file stops growing under steady load; on PostgreSQL
//! vacuum reclaims the space (see `vacuum`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use crate::store::{Deleted, Store, StoreError};

/// Retention settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct RetentionConfig {
    /// Finished runs older than this are deleted; zero keeps everything.
    /// Default: 7 days.
    pub keep: Duration,
    /// Runs deleted per transaction. Default: 500.
    pub batch: i64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig { keep: Duration::from_secs(7 * 24 * 3600), batch: 500 }
    }
}

/// Deletes one batch of finished runs past retention (the cut-off is on the
/// database's clock). Nothing when retention is off.
pub async fn tick(store: &Store, config: &RetentionConfig) -> Result<Deleted, StoreError> {
    // Whatever the retention: a key rows' table holds no key that has
    // neither a limit nor runs to claim (a submit writes it again).
    store.forget_idle_keys(config.batch).await?;
    store.forget_spent_holds().await?;
    if config.keep.is_zero() {
        return Ok(Deleted::default());
    }
    let keep_ms = i64::try_from(config.keep.as_millis()).unwrap_or(i64::MAX);
    // Schedules' tick records past retention too (never a buffered one).
    store.forget_old_ticks(keep_ms, config.batch).await?;
    let deleted = store.delete_finished(keep_ms, config.batch).await?;
    if deleted.runs > 0 {
        store.give_back_space().await?;
        let m = crate::metrics::global();
        m.deleted_runs.fetch_add(deleted.runs, Ordering::Relaxed);
        m.deleted_effects.fetch_add(deleted.effects, Ordering::Relaxed);
        m.deleted_events.fetch_add(deleted.events, Ordering::Relaxed);
        tracing::debug!(?deleted, "retention: deleted finished runs");
    }
    Ok(deleted)
}

/// Ticks until `stop`: at once again after a full batch (there is more to
/// delete), else after `every`. A failed tick is logged. Runs with
/// retention off too: idle keys and spent holds are forgotten whatever it is.
pub async fn run(store: Store, config: RetentionConfig, every: Duration, mut stop: watch::Receiver<bool>) {
    loop {
        let pause = match tick(&store, &config).await {
            // A short pause between full batches lets other writers in.
            Ok(d) if d.runs as i64 >= config.batch => Duration::from_millis(10),
            Ok(_) => every,
            Err(e) => {
                tracing::warn!(error = %e, "retention: deleting finished runs failed");
                every
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
