//! `bench e2e` runs the whole lifecycle and cleans up after itself.

use anyhow::ensure;
use leasehold::bench::e2e::E2eBench;

use crate::harness::both;
use crate::plugins;

both! {
    async fn the_e2e_bench_completes_every_run_and_leaves_the_database_empty(db) {
        let dir = tempfile::tempdir()?;
        let plugin_file = dir.path().join("testkit.wasm");
        std::fs::write(&plugin_file, plugins::rust_plugin("testkit")?)?;
        let bench = E2eBench {
            database_url: db.url().to_string(),
            runs: 40,
            concurrency: 2,
            submitters: 3,
            // Both orders of the pair: baseline first in the second round.
            rounds: 2,
            plugin_file,
            cache_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"),
            progress: false,
            sqlite_sync: Default::default(),
        };
        let result = bench.run().await?;
        ensure!(result.runs_per_sec > 0.0 && result.baseline_per_sec > 0.0 && result.ratio > 0.0 && result.rounds == 2, "{result:?}");
        // Every run of the latency phase was measured, at half the peak.
        ensure!(result.latency_samples == 40, "{result:?}");
        // Both figures are rounded from unrounded rates: within one.
        ensure!((result.latency_rate_per_sec - result.runs_per_sec / 2.0).abs() <= 1.0, "{result:?}");
        let (p50, p99) = (result.submit_to_start_p50_ms, result.submit_to_start_p99_ms);
        // A latency is never zero: a submit takes time to reach a worker.
        ensure!(p50.is_finite() && p99.is_finite() && p50 > 0.0 && p99 >= p50, "{result:?}");
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(db.store.pool()).await?;
        let plugins: i64 = sqlx::query_scalar("SELECT (SELECT COUNT(*) FROM plugins) + (SELECT COUNT(*) FROM plugin_versions)")
            .fetch_one(db.store.pool())
            .await?;
        ensure!(left == 0 && plugins == 0, "{left} runs and {plugins} plugins left behind");
        // A second run on the same database works, and a database with
        // runs is refused.
        bench.run().await?;
        db.store.create_run(&leasehold::store::NewRun::new("other", "{}")).await?;
        ensure!(bench.run().await.is_err(), "a database holding runs was not refused");
        Ok(())
    }
}
