//! Paused runs (docs/operations.md, "Pausing a run"): a paused run is not
//! claimed, a running one stops at its next slice point, whatever would
//! have woken a paused run waits for its resume, and the pause survives a
//! host's restart. Both backends.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::store::{FOREVER, NewRun, RunStatus, StoreError};
use serde_json::json;

use crate::harness::{TTL, TestDb, both};
use crate::plugins;
use crate::sink::Sink;

/// A host whose lease (30 s) is renewed every `renew_every`.
fn host_renewing(db: &TestDb, rt: &Arc<leasehold::runtime::Runtime>, owner: &str, renew_every: Duration) -> Executor {
    let config = ExecutorConfig {
        renew_every: Some(renew_every),
        ..crate::harness::worker(owner)
    };
    Executor::new(db.store.clone(), rt.clone(), config)
}

/// A host renewing every 10 s (a third of its lease, the default): it
/// hears of a pause made elsewhere no sooner.
fn host(db: &TestDb, rt: &Arc<leasehold::runtime::Runtime>, owner: &str) -> Executor {
    host_renewing(db, rt, owner, Duration::from_secs(10))
}

/// Starts an 8-step HTTP run (150 ms a step) on `a` and waits until two
/// steps reached the sink; returns the run, the segment's task and the sink.
async fn running(db: &TestDb, a: Executor) -> anyhow::Result<(i64, tokio::task::JoinHandle<Result<Option<(i64, SegmentOutcome)>, StoreError>>, Sink, Arc<leasehold::runtime::Runtime>)> {
    let sink = Sink::start_with_delay(Duration::from_millis(150)).await?;
    let rt = a.runtime().clone();
    let mut limits = plugins::test_limits();
    limits.http_allow = vec![sink.allow()];
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    let input = json!({ "mode": "http-steps", "steps": 8, "url": sink.url });
    let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
    let task = tokio::spawn(async move { a.run_once().await });
    crate::harness::eventually("the turn never got going", async || {
        if sink.hits().len() >= 2 {
            return Ok(true);
        }
        ensure!(!task.is_finished(), "the turn never got going: its segment ended");
        Ok(false)
    })
    .await?;
    Ok((id, task, sink, rt))
}

