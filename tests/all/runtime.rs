//! Turns run as Wasm components: replay, suspension, lost leases and hostile
//! guests, on both backends. The guest is `plugins/testkit`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use leasehold::executor::{Executor, ExecutorConfig, GuestErrorKind, SegmentOutcome};
use leasehold::runtime::{PluginError, Runtime};
use leasehold::store::{EffectState, NewRun, RunStatus, Store};

use crate::harness::{worker, TestDb, both, eventually, eventually_some};
use crate::plugins;

fn setup(db: &TestDb) -> Result<(Arc<Runtime>, Executor)> {
    let runtime = plugins::runtime()?;
    runtime.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
    let exec = Executor::new(db.store.clone(), runtime.clone(), worker("worker-a"));
    Ok((runtime, exec))
}

/// A runtime with the test plugin and a slice budget of `budget`, for turns
/// that compute longer than the tests' default budget allows.
fn runtime_with_budget(budget: Duration) -> Result<Arc<Runtime>> {
    let runtime = plugins::runtime()?;
    let limits = leasehold::runtime::Limits { segment_budget: budget, ..plugins::test_limits() };
    runtime.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    Ok(runtime)
}

async fn submit(store: &Store, input: serde_json::Value) -> Result<i64> {
    let mut new = NewRun::new("testkit", input.to_string());
    new.max_attempts = Some(3);
    Ok(store.create_run(&new).await?.0.id)
}

async fn kv_count(store: &Store) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM kv").fetch_one(store.pool()).await?)
}

