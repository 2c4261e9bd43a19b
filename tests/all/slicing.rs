//! Segment budgets and attempts, on both backends: a guest blocked in its
//! language's ordinary sleep or in a host call is stopped like a computing
//! one, and deliberate suspensions never use up `max_attempts`. The guest is
//! `plugins/testkit`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, ExecutorConfig, GuestErrorKind, SegmentOutcome};
use leasehold::runtime::{Limits, Runtime};
use leasehold::store::{EffectState, NewRun, RunStatus, Store};
use serde_json::{Value, json};

use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

fn runtime(limits: Limits) -> Result<Arc<Runtime>> {
    let rt = plugins::runtime()?;
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    Ok(rt)
}

fn executor(db: &TestDb, rt: &Arc<Runtime>, owner: &str) -> Executor {
    crate::harness::executor(db, rt, owner)
}

async fn submit(store: &Store, input: Value, max_attempts: i64) -> Result<i64> {
    let mut new = NewRun::new("testkit", input.to_string());
    new.max_attempts = Some(max_attempts);
    Ok(store.create_run(&new).await?.0.id)
}

/// Runs one segment, but gives up after `secs`: a guest that is not stopped
/// would otherwise hold the test for as long as it blocks.
async fn segment_within(exec: &Executor, secs: u64) -> Result<Option<(i64, SegmentOutcome)>> {
    tokio::time::timeout(Duration::from_secs(secs), exec.run_once())
        .await
        .map_err(|_| anyhow::anyhow!("the segment was not stopped within {secs} s"))?
        .map_err(Into::into)
}

/// Moves every timer of the run's ledger (`sleep`, and the language's own
/// sleep when it ended a segment) and the run's own deadlines `ms` into the
/// past.
async fn advance(db: &TestDb, ms: i64) -> Result<()> {
    db.advance_clock(ms).await?;
    sqlx::query("UPDATE effects SET result = CAST(CAST(result AS BIGINT) - $1 AS TEXT) WHERE name IN ('sleep', 'wasi.sleep')")
        .bind(ms)
        .execute(db.store.pool())
        .await?;
    Ok(())
}

async fn kv(store: &Store, key: &str) -> Result<Option<String>> {
    Ok(sqlx::query_scalar("SELECT value FROM kv WHERE key = $1").bind(key).fetch_optional(store.pool()).await?)
}

