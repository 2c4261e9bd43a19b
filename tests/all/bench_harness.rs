//! `leasehold bench harness-adapter`, driven as the benchmark harness
//! drives it (benches/harness/): settings in the environment, `ENQUEUE n`
//! lines on stdin, JSONL on stdout, SIGKILL and a restart on the same
//! database, SIGTERM at the end.

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use crate::harness::{both, eventually_some};
use crate::plugins;

/// One adapter process and the JSON lines it printed.
struct Adapter {
    child: Child,
    lines: mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl Adapter {
    fn start(db_url: &str, plugin_file: &std::path::Path, log: &std::path::Path) -> Result<Adapter> {
        let cache = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache");
        let mut child = Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(["bench", "harness-adapter", "--plugin-file"])
            .arg(plugin_file)
            .env("DATABASE_URL", db_url)
            .env("SCENARIO", "long_horizon")
            .env("PRODUCER_MODE", "fixed")
            .env("PRODUCER_RATE", "400")
            .env("PRODUCER_PACING", "harness")
            .env("WORKER_COUNT", "4")
            // Long enough that a SIGKILL finds runs in flight.
            .env("JOB_WORK_MS", "150")
            .env("SAMPLE_EVERY_S", "1")
            .env("BENCH_INSTANCE_ID", "0")
            // A killed host's runs come back within seconds.
            .env("LEASEHOLD_LEASE_TTL_MS", "2000")
            .env("LEASEHOLD_REAPER_INTERVAL_MS", "200")
            .env("LEASEHOLD_CACHE_DIR", cache)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log)?)
            .spawn()
            .context("starting leasehold bench harness-adapter")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                // Anything else on stdout is a defect the test reports.
                let v = serde_json::from_str(&line).unwrap_or_else(|_| serde_json::json!({ "not_json": line }));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        Ok(Adapter { child, lines, seen: Vec::new() })
    }

    fn enqueue(&mut self, n: usize) -> Result<()> {
        let stdin = self.child.stdin.as_mut().context("no stdin")?;
        writeln!(stdin, "ENQUEUE {n}")?;
        stdin.flush()?;
        Ok(())
    }

    /// Takes the lines printed so far.
    fn drain(&mut self) -> Result<()> {
        while let Ok(v) = self.lines.try_recv() {
            ensure!(v.get("not_json").is_none(), "the adapter printed a line that is not JSON: {v}");
            self.seen.push(v);
        }
        Ok(())
    }

    /// The sum of `metric × window_s` over the samples so far: runs, for a rate.
    fn total(&self, metric: &str) -> f64 {
        self.samples(metric).map(|s| s["value"].as_f64().unwrap_or(0.0) * s["window_s"].as_f64().unwrap_or(0.0)).sum()
    }

    fn samples<'a>(&'a self, metric: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.seen.iter().filter(move |v| v["kind"] == "adapter" && v["metric"] == metric)
    }
}

impl Drop for Adapter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn descriptor(a: &mut Adapter) -> Result<Value> {
    eventually_some(
        Duration::from_secs(60),
        async || Ok("no descriptor within 60 s (the adapter's log says why)".to_string()),
        async || {
            a.drain()?;
            Ok(a.seen.iter().find(|v| v["kind"] == "descriptor").cloned())
        },
    )
    .await
}

async fn completed(db: &crate::harness::TestDb) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = 'completed'").fetch_one(db.store.pool()).await?)
}