both! {
    async fn a_turn_completes_recording_each_effect_and_streaming_its_output(db) {
        let (_rt, exec) = setup(db)?;
        let id = submit(&db.store, serde_json::json!({ "steps": 4 })).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Completed)));
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("did 4 steps"), "{run:?}");
        ensure!(run.partial == "step 0 step 1 step 2 step 3 ", "{:?}", run.partial);
        let effects = db.store.effects(id).await?;
        ensure!(effects.len() == 4 && effects.iter().all(|e| e.state == EffectState::Committed && e.name == "kv.put"));
        ensure!(effects.iter().enumerate().all(|(i, e)| e.emit_pos == i as i64), "each row records the emit position");
        ensure!(kv_count(&db.store).await? == 4);
        Ok(())
    }

    async fn a_delta_reaches_the_stream_while_the_turn_still_computes(db) {
        // Deltas are buffered for a few milliseconds (EMIT_FLUSH), not until
        // the segment's next write: here there is none for seconds.
        let runtime = runtime_with_budget(Duration::from_secs(120))?;
        let exec = Executor::new(db.store.clone(), runtime.clone(), worker("worker-a"));
        // 2^30 spins: about 2 s here (some 5 x 10^8 a second).
        let id = submit(&db.store, serde_json::json!({ "mode": "emit-then-spin", "spins": 1u64 << 30 })).await?;
        let task = tokio::spawn(async move { exec.run_once().await });
        let run = eventually_some(Duration::from_secs(60), async || Ok(format!("no delta: {:?}", db.store.get_run(id).await?)), async || {
            let run = db.store.get_run(id).await?;
            if run.partial == "early " {
                return Ok(Some(run));
            }
            ensure!(!run.status.is_terminal(), "the turn ended before its first delta was stored: {run:?}");
            Ok(None)
        })
        .await?;
        ensure!(run.status == RunStatus::Running, "{run:?}");
        ensure!(task.await?? == Some((id, SegmentOutcome::Completed)));
        let run = db.store.get_run(id).await?;
        ensure!(run.partial == "early late" && run.emit_pos == 2 && run.output.as_deref() == Some("spun"), "{run:?}");
        Ok(())
    }

    async fn a_put_reaches_the_database_while_the_turn_still_computes(db) {
        // Puts are held for a few milliseconds (EMIT_FLUSH), like deltas,
        // not until the segment's next write: here there is none for seconds.
        let runtime = runtime_with_budget(Duration::from_secs(120))?;
        let exec = Executor::new(db.store.clone(), runtime.clone(), worker("worker-a"));
        let id = submit(&db.store, serde_json::json!({ "mode": "put-then-spin", "spins": 1u64 << 30 })).await?;
        let task = tokio::spawn(async move { exec.run_once().await });
        let effects = eventually_some(Duration::from_secs(60), async || Ok(format!("no put: {:?}", db.store.get_run(id).await?)), async || {
            let effects = db.store.effects(id).await?;
            if !effects.is_empty() {
                return Ok(Some(effects));
            }
            let run = db.store.get_run(id).await?;
            ensure!(!run.status.is_terminal(), "the turn ended before its put was stored: {run:?}");
            Ok(None)
        })
        .await?;
        ensure!(effects.len() == 1 && effects[0].state == EffectState::Committed && effects[0].name == "kv.put", "{effects:?}");
        ensure!(kv_count(&db.store).await? == 1, "the put is written with its ledger row");
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Running, "{run:?}");
        ensure!(task.await?? == Some((id, SegmentOutcome::Completed)));
        ensure!(db.store.effects(id).await?.len() == 1 && kv_count(&db.store).await? == 1);
        Ok(())
    }

    async fn a_dead_segment_is_resumed_by_replay_without_repeating_committed_effects(db) {
        // A budget far above the turn's compute: B replays A's steps before
        // it makes progress, and a slice that makes none fails the run as a
        // timeout. With the tests' 500 ms budget, a loaded machine (the
        // whole suite at once on 2 cores) failed the run that way.
        let rt = runtime_with_budget(Duration::from_secs(20))?;
        // A renews often, so a renewer that outlived A's dropped segment
        // would move the backdated lease on before B's claim below.
        let renew_every = Duration::from_millis(20);
        let exec = Executor::new(db.store.clone(), rt.clone(), ExecutorConfig { renew_every: Some(renew_every), ..worker("worker-a") });
        // Each step computes a while, so A's puts are written in several
        // timed flushes (EMIT_FLUSH) before it dies; without the spin the
        // whole turn runs inside one flush window.
        let id = submit(&db.store, serde_json::json!({ "steps": 300, "spin": 1_000_000 })).await?;
        // Worker A dies mid-turn: its segment future is dropped once some
        // effects are committed (no graceful suspend, no close).
        let task = tokio::spawn(async move { exec.run_once().await });
        eventually("A neither committed 20 effects nor ended", async || Ok(db.store.effects(id).await?.len() >= 20 || task.is_finished())).await?;
        ensure!(!task.is_finished(), "A ended before dying: {:?}", db.store.get_run(id).await?);
        task.abort();
        let _ = task.await;
        // A renewal already in flight (its own task, never dropped half-way)
        // may still land after the abort, under load well after it; a
        // renewer that outlived the segment would keep landing. Wait until
        // the heartbeat stands still for ten renewal periods.
        let (mut last, mut still_since) = (db.store.get_run(id).await?.heartbeat_at, std::time::Instant::now());
        let still = async || {
            let now = db.store.get_run(id).await?.heartbeat_at;
            if now != last {
                (last, still_since) = (now, std::time::Instant::now());
            }
            Ok((still_since.elapsed() >= renew_every * 10).then_some(()))
        };
        eventually_some(Duration::from_secs(10), async || Ok("A's lease kept being renewed after its segment was dropped".into()), still).await?;
        db.backdate_lease(id, 60_000).await?;
        tokio::time::sleep(renew_every * 5).await;

        // B claims: from here on every write of A's segment fails its guard,
        // so this snapshot is final for fence 1.
        let b = Executor::new(db.store.clone(), rt, worker("worker-b"));
        let Some(claimed) = db.store.claim("worker-b", Duration::from_secs(30)).await? else {
            bail!("B could not claim A's expired lease: {:?}", db.store.get_run(id).await?);
        };
        let before = db.store.effects(id).await?;
        ensure!(before.len() >= 20 && before.len() < 300, "A died mid-turn after {} effects", before.len());
        ensure!(before.iter().all(|r| r.fence_started == 1));
        // B resumes by replay; on a slow database it may need several
        // slices (each suspends as waiting_takeover after progress).
        let mut outcomes = vec![(id, b.run_segment(claimed).await?)];
        outcomes.extend(b.drain().await?);
        ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "B: {outcomes:?}");
        ensure!(outcomes.iter().rev().skip(1).all(|o| o.1 == SegmentOutcome::Suspended(RunStatus::WaitingTakeover)), "{outcomes:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some("did 300 steps"), "{run:?}");
        let after = db.store.effects(id).await?;
        ensure!(after.len() == 300);
        for row in &before {
            if row.state == EffectState::Committed {
                ensure!(after[row.seq as usize] == *row, "replay rewrote committed row {}", row.seq);
            }
        }
        ensure!(after.iter().skip(before.len()).all(|r| r.fence_started >= 2), "new rows belong to B's segments");
        ensure!(kv_count(&db.store).await? == 300);
        let expected: String = (0..300).map(|i| format!("step {i} ")).collect();
        ensure!(run.partial == expected, "the stream holds each step exactly once");
        Ok(())
    }

    async fn wait_input_suspends_the_run_and_resumes_it_with_the_delivered_input(db) {
        let (_rt, exec) = setup(db)?;
        let id = submit(&db.store, serde_json::json!({ "mode": "wait" })).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Suspended(RunStatus::WaitingInput))));
        ensure!(exec.run_once().await?.is_none(), "not claimable until input arrives");
        db.store.deliver_input(id, "Ada").await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Completed)));
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some("hello Ada") && run.pending_input.is_none(), "{run:?}");
        Ok(())
    }

    async fn sleep_suspends_the_run_until_its_timer_is_due(db) {
        let (_rt, exec) = setup(db)?;
        let id = submit(&db.store, serde_json::json!({ "mode": "sleep", "ms": 3_600_000 })).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))));
        ensure!(exec.run_once().await?.is_none(), "asleep");
        db.advance_clock(3_600_001).await?;
        // The recorded wake time is in the ledger: move it too.
        sqlx::query("UPDATE effects SET result = CAST(CAST(result AS BIGINT) - 3600001 AS TEXT) WHERE name = 'sleep'")
            .execute(db.store.pool()).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Completed)));
        ensure!(db.store.get_run(id).await?.output.as_deref() == Some("woke"));
        Ok(())
    }

    async fn a_turn_that_changes_its_calls_on_replay_fails_as_non_deterministic(db) {
        let (_rt, exec) = setup(db)?;
        // Record a ledger with one version of the turn's calls…
        let recorded = submit(&db.store, serde_json::json!({ "steps": 2, "prefix": "a" })).await?;
        ensure!(exec.run_once().await? == Some((recorded, SegmentOutcome::Completed)));
        // …and give it to a run whose turn now makes different calls (as if
        // the plugin's code changed mid-run).
        // The ledger was written by an earlier segment (fence 1): a run's
        // first segment has no ledger to replay.
        let changed = submit(&db.store, serde_json::json!({ "steps": 2, "prefix": "b" })).await?;
        sqlx::query("UPDATE runs SET fence = 1 WHERE id = $1").bind(changed).execute(db.store.pool()).await?;
        sqlx::query(
            "INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, result, \
             emit_pos, fence_started, fence_completed, created_at, updated_at) \
             SELECT $2, seq, name, request_hash, idempotency_key, class, state, result, emit_pos, 1, 1, \
             created_at, updated_at FROM effects WHERE run_id = $1",
        )
        .bind(recorded)
        .bind(changed)
        .execute(db.store.pool())
        .await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((changed, SegmentOutcome::Failed(GuestErrorKind::NonDeterminism))), "{out:?}");
        let run = db.store.get_run(changed).await?;
        let error = run.error.unwrap_or_default();
        ensure!(error == r#"non-determinism: call 0 ("kv.put") was recorded with a different request"#, "{error}");
        ensure!(kv_count(&db.store).await? == 2, "nothing of the changed turn was performed");

        // A turn whose first call is now another effect: both names are said.
        let renamed = submit(&db.store, serde_json::json!({ "mode": "chaos", "steps": 1 })).await?;
        sqlx::query("UPDATE runs SET fence = 1 WHERE id = $1").bind(renamed).execute(db.store.pool()).await?;
        sqlx::query(
            "INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, result, \
             emit_pos, fence_started, fence_completed, created_at, updated_at) \
             SELECT $2, seq, name, request_hash, idempotency_key, class, state, result, emit_pos, 1, 1, \
             created_at, updated_at FROM effects WHERE run_id = $1",
        )
        .bind(recorded)
        .bind(renamed)
        .execute(db.store.pool())
        .await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((renamed, SegmentOutcome::Failed(GuestErrorKind::NonDeterminism))), "{out:?}");
        let error = db.store.get_run(renamed).await?.error.unwrap_or_default();
        ensure!(error == r#"non-determinism: call 0 was recorded as "kv.put" but the turn now makes "kv.get""#, "{error}");
        Ok(())
    }

    async fn hostile_guests_are_classified_and_neighbouring_runs_keep_completing(db) {
        // A short budget, for the loop: it is sliced without progress.
        let rt = runtime_with_budget(Duration::from_secs(1))?;
        let exec = Executor::new(db.store.clone(), rt, worker("worker-a"));
        let cases = [
            ("loop", GuestErrorKind::Timeout),
            ("oom", GuestErrorKind::OutOfMemory),
            ("emit-bomb", GuestErrorKind::OutputTooLarge),
            ("big-output", GuestErrorKind::OutputTooLarge),
            ("trap", GuestErrorKind::Trap),
            ("fail", GuestErrorKind::TurnError),
        ];
        for (mode, kind) in cases {
            let id = submit(&db.store, serde_json::json!({ "mode": mode })).await?;
            let out = exec.run_once().await?;
            ensure!(out == Some((id, SegmentOutcome::Failed(kind))), "{mode}: {out:?}");
            let run = db.store.get_run(id).await?;
            ensure!(run.status == RunStatus::Failed, "{mode}: {run:?}");
            let error = run.error.unwrap_or_default();
            ensure!(error.starts_with(kind.as_str()), "{mode}: error {error:?}");
            // A neighbour right after each hostile guest still completes.
            let ok = submit(&db.store, serde_json::json!({ "steps": 1, "prefix": mode })).await?;
            ensure!(exec.run_once().await? == Some((ok, SegmentOutcome::Completed)), "{mode}: neighbour");
        }
        Ok(())
    }

    async fn a_panicking_guest_fails_with_its_panic_message_and_a_chatty_one_still_completes(db) {
        let (_rt, exec) = setup(db)?;
        let id = submit(&db.store, serde_json::json!({ "mode": "panic", "message": "the widget is missing" })).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Failed(GuestErrorKind::Trap))));
        let error = db.store.get_run(id).await?.error.unwrap_or_default();
        ensure!(error.starts_with("trap: ") && error.contains("panicked at") && error.contains("the widget is missing"), "{error}");
        // About 70 KB on stdout and stderr, far over the 4 KiB kept: a
        // tail, never an error. (20,000 lines, a write each, timed out the
        // 10 s slice under a loaded CI.)
        let id = submit(&db.store, serde_json::json!({ "mode": "print", "lines": 2_000 })).await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(id).await?.error);
        ensure!(db.store.get_run(id).await?.output.as_deref() == Some("printed"));
        Ok(())
    }

    async fn text_with_nul_characters_is_kept_the_same_way_on_both_backends(db) {
        // PostgreSQL cannot store NUL in text; SQLite can. The host replaces
        // each NUL a guest writes with U+FFFD, and refuses a kv key with one.
        let (_rt, exec) = setup(db)?;
        let id = submit(&db.store, serde_json::json!({ "mode": "nul" })).await?;
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?}: {:?}", db.store.get_run(id).await?);
        let run = db.store.get_run(id).await?;
        ensure!(run.partial == "a\u{FFFD}b", "{:?}", run.partial);
        let output = run.output.unwrap_or_default();
        ensure!(output.starts_with("x\u{FFFD}y | failed: kv.put: key must not contain NUL"), "{output:?}");
        ensure!(output.contains("denied:"), "{output:?}");
        let effects = db.store.effects(id).await?;
        // A name with a NUL is not a valid name: refused, recorded short.
        ensure!(effects.len() == 2 && effects[1].name == "invalid:no?such", "{effects:?}");
        ensure!(kv_count(&db.store).await? == 0);

        let id = submit(&db.store, serde_json::json!({ "mode": "nul-fail" })).await?;
        ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Failed(GuestErrorKind::TurnError))));
        let run = db.store.get_run(id).await?;
        ensure!(run.error.as_deref() == Some("turn-error: gave\u{FFFD}up"), "{run:?}");
        Ok(())
    }

    async fn a_late_renewal_keeps_a_lease_nobody_took(db) {
        // Renewals that do not land in time (a slow database, a paused
        // host) do not cost the segment its run while its lease is live: a
        // quarter of a lease before its local deadline it renews once more
        // and goes on.
        let runtime = plugins::runtime()?;
        let mut limits = plugins::test_limits();
        limits.segment_budget = Duration::from_secs(120);
        runtime.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
        // A 1 s lease: its last renewal goes out 250 ms before the local
        // deadline, room for a claim answer that a loaded machine delays
        // (with 500 ms and 125 ms, the full suite once lost the lease).
        let config = ExecutorConfig {
            lease_ttl: Duration::from_secs(1),
            renew_every: Some(Duration::from_secs(600)),
            ..crate::harness::worker("slow")
        };
        let exec = Executor::new(db.store.clone(), runtime, config);
        // 2^32 spins: about 3 s here, three leases.
        let id = submit(&db.store, serde_json::json!({ "mode": "spin-then-put", "spins": 1u64 << 32 })).await?;
        let started = std::time::Instant::now();
        let out = exec.run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "{out:?} after {:?}", started.elapsed());
        ensure!(started.elapsed() > Duration::from_secs(1), "the turn ended before its first lease ran out");
        ensure!(kv_count(&db.store).await? == 1);
        Ok(())
    }

    async fn a_host_paused_past_its_lease_asks_the_database_before_it_gives_up_the_run(db) {
        // As if this process were stopped for two minutes mid-turn (SIGSTOP,
        // a VM migration): by its own clock the lease ran out long ago, but
        // nobody took the run, so the one renewal it asks for on waking
        // keeps it.
        let runtime = plugins::runtime()?;
        let mut limits = plugins::test_limits();
        limits.segment_budget = Duration::from_secs(600);
        runtime.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
        let clock = leasehold::clock::Monotonic::default();
        let config = ExecutorConfig {
            renew_every: Some(Duration::from_secs(600)),
            clock: clock.clone(),
            ..crate::harness::worker("paused")
        };
        let exec = Executor::new(db.store.clone(), runtime, config);
        let id = submit(&db.store, serde_json::json!({ "mode": "spin-then-put", "spins": 1u64 << 30 })).await?;
        let task = tokio::spawn(async move { exec.run_once().await });
        crate::harness::eventually("never started", async || Ok(db.store.get_run(id).await?.status == RunStatus::Running)).await?;
        ensure!(kv_count(&db.store).await? == 0, "the turn got past its spin before the pause");
        clock.advance(Duration::from_secs(120));
        let out = tokio::time::timeout(Duration::from_secs(60), task).await???;
        ensure!(out == Some((id, SegmentOutcome::Completed)), "the paused host gave the run up: {out:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.fence == 1 && kv_count(&db.store).await? == 1, "{run:?}");
        Ok(())
    }

    async fn a_guest_whose_lease_was_taken_is_stopped_and_writes_nothing(db) {
        let runtime = plugins::runtime()?;
        let mut limits = plugins::test_limits();
        limits.segment_budget = Duration::from_secs(60);
        runtime.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
        // A 1 s lease that this worker never renews on its own schedule in
        // time: at its deadline it asks one last time, and by then the lease
        // has been taken.
        let config = ExecutorConfig {
            lease_ttl: Duration::from_secs(1),
            renew_every: Some(Duration::from_secs(60)),
            ..crate::harness::worker("slow")
        };
        let exec = Executor::new(db.store.clone(), runtime, config);
        let id = submit(&db.store, serde_json::json!({ "mode": "spin-then-put", "spins": 1u64 << 40 })).await?;
        let task = tokio::spawn(async move { exec.run_once().await });
        crate::harness::eventually("never started", async || Ok(db.store.get_run(id).await?.status == RunStatus::Running)).await?;
        db.backdate_lease(id, 60_000).await?;
        let thief = db.store.claim("thief", Duration::from_secs(30)).await?;
        ensure!(thief.as_ref().is_some_and(|c| c.run.id == id && c.lease.fence == 2), "{thief:?}");
        let out = tokio::time::timeout(Duration::from_secs(20), task).await???;
        ensure!(out == Some((id, SegmentOutcome::LeaseLost)), "{out:?}");
        ensure!(db.store.effects(id).await?.is_empty() && kv_count(&db.store).await? == 0);
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Running && run.lease_owner.as_deref() == Some("thief"), "{run:?}");
        Ok(())
    }
}

