//! `bench drain` drains a loaded backlog with the worker pool, measures it
//! on the database clock, and cleans up after itself.

use anyhow::ensure;
use leasehold::bench::drain::DrainBench;

use crate::harness::both;
use crate::plugins;

both! {
    async fn the_drain_bench_completes_the_backlog_and_leaves_other_rows_alone(db) {
        let dir = tempfile::tempdir()?;
        let plugin_file = dir.path().join("testkit.wasm");
        std::fs::write(&plugin_file, plugins::rust_plugin("testkit")?)?;
        let bench = DrainBench {
            database_url: db.url().to_string(),
            // More than one batch submit, so loading takes two commits.
            runs: 1_200,
            steps: 1,
            gets: 0,
            workers: 4,
            claim_batch: 4,
            prefetch: 4,
            rounds: 2,
            plugin_file,
            cache_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"),
            progress: false,
            sqlite_sync: Default::default(),
            // Low, so the vacuum loop runs beside the pool here too.
            pg_vacuum_dead_rows: 500,
            // Keyed, so the pool's claims go through the keys' turns.
            keys: 7,
            limit: Some(2),
            finished: 0,
            sleeping: 0,
        };
        let result = bench.run().await?;
        ensure!(result.runs == 1_200 && result.rounds == 2 && result.runs_per_sec > 0.0, "{result:?}");
        ensure!(result.first_tenth_per_sec > 0.0 && result.last_tenth_per_sec > 0.0 && result.cpu_us_per_run > 0.0, "{result:?}");
        ensure!(result.closes_per_commit >= 1.0, "{result:?}");
        ensure!(result.keys == 7 && result.limit == Some(2), "{result:?}");
        let left: i64 = sqlx::query_scalar("SELECT (SELECT COUNT(*) FROM runs) + (SELECT COUNT(*) FROM events) + (SELECT COUNT(*) FROM effects) + (SELECT COUNT(*) FROM kv) + (SELECT COUNT(*) FROM plugins)")
            .fetch_one(db.store.pool())
            .await?;
        ensure!(left == 0, "{left} rows left behind");
        // A database holding runs is refused, and the refusal deletes nothing.
        let (other, _) = db.store.create_run(&leasehold::store::NewRun::new("other", "{}")).await?;
        ensure!(bench.run().await.is_err(), "a database holding runs was not refused");
        ensure!(db.store.get_run(other.id).await.is_ok(), "the bench deleted another plugin's run");
        Ok(())
    }

    async fn the_drain_bench_leaves_finished_and_sleeping_runs_beside_the_backlog_alone(db) {
        let dir = tempfile::tempdir()?;
        let plugin_file = dir.path().join("testkit.wasm");
        std::fs::write(&plugin_file, plugins::rust_plugin("testkit")?)?;
        let bench = DrainBench {
            database_url: db.url().to_string(),
            runs: 300,
            steps: 0,
            gets: 0,
            workers: 4,
            claim_batch: 8,
            prefetch: 8,
            rounds: 1,
            plugin_file,
            cache_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"),
            progress: false,
            sqlite_sync: Default::default(),
            pg_vacuum_dead_rows: 0,
            keys: 0,
            limit: None,
            // Over one loading slice of finished runs, and an odd number
            // of open ones, so the halves differ.
            finished: 100_001,
            sleeping: 301,
        };
        // The bench fails if a claim took one of the runs beside the
        // backlog, or if it counted them as drained.
        let result = bench.run().await?;
        ensure!(result.runs == 300 && result.finished == 100_001 && result.sleeping == 301 && result.runs_per_sec > 0.0, "{result:?}");
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(db.store.pool()).await?;
        ensure!(left == 0, "{left} runs left behind");
        Ok(())
    }

    async fn a_batch_of_runs_is_refused_whole_when_one_is_invalid(db) {
        use leasehold::store::NewRun;
        let keyed = |k: &str| NewRun { idempotency_key: Some(k.into()), ..NewRun::new("p", "{}") };
        let threaded = |t: &str| NewRun { thread_id: Some(t.into()), ..NewRun::new("p", "{}") };
        let bad: [(Vec<NewRun>, &str); 4] = [
            (vec![keyed("a"), keyed("a")], "already used by this batch"),
            (vec![threaded("t"), threaded("t")], "names each thread once"),
            (vec![NewRun { max_attempts: Some(0), ..NewRun::new("p", "{}") }], "max_attempts"),
            ((0..=leasehold::store::MAX_SUBMIT_BATCH).map(|_| NewRun::new("p", "{}")).collect(), "at most"),
        ];
        for (batch, says) in bad {
            let err = db.store.create_runs(&batch).await.err().map(|e| e.to_string()).unwrap_or_default();
            ensure!(err.contains(says), "{err:?} does not say {says:?}");
        }
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(db.store.pool()).await?;
        ensure!(n == 0, "a refused batch wrote {n} runs");
        let made = db.store.create_runs(&[keyed("a"), keyed("b"), threaded("t")]).await?;
        ensure!(made.len() == 3 && made.iter().all(|(_, new)| *new) && made[2].0.thread_id == "t", "{made:?}");
        let again = db.store.create_runs(&[keyed("b"), keyed("c")]).await?;
        ensure!(!again[0].1 && again[0].0.id == made[1].0.id && again[1].1, "{again:?}");
        Ok(())
    }
}
