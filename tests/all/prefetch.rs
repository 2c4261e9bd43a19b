//! The worker pool's local queue (`PoolConfig::prefetch`): runs claimed
//! ahead of free workers hold leases, so they must never be left to
//! expire: they are given back at shutdown, and given back rather than run
//! once they have waited a third of their lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::plugins::PluginSettings;
use leasehold::pool::{PoolConfig, WorkerPool};
use leasehold::store::{NewRun, RunStatus, Store};

use crate::harness::{TestDb, both, eventually, eventually_some};
use crate::plugins;

/// One worker, a local queue of three, and `lease_ttl`.
async fn pool(db: &TestDb, owner: &str, lease_ttl: Duration) -> Result<WorkerPool> {
    pool_with(db, owner, lease_ttl, 4, 3).await
}

/// One worker of `owner` running testkit, with `claim_batch` and `prefetch`.
async fn pool_with(db: &TestDb, owner: &str, lease_ttl: Duration, claim_batch: usize, prefetch: usize) -> Result<WorkerPool> {
    let runtime = plugins::runtime()?;
    leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
    let config = ExecutorConfig { lease_ttl, ..crate::harness::worker(owner) };
    let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
    Ok(WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 1, poll: Duration::from_millis(50), claim_batch, prefetch }))
}

/// Runs of a turn that waits `ms` in the language's own sleep (a short one
/// just waits, holding its worker).
async fn submit_sleepers(store: &Store, n: usize, ms: u64) -> Result<Vec<i64>> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let input = serde_json::json!({ "mode": "script", "ops": [{ "op": "wasi-sleep", "ms": ms }] }).to_string();
        ids.push(store.create_run(&NewRun::new("testkit", input)).await?.0.id);
    }
    Ok(ids)
}

/// Holds up writes to run `id` from another session until dropped or
/// released: PostgreSQL locks its row; SQLite, which has one writer, takes
/// the write lock, so every write waits (and is retried, within the
/// store's retry window).
enum Hold {
    Row(sqlx::Transaction<'static, sqlx::Any>),
    Writer(sqlx::SqliteConnection),
}

impl Hold {
    async fn start(db: &TestDb, id: i64) -> Result<Hold> {
        use sqlx::Connection;
        Ok(match db.backend {
            leasehold::Backend::Postgres => {
                let mut tx = db.store.pool().begin().await?;
                sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE").bind(id).execute(&mut *tx).await?;
                Hold::Row(tx)
            }
            leasehold::Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(db.url()).await?;
                sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut conn).await?;
                Hold::Writer(conn)
            }
        })
    }

    async fn release(self) -> Result<()> {
        match self {
            Hold::Row(tx) => tx.rollback().await?,
            Hold::Writer(mut conn) => {
                sqlx::raw_sql("ROLLBACK").execute(&mut conn).await?;
            }
        }
        Ok(())
    }
}

/// Run `id` once it has completed, within 20 s.
async fn completed(store: &Store, id: i64) -> Result<leasehold::store::Run> {
    eventually_some(Duration::from_secs(20), async || Ok(format!("run {id} did not complete: {:?}", store.get_run(id).await?)), async || {
        let run = store.get_run(id).await?;
        Ok((run.status == RunStatus::Completed).then_some(run))
    })
    .await
}

/// Waits, up to 20 s, until `owner` runs `running` and holds `held` runs
/// in all (the rest queued).
async fn until_holding(store: &Store, owner: &str, running: i64, held: i64) -> Result<()> {
    let holding = async || Ok(store.get_run(running).await?.lease_owner.as_deref() == Some(owner) && held_by(store, owner).await? >= held);
    eventually(&format!("{owner} never took run {running} and queued {} more", held - 1), holding).await
}

async fn held_by(store: &Store, owner: &str) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE lease_owner = $1 AND status = 'running'")
        .bind(owner)
        .fetch_one(store.pool())
        .await?)
}

