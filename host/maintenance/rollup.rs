//! Keeps the per-minute rollup the dashboard's charts draw
//! (`store::rollup`), on every host with no leader: each pass adds the
//! first claims' waits this host observed and counts the minutes that are
//! over and not counted yet (each by one host, claimed in the database).
//! A host that dies loses the waits of its last pass (at most
//! [`EVERY`]); the counts are the database's and lose nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

use crate::store::rollup::MINUTE_MS;
use crate::store::{Store, StoreError};

/// How often a host adds its waits and looks for minutes to count.
pub const EVERY: Duration = Duration::from_secs(10);

/// Upper bounds of the wait buckets, ms (a 15th bucket holds the rest):
/// the same as `leasehold_submit_to_start_seconds`'.
pub const WAIT_BOUNDS_MS: [i64; 14] = [10, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 300_000, 1_800_000, 3_600_000];

/// How long the rollup's rows are kept: a day.
pub const KEEP: Duration = Duration::from_secs(24 * 3600);

/// Waits observed and not yet added, by store handle (`Store::node`: a
/// process may hold several, tests do): minute -> count per bucket.
type Pending = BTreeMap<i64, [u64; 15]>;
static WAITS: Mutex<Option<HashMap<String, Pending>>> = Mutex::new(None);

/// Notes a run of `store`'s first claim at `started_at` after waiting
/// `wait_ms` since its submit (both from the database's clock).
pub fn observe_wait(store: &Store, started_at: i64, wait_ms: i64) {
    let bucket = WAIT_BOUNDS_MS.iter().position(|le| wait_ms <= *le).unwrap_or(WAIT_BOUNDS_MS.len());
    let minute = started_at.div_euclid(MINUTE_MS) * MINUTE_MS;
    let mut waits = WAITS.lock().expect("rollup lock");
    let by_node = waits.get_or_insert_default();
    // No allocation but a store handle's first.
    if !by_node.contains_key(store.node()) {
        by_node.insert(store.node().to_string(), Pending::new());
    }
    let pending = by_node.get_mut(store.node()).expect("inserted above");
    pending.entry(minute).or_insert([0; 15])[bucket] += 1;
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// (minute, bucket) rows of waits added.
    pub waits: usize,
    /// Minutes this host counted.
    pub counted: usize,
}

/// One pass at `now` (epoch ms): the database's clock in [`run`].
pub async fn tick_at(store: &Store, now: i64) -> Result<Pass, StoreError> {
    let taken = WAITS.lock().expect("rollup lock").get_or_insert_default().remove(store.node()).unwrap_or_default();
    let rows: Vec<(i64, usize, u64)> =
        taken.iter().flat_map(|(m, b)| b.iter().enumerate().filter(|(_, n)| **n > 0).map(move |(i, n)| (*m, i, *n))).collect();
    if let Err(e) = store.add_waits(&rows).await {
        // Kept for the next pass.
        let mut waits = WAITS.lock().expect("rollup lock");
        let mine = waits.get_or_insert_default().entry(store.node().to_string()).or_default();
        for (m, b) in taken {
            let into = mine.entry(m).or_insert([0; 15]);
            for (i, n) in b.iter().enumerate() {
                into[i] += n;
            }
        }
        return Err(e);
    }
    let counted = store.count_minutes(now).await?;
    Ok(Pass { waits: rows.len(), counted })
}

/// One pass on the database's clock.
pub async fn tick(store: &Store) -> Result<Pass, StoreError> {
    let now = store.now_ms().await?;
    tick_at(store, now).await
}

/// Passes every [`EVERY`] until `stop`; rows older than [`KEEP`] are
/// deleted once an hour. A failed pass is logged and tried again.
pub async fn run(store: Store, mut stop: watch::Receiver<bool>) {
    let mut passes = 0u64;
    loop {
        if let Err(e) = tick(&store).await {
            tracing::warn!(error = %e, "rollup: a pass failed; trying again");
        }
        if passes % 360 == 0
            && let Err(e) = store.forget_old_minutes(KEEP.as_millis() as i64).await
        {
            tracing::warn!(error = %e, "rollup: deleting old minutes failed");
        }
        passes += 1;
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