both! {
    async fn a_guest_in_its_languages_ordinary_sleep_is_suspended_as_a_durable_sleep(db) {
        // `std::thread::sleep` for an hour with a 500 ms budget: the segment
        // must end at once as a durable sleep, not hold its worker (and
        // renew its lease) for the hour.
        let rt = runtime(Limits { segment_budget: Duration::from_millis(500), ..plugins::test_limits() })?;
        let exec = executor(db, &rt, "w");
        let ops = json!([
            { "op": "put", "key": "before", "value": 1 },
            { "op": "wasi-sleep", "ms": 3_600_000 },
            { "op": "put", "key": "after", "value": 2 },
            { "op": "clock" },
        ]);
        let id = submit(&db.store, json!({ "mode": "script", "ops": ops }), 1).await?;
        let before = db.store.now_ms().await?;
        let out = segment_within(&exec, 20).await?;
        ensure!(out == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{out:?}: {:?}", db.store.get_run(id).await?);
        let run = db.store.get_run(id).await?;
        ensure!(run.lease_owner.is_none() && run.not_before >= before + 3_590_000, "{run:?}");
        let ledger = db.store.effects(id).await?;
        ensure!(ledger.len() == 2 && ledger[1].name == "wasi.sleep" && ledger[1].state == EffectState::Committed, "{ledger:?}");
        ensure!(segment_within(&exec, 20).await?.is_none(), "asleep");

        advance(db, 3_600_001).await?;
        let out = segment_within(&exec, 20).await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(id).await?.error);
        let run = db.store.get_run(id).await?;
        let output: Value = serde_json::from_str(run.output.as_deref().unwrap_or("null"))?;
        // The guest's clocks moved on by the hour it slept.
        ensure!(output[3]["monotonic_ms"].as_u64().is_some_and(|ms| ms >= 3_600_000), "{output}");
        ensure!(kv(&db.store, "before").await?.as_deref() == Some("1") && kv(&db.store, "after").await?.as_deref() == Some("2"));
        ensure!(db.store.effects(id).await?.len() == 3);
        Ok(())
    }

    async fn a_short_language_sleep_just_waits_and_a_replay_does_not_record_it(db) {
        let rt = runtime(Limits { segment_budget: Duration::from_secs(20), ..plugins::test_limits() })?;
        let exec = executor(db, &rt, "w");
        let ops = json!([
            { "op": "put", "key": "a", "value": 1 },
            { "op": "wasi-sleep", "ms": 50 },
            { "op": "put", "key": "b", "value": 2 },
            { "op": "sleep", "ms": 3_600_000 },
            { "op": "wasi-sleep", "ms": 50 },
            { "op": "clock" },
        ]);
        let id = submit(&db.store, json!({ "mode": "script", "ops": ops }), 1).await?;
        let out = segment_within(&exec, 20).await?;
        ensure!(out == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{out:?}");
        let names: Vec<String> = db.store.effects(id).await?.into_iter().map(|r| r.name).collect();
        ensure!(names == ["kv.put", "kv.put", "sleep"], "a short sleep is not recorded: {names:?}");
        advance(db, 3_600_001).await?;
        let out = segment_within(&exec, 20).await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(id).await?.error);
        let run = db.store.get_run(id).await?;
        let output: Value = serde_json::from_str(run.output.as_deref().unwrap_or("null"))?;
        // Both kinds of sleep moved the guest's clock on, on every replay.
        ensure!(output[5]["monotonic_ms"].as_u64().is_some_and(|ms| (3_600_100..3_700_000).contains(&ms)), "{output}");
        ensure!(db.store.effects(id).await?.len() == 3);
        Ok(())
    }

    async fn a_guest_blocked_in_a_host_call_is_stopped_at_its_budget(db) {
        // The sink never answers: the call blocks. The segment must end
        // soon after its budget (plus the grace a host call in flight
        // gets), and its lease must stop being renewed, rather than wait
        // for the request's own timeout.
        let sink = Sink::start().await?;
        sink.hold(true);
        let limits = Limits {
            segment_budget: Duration::from_millis(500),
            http_allow: vec![sink.allow(), "127.0.0.1".into()],
            ..plugins::test_limits()
        };
        let rt = runtime(limits)?;
        let config = ExecutorConfig {
            lease_ttl: Duration::from_secs(3),
            renew_every: Some(Duration::from_millis(100)),
            ..crate::harness::worker("w")
        };
        let exec = Executor::new(db.store.clone(), rt.clone(), config);
        let id = submit(&db.store, json!({ "mode": "http", "url": sink.url, "keyed": true }), 3).await?;
        let out = segment_within(&exec, 20).await?;
        ensure!(out == Some((id, SegmentOutcome::Failed(GuestErrorKind::Timeout))), "{out:?}: {:?}", db.store.get_run(id).await?);
        let run = db.store.get_run(id).await?;
        let error = run.error.unwrap_or_default();
        ensure!(error.contains("http") && error.contains("call 0"), "the error names the call in flight: {error:?}");
        ensure!(sink.hits().len() == 1);
        Ok(())
    }

    async fn a_run_with_one_attempt_waits_for_input_and_still_completes(db) {
        let rt = runtime(plugins::test_limits())?;
        let exec = executor(db, &rt, "w");
        let id = submit(&db.store, json!({ "mode": "wait" }), 1).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingInput))));
        db.store.deliver_input(id, "Ada").await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(id).await?);
        ensure!(db.store.get_run(id).await?.output.as_deref() == Some("hello Ada"));
        Ok(())
    }

    async fn a_run_with_one_attempt_survives_a_sleep_replayed_before_it_is_due(db) {
        let rt = runtime(plugins::test_limits())?;
        let exec = executor(db, &rt, "w");
        let id = submit(&db.store, json!({ "mode": "sleep", "ms": 3_600_000 }), 1).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))));
        // Claimable before its timer is due (a host's poll, an operator):
        // the replayed sleep suspends again.
        sqlx::query("UPDATE runs SET not_before = 0 WHERE id = $1").bind(id).execute(db.store.pool()).await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{out:?}");
        advance(db, 3_600_001).await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(id).await?);
        Ok(())
    }

    async fn a_run_with_one_attempt_survives_a_shutdown_hand_over(db) {
        let rt = runtime(Limits { segment_budget: Duration::from_secs(120), ..plugins::test_limits() })?;
        let exec = Arc::new(executor(db, &rt, "w"));
        let id = submit(&db.store, json!({ "mode": "spin-then-put", "spins": 1u64 << 40 }), 1).await?;
        let running = exec.clone();
        let task = tokio::spawn(async move { running.run_once().await });
        crate::harness::eventually("never started", async || Ok(db.store.get_run(id).await?.status == RunStatus::Running)).await?;
        exec.stop_guests();
        let out = task.await??;
        ensure!(out == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingTakeover))), "{out:?}");
        let claimed = db.store.claim("other", Duration::from_secs(30)).await?;
        ensure!(claimed.as_ref().map(|c| c.run.id) == Some(id), "not claimable after the hand-over: {:?}", db.store.get_run(id).await?);
        Ok(())
    }
}
