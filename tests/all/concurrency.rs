//! Many workers on separate connections claiming from one queue.

use std::collections::HashSet;

use anyhow::ensure;
use leasehold::store::StoreError;

use crate::harness::{TTL, both};

both! {
    async fn concurrent_claimers_take_each_run_exactly_once(db) {
        const RUNS: i64 = 2_000;
        const WORKERS: usize = 8;
        ensure!(db.store.bulk_load_queued(RUNS, "p").await? == RUNS as u64);
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..WORKERS {
            // Its own pool and connection: a separate worker as far as the
            // database can tell. SQLite busy errors are retried inside the
            // store; any error that surfaces fails the test.
            let store = db.another_store(1).await?;
            tasks.spawn(async move {
                let owner = format!("worker-{w}");
                let mut mine = Vec::new();
                loop {
                    let batch = store.claim_batch(&owner, TTL, if w % 2 == 0 { 1 } else { 7 }).await?;
                    if batch.is_empty() {
                        break;
                    }
                    mine.extend(batch.into_iter().map(|c| (c.run.id, c.run.fence, c.run.attempt)));
                }
                store.shutdown().await;
                Ok::<_, StoreError>(mine)
            });
        }
        let mut all = Vec::new();
        let mut per_worker = Vec::new();
        while let Some(r) = tasks.join_next().await {
            let mine = r??;
            per_worker.push(mine.len());
            all.extend(mine);
        }
        let distinct: HashSet<i64> = all.iter().map(|c| c.0).collect();
        ensure!(all.len() == RUNS as usize, "{} claims for {RUNS} runs", all.len());
        ensure!(distinct.len() == RUNS as usize, "a run was claimed twice");
        ensure!(all.iter().all(|&(_, fence, attempt)| fence == 1 && attempt == 1));
        ensure!(db.store.claim("late", TTL).await?.is_none());
        eprintln!("{:?}: claims per worker {per_worker:?}", db.backend);
        Ok(())
    }
}

both! {
    // On SQLite the claims made at once go to the database together (one
    // statement for several owners and lease lengths); each must still get
    // runs leased to its own owner, for its own lease length.
    async fn claims_made_at_once_by_several_owners_each_lease_to_their_own_owner_and_length(db) {
        const RUNS: i64 = 100;
        ensure!(db.store.bulk_load_queued(RUNS, "p").await? == RUNS as u64);
        // Newer runs eligible first, so the claim order is not id order.
        sqlx::query("UPDATE runs SET not_before = not_before - id").execute(db.store.pool()).await?;
        for round in 0..3 {
            let mut tasks = tokio::task::JoinSet::new();
            for w in 0..12u64 {
                let store = db.store.clone();
                let (owner, ttl, max) = (format!("owner-{}", w % 4), TTL + std::time::Duration::from_millis(w % 3), 1 + (w % 3) as i64);
                tasks.spawn(async move {
                    let got = store.claim_batch(&owner, ttl, max).await?;
                    Ok::<_, StoreError>((owner, ttl, max, got))
                });
            }
            let mut ids = HashSet::new();
            while let Some(r) = tasks.join_next().await {
                let (owner, ttl, max, got) = r??;
                ensure!(got.len() as i64 == max, "round {round}: {owner} asked for {max} runs and got {}", got.len());
                for c in got {
                    ensure!(ids.insert(c.run.id), "round {round}: run {} claimed twice", c.run.id);
                    ensure!(c.lease.owner == owner && c.lease.fence == 1 && c.run.fence == 1);
                    let (row_owner, expires, heartbeat): (String, i64, i64) =
                        sqlx::query_as("SELECT lease_owner, lease_expires_at, heartbeat_at FROM runs WHERE id = $1")
                            .bind(c.run.id)
                            .fetch_one(db.store.pool())
                            .await?;
                    ensure!(row_owner == owner, "round {round}: run {} leased to {row_owner}, claimed by {owner}", c.run.id);
                    ensure!(
                        expires - heartbeat == ttl.as_millis() as i64,
                        "round {round}: run {} leased for {} ms, asked {} ms",
                        c.run.id,
                        expires - heartbeat,
                        ttl.as_millis()
                    );
                }
            }
            ensure!(ids.len() == 24, "round {round}: {} runs claimed", ids.len());
        }
        Ok(())
    }
}

