//! Waiting for a state, never for a time.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use leasehold::executor::{Executor, SegmentOutcome};

use super::TestDb;

/// Polls `check` every 10 ms until it holds, up to 30 s; the error names
/// `what` (say what did not happen). For a state the test cannot be told about, only look at.
pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    eventually_some(Duration::from_secs(30), async || Ok(what.to_string()), async || Ok(check().await?.then_some(()))).await
}

/// Polls `check` every 10 ms until it yields a value, up to `within`, and
/// returns the value. On the timeout the error is what `what` says then (an
/// async closure, so it can look again at the state it describes: the
/// run, the log), with the time waited. An error from `check` (a state
/// that can no longer come right: the segment ended, the run failed) ends
/// the wait at once.
pub async fn eventually_some<T>(
    within: Duration,
    what: impl AsyncFnOnce() -> Result<String>,
    mut check: impl AsyncFnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            let what = what().await.with_context(|| format!("timed out after {within:?}, then failed to say on what"))?;
            anyhow::bail!("{what} (waited {within:?})");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
