//! Waiting for a state, never for a time.

use std::time::{Duration, Instant};

use anyhow::Result;
use leasehold::executor::{Executor, SegmentOutcome};

use super::TestDb;

/// Polls `check` every 10 ms until it holds, up to 30 s; the error names
/// `what` (say what did not happen). For a state the test cannot be told about, only look at.
pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check().await? {
        anyhow::ensure!(Instant::now() < deadline, "{what} (waited 30 s)");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Runs one segment of `exec` until `dead_when` holds (20 s at most),
/// then kills it (drops its future, as a host that died mid-turn) and
/// expires run `run_id`'s lease so another host may take it over. An
/// error if the segment ended first: it was never killed.
pub async fn kill_when(db: &TestDb, exec: Executor, run_id: i64, mut dead_when: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let task = tokio::spawn(async move { exec.run_once().await });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dead_when().await? {
        if task.is_finished() {
            let ended: Result<Option<(i64, SegmentOutcome)>, _> = task.await?;
            anyhow::bail!("the segment ended ({ended:?}) before it could be killed: {:?}", db.store.get_run(run_id).await?);
        }
        anyhow::ensure!(Instant::now() < deadline, "the kill point was never reached in 20 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    task.abort();
    let _ = task.await;
    db.backdate_lease(run_id, 60_000).await
}
