//! `bench fairness` runs both phases and reports the small key's waits;
//! the figures themselves are for docs/benchmarks.md, not asserted.

use anyhow::ensure;
use leasehold::bench::fairness::FairnessBench;

use crate::harness::both;
use crate::plugins;

both! {
    async fn the_fairness_bench_measures_a_small_key_beside_a_backlog_and_leaves_no_rows(db) {
        let dir = tempfile::tempdir()?;
        let plugin_file = dir.path().join("testkit.wasm");
        std::fs::write(&plugin_file, plugins::rust_plugin("testkit")?)?;
        let bench = FairnessBench {
            database_url: db.url().to_string(),
            backlog: 3_000,
            small: 10,
            gap_ms: 5,
            workers: 4,
            claim_batch: 8,
            prefetch: 8,
            plugin_file,
            cache_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"),
            progress: false,
            sqlite_sync: Default::default(),
        };
        let r = bench.run().await?;
        ensure!(r.small == 10 && r.backlog == 3_000, "{r:?}");
        ensure!(r.alone_p50_ms <= r.alone_p99_ms && r.beside_p50_ms <= r.beside_p99_ms && r.p99_ratio > 0.0, "{r:?}");
        // 4 workers cannot drain 3,000 runs while 10 are submitted.
        ensure!(r.backlog_left > 0, "the backlog was gone before the small key's runs started: {r:?}");
        let left: i64 = sqlx::query_scalar("SELECT (SELECT COUNT(*) FROM runs) + (SELECT COUNT(*) FROM plugins) + (SELECT COUNT(*) FROM concurrency_keys)")
            .fetch_one(db.store.pool())
            .await?;
        ensure!(left == 0, "{left} rows left behind");
        Ok(())
    }
}