both! {
    async fn prefetched_runs_are_given_back_unstarted_at_shutdown(db) {
        let ids = submit_sleepers(&db.store, 5, 2_000).await?;
        let pool = pool(db, "prefetcher", Duration::from_secs(30)).await?;
        // One run on the worker and three queued, all leased by this host.
        eventually_some(
            Duration::from_secs(20),
            async || Ok(format!("the pool never held 4 runs: {}", held_by(&db.store, "prefetcher").await?)),
            async || Ok((held_by(&db.store, "prefetcher").await? >= 4).then_some(())),
        )
        .await?;
        ensure!(held_by(&db.store, "prefetcher").await? == 4, "the queue held more than --prefetch");
        pool.shutdown(Duration::from_millis(100)).await;
        ensure!(held_by(&db.store, "prefetcher").await? == 0, "shutdown left leases behind");
        // The running one was suspended by the shutdown (its `suspended`
        // event says so); the three queued were given back unstarted, with
        // nothing in their threads but their submits; one was never claimed.
        let (mut given_back, mut suspended) = (0, 0);
        for id in &ids {
            let run = db.store.get_run(*id).await?;
            ensure!(matches!(run.status, RunStatus::WaitingTakeover | RunStatus::Queued), "{run:?}");
            if run.status == RunStatus::WaitingTakeover {
                ensure!(run.fence == 1 && run.attempt == 0, "{run:?}");
                let events = db.store.events_after(&run.thread_id, 0, 10).await?;
                if events.iter().all(|e| e.kind == "submitted") {
                    given_back += 1;
                } else {
                    suspended += 1;
                }
            }
        }
        ensure!(given_back == 3 && suspended == 1, "{given_back} runs given back unstarted, {suspended} suspended");
        // Any host takes them at once.
        let again = db.store.claim_batch("other", Duration::from_secs(30), 10).await?;
        ensure!(again.len() == 5, "{} of 5 claimable after shutdown", again.len());
        Ok(())
    }

    async fn a_worker_starts_a_queued_run_while_its_last_close_is_held_up(db) {
        // One worker: A holds it for a second, B and C wait in the queue.
        let a = submit_sleepers(&db.store, 1, 1_000).await?[0];
        let mut rest = Vec::new();
        for _ in 0..2 {
            rest.push(db.store.create_run(&NewRun::new("testkit", r#"{"steps": 0}"#)).await?.0.id);
        }
        let pool = pool(db, "behind", Duration::from_secs(30)).await?;
        until_holding(&db.store, "behind", a, 3).await?;
        // A's close cannot be written while this holds; the worker goes on
        // to a queued run instead of waiting for it.
        let hold = Hold::start(db, a).await?;
        crate::harness::eventually("the worker waited for its held-up close instead of starting a queued run", async || Ok(pool.closes_behind() > 0)).await?;
        ensure!(db.store.get_run(a).await?.status == RunStatus::Running, "A closed while its close was held up");
        hold.release().await?;
        for id in std::iter::once(a).chain(rest) {
            let run = completed(&db.store, id).await?;
            ensure!(run.fence == 1 && run.attempt == 1, "run {id} ran more than once: {run:?}");
        }
        // The last close behind counts itself out just after it is written.
        eventually_some(
            Duration::from_secs(20),
            async || Ok(format!("{} closes still behind after every run completed", pool.closes_behind())),
            async || Ok((pool.closes_behind() == 0).then_some(())),
        )
        .await?;
        pool.shutdown(Duration::from_secs(5)).await;
        ensure!(held_by(&db.store, "behind").await? == 0, "shutdown left leases behind");
        Ok(())
    }

    async fn with_long_turns_the_queue_holds_about_a_second_of_work_not_all_of_prefetch(db) {
        let pool = pool_with(db, "paced", Duration::from_secs(30), 32, 20).await?;
        // Idle: the pace it starts with (all of prefetch) halves with each
        // window in which nothing ends, until nothing is queued ahead
        // before the worker has shown its pace.
        eventually_some(
            Duration::from_secs(10),
            async || Ok(format!("an idle pool still aims to queue {} runs", pool.queue_target())),
            async || Ok((pool.queue_target() == 0).then_some(())),
        )
        .await?;
        // 300 ms turns: about 3.3 a second for its one worker.
        let ids = submit_sleepers(&db.store, 12, 300).await?;
        let done = async || {
            let mut done = 0;
            for id in &ids {
                done += usize::from(db.store.get_run(*id).await?.status == RunStatus::Completed);
            }
            anyhow::Ok(done)
        };
        let mut most = 0;
        eventually_some(Duration::from_secs(30), async || Ok(format!("{} of {} runs completed", done().await?, ids.len())), async || {
            most = most.max(held_by(&db.store, "paced").await?);
            Ok((done().await? == ids.len()).then_some(()))
        })
        .await?;
        pool.shutdown(Duration::from_secs(5)).await;
        // One running, about four queued (a second's work), and the claim
        // on its way in a close.
        ensure!(most <= 7, "the host held {most} runs at once with a pace of about 3 a second");
        ensure!(most >= 2, "the host never queued a run ahead of its worker");
        Ok(())
    }

    async fn a_queued_run_is_given_back_before_its_lease_runs_out_though_no_worker_frees(db) {
        // A holds the one worker for 3 s, twice its 1.5 s lease (which its
        // segment renews); B and C, queued behind it, may wait 0.5 s.
        let a = submit_sleepers(&db.store, 1, 3_000).await?[0];
        let rest = submit_sleepers(&db.store, 2, 10).await?;
        let pool = pool(db, "busy", Duration::from_millis(1_500)).await?;
        let mut queued = false;
        eventually("A did not complete", async || {
            if db.store.get_run(a).await?.status == RunStatus::Completed {
                return Ok(true);
            }
            for id in &rest {
                let run = db.store.get_run(*id).await?;
                let now = db.store.now_ms().await?;
                if run.status == RunStatus::Running && run.lease_owner.as_deref() == Some("busy") {
                    queued = true;
                    // 200 ms for the two reads.
                    let left = run.lease_expires_at.unwrap_or(0) - now;
                    ensure!(left > -200, "run {id} stayed queued {} ms past its lease while A ran: {run:?}", -left);
                }
            }
            Ok(false)
        })
        .await?;
        ensure!(queued, "B and C were never queued behind A");
        for id in &rest {
            let run = completed(&db.store, *id).await?;
            ensure!(run.attempt == 1, "a give-back counted as an attempt: {run:?}");
        }
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn a_prefetched_run_that_waited_a_third_of_its_lease_is_given_back_not_run(db) {
        // A 1.5 s lease: a queued run may wait 0.5 s; each turn holds the
        // one worker for 0.7 s.
        let ids = submit_sleepers(&db.store, 4, 700).await?;
        let pool = pool(db, "slow", Duration::from_millis(1_500)).await?;
        for id in &ids {
            eventually_some(Duration::from_secs(60), async || Ok(format!("{:?}", db.store.get_run(*id).await?)), async || {
                let run = db.store.get_run(*id).await?;
                ensure!(!matches!(run.status, RunStatus::Failed | RunStatus::Aborted | RunStatus::Cancelled), "{run:?}");
                Ok((run.status == RunStatus::Completed).then_some(()))
            })
            .await?;
        }
        pool.shutdown(Duration::from_secs(5)).await;
        // Some runs were claimed, given back and claimed again (no reaper
        // runs here), and none lost an attempt or a lease to the wait.
        let mut refenced = 0;
        for id in &ids {
            let run = db.store.get_run(*id).await?;
            ensure!(run.output.is_some() && run.error.is_none(), "{run:?}");
            if run.fence > 1 {
                refenced += 1;
                ensure!(run.attempt == 1, "a give-back counted as an attempt: {run:?}");
            }
        }
        ensure!(refenced > 0, "no queued run was given back after waiting");
        Ok(())
    }
}

both! {
    async fn a_run_a_close_claims_after_shutdown_began_is_given_back_not_started(db) {
        // One worker, no local queue: A's close claims B in its own
        // statement, after the shutdown has begun.
        // A emits, then sleeps: its emit says its segment has started, past
        // the slot's look at the stop (a stop seen first has the close
        // claim nothing, and the test would test nothing).
        let input = serde_json::json!({ "mode": "script", "ops": [{ "op": "emit", "text": "started" }, { "op": "wasi-sleep", "ms": 1_000 }] });
        let a = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        let b = db.store.create_run(&NewRun::new("testkit", r#"{"steps": 0}"#)).await?.0.id;
        let runtime = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let config = crate::harness::worker("stopping");
        let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 1, poll: Duration::from_millis(50), claim_batch: 1, prefetch: 0 });
        crate::harness::eventually("A never started", async || Ok(db.store.get_run(a).await?.partial == "started")).await?;
        pool.shutdown(Duration::from_secs(10)).await;
        ensure!(db.store.get_run(a).await?.status == RunStatus::Completed, "A did not finish in the grace period");
        let run = db.store.get_run(b).await?;
        ensure!(run.status != RunStatus::Completed, "B was started after the shutdown began: {run:?}");
        ensure!(run.fence >= 1, "B was never claimed (the close claimed nothing to give back): {run:?}");
        ensure!(run.lease_owner.is_none() && run.attempt == 0, "B was not given back with its attempt: {run:?}");
        Ok(())
    }
}

both! {
    async fn a_claim_for_a_local_queue_counts_no_attempt_until_its_segment_starts(db) {
        let mut ids = Vec::new();
        for _ in 0..3 {
            let mut new = NewRun::new("testkit", r#"{"steps": 0}"#);
            new.max_attempts = Some(1);
            ids.push(db.store.create_run(&new).await?.0.id);
        }
        // One run for a free worker, two for the queue.
        let claimed = db.store.claim_batch_charging("queueing", Duration::from_secs(30), 3, 1).await?;
        ensure!(claimed.len() == 3, "{claimed:?}");
        let (now, queued): (Vec<_>, Vec<_>) = claimed.iter().partition(|c| c.charged);
        ensure!(now.len() == 1 && queued.len() == 2, "{claimed:?}");
        ensure!(now[0].run.attempt == 1 && queued.iter().all(|c| c.run.attempt == 0), "{claimed:?}");
        // The first queued run starts: its first renewal counts its attempt.
        db.store.renew_charging(&queued[0].lease, Duration::from_secs(30)).await?;
        ensure!(db.store.get_run(queued[0].run.id).await?.attempt == 1);
        // The host dies. Its one-attempt runs whose guests started are out
        // of attempts; the one still queued is not, and another host runs it.
        sqlx::query("UPDATE runs SET lease_expires_at = lease_expires_at - 60000").execute(db.store.pool()).await?;
        let again = db.store.claim_batch("other", Duration::from_secs(30), 3).await?;
        ensure!(again.len() == 1 && again[0].run.id == queued[1].run.id, "{again:?}");
        ensure!(again[0].charged && again[0].run.attempt == 1, "{again:?}");
        Ok(())
    }
}

both! {
    async fn shutdown_gives_back_a_full_queue_in_bounded_time_when_the_database_is_slow(db) {
        // One worker held by a long turn, six runs queued behind it; each
        // give-back takes 3 s, as with a database that does not answer.
        let long = submit_sleepers(&db.store, 1, 20_000).await?[0];
        submit_sleepers(&db.store, 6, 10).await?;
        let runtime = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let config = crate::harness::worker("slow-db");
        let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 1, poll: Duration::from_millis(50), claim_batch: 8, prefetch: 8 });
        crate::harness::eventually("the pool never queued runs behind the long turn", async || Ok(!(db.store.get_run(long).await?.lease_owner.as_deref() != Some("slow-db") || held_by(&db.store, "slow-db").await? < 6))).await?;
        db.store.faults().delay_give_backs(Duration::from_secs(3));
        let started = Instant::now();
        pool.shutdown(Duration::from_millis(100)).await;
        let took = started.elapsed();
        db.store.faults().delay_give_backs(Duration::ZERO);
        // At least five queued: 15 s one after another, 3 s at once.
        ensure!(took < Duration::from_secs(10), "shutdown took {took:?} giving back its queue");
        Ok(())
    }
}

both! {
    async fn a_keyed_submit_is_claimed_at_once_and_queued_ahead_of_another_keys_full_local_queue(db) {
        let pool = pool_with(db, "express", Duration::from_secs(30), 8, 6).await?;
        // One worker, 100 ms turns of key "big": one running, up to six
        // queued, topped up when half of them have started.
        let sleeper = serde_json::json!({ "mode": "script", "ops": [{ "op": "wasi-sleep", "ms": 100 }] }).to_string();
        let mut big = Vec::new();
        for _ in 0..16 {
            let new = NewRun { concurrency_key: Some("big".into()), ..NewRun::new("testkit", sleeper.clone()) };
            big.push(db.store.create_run(&new).await?.0.id);
        }
        // Until the queue runs full: two runs done (the first segments,
        // started with nothing queued, claim their successors in their
        // closes; the later ones find runs queued and leave their closes
        // behind them) and five held.
        let filled = async || {
            let done: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = 'completed'").fetch_one(db.store.pool()).await?;
            Ok(done >= 2 && held_by(&db.store, "express").await? >= 5)
        };
        eventually("the local queue never filled", filled).await?;
        let new = NewRun { concurrency_key: Some("small".into()), ..NewRun::new("testkit", sleeper.clone()) };
        let small = db.store.create_run(&new).await?.0;
        let done = completed(&db.store, small.id).await?;
        // With one worker, runs finish in the order they ran: the big
        // key's runs that finished after the small run was submitted and
        // before it did are those it waited behind.
        let behind: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM runs WHERE concurrency_key = 'big' AND finished_at >= $1 AND finished_at <= $2",
        )
        .bind(small.created_at)
        .bind(done.finished_at)
        .fetch_one(db.store.pool())
        .await?;
        pool.shutdown(Duration::from_secs(5)).await;
        // The one running and, in its round, the first queued.
        ensure!(behind <= 2, "the small key's run waited behind {behind} of the big key's runs");
        Ok(())
    }
}

both! {
    async fn a_queued_run_whose_turn_is_short_counts_its_attempt_in_its_close_and_a_long_one_in_a_renewal(db) {
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let exec = Executor::new(db.store.clone(), rt, crate::harness::worker("charging"));
        // Each run is claimed for a local queue (no attempt counted) and
        // then run: a no-op turn, a turn of 300 ms, a turn that waits for
        // input at once.
        let waits = serde_json::json!({ "mode": "script", "ops": [{ "op": "wait", "prompt": "?" }] }).to_string();
        let long = serde_json::json!({ "mode": "script", "ops": [{ "op": "wasi-sleep", "ms": 300 }] }).to_string();
        for (input, renewals, attempt) in [(r#"{"steps": 0}"#.to_string(), 0, 1), (long, 1, 1), (waits, 1, 0)] {
            let id = db.store.create_run(&NewRun::new("testkit", input.clone())).await?.0.id;
            let claimed = exec.claim_charging(1, 0).await?.pop().ok_or_else(|| anyhow::anyhow!("nothing claimed"))?;
            ensure!(claimed.run.id == id && !claimed.charged && claimed.run.attempt == 0, "{claimed:?}");
            let before = db.store.renewals_written().0;
            let outcome = exec.run_claimed(claimed).await?;
            let run = db.store.get_run(id).await?;
            let sent = db.store.renewals_written().0 - before;
            // A suspension that made no progress gives back the attempt
            // its segment counted: so it must have counted one (0, not -1).
            ensure!(run.attempt == attempt && sent == renewals, "{input}: {outcome:?}, {sent} renewals, {run:?}");
        }
        Ok(())
    }
}

both! {
    async fn a_queued_runs_last_put_is_written_with_its_close_though_its_attempt_count_is_held_up(db) {
        // One worker: A holds it for half a second while B (one kv.put and
        // an emit) waits in the queue; B counts its attempt when it starts,
        // in a write of its row, which this test holds up.
        let a = submit_sleepers(&db.store, 1, 500).await?[0];
        let b = db.store.create_run(&NewRun::new("testkit", r#"{"steps": 1, "prefix": "tail"}"#)).await?.0.id;
        let pool = pool(db, "tail", Duration::from_secs(30)).await?;
        until_holding(&db.store, "tail", a, 2).await?;
        let hold = Hold::start(db, b).await?;
        // A ends, B's guest runs: its put is performed (held, written with
        // the close) and it returns; its count of the attempt waits.
        let puts = async || Ok(leasehold::metrics::global().effects_observed("kv.put") >= 1);
        crate::harness::eventually("B never performed its put", puts).await?;
        if db.backend == leasehold::Backend::Postgres {
            crate::harness::until_lock_waiter(db, 1).await?;
        }
        hold.release().await?;
        let run = completed(&db.store, b).await?;
        pool.shutdown(Duration::from_secs(5)).await;
        // The put went with the close (PostgreSQL: one statement, one
        // clock reading), not in a timed flush of its own sent while the
        // segment waited, whose clock reading is from before the release.
        let put_at: i64 = sqlx::query_scalar("SELECT created_at FROM effects WHERE run_id = $1 AND class = 'local'")
            .bind(b)
            .fetch_one(db.store.pool())
            .await?;
        let finished = run.finished_at.unwrap_or_default();
        ensure!(finished - put_at <= 5, "B's put was written {} ms before its close", finished - put_at);
        Ok(())
    }
}

/// A run of `ms` of sleep at `priority`.
async fn sleeper_at(store: &Store, priority: i64, ms: u64) -> Result<i64> {
    let input = serde_json::json!({ "mode": "script", "ops": [{ "op": "wasi-sleep", "ms": ms }] }).to_string();
    Ok(store.create_run(&NewRun { priority, ..NewRun::new("testkit", input) }).await?.0.id)
}

both! {
    async fn a_higher_priority_run_starts_before_lower_ones_already_in_the_local_queue(db) {
        let s = &db.store;
        // The blocker is claimed first (highest priority), the rest queued
        // by one claim in id order: three at 0, then two at 10.
        let blocker = sleeper_at(s, 20, 300).await?;
        let mut low = Vec::new();
        for _ in 0..3 {
            low.push(sleeper_at(s, 0, 50).await?);
        }
        let mut high = Vec::new();
        for _ in 0..2 {
            high.push(sleeper_at(s, 10, 50).await?);
        }
        let pool = pool_with(db, "prio", Duration::from_secs(30), 8, 8).await?;
        completed(s, blocker).await?;
        let mut finished = std::collections::HashMap::new();
        for id in low.iter().chain(&high) {
            finished.insert(*id, completed(s, *id).await?.finished_at.unwrap_or_default());
        }
        let first_high = high.iter().map(|id| finished[id]).min().unwrap_or_default();
        let before = low.iter().filter(|id| finished[id] < first_high).count();
        ensure!(before == 0, "{before} priority-0 runs started before the first priority-10 run");
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn express_claims_keep_the_local_queue_within_prefetch(db) {
        let s = &db.store;
        let blocker = sleeper_at(s, 20, 1_500).await?;
        for _ in 0..3 {
            sleeper_at(s, 0, 10).await?;
        }
        let pool = pool_with(db, "bounded", Duration::from_secs(30), 4, 4).await?;
        until_holding(s, "bounded", blocker, 4).await?;
        let mut most = 0;
        for _ in 0..16 {
            sleeper_at(s, 5, 10).await?;
            for _ in 0..5 {
                most = most.max(held_by(s, "bounded").await?);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        // The blocker, the queue's 4, and one express run between its
        // claim and the queue letting its last go.
        ensure!(most <= 1 + 4 + 1, "the host held {most} runs with a queue of 4");
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn a_run_paused_in_the_local_queue_never_starts(db) {
        let s = &db.store;
        let blocker = sleeper_at(s, 20, 500).await?;
        let input = serde_json::json!({ "mode": "script", "ops": [{ "op": "emit", "text": "ran" }, { "op": "wasi-sleep", "ms": 10 }] }).to_string();
        let queued = s.create_run(&NewRun::new("testkit", input)).await?.0.id;
        let pool = pool_with(db, "pauser", Duration::from_secs(30), 4, 3).await?;
        until_holding(s, "pauser", blocker, 2).await?;
        s.pause_run(queued).await?;
        completed(s, blocker).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let run = s.get_run(queued).await?;
        ensure!(run.status == RunStatus::Queued && run.started_at.is_none() && run.lease_owner.is_none() && run.paused_at.is_some(), "{run:?}");
        let kinds: Vec<String> = s.run_events(queued).await?.into_iter().map(|e| e.kind).collect();
        ensure!(!kinds.iter().any(|k| k == "delta" || k == "suspended"), "the paused run's guest started: {kinds:?}");
        s.resume_run(queued).await?;
        completed(s, queued).await?;
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }
}

both! {
    async fn claims_grow_past_the_claim_batch_while_a_backlog_fills_them_and_never_past_256(db) {
        let news: Vec<NewRun> = (0..600).map(|_| NewRun::new("testkit", r#"{"steps": 0}"#)).collect();
        for chunk in news.chunks(200) {
            db.store.create_runs(chunk).await?;
        }
        let runtime = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let exec = Arc::new(Executor::new(db.store.clone(), runtime, crate::harness::worker("grower")));
        let sizes = &leasehold::metrics::global().claim_batch.0;
        let before = (sizes.count(), sizes.count_at_most(2.0).expect("2 is a bucket bound"));
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 4, poll: Duration::from_millis(50), claim_batch: 2, prefetch: 400 });
        const OPEN: &str = "SELECT COUNT(*) FROM runs WHERE status <> 'completed'";
        let open = async || -> Result<i64> { Ok(sqlx::query_scalar::<_, i64>(OPEN).fetch_one(db.store.pool()).await?) };
        eventually_some(
            Duration::from_secs(60),
            async || Ok(format!("{} of 600 runs never completed", open().await?)),
            async || Ok((open().await? == 0).then_some(())),
        )
        .await?;
        pool.shutdown(Duration::from_secs(5)).await;
        let claims = sizes.count() - before.0;
        let small = sizes.count_at_most(2.0).expect("a bound") - before.1;
        let capped = sizes.count_at_most(256.0).expect("a bound");
        ensure!(claims > small, "every one of {claims} claims took at most the claim batch of 2");
        ensure!(capped == sizes.count(), "a claim took more than 256 runs");
        Ok(())
    }
}