/// PostgreSQL runs two close batches at once: a batch held up in the
/// database (here by a row lock another session holds) does not hold up
/// the closes queued behind it, which go in a second batch at once rather
/// than after the 200 ms stall rescue. Also what lets one batch execute
/// while the other commits or travels, so the server's second core works.
/// PostgreSQL only: SQLite has one writer, and its batches take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_writes_a_second_close_batch_while_the_first_waits_on_a_row_lock() -> anyhow::Result<()> {
    use leasehold::store::{NewRun, Outcome};
    crate::harness::run_on(leasehold::Backend::Postgres, async |db: &crate::harness::TestDb| {
        let (a, _) = db.store.create_run(&NewRun::new("p", "{}")).await?;
        let (b, _) = db.store.create_run(&NewRun::new("p", "{}")).await?;
        let claimed = db.store.claim_batch("w", TTL, 2).await?;
        let lease = |id: i64| claimed.iter().find(|c| c.run.id == id).map(|c| c.lease.clone()).expect("claimed");
        let (lease_a, lease_b) = (lease(a.id), lease(b.id));
        // Another session holds run A's row: A's batch waits for it.
        let mut holder = db.store.pool().begin().await?;
        sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE").bind(a.id).execute(&mut *holder).await?;
        let store = db.store.clone();
        let first = tokio::spawn(async move { store.close(&lease_a, &Outcome::Completed { output: "a".into() }).await });
        crate::harness::wait_for_count(
            db,
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            "A's batch waits on the row lock",
        )
        .await?;
        db.store.close(&lease_b, &Outcome::Completed { output: "b".into() }).await?;
        ensure!(!first.is_finished(), "A's close finished while its row was held");
        ensure!(
            db.store.closes_stalled() == 0,
            "B's close waited behind A's batch for the stall rescue ({} stalled writers started)",
            db.store.closes_stalled()
        );
        holder.rollback().await?;
        first.await??;
        let status = |id: i64| sqlx::query_scalar::<_, String>("SELECT status FROM runs WHERE id = $1").bind(id);
        ensure!(status(a.id).fetch_one(db.store.pool()).await? == "completed");
        ensure!(status(b.id).fetch_one(db.store.pool()).await? == "completed");
        Ok(())
    })
    .await
}

/// PostgreSQL only: a batch of closes that meets a row a frozen session
/// holds gives up after the lock timeout (2 s) and is written again one
/// close at a time, so only that close waits (and fails) again; the others
/// in its batch are written, well before the frozen session lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_batch_stuck_on_a_frozen_sessions_row_writes_its_other_closes() -> anyhow::Result<()> {
    use leasehold::store::{NewRun, Outcome};
    use sqlx::Connection;
    use std::time::{Duration, Instant};
    crate::harness::run_on(leasehold::Backend::Postgres, async |db: &crate::harness::TestDb| {
        let mut ids = Vec::new();
        for _ in 0..5 {
            ids.push(db.store.create_run(&NewRun::new("p", "{}")).await?.0.id);
        }
        let claimed = db.store.claim_batch("w", Duration::from_secs(60), 5).await?;
        let lease = |id: i64| claimed.iter().find(|c| c.run.id == id).map(|c| c.lease.clone()).expect("claimed");
        // X and Y keep both batch writers waiting; A's row makes the batch
        // that takes A, B and C (queued behind them) wait too.
        let (x, y, a, b, c) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
        let mut frozen = sqlx::PgConnection::connect(db.url()).await?;
        sqlx::raw_sql("BEGIN").execute(&mut frozen).await?;
        for id in [x, y, a] {
            sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE").bind(id).fetch_all(&mut frozen).await?;
        }
        let close = |id: i64| {
            let (store, lease) = (db.store.clone(), lease(id));
            tokio::spawn(async move { store.close(&lease, &Outcome::Completed { output: id.to_string() }).await })
        };
        // X first, and Y once X's batch waits: queued together, both would
        // go in one batch and leave the second writer idle.
        let held_x = close(x);
        crate::harness::wait_for_count(
            db,
            "SELECT CASE WHEN COUNT(*) >= 1 THEN 1 ELSE 0 END::int8 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            "the first batch writer waits on the frozen session's row",
        )
        .await?;
        let held = [held_x, close(y)];
        crate::harness::wait_for_count(
            db,
            "SELECT CASE WHEN COUNT(*) >= 2 THEN 1 ELSE 0 END::int8 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            "both batch writers wait on the frozen session's rows",
        )
        .await?;
        let timeouts = leasehold::metrics::global().lock_timeouts.load(std::sync::atomic::Ordering::Relaxed);
        let started = Instant::now();
        let (close_a, close_b, close_c) = (close(a), close(b), close(c));
        let (done_b, done_c) = (tokio::time::timeout(Duration::from_secs(10), close_b).await, tokio::time::timeout(Duration::from_secs(10), close_c).await);
        let waited = started.elapsed();
        ensure!(done_b.is_ok() && done_c.is_ok(), "B and C waited {waited:?} on A's row, which a frozen session holds");
        done_b.unwrap()??;
        done_c.unwrap()??;
        let status = |id: i64| sqlx::query_scalar::<_, String>("SELECT status FROM runs WHERE id = $1").bind(id);
        ensure!(status(b).fetch_one(db.store.pool()).await? == "completed");
        ensure!(status(c).fetch_one(db.store.pool()).await? == "completed");
        // A's own close gives up too, with the lock timeout's error, and is counted.
        let a_result = tokio::time::timeout(Duration::from_secs(10), close_a).await?;
        ensure!(a_result?.as_ref().is_err_and(leasehold::store::is_lock_timeout), "A's close did not give up on its row");
        let now = leasehold::metrics::global().lock_timeouts.load(std::sync::atomic::Ordering::Relaxed);
        ensure!(now > timeouts, "no lock timeout was counted");
        sqlx::raw_sql("ROLLBACK").execute(&mut frozen).await?;
        for h in held {
            let _ = h.await?;
        }
        ensure!(status(a).fetch_one(db.store.pool()).await? == "running", "A closed though its close failed");
        Ok(())
    })
    .await
}

