//! A segment's lease is renewed from its claim until its last write
//! returns: a slow start (a cold compile, the upgrade check) and a close
//! held up behind another session's lock or written behind its slot keep
//! the lease, so no other host takes a run that is still being finished.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::maintenance::reaper::{self, ReaperConfig};
use leasehold::store::{NewRun, RunStatus};

use crate::harness::{TestDb, both};
use crate::plugins;

/// Long enough that a loaded machine's late renewal (every second) still
/// lands inside it.
const TTL: Duration = Duration::from_secs(3);

/// Runs one segment of a one-attempt run while `hold` (two lease
/// lengths) holds part of it up; meanwhile another host tries to claim
/// the run and the reaper looks at it. Neither may touch it.
async fn held_up_for_two_leases(db: &TestDb, hold: impl Fn(Duration)) -> Result<()> {
    let runtime = plugins::runtime()?;
    runtime.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
    let config = ExecutorConfig { lease_ttl: TTL, ..crate::harness::worker("slow") };
    let exec = Executor::new(db.store.clone(), runtime, config);
    let mut new = NewRun::new("testkit", serde_json::json!({ "steps": 1 }).to_string());
    new.max_attempts = Some(1);
    let id = db.store.create_run(&new).await?.0.id;
    hold(TTL * 2);
    let task = tokio::spawn(async move { exec.run_once().await });
    crate::harness::eventually("the segment never claimed the run", async || {
        if db.store.get_run(id).await?.lease_owner.as_deref() == Some("slow") {
            return Ok(true);
        }
        ensure!(!task.is_finished(), "the segment never claimed the run: it ended");
        Ok(false)
    })
    .await?;
    // Held up for two leases, it ends well inside 30 s; meanwhile nobody
    // else may touch its run (a check each 100 ms, not a wait).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !task.is_finished() {
        ensure!(Instant::now() < deadline, "the segment did not end");
        let thief = db.store.claim("thief", TTL).await?;
        ensure!(thief.is_none(), "another host took the run while its segment held it: {thief:?}");
        let reaped = reaper::tick(&db.store, &ReaperConfig::default()).await?;
        ensure!(reaped.aborted.is_empty(), "the reaper aborted the run while its segment held it: {reaped:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    hold(Duration::ZERO);
    let outcome = task.await??;
    ensure!(outcome == Some((id, SegmentOutcome::Completed)), "{outcome:?}");
    let run = db.store.get_run(id).await?;
    ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("did 1 steps"), "{run:?}");
    ensure!(run.fence == 1 && run.attempt == 1, "{run:?}");
    Ok(())
}

both! {
    async fn a_close_held_up_for_longer_than_a_lease_keeps_its_run(db) {
        let faults = db.store.clone();
        held_up_for_two_leases(db, move |by| faults.faults().delay_closes(by)).await
    }

    async fn a_segment_slow_to_start_its_guest_keeps_its_run(db) {
        let faults = db.store.clone();
        held_up_for_two_leases(db, move |by| faults.faults().delay_guests(by)).await
    }
}
