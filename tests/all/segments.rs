//! The segment log (`store::segments`): each segment's host, fence, times
//! and outcome, written behind it, served by `GET /v1/runs/{id}/segments`
//! for the run page's time line, and deleted with its run.

use anyhow::ensure;
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::store::{NewRun, RunStatus};
use serde_json::json;

use crate::harness::both;
use crate::plugins;

both! {
    async fn each_segment_is_recorded_with_its_host_fence_times_and_outcome(db) {
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let exec = Executor::new(db.store.clone(), rt.clone(), crate::harness::worker("host-w"));
        let input = json!({ "mode": "script", "ops": [{ "op": "wait", "prompt": "more?" }] });
        let run = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0;
        ensure!(exec.drain().await? == vec![(run.id, SegmentOutcome::Suspended(RunStatus::WaitingInput))]);
        db.store.deliver_input(run.id, "\"yes\"").await?;
        ensure!(exec.drain().await? == vec![(run.id, SegmentOutcome::Completed)]);
        // Written behind the segments: nothing yet until the log is flushed
        // (or its second is up).
        exec.flush_segment_log().await;
        let segments = db.store.segments(run.id).await?;
        let said: Vec<(i64, &str, &str)> = segments.iter().map(|s| (s.fence, s.owner.as_str(), s.outcome.as_str())).collect();
        ensure!(said == vec![(1, "host-w", "suspended: waiting_input"), (2, "host-w", "completed")], "{segments:?}");
        let finished = db.store.get_run(run.id).await?.finished_at.unwrap_or_default();
        for s in &segments {
            ensure!(run.created_at <= s.started_at && s.started_at <= s.ended_at && s.ended_at <= finished + 1000, "{s:?} of {run:?}");
        }
        ensure!(segments[0].ended_at <= segments[1].started_at, "{segments:?}");
        // The API serves them; an unknown run is a 404.
        let server = crate::harness::Server::on(db, rt, leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let http = reqwest::Client::new();
        let got: serde_json::Value = http.get(format!("{base}/v1/runs/{}/segments", run.id)).send().await?.json().await?;
        ensure!(got["segments"][1]["outcome"] == "completed" && got["segments"][1]["owner"] == "host-w", "{got}");
        let missing = http.get(format!("{base}/v1/runs/999999/segments")).send().await?;
        ensure!(missing.status() == 404, "{}", missing.status());
        server.stop().await;
        // Deleted with the run.
        let deleted = db.store.delete_finished(-60_000, 100).await?;
        ensure!(deleted.runs == 1, "{deleted:?}");
        ensure!(db.store.segments(run.id).await?.is_empty(), "the run's segments outlived it");
        Ok(())
    }
}

both! {
    async fn a_pool_shut_down_writes_the_records_it_still_held(db) {
        use leasehold::pool::{PoolConfig, WorkerPool};
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        // An hour: only the shutdown can write the record.
        let config = ExecutorConfig { segment_log_every: std::time::Duration::from_secs(3600), ..crate::harness::worker("host-s") };
        let exec = std::sync::Arc::new(Executor::new(db.store.clone(), rt, config));
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 1, poll: std::time::Duration::from_millis(20), claim_batch: 1, prefetch: 0 });
        // A segment that suspends has a row of its own (one that completes
        // its run's first would be read from the run row).
        let input = json!({ "mode": "script", "ops": [{ "op": "wait", "prompt": "more?" }] });
        let run = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        crate::harness::eventually("the run never waited", async || Ok(db.store.get_run(run).await?.status == RunStatus::WaitingInput)).await?;
        ensure!(db.store.segments(run).await?.is_empty(), "the record was written before the shutdown");
        pool.shutdown(std::time::Duration::from_secs(5)).await;
        let segments = db.store.segments(run).await?;
        ensure!(segments.len() == 1 && segments[0].owner == "host-s", "{segments:?}");
        Ok(())
    }
}

both! {
    async fn a_first_segment_that_completes_its_run_is_read_from_the_run_row(db) {
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let exec = Executor::new(db.store.clone(), rt.clone(), crate::harness::worker("host-f"));
        let done = db.store.create_run(&NewRun::new("testkit", json!({ "steps": 1 }).to_string())).await?.0;
        let failed = db.store.create_run(&NewRun::new("testkit", json!({ "mode": "fail" }).to_string())).await?.0;
        exec.drain().await?;
        exec.flush_segment_log().await;
        // No row written for the completing one; the failing one has its row.
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM segments WHERE run_id = $1").bind(done.id).fetch_one(db.store.pool()).await?;
        ensure!(rows == 0, "{rows} segment rows written for a run its first segment completed");
        let closed = db.store.get_run(done.id).await?;
        let segments = db.store.segments(done.id).await?;
        let want = leasehold::store::segments::SegmentRecord {
            run_id: done.id,
            fence: 1,
            owner: "host-f".into(),
            started_at: closed.started_at.unwrap_or_default(),
            ended_at: closed.finished_at.unwrap_or_default(),
            outcome: "completed".into(),
        };
        ensure!(segments == vec![want], "{segments:?} of {closed:?}");
        let segments = db.store.segments(failed.id).await?;
        ensure!(segments.len() == 1 && segments[0].outcome.starts_with("failed") && segments[0].owner == "host-f", "{segments:?}");
        // A rerun's first segment is its fence 2 (its fence starts at 1).
        let rerun = db.store.rerun(&closed, 0, &closed.plugin_digest).await?;
        exec.drain().await?;
        exec.flush_segment_log().await;
        let segments = db.store.segments(rerun.id).await?;
        ensure!(segments.len() == 1 && segments[0].fence == 2 && segments[0].outcome == "completed" && segments[0].owner == "host-f", "{segments:?}");
        Ok(())
    }
}