#[test]
fn runtimes_compiling_the_same_component_at_once_both_load_it() -> Result<()> {
    // Regression: the cache's temporary file was named by process id only,
    // so two runtimes of one process caching the same new component raced
    // on it ("cache write did not stick", or ENOENT on rename).
    let bytes = plugins::rust_plugin("testkit")?;
    let dir = tempfile::tempdir()?;
    let config = || leasehold::runtime::RuntimeConfig {
        cache_dir: dir.path().to_path_buf(),
        max_instances: 1,
        pool_max_memory_bytes: 64 << 20,
        ..Default::default()
    };
    const THREADS: usize = 8;
    let start = std::sync::Barrier::new(THREADS);
    let loaded: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let (bytes, config, start) = (&bytes, config(), &start);
                scope.spawn(move || {
                    let rt = Runtime::new(config).map_err(|e| e.to_string())?;
                    // Compile and cache at the same moment in every thread.
                    start.wait();
                    rt.add_plugin("testkit", bytes, plugins::test_limits())
                        .map(|p| p.digest.clone())
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &loaded {
        ensure!(r.is_ok(), "{loaded:?}");
    }
    let files: Vec<String> = std::fs::read_dir(dir.path())?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    let compiled = files.iter().filter(|f| f.ends_with(".cwasm")).count();
    ensure!(compiled == 1 && files.len() == 2, "one cache entry and its record, no temporary files left: {files:?}");
    Ok(())
}

#[tokio::test]
async fn components_that_are_not_turns_are_refused_with_a_reason() -> Result<()> {
    let runtime = plugins::runtime()?;
    let garbage = runtime.add_plugin("junk", b"not wasm at all", plugins::test_limits());
    ensure!(matches!(garbage, Err(PluginError::Invalid(_))), "{:?}", garbage.err());
    let missing = runtime.add_plugin("missing", &plugins::hostile_wat("missing-import.wat")?, plugins::test_limits());
    match missing {
        Err(PluginError::Link(reason)) => ensure!(reason.contains("not-provided"), "{reason}"),
        other => anyhow::bail!("expected a link error, got {:?}", other.err()),
    }
    ensure!(runtime.plugin("missing").is_none() && runtime.plugin("junk").is_none());
    Ok(())
}
