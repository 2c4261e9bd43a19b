//! The histograms and gauges worth graphing (docs/operations.md,
//! "Metrics and logs"): submit to start, claim and close batch sizes, effect
//! latency by name, the local queue's wait, and queued runs by key; and
//! every metric the docs name is on the page. The counters are a
//! process's: the host runs as a process of its own (`leasehold serve`),
//! so each count is this test's alone and is checked exactly. Both
//! backends.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use crate::harness::{both, eventually_some};
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc};

/// The value of the series `name` (with its labels) in a scrape.
fn value(text: &str, name: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

/// Every `leasehold_*` name in `docs/` that is not one of the schema's SQL
/// functions: the metrics an operator is told to graph.
fn documented_metrics() -> Result<Vec<String>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sql = String::new();
    for entry in std::fs::read_dir(root.join("migrations/postgres"))? {
        sql.push_str(&std::fs::read_to_string(entry?.path())?);
    }
    let mut names = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let mut rest = text.as_str();
        while let Some(at) = rest.find("leasehold_") {
            let name: String = rest[at..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
            rest = &rest[at + name.len()..];
            // A prefix (`leasehold_tpl_<digest>`, a database's name) names
            // no metric.
            if name.ends_with('_') {
                continue;
            }
            let base = ["_bucket", "_count", "_sum"].iter().fold(name.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n));
            if !sql.contains(&format!("FUNCTION {base}")) && !sql.contains(&format!("FUNCTION {base}(")) {
                names.insert(base.to_string());
            }
        }
    }
    Ok(names.into_iter().collect())
}

async fn finished(http: &reqwest::Client, base: &str, id: i64) -> Result<()> {
    let get = async || -> Result<Value> { Ok(http.get(format!("{base}/v1/runs/{id}")).send().await?.json().await?) };
    eventually_some(Duration::from_secs(60), async || Ok(format!("run {id} did not complete: {}", get().await?)), async || {
        Ok((get().await?["status"] == "completed").then_some(()))
    })
    .await
}

both! {
    async fn the_metrics_page_has_histograms_of_waits_batches_and_effects_and_queued_runs_by_key(db) {
        leasehold::effects::http::install_tls();
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let args = ServeArgs::new(db.url(), dir.path(), "host-m".into())?;
        // The page's gauges are cached for 10 s from the first scrape: the
        // one scrape below is after every submit.
        let host = ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let base = host.base.clone();
        let scrape = async || -> Result<String> { Ok(http.get(format!("{base}/metrics")).send().await?.text().await?) };

        // A paused key's runs stay queued: the gauge by key shows them, its
        // label escaped.
        let key = r#"tenant "q" \ 1"#;
        let resp = http.put(format!("{base}/v1/limits/{}", urlencoding(key))).json(&json!({ "paused": true })).send().await?;
        ensure!(resp.status() == 200, "pausing the key: {}", resp.text().await?);
        for _ in 0..3 {
            let resp = http.post(format!("{base}/v1/runs")).json(&json!({ "plugin": "testkit", "input": { "steps": 1 }, "concurrency_key": key })).send().await?;
            ensure!(resp.status().is_success(), "{}", resp.text().await?);
        }
        // A run of two kv.puts, run to its end.
        let run: Value = http.post(format!("{base}/v1/runs")).json(&json!({ "plugin": "testkit", "input": { "steps": 2 } })).send().await?.json().await?;
        let id = run["id"].as_i64().with_context(|| format!("no id in {run}"))?;
        finished(&http, &base, id).await?;
        let after = scrape().await?;

        ensure!(value(&after, "leasehold_submit_to_start_seconds_count") == 1.0, "one run started:\n{after}");
        ensure!(value(&after, "leasehold_claim_batch_size_count") >= 1.0, "claim batch size:\n{after}");
        ensure!(value(&after, "leasehold_claim_batch_size_sum") == 1.0, "one run claimed:\n{after}");
        ensure!(value(&after, r#"leasehold_effect_seconds_count{effect="kv.put"}"#) == 2.0, "two kv.puts timed:\n{after}");
        ensure!(value(&after, r#"leasehold_effect_seconds_bucket{effect="kv.put",le="+Inf"}"#) == 2.0, "{after}");
        ensure!(after.contains("# TYPE leasehold_local_queue_wait_seconds histogram"), "{after}");
        ensure!(value(&after, r#"leasehold_queued_runs_by_key{key="tenant \"q\" \\ 1"}"#) == 3.0, "queued by key:\n{after}");
        if db.backend == leasehold::Backend::Postgres {
            // Closes are group-committed on PostgreSQL (`store::closes`).
            ensure!(value(&after, "leasehold_close_batch_size_sum") >= 1.0, "close batch size:\n{after}");
        }
        // Every metric the docs name is on the page.
        let missing: Vec<String> = documented_metrics()?
            .into_iter()
            .filter(|name| !after.lines().any(|l| l.strip_prefix(name.as_str()).is_some_and(|r| r.starts_with([' ', '{', '_']))))
            .collect();
        ensure!(missing.is_empty(), "documented but not on /metrics: {missing:?}\n{after}");
        Ok(())
    }
}

fn urlencoding(s: &str) -> String {
    s.bytes().map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") }).collect()
}
