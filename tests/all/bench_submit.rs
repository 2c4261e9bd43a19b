//! `bench submit` submits through the real HTTP API, one run at a time and
//! in batches, while the pool drains, and cleans up after itself.

use anyhow::ensure;
use leasehold::bench::submit::SubmitBench;

use crate::harness::both;
use crate::plugins;

both! {
    async fn the_submit_bench_takes_runs_in_over_http_and_leaves_no_rows(db) {
        let dir = tempfile::tempdir()?;
        let plugin_file = dir.path().join("testkit.wasm");
        std::fs::write(&plugin_file, plugins::rust_plugin("testkit")?)?;
        let bench = SubmitBench {
            database_url: db.url().to_string(),
            // More than one batch request in the batch phase.
            runs: 250,
            clients: 8,
            batch: 100,
            batch_clients: 2,
            workers: 4,
            plugin_file,
            cache_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"),
            progress: false,
            sqlite_sync: Default::default(),
        };
        let result = bench.run().await?;
        ensure!(result.runs == 250 && result.submits_per_sec > 0.0 && result.batch_runs_per_sec > 0.0, "{result:?}");
        ensure!(result.submit_p50_ms > 0.0 && result.submit_p99_ms >= result.submit_p50_ms, "{result:?}");
        ensure!(result.submits_per_commit >= 1.0 && result.cpu_us_per_submit > 0.0, "{result:?}");
        let left: i64 = sqlx::query_scalar(
            "SELECT (SELECT COUNT(*) FROM runs) + (SELECT COUNT(*) FROM events) + (SELECT COUNT(*) FROM threads) + (SELECT COUNT(*) FROM plugins)",
        )
        .fetch_one(db.store.pool())
        .await?;
        ensure!(left == 0, "{left} rows left behind");
        Ok(())
    }
}