both! {
    async fn the_harness_adapter_reports_the_metrics_the_harness_reads_and_a_sigkilled_replica_loses_no_run(db) {
        let dir = tempfile::tempdir()?;
        let plugin_file = dir.path().join("testkit.wasm");
        std::fs::write(&plugin_file, plugins::rust_plugin("testkit")?)?;
        let log = dir.path().join("adapter.log");
        let mut a = Adapter::start(db.url(), &plugin_file, &log)?;
        let d = descriptor(&mut a).await?;
        // The harness aborts a run whose descriptor lists fewer tables than
        // the adapter's manifest.
        let manifest: Value = serde_json::from_str(include_str!("../../benches/harness/adapter.json"))?;
        let tables = d["event_tables"].as_array().context("no event_tables")?;
        for t in manifest["event_tables"].as_array().context("manifest")? {
            ensure!(tables.contains(t), "the descriptor lacks {t}: {d}");
        }
        ensure!(d["system"] == manifest["system"] && d["extensions"].is_array(), "{d}");

        // More than one batch submit (128), and the pickup percentiles.
        a.enqueue(150)?;
        eventually_some(
            Duration::from_secs(60),
            async || Ok(format!("runs completed: {:?} of 150", completed(db).await)),
            async || {
                a.drain()?;
                Ok((a.total("completion_rate").round() as i64 == 150).then_some(()))
            },
        )
        .await?;
        ensure!(a.total("enqueue_rate").round() as i64 == 150, "enqueued {}", a.total("enqueue_rate"));
        let p = |m: &str| a.samples(m).last().and_then(|s| s["value"].as_f64());
        let (p50, p95, p99) = (p("claim_p50_ms"), p("claim_p95_ms"), p("claim_p99_ms"));
        ensure!(matches!((p50, p95, p99), (Some(a), Some(b), Some(c)) if a <= b && b <= c), "pickup percentiles {p50:?} {p95:?} {p99:?}");
        ensure!(a.samples("claim_p99_ms").all(|s| s["window_s"] == 30.0), "the pickup window is 30 s");
        ensure!(a.samples("queue_depth").count() > 0 && a.samples("queue_depth").all(|s| s["window_s"] == 0.0), "no queue depth");

        // A SIGKILL with runs in flight (4 workers, 150 ms each), then a
        // replica started again on the same database: every run completes
        // once, counted by whichever replica finished it.
        a.enqueue(60)?;
        let before = eventually_some(
            Duration::from_secs(30),
            async || Ok("no run of the second batch started".to_string()),
            async || {
                a.drain()?;
                let running: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = 'running'").fetch_one(db.store.pool()).await?;
                Ok((running > 0).then(|| a.total("completion_rate")))
            },
        )
        .await?;
        a.child.kill()?;
        a.child.wait()?;
        a.drain()?;
        // What the killed replica finished; its last partial tick is never
        // printed (as with any adapter the harness SIGKILLs).
        let at_kill = completed(db).await?;
        let (reported, enqueued) = (a.total("completion_rate").round() as i64, a.total("enqueue_rate").round() as i64);
        ensure!(reported >= before.round() as i64 && reported <= at_kill && enqueued <= 210, "reported {reported} of {at_kill}, enqueued {enqueued}");
        let mut b = Adapter::start(db.url(), &plugin_file, &log)?;
        descriptor(&mut b).await?;
        eventually_some(
            Duration::from_secs(60),
            async || Ok(format!("runs completed: {:?} of 210", completed(db).await)),
            async || Ok((completed(db).await? == 210).then_some(())),
        )
        .await?;
        // Until the new replica's samples have counted what it completed
        // (its tick after the last close); a count past it would show here.
        eventually_some(
            Duration::from_secs(10),
            async || Ok(format!("the restarted replica counted fewer than the {} runs left at the kill", 210 - at_kill)),
            async || {
                b.drain()?;
                Ok((b.total("completion_rate").round() as i64 >= 210 - at_kill).then_some(()))
            },
        )
        .await?;
        let all: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(db.store.pool()).await?;
        // Each run left at the kill is completed once, by the new replica,
        // and counted once there.
        let second = b.total("completion_rate").round() as i64;
        ensure!(all == 210 && second == 210 - at_kill, "runs {all}: {at_kill} completed at the kill, {second} counted after");
        // The runs the killed replica had claimed (its local queue) but not
        // started count their pickup when the new one starts them: from
        // their submit, the killed host's lease included.
        let p99 = b.samples("claim_p99_ms").filter_map(|s| s["value"].as_f64()).fold(0.0, f64::max);
        ensure!(p99 >= 1000.0, "the restarted replica's pickup p99 is {p99} ms");

        // SIGTERM: a clean exit within the harness's 5 s.
        let pid = rustix::process::Pid::from_raw(b.child.id() as i32).context("pid")?;
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
        let exited = eventually_some(
            Duration::from_secs(5),
            async || Ok("the adapter did not exit within 5 s of SIGTERM".to_string()),
            async || Ok(b.child.try_wait()?),
        )
        .await?;
        ensure!(exited.success(), "exit {exited}");
        Ok(())
    }
}

#[tokio::test]
async fn the_harness_adapter_names_a_setting_it_cannot_read() -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["bench", "harness-adapter"])
        .env("DATABASE_URL", "sqlite:///nonexistent/never.db")
        .env("WORKER_COUNT", "eight")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("WORKER_COUNT=\"eight\""), "{}: {err}", out.status);
    Ok(())
}