both! {
    async fn a_close_the_database_refuses_in_a_batch_fails_alone_and_the_others_close(db) {
        use leasehold::store::{NewRun, Outcome, RunStatus};
        let s = &db.store;
        // The database refuses one close, as a constraint would: a trigger.
        let refuse: &[&'static str] = match db.backend {
            leasehold::Backend::Sqlite => &["CREATE TRIGGER test_refuse BEFORE UPDATE OF output ON runs \
                 WHEN NEW.output = 'refused' BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"],
            leasehold::Backend::Postgres => &[
                "CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
                "CREATE TRIGGER test_refuse BEFORE UPDATE OF output ON runs FOR EACH ROW \
                 WHEN (NEW.output = 'refused') EXECUTE FUNCTION test_refuse()",
            ],
        };
        for &statement in refuse {
            sqlx::query(statement).execute(s.pool()).await?;
        }
        // Closes made at once usually share a batch; a round whose refused
        // close did is one whose batch was rolled back and split.
        for _ in 0..10 {
            for _ in 0..8 {
                s.create_run(&NewRun::new("p", "{}")).await?;
            }
            let claimed = s.claim_batch("w", TTL, 8).await?;
            ensure!(claimed.len() == 8, "{} claimed", claimed.len());
            let split = s.closes_split();
            let mut tasks = tokio::task::JoinSet::new();
            for (i, c) in claimed.into_iter().enumerate() {
                let s = s.clone();
                tasks.spawn(async move {
                    let output = if i == 3 { "refused" } else { "fine" };
                    (i, c.run.id, s.close_and_claim(&c.lease, &[], &[], &Outcome::Completed { output: output.into() }, None).await)
                });
            }
            while let Some(joined) = tasks.join_next().await {
                let (i, id, got) = joined?;
                let run = s.get_run(id).await?;
                if i == 3 {
                    ensure!(got.as_ref().is_err_and(|e| !e.is_lease_lost() && e.to_string().contains("refused by the test")), "{got:?}");
                    ensure!(run.status == RunStatus::Running && run.output.is_none(), "the refused close wrote nothing: {run:?}");
                } else {
                    ensure!(got.is_ok() && run.status == RunStatus::Completed && run.output.as_deref() == Some("fine"), "{i}: {got:?} {run:?}");
                }
            }
            if s.closes_split() > split {
                return Ok(());
            }
        }
        anyhow::bail!("in 10 rounds of 8 closes at once, the refused one never shared a batch")
    }
}
