//! Several `leasehold serve` processes on one database: every run completes
//! exactly once, and when one host is SIGKILLed mid-way the others resume
//! its runs with the next fence, without repeating any effect. Effects are
//! counted at a counting HTTP sink. The run count is `LEASEHOLD_HOSTS_RUNS`
//! (default 400; the long mode: 1000 or more).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::json;

use crate::harness::{TestDb, both, eventually_some};
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc};
use crate::sink::Sink;

async fn count(db: &TestDb, status: &str) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = $1")
        .bind(status)
        .fetch_one(db.store.pool())
        .await?)
}

both! {
    async fn three_hosts_complete_every_run_once_and_survive_a_sigkill(db) {
        let runs: i64 = std::env::var("LEASEHOLD_HOSTS_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(400);
        const STEPS: i64 = 3;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        // 20 ms an effect: slower than the submits, so a queue builds and
        // the kill below lands mid-way, with runs left for the others.
        let sink = Sink::start_with_delay(Duration::from_millis(20)).await?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let mut hosts = Vec::new();
        for n in 0..3 {
            let mut args = ServeArgs::new(db.url(), dir.path(), format!("host-{n}"))?;
            args.http_allow = vec![sink.allow()];
            hosts.push(Some(ServeProc::spawn(&args)?));
        }
        for h in hosts.iter().flatten() {
            h.wait_healthy(&http, Duration::from_secs(60)).await?;
        }
        // Submitted through all three APIs, a batch each (at most 1,000
        // runs a request), so the whole backlog is queued before much of it
        // is done. (Submitted one request at a time, under a loaded
        // machine's slow commits, the hosts kept pace with the submits and
        // had finished nearly every run by the time the kill below looked
        // for one that host-1 held.)
        let started = Instant::now();
        let mut batches: [Vec<serde_json::Value>; 3] = Default::default();
        for i in 0..runs {
            batches[(i % 3) as usize].push(json!({
                "plugin": "testkit", "input": { "mode": "http-steps", "steps": STEPS, "url": sink.url },
                "idempotency_key": format!("hosts-{i}"),
            }));
        }
        for (n, batch) in batches.iter().enumerate() {
            let base = &hosts[n].as_ref().unwrap().base;
            for chunk in batch.chunks(1000) {
                let r = http.post(format!("{base}/v1/runs:batch")).json(&json!({ "runs": chunk })).send().await?;
                ensure!(r.status() == 200, "batch submit: {}", r.status());
            }
        }
        // SIGKILL host 1 once a third of the runs are done.
        let a_third = async || Ok((count(db, "completed").await? >= runs / 3).then_some(()));
        let done = async || Ok(format!("too slow before the kill: {} of {runs} completed", count(db, "completed").await?));
        eventually_some(Duration::from_secs(300).saturating_sub(started.elapsed()), done, a_third).await?;
        // ...while it holds runs: the sink stops answering, so every
        // worker stays inside its run's effect, and host-1's workers take
        // runs from the queue and stay there too. (Killed at any moment,
        // it held none in both SQLite runs one day.)
        // Held for at most 10 s at a time, well inside the hosts' 30 s
        // request timeout (a request held past it would fail, not wait).
        let holding = async || -> Result<bool> {
            Ok(sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM runs WHERE lease_owner = 'host-1' AND status = 'running'")
                .fetch_one(db.store.pool())
                .await?
                > 0)
        };
        let mut round = 0;
        loop {
            sink.hold(true);
            let wanted_at = Instant::now();
            while !holding().await? && wanted_at.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if holding().await? {
                break;
            }
            sink.hold(false);
            round += 1;
            if round == 6 {
                let log = std::fs::read_to_string(dir.path().join("host-1.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                let done = count(db, "completed").await?;
                anyhow::bail!(
                    "host-1 held no run in 6 tries ({done} of {runs} completed); its log ends:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let killed_at = Instant::now();
        drop(hosts[1].take()); // SIGKILL, and wait for the process to end
        // Counted after the kill: a run counted before it could still be
        // finished by host-1 in between, and then need no resume.
        let held: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE lease_owner = 'host-1' AND status = 'running'")
            .fetch_one(db.store.pool()).await?;
        sink.hold(false);
        ensure!(held > 0, "host-1 held no run when it was killed");
        let stuck = async || {
            let stuck: Vec<(i64, String)> = sqlx::query_as("SELECT id, status FROM runs WHERE status <> 'completed' LIMIT 5")
                .fetch_all(db.store.pool()).await?;
            Ok(format!("not all runs completed: {stuck:?}"))
        };
        let within = Duration::from_secs(600).saturating_sub(started.elapsed());
        eventually_some(within, stuck, async || Ok((count(db, "completed").await? >= runs).then_some(()))).await?;
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
        ensure!(resumed >= held, "{held} runs were held by the killed host, {resumed} were resumed");
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

both! {
    async fn sigterm_suspends_a_running_segment_for_another_host_and_exits_zero(db) {
        // The HTTP client needs the process's TLS provider even when this
        // test runs alone.
        leasehold::effects::http::install_tls();
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let mut args = ServeArgs::new(db.url(), dir.path(), "host-term".into())?;
        args.extra = vec!["--shutdown-grace-ms=300".into()];
        let mut host = ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        // A guest that spins far longer than the grace period.
        let body = json!({ "plugin": "testkit", "input": { "mode": "spin-then-put", "spins": 1u64 << 40 } });
        let run: serde_json::Value = http.post(format!("{}/v1/runs", host.base)).json(&body).send().await?.json().await?;
        let id = run["id"].as_i64().unwrap();
        crate::harness::eventually("the run never started", async || Ok(count(db, "running").await? > 0)).await?;
        std::process::Command::new("kill").args(["-TERM", &host.pid().to_string()]).status()?;
        let exit = eventually_some(Duration::from_secs(30), async || Ok("serve did not exit within 30 s of SIGTERM".into()), async || Ok(host.child.try_wait()?)).await?;
        ensure!(exit.code() == Some(0), "serve exited with {exit:?}; log:\n{}", std::fs::read_to_string(&args.log)?);
        let (status, owner): (String, Option<String>) =
            sqlx::query_as("SELECT status, lease_owner FROM runs WHERE id = $1").bind(id).fetch_one(db.store.pool()).await?;
        ensure!(status == "waiting_takeover" && owner.is_none(), "after SIGTERM the run is {status}, owner {owner:?}");
        Ok(())
    }

    async fn logs_written_to_a_file_are_plain_text_without_colour_codes(db) {
        // An operator's log file or journal must not fill with terminal
        // escapes; colour is for a terminal only.
        leasehold::effects::http::install_tls();
        let dir = tempfile::tempdir()?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let mut args = ServeArgs::new(db.url(), dir.path(), "host-log".into())?;
        // Test hosts log at warn; a clock skew is warned of at start.
        args.extra = vec!["--test-clock-skew-ms=1".into()];
        let host = ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        drop(host);
        let log = std::fs::read_to_string(&args.log)?;
        ensure!(log.contains("WARN"), "no log lines: {log:?}");
        ensure!(!log.contains('\x1b'), "colour codes in a log file: {:?}", &log[..log.len().min(300)]);
        Ok(())
    }
}

both! {
    async fn a_host_killed_with_runs_queued_costs_them_no_attempt(db) {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        // One worker and a queue of up to 8. A 6 s lease: a queued run is
        // given back after 2 s unless a worker starts it.
        let mut args = ServeArgs::new(db.url(), dir.path(), "queueing".into())?;
        args.workers = 1;
        args.lease_ttl_ms = 6_000;
        args.extra = vec!["--prefetch=8".into()];
        let host = ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        // The worker is held by a 20 s turn; runs of one attempt wait behind it.
        let submit = async |input: serde_json::Value, max_attempts: i64| -> Result<i64> {
            let body = json!({ "plugin": "testkit", "input": input, "max_attempts": max_attempts });
            let r: serde_json::Value = http.post(format!("{}/v1/runs", host.base)).json(&body).send().await?.json().await?;
            r["id"].as_i64().ok_or_else(|| anyhow::anyhow!("submit: {r}"))
        };
        let long = submit(json!({ "mode": "script", "ops": [{ "op": "wasi-sleep", "ms": 20_000 }] }), 3).await?;
        crate::harness::eventually("the host never started the long turn", async || Ok(db.store.get_run(long).await?.lease_owner.as_deref() == Some("queueing"))).await?;
        let mut short = Vec::new();
        for _ in 0..6 {
            short.push(submit(json!({ "steps": 1 }), 1).await?);
        }
        let held = async || -> Result<i64> {
            Ok(sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM runs WHERE lease_owner = 'queueing' AND status = 'running' AND id <> $1")
                .bind(long)
                .fetch_one(db.store.pool())
                .await?)
        };
        crate::harness::eventually("the host never queued the short runs", async || Ok(held().await? >= 3)).await?;
        drop(host); // SIGKILL
        let mut args = ServeArgs::new(db.url(), dir.path(), "other".into())?;
        args.lease_ttl_ms = 6_000;
        let other = ServeProc::spawn(&args)?;
        other.wait_healthy(&http, Duration::from_secs(60)).await?;
        for id in &short {
            let unfinished = async || Ok(format!("run {id} did not finish: {:?}", db.store.get_run(*id).await?));
            let run = eventually_some(Duration::from_secs(60), unfinished, async || {
                let run = db.store.get_run(*id).await?;
                Ok(run.status.is_terminal().then_some(run))
            })
            .await?;
            ensure!(run.status == leasehold::store::RunStatus::Completed, "a queued run of one attempt did not run: {run:?}");
        }
        drop(other);
        Ok(())
    }
}

both! {
    async fn a_host_streams_a_run_that_another_host_runs(db) {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let a = ServeProc::spawn(&ServeArgs::new(db.url(), dir.path(), "host-a".into())?)?;
        a.wait_healthy(&http, Duration::from_secs(60)).await?;
        // Three emits half a second apart: the stream is read while A runs.
        let ops = json!([
            { "op": "emit", "text": "a " }, { "op": "wasi-sleep", "ms": 600 },
            { "op": "emit", "text": "b " }, { "op": "wasi-sleep", "ms": 600 },
            { "op": "emit", "text": "c" },
        ]);
        let run: serde_json::Value = http
            .post(format!("{}/v1/runs", a.base))
            .json(&json!({ "plugin": "testkit", "input": { "mode": "script", "ops": ops } }))
            .send()
            .await?
            .json()
            .await?;
        let (id, thread) = (run["id"].as_i64().unwrap_or_default(), run["thread_id"].as_str().unwrap_or_default().to_string());
        crate::harness::eventually("host A never took the run", async || Ok(db.store.get_run(id).await?.lease_owner.as_deref() == Some("host-a"))).await?;
        let b = ServeProc::spawn(&ServeArgs::new(db.url(), dir.path(), "host-b".into())?)?;
        b.wait_healthy(&http, Duration::from_secs(60)).await?;
        ensure!(!db.store.get_run(id).await?.status.is_terminal(), "the run ended before host B streamed it");
        let resp = http.get(format!("{}/v1/threads/{thread}/events", b.base)).header("Accept", "text/event-stream").send().await?;
        ensure!(resp.status() == 200, "{}", resp.status());
        let events = crate::harness::sse::read(resp, |e| e["kind"] == "message").await?;
        let kinds: Vec<&str> = events.iter().map(|e| e.data["kind"].as_str().unwrap_or_default()).collect();
        let text: String = events.iter().filter(|e| e.data["kind"] == "delta").map(|e| e.data["payload"]["delta"].as_str().unwrap_or_default()).collect();
        ensure!(text == "a b c", "host B streamed {text:?} ({kinds:?})");
        ensure!(kinds.first() == Some(&"submitted"), "{kinds:?}");
        let done = db.store.get_run(id).await?;
        ensure!(done.status == leasehold::store::RunStatus::Completed && done.fence == 1, "host A did not run it alone: {done:?}");
        drop((a, b));
        Ok(())
    }
}
