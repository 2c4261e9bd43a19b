//! Several `leasehold serve` processes on one database: every run completes
//! exactly once, and when one host is SIGKILLed mid-way the others resume
//! its runs with the next fence, without repeating any effect. Effects are
//! counted at a counting HTTP sink. The run count is `LEASEHOLD_HOSTS_RUNS`
//! (default 1000).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;

use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

struct Host {
    child: Child,
    base: String,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start_host(db_url: &str, plugins_dir: &std::path::Path, n: usize) -> Result<Host> {
    let port = free_port()?;
    let log = std::fs::File::create(plugins_dir.join(format!("host-{n}.log")))?;
    let child = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["serve", "--database-url", db_url, "--listen", &format!("127.0.0.1:{port}")])
        .arg("--plugins-dir")
        .arg(plugins_dir)
        .args(["--http-allow", "127.0.0.1", "--workers", "4", "--lease-ttl-ms", "3000"])
        .args(["--reaper-interval-ms", "500", "--poll-ms", "200", "--owner", &format!("host-{n}")])
        .arg("--cache-dir")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"))
        .env("LEASEHOLD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting leasehold serve")?;
    Ok(Host { child, base: format!("http://127.0.0.1:{port}") })
}

async fn wait_healthy(http: &reqwest::Client, host: &Host) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = http.get(format!("{}/healthz", host.base)).send().await
            && r.status() == 200
        {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{} never became healthy", host.base);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn count(db: &TestDb, status: &str) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = $1")
        .bind(status)
        .fetch_one(db.store.pool())
        .await?)
}

both! {
    async fn three_hosts_complete_every_run_once_and_survive_a_sigkill(db) {
        let runs: i64 = std::env::var("LEASEHOLD_HOSTS_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
        const STEPS: i64 = 3;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let sink = Sink::start().await?;
        leasehold::effects::http::install_tls();
        let http = reqwest::Client::new();
        let mut hosts = Vec::new();
        for n in 0..3 {
            hosts.push(Some(start_host(db.url(), dir.path(), n)?));
        }
        for h in hosts.iter().flatten() {
            wait_healthy(&http, h).await?;
        }
        // Submitted through all three APIs in turn.
        let started = Instant::now();
        for i in 0..runs {
            let base = &hosts[(i % 3) as usize].as_ref().unwrap().base;
            let body = json!({ "plugin": "testkit", "input": { "mode": "http-steps", "steps": STEPS, "url": sink.url } });
            let r = http.post(format!("{base}/v1/runs")).json(&body).send().await?;
            ensure!(r.status() == 201, "submit: {}", r.status());
        }
        // SIGKILL host 1 once a third of the runs are done.
        while count(db, "completed").await? < runs / 3 {
            ensure!(started.elapsed() < Duration::from_secs(300), "too slow before the kill");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let held: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE lease_owner = 'host-1' AND status = 'running'")
            .fetch_one(db.store.pool()).await?;
        let killed_at = Instant::now();
        drop(hosts[1].take()); // SIGKILL
        while count(db, "completed").await? < runs {
            let stuck: Vec<(i64, String)> = sqlx::query_as("SELECT id, status FROM runs WHERE status <> 'completed' LIMIT 5")
                .fetch_all(db.store.pool()).await?;
            ensure!(started.elapsed() < Duration::from_secs(600), "not all runs completed: {stuck:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let elapsed = started.elapsed();

        // Every effect was applied under exactly one key, and a key repeats
        // only for a request in flight on the killed host (re-issued with
        // the same key, which the remote deduplicates).
        let hits = sink.hits();
        let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
        for h in &hits {
            by_key.entry(h.key.clone()).or_default().push(h.fence.clone());
        }
        ensure!(by_key.len() as i64 == runs * STEPS, "{} distinct keys for {} effects", by_key.len(), runs * STEPS);
        let repeated: Vec<_> = by_key.iter().filter(|(_, f)| f.len() > 1).collect();
        // At most one request in flight per worker of the killed host.
        ensure!(repeated.len() <= 4, "{} keys repeated; the killed host had 4 workers", repeated.len());
        ensure!(repeated.iter().all(|(_, f)| f.windows(2).all(|w| w[0] < w[1])), "a key repeated under one fence: {repeated:?}");
        let committed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE state = 'committed'")
            .fetch_one(db.store.pool()).await?;
        ensure!(committed == runs * STEPS, "{committed} committed ledger rows");
        let resumed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE fence > 1").fetch_one(db.store.pool()).await?;
        ensure!(held == 0 || resumed > 0, "{held} runs were held by the killed host, none was resumed");
        let owners: Vec<String> = sqlx::query_scalar("SELECT DISTINCT lease_owner FROM runs WHERE lease_owner IS NOT NULL")
            .fetch_all(db.store.pool()).await?;
        ensure!(owners.is_empty(), "leases left behind: {owners:?}");
        eprintln!(
            "{}: {runs} runs on 3 hosts in {elapsed:?}; host-1 SIGKILLed holding {held}; {resumed} resumed with a later fence; \
             {} sink hits, {} keys re-sent after the kill; recovered {:?} after the kill",
            db.backend.name(), hits.len(), repeated.len(), killed_at.elapsed()
        );
        Ok(())
    }
}