both! {
    async fn a_run_paused_mid_turn_stops_at_a_slice_point_stays_paused_across_a_restart_and_completes_once_resumed(db) {
        let rt = plugins::runtime()?;
        // Its renewals come every 10 s: a pause made on its own host must
        // reach it sooner than that.
        let (id, task, sink, rt) = running(db, host(db, &rt, "host-a")).await?;
        let paused = db.store.pause_run(id).await?;
        ensure!(paused.paused_at.is_some() && paused.status == RunStatus::Running, "{paused:?}");
        let outcome = tokio::time::timeout(Duration::from_secs(5), task).await??;
        ensure!(outcome? == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingTakeover))), "host A did not stop");
        let hits = sink.hits().len();
        ensure!(hits < 8, "the turn ran to its end: {hits} steps");
        let run = db.store.get_run(id).await?;
        ensure!(run.paused_at.is_some() && run.not_before == FOREVER && run.lease_owner.is_none(), "{run:?}");
        // A host started afresh claims nothing while the run is paused.
        let b = host(db, &rt, "host-b");
        ensure!(b.run_once().await?.is_none(), "a paused run was claimed");
        tokio::time::sleep(Duration::from_millis(300)).await;
        ensure!(sink.hits().len() == hits, "the sink was called while the run was paused");
        let resumed = db.store.resume_run(id).await?;
        ensure!(resumed.paused_at.is_none(), "{resumed:?}");
        b.drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("did 8 http steps"), "{:?} {:?} {:?}", run.status, run.output, run.error);
        let mut steps: Vec<String> = sink.hits().into_iter().map(|h| h.body).collect();
        steps.sort();
        steps.dedup();
        ensure!(sink.hits().len() == 8 && steps.len() == 8, "each step reached the sink once: {:?}", sink.hits());
        Ok(())
    }

    async fn a_pause_made_on_another_host_reaches_a_running_segment_with_its_next_renewal(db) {
        let rt = plugins::runtime()?;
        let (id, task, sink, _rt) = running(db, host_renewing(db, &rt, "host-a", Duration::from_millis(50))).await?;
        // Another host's store: no in-process signal reaches host A.
        let other = db.another_store(2).await?;
        other.pause_run(id).await?;
        let outcome = tokio::time::timeout(Duration::from_secs(5), task).await??;
        ensure!(outcome? == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingTakeover))), "host A did not stop");
        ensure!(sink.hits().len() < 8, "the turn ran to its end");
        ensure!(db.store.get_run(id).await?.paused_at.is_some(), "not paused");
        Ok(())
    }

    async fn what_would_wake_a_paused_run_waits_for_its_resume(db) {
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let h = host(db, &rt, "host-a");
        // Waiting for input: input delivered while paused is kept, not run.
        let waits = db.store.create_run(&NewRun::new("testkit", json!({ "mode": "wait" }).to_string())).await?.0.id;
        ensure!(h.run_once().await? == Some((waits, SegmentOutcome::Suspended(RunStatus::WaitingInput))), "no wait");
        db.store.pause_run(waits).await?;
        db.store.deliver_input(waits, "ada").await?;
        ensure!(h.run_once().await?.is_none(), "a paused run with its input was claimed");
        db.store.resume_run(waits).await?;
        ensure!(h.run_once().await? == Some((waits, SegmentOutcome::Completed)), "not resumed");
        let output = db.store.get_run(waits).await?.output;
        ensure!(output.as_deref() == Some("hello ada"), "output {output:?}");

        // A paused run whose host died is not taken over.
        let taken = db.store.create_run(&NewRun::new("testkit", json!({ "mode": "sleep", "ms": 1 }).to_string())).await?.0.id;
        let dead = db.store.claim("dead-host", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        ensure!(dead.lease.run_id == taken, "claimed {}", dead.lease.run_id);
        db.store.pause_run(taken).await?;
        db.backdate_lease(taken, 60_000).await?;
        ensure!(h.run_once().await?.is_none(), "a paused run's expired lease was taken over");
        // Cancel still works on a paused run; a finished one is not paused.
        let cancelled = db.store.cancel(taken).await?;
        ensure!(cancelled.status == RunStatus::Cancelled, "{cancelled:?}");
        match db.store.pause_run(waits).await {
            Err(StoreError::Conflict { .. }) => {}
            other => anyhow::bail!("pausing a completed run: {other:?}"),
        }
        let again = db.store.resume_run(waits).await?;
        ensure!(again.status == RunStatus::Completed, "resuming a run not paused changed it: {again:?}");
        Ok(())
    }

    async fn an_expired_paused_lease_is_parked_by_the_reaper_and_waits_for_its_resume(db) {
        let s = &db.store;
        let id = s.create_run(&NewRun::new("p", "{}")).await?.0.id;
        let dead = s.claim("dead-host", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        ensure!(dead.lease.run_id == id);
        s.pause_run(id).await?;
        db.backdate_lease(id, 60_000).await?;
        leasehold::maintenance::reaper::tick(s, &leasehold::maintenance::reaper::ReaperConfig::default()).await?;
        let parked = s.get_run(id).await?;
        ensure!(parked.status == RunStatus::WaitingTakeover && parked.lease_owner.is_none() && parked.attempt == 1, "{parked:?}");
        ensure!(s.claim("b", TTL).await?.is_none(), "a parked paused run was claimed");
        s.resume_run(id).await?;
        let taken = s.claim("b", TTL).await?.ok_or_else(|| anyhow::anyhow!("the resumed run was not claimed"))?;
        ensure!(taken.lease.run_id == id && taken.run.attempt == 2, "{:?}", taken.run);
        Ok(())
    }
}
