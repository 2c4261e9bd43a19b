//! Unloading plugin versions no run needs any more. Every version a run was
//! submitted with stays in the database (a run resumes on its own version,
//! on any host); in memory a host keeps only the current versions and
//! those of runs not yet finished, so a plugin updated a hundred times does
//! not hold a hundred compiled components. Unloaded ones load again from
//! the database (and the on-disk compiled cache) if a run needs them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::runtime::Runtime;
use crate::store::{Store, StoreError};

/// One pass: unloads what no open run uses. Returns how many versions went.
pub async fn tick(store: &Store, runtime: &Runtime) -> Result<usize, StoreError> {
    let keep: HashSet<(String, String)> = store.open_versions().await?.into_iter().collect();
    let dropped = runtime.retain_versions(&keep);
    if dropped > 0 {
        tracing::info!(dropped, loaded = runtime.loaded_versions(), "unloaded plugin versions no open run uses");
    }
    Ok(dropped)
}

/// Ticks every `every` until `stop` turns true; a failed tick is logged.
pub async fn run(store: Store, runtime: Arc<Runtime>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(every.max(Duration::from_millis(10)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            _ = interval.tick() => if let Err(e) = tick(&store, &runtime).await {
                tracing::warn!(error = %e, "unloading plugin versions failed");
            },
        }
    }
}
