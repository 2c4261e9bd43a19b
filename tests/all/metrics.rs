//! The histograms and gauges worth graphing (docs/operations.md,
//! "Metrics and logs"): submit to start, claim and close batch sizes, effect
//! latency by name, the local queue's wait, and queued runs by key. The
//! counters are the process's, shared by the tests running beside this
//! one, so the checks are of growth, not of exact counts. Both backends.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::api::{ApiConfig, AppState};
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::store::{NewRun, PluginSettings, RunStatus};
use serde_json::json;

use crate::harness::both;
use crate::plugins;

/// The value of the series `name` (with its labels) in a scrape.
fn value(text: &str, name: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

both! {
    async fn the_metrics_page_has_histograms_of_waits_batches_and_effects_and_queued_runs_by_key(db) {
        leasehold::effects::http::install_tls();
        let rt = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let state = AppState::new(db.store.clone(), rt.clone(), ApiConfig { metrics_ttl: Duration::ZERO, ..ApiConfig::default() }, shutdown.clone());
        let base = crate::harness::serve_api(state, shutdown).await?;
        let scrape = async || -> Result<String> { Ok(reqwest::get(format!("{base}/metrics")).await?.text().await?) };
        let before = scrape().await?;

        // A paused key's runs stay queued: the gauge by key shows them, its
        // label escaped.
        let key = r#"tenant "q" \ 1"#;
        db.store.set_limit(key, None, true).await?;
        for _ in 0..3 {
            let run = NewRun { concurrency_key: Some(key.into()), ..NewRun::new("testkit", json!({ "steps": 1 }).to_string()) };
            db.store.create_run(&run).await?;
        }
        // A run of two kv.puts, run to its end.
        let id = db.store.create_run(&NewRun::new("testkit", json!({ "steps": 2 }).to_string())).await?.0.id;
        let config = ExecutorConfig { owner: "host-m".into(), renew_every: None, model: None, reserved: vec![], ..ExecutorConfig::default() };
        let worker = Executor::new(db.store.clone(), Arc::clone(&rt), config);
        while db.store.get_run(id).await?.status != RunStatus::Completed {
            ensure!(worker.run_once().await?.is_some(), "nothing to claim before run {id} completed");
        }
        let after = scrape().await?;

        let grew = |name: &str| value(&after, name) > value(&before, name);
        ensure!(grew("leasehold_submit_to_start_seconds_count"), "submit to start:\n{after}");
        ensure!(grew("leasehold_claim_batch_size_count"), "claim batch size:\n{after}");
        ensure!(value(&after, r#"leasehold_effect_seconds_count{effect="kv.put"}"#) >= value(&before, r#"leasehold_effect_seconds_count{effect="kv.put"}"#) + 2.0, "two kv.puts timed:\n{after}");
        ensure!(after.contains(r#"leasehold_effect_seconds_bucket{effect="kv.put",le="+Inf"}"#), "{after}");
        ensure!(after.contains("# TYPE leasehold_local_queue_wait_seconds histogram"), "{after}");
        ensure!(value(&after, r#"leasehold_queued_runs_by_key{key="tenant \"q\" \\ 1"}"#) == 3.0, "queued by key:\n{after}");
        if db.backend == leasehold::Backend::Postgres {
            // Closes are group-committed on PostgreSQL (`store::closes`).
            ensure!(grew("leasehold_close_batch_size_count"), "close batch size:\n{after}");
        }
        let _ = stop.send(true);
        Ok(())
    }
}
