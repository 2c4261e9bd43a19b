//! The segment log's writer (`store::segments`): each segment's record is
//! held and written behind it with the others of the same second, in one
//! statement, so the log costs a run no round trip. Best effort: a write
//! that fails is logged and its records dropped; a host that dies loses
//! the records it held.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::store::Store;
use crate::store::segments::SegmentRecord;

/// How long a record waits for others to share its write by default: 1 s
/// (`ExecutorConfig::segment_log_every`).
pub const EVERY: Duration = Duration::from_secs(1);
/// Records one write holds at most; a full batch is written at once.
const BATCH: usize = 1000;

/// Records held for the next write.
#[derive(Clone)]
pub struct SegmentLog {
    store: Store,
    held: Arc<Mutex<Held>>,
    every: Duration,
}

#[derive(Default)]
struct Held {
    rows: Vec<SegmentRecord>,
    /// A timed write is scheduled.
    armed: bool,
}

impl SegmentLog {
    /// A log whose records wait up to `every` for each other.
    pub fn new(store: Store, every: Duration) -> SegmentLog {
        SegmentLog { store, held: Arc::default(), every }
    }

    /// Holds `row` for the next write: within `every`, or at once when
    /// the batch is full.
    pub fn record(&self, row: SegmentRecord) {
        let mut held = self.held.lock().expect("segment log lock");
        held.rows.push(row);
        if held.rows.len() >= BATCH {
            let rows = std::mem::take(&mut held.rows);
            let store = self.store.clone();
            tokio::spawn(async move { write(&store, rows).await });
        } else if !held.armed {
            held.armed = true;
            let log = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(log.every).await;
                log.held.lock().expect("segment log lock").armed = false;
                log.flush().await;
            });
        }
    }

    /// Writes what is held now (one pass; tests call it instead of waiting).
    pub async fn flush(&self) {
        let rows = std::mem::take(&mut self.held.lock().expect("segment log lock").rows);
        write(&self.store, rows).await;
    }
}

async fn write(store: &Store, rows: Vec<SegmentRecord>) {
    if let Err(e) = store.record_segments(&rows).await {
        tracing::warn!(error = %e, records = rows.len(), "could not write the segment log; these segments will be missing from their runs' time lines");
    }
}
