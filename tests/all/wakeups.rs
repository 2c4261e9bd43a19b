//! Wake-ups: an idle worker pool starts a submitted run at once, without
//! waiting for its fallback poll. On SQLite the submit wakes the pool in
//! process; on PostgreSQL a submit on another host reaches it by `NOTIFY`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use leasehold::Backend;
use leasehold::executor::Executor;
use leasehold::plugins::PluginSettings;
use leasehold::pool::{PoolConfig, WorkerPool};
use leasehold::store::{NewRun, RunStatus, Store};

use crate::harness::{TestDb, both, eventually_some, run_on};
use crate::plugins;

/// Waits until the pool's `LISTEN` connection is up (PostgreSQL): a
/// `NOTIFY` sent before it would be lost, and the test would wait for the
/// poll.
async fn wait_listening(db: &TestDb) -> Result<()> {
    crate::harness::wait_for_count(
        db,
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        "the pool ran LISTEN",
    )
    .await
}

async fn submit_and_wait(submitter: &Store, db: &TestDb, what: &str) -> Result<()> {
    let (run, _) = submitter.create_run(&NewRun::new("testkit", r#"{"steps":1}"#)).await?;
    let still = async || Ok(format!("{what}: run {} still {:?}; the idle pool was not woken", run.id, db.store.get_run(run.id).await?.status));
    eventually_some(Duration::from_secs(30), still, async || Ok((db.store.get_run(run.id).await?.status == RunStatus::Completed).then_some(()))).await
}

both! {
    async fn an_idle_pool_starts_a_submitted_run_without_waiting_for_its_poll(db) {
        let runtime = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let config = crate::harness::worker("idle-pool");
        let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
        // An hour: within the test only a wake-up can start a run.
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 2, poll: Duration::from_secs(3600), ..PoolConfig::default() });
        if db.backend == Backend::Postgres {
            wait_listening(db).await?;
        }
        // Submitted by this host, several times: each run finds the pool
        // idle again (its last claim found nothing).
        for i in 0..3 {
            crate::harness::eventually("the pool never went idle", async || Ok(pool.waiting_for_work())).await?;
            submit_and_wait(&db.store, db, &format!("submit {i} on the pool's own host")).await?;
        }
        if db.backend == Backend::Postgres {
            // Another host: only its NOTIFY reaches this pool.
            let other = db.another_store(2).await?;
            for i in 0..3 {
                crate::harness::eventually("the pool never went idle", async || Ok(pool.waiting_for_work())).await?;
                submit_and_wait(&other, db, &format!("submit {i} on another host")).await?;
            }
            other.shutdown().await;
        }
        pool.shutdown(Duration::from_secs(10)).await;
        Ok(())
    }
}

/// PostgreSQL only: it tests `NOTIFY`, and SQLite hosts in other processes
/// find new runs by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_concurrent_submits_on_another_host_all_reach_an_idle_pool() -> Result<()> {
    run_on(Backend::Postgres, async |db: &TestDb| {
        let runtime = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let config = crate::harness::worker("idle-pool");
        let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 2, poll: Duration::from_secs(3600), ..PoolConfig::default() });
        wait_listening(db).await?;
        // Concurrent submits share batches and NOTIFYs: some batches commit
        // while the host's NOTIFY is in flight and carry none; their runs
        // must still be announced once the pool has gone idle. A burst
        // strands a run rarely when they are not: 200 bursts made each of 4
        // runs fail (at bursts 10 to 158) with that announcement taken out.
        let other = db.another_store(8).await?;
        for burst in 0..200 {
            let mut ids = Vec::new();
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..8 {
                let other = other.clone();
                tasks.spawn(async move { other.create_run(&NewRun::new("testkit", r#"{"steps":1}"#)).await });
            }
            while let Some(r) = tasks.join_next().await {
                ids.push(r??.0.id);
            }
            let done = async || {
                // Nothing else is submitted meanwhile: the burst's runs are
                // the ids from its least to its greatest.
                let (lo, hi) = (ids.iter().min().copied().unwrap_or(0), ids.iter().max().copied().unwrap_or(0));
                let done: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = 'completed' AND id BETWEEN $1 AND $2")
                    .bind(lo)
                    .bind(hi)
                    .fetch_one(db.store.pool())
                    .await?;
                anyhow::Ok(done)
            };
            let what = async || Ok(format!("burst {burst}: {} of {} runs completed", done().await?, ids.len()));
            eventually_some(Duration::from_secs(30), what, async || Ok((done().await? == ids.len() as i64).then_some(()))).await?;
        }
        other.shutdown().await;
        pool.shutdown(Duration::from_secs(10)).await;
        Ok(())
    })
    .await
}

/// PostgreSQL only (`NOTIFY`): a run a host gives back unstarted (its
/// local queue at shutdown, or a queued run that waited too long) wakes an
/// idle pool on another host, which starts it without waiting for its poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_given_back_wakes_an_idle_pool_on_another_host() -> Result<()> {
    run_on(Backend::Postgres, async |db: &TestDb| {
        let runtime = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let other = db.another_store(2).await?;
        let (run, _) = other.create_run(&NewRun::new("testkit", r#"{"steps":1}"#)).await?;
        let queued = other.claim("queueing-host", Duration::from_secs(30)).await?.expect("the run is claimable");
        let config = crate::harness::worker("idle-pool");
        let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
        // An hour: within the test only a wake-up can start the run.
        let pool = WorkerPool::start(db.store.clone(), exec, PoolConfig { workers: 2, poll: Duration::from_secs(3600), ..PoolConfig::default() });
        wait_listening(db).await?;
        // Its first claim found the run leased; it waits for a signal now.
        // Seen in the server's sessions: besides the one that queued the
        // run, a session whose last statement was a claim.
        crate::harness::wait_for_count(
            db,
            "SELECT COUNT(*) - 1 FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE '%claim_token = CASE%' AND pid <> pg_backend_pid()",
            "the idle pool made its first claim",
        )
        .await?;
        other.give_back(&queued.lease, queued.charged).await?;
        let completed = async || Ok(db.store.get_run(run.id).await?.status == RunStatus::Completed);
        crate::harness::eventually("a run given back on another host waited for the poll", completed).await?;
        other.shutdown().await;
        pool.shutdown(Duration::from_secs(10)).await;
        Ok(())
    })
    .await
}
