//! The dashboard in a real browser: Debian's Chromium driven by
//! playwright-core (`tests/browser/dashboard.mjs`), against the API served
//! in process, on both backends. The script submits a run through the page
//! and watches its stream arrive, delivers input through the form, cancels
//! a run (and sees a refusal for a finished one), watches a killed worker's
//! deltas struck through and removed after a takeover, and screenshots
//! every page into `target/dashboard/<backend>/`.
//!
//! The script and this test take turns: it prints `SYNC <name> <json>` and
//! waits for a line on stdin while this side runs the workers.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use leasehold::api::ApiConfig;
use leasehold::plugins::PluginSettings;
use leasehold::store::{NewRun, RunStatus};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::fake_model::{FakeModel, worker};
use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

const TOKEN: &str = "dashboard-test-token";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}


async fn submit(db: &TestDb, plugin: &str, input: Value) -> Result<i64> {
    let digest = db.store.plugin_digest(plugin).await?.context("plugin not registered")?;
    let new = NewRun { plugin_digest: digest, ..NewRun::new(plugin, input.to_string()) };
    Ok(db.store.create_run(&new).await?.0.id)
}

/// What the browser test needs, or why it cannot run.
fn browser() -> Result<(PathBuf, PathBuf)> {
    let chromium = std::env::var_os("CHROMIUM").map(PathBuf::from).unwrap_or_else(|| "/usr/bin/chromium".into());
    ensure!(chromium.exists(), "{} not found: run scripts/toolchains (it installs Debian's chromium)", chromium.display());
    let script = root().join("tests/browser/dashboard.mjs");
    let modules = root().join("tests/browser/node_modules/playwright-core");
    ensure!(modules.exists(), "{} not found: run scripts/toolchains (npm ci in tests/browser)", modules.display());
    Ok((chromium, script))
}

both! {
    async fn the_dashboard_submits_streams_delivers_input_cancels_and_shows_a_retract_in_a_browser(db) {
        let (chromium, script) = browser()?;
        // The crash run's first answer stops after two chunks; the second
        // worker's is whole.
        let answers: crate::fake_model::Script = Arc::new(|n, _| {
            let words: &[&str] = if n == 0 { &["dead ", "half ", "answer"] } else { &["the ", "whole ", "answer"] };
            words.iter().map(|w| w.to_string()).collect()
        });
        let (model, tool) = (FakeModel::start_holding(answers, 2).await?, Sink::start().await?);
        let rt = plugins::runtime()?;
        let tk = PluginSettings { http_allow: vec![], ..PluginSettings::default() };
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, tk).await?;
        let agent = PluginSettings { http_allow: vec![tool.allow()], model: leasehold::store::ModelGrant::any(), ..PluginSettings::default() };
        leasehold::plugins::register(&db.store, &rt, "agent-rust", plugins::example_plugin("agent-rust")?, agent).await?;

        // A worker streams half an answer and holds its lease.
        model.hold(true);
        let crash = submit(db, "agent-rust", json!({ "prompt": "go", "tool_url": tool.url })).await?;
        let a = worker(db, &rt, "host-a", &model);
        let dying = tokio::spawn(async move { a.run_once().await });
        crate::harness::eventually("host-a never streamed", async || {
            if db.store.get_run(crash).await?.emit_pos >= 2 {
                return Ok(true);
            }
            ensure!(!dying.is_finished(), "host-a never streamed: its segment ended");
            Ok(false)
        })
        .await?;
        // A run waiting for input, a finished one, and one asleep for a
        // minute (queued, not claimable: the drains below leave it be).
        let w = worker(db, &rt, "host-w", &model);
        let wait = submit(db, "testkit", json!({ "mode": "wait" })).await?;
        let done = submit(db, "testkit", json!({ "steps": 1, "prefix": "d" })).await?;
        let asleep = submit(db, "testkit", json!({ "mode": "sleep", "ms": 60_000 })).await?;
        // A run whose key is paused, and a rate limit a provider's
        // Retry-After holds: the Queues page and the run page show both.
        db.store.set_limit("tenant-a", Some(2), true).await?;
        let digest = db.store.plugin_digest("testkit").await?.context("testkit")?;
        let keyed = NewRun { plugin_digest: digest, concurrency_key: Some("tenant-a".into()), ..NewRun::new("testkit", json!({ "steps": 1 }).to_string()) };
        let keyed = db.store.create_run(&keyed).await?.0.id;
        db.store.set_rate("http:api.example.com:443", Some(60), None).await?;
        db.store.hold("http:api.example.com:443", Duration::from_secs(600)).await?;
        // A parent waiting for two children that wait for input.
        let fanout = PluginSettings { spawn_allow: vec!["testkit".into()], ..PluginSettings::default() };
        leasehold::plugins::register(&db.store, &rt, "fanout", plugins::rust_plugin("fanout")?, fanout).await?;
        let digest = db.store.plugin_digest("fanout").await?.context("fanout")?;
        let tree = NewRun { plugin_digest: digest, budget_tokens: Some(1_000_000), ..NewRun::new("fanout", json!({ "n": 2, "input": { "mode": "wait" } }).to_string()) };
        let tree = db.store.create_run(&tree).await?.0.id;
        w.drain().await?;
        let filter = leasehold::store::RunFilter { parent: Some(tree), ..Default::default() };
        let tree_kids: Vec<i64> = db.store.runs_page(&filter, None, 10, i64::MAX).await?.0.iter().map(|r| r.id).collect();
        ensure!(tree_kids.len() == 2, "the tree has children {tree_kids:?}");
        ensure!(db.store.get_run(tree).await?.waiting_for.as_deref() == Some("children"), "the parent is not waiting for its children");
        ensure!(db.store.get_run(keyed).await?.status == RunStatus::Queued, "a paused key's run ran");
        ensure!(db.store.get_run(wait).await?.status == RunStatus::WaitingInput);
        ensure!(db.store.get_run(done).await?.status == RunStatus::Completed);
        ensure!(db.store.get_run(asleep).await?.status == RunStatus::Queued);

        // The charts' rollup: the finished run ended two minutes ago (so its
        // minute is counted), and the first claims' waits are added.
        sqlx::query("UPDATE runs SET finished_at = finished_at - 130000 WHERE id = $1").bind(done).execute(db.store.pool()).await?;
        let rolled = leasehold::maintenance::rollup::tick(&db.store).await?;
        ensure!(rolled.waits > 0 && rolled.counted == 60, "{rolled:?}");
        // A schedule with two past nights backfilled under `skip`: the first
        // started a run, the second was skipped (that run was open).
        let mut nightly = leasehold::store::Schedule {
            id: "nightly".into(), plugin: "testkit".into(), input: json!({ "steps": 1 }).to_string(), cron: Some("30 2 * * *".into()),
            interval_ms: None, time_zone: "Europe/Berlin".into(), overlap: leasehold::store::Overlap::Skip, catchup_window_ms: 3_600_000,
            jitter_ms: 0, priority: 0, concurrency_key: None, max_attempts: 3, budget_tokens: None, budget_usd_nanos: None, paused: false,
            note: None, next_at: None, version: 0, created_at: 0, updated_at: 0,
        };
        let spec = leasehold::schedules::Spec::of(&nightly).map_err(anyhow::Error::msg)?;
        let now = db.store.now_ms().await?;
        nightly.next_at = spec.next_after(now);
        let nightly = db.store.create_schedule(&nightly).await?;
        let nights = spec.upcoming(now - 3 * 86_400_000, 2);
        let filled = db.store.backfill(&nightly, &nights, leasehold::store::Overlap::Skip).await?;
        let schedule_run = filled[0].run_id.context("the first night started a run")?;
        ensure!(filled[1].reason.as_deref().is_some_and(|r| r.starts_with("overlap")), "{filled:?}");

        let config = ApiConfig { token: Some(TOKEN.into()), stream_poll: Duration::from_millis(50), ..ApiConfig::default() };
        let server = crate::harness::Server::on(db, rt.clone(), config).await?;
        let base = server.base.clone();

        let shots = root().join("target/dashboard").join(db.backend.name());
        let _ = std::fs::remove_dir_all(&shots); // no screenshot of an earlier run stays
        std::fs::create_dir_all(&shots)?;
        let scenario = json!({
            "wait_run": wait, "cancel_run": asleep, "done_run": done, "crash_run": crash, "keyed_run": keyed,
            "tree_run": tree, "tree_child": tree_kids[0], "schedule_run": schedule_run,
            "submit": { "plugin": "testkit", "input": { "mode": "script", "ops": [
                { "op": "emit", "text": "hello " }, { "op": "wasi-sleep", "ms": 1500 }, { "op": "emit", "text": "world" },
            ] } },
        });
        let mut child = tokio::process::Command::new("node")
            .arg(&script)
            .env("LEASEHOLD_URL", &base)
            .env("LEASEHOLD_TOKEN", TOKEN)
            .env("LEASEHOLD_SCREENSHOTS", &shots)
            .env("LEASEHOLD_SCENARIO", scenario.to_string())
            .env("CHROMIUM", &chromium)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting node (install Node.js)")?;
        let mut stdin = child.stdin.take().context("stdin")?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut dying = Some(dying);
        let mut background = Vec::new();
        let mut seen = Vec::new();
        let steps = async {
            while let Some(line) = lines.next_line().await? {
                let Some(rest) = line.strip_prefix("SYNC ") else { continue };
                let (name, _) = rest.split_once(' ').unwrap_or((rest, "{}"));
                seen.push(name.to_string());
                match name {
                    "submitted" | "input" => {
                        if name == "input" {
                            // The page's POST may still be on its way.
                            crate::harness::eventually("the page's input never arrived", async || Ok(db.store.get_run(wait).await?.pending_input.is_some())).await?;
                        }
                        // The page watches while the worker runs.
                        stdin.write_all(b"go\n").await?;
                        let w = worker(db, &rt, "host-w", &model);
                        background.push(tokio::spawn(async move { w.drain().await }));
                        continue;
                    }
                    "crash" => {
                        // host-a dies mid-answer; host-b takes the run over
                        // once its lease has run out.
                        if let Some(task) = dying.take() {
                            task.abort();
                            let _ = task.await;
                        }
                        model.hold(false);
                        db.backdate_lease(crash, 60_000).await?;
                        stdin.write_all(b"go\n").await?;
                        let b = worker(db, &rt, "host-b", &model);
                        background.push(tokio::spawn(async move { b.drain().await }));
                        continue;
                    }
                    "tree" => {
                        // The children get their input and end; the parent
                        // is woken and completes, while the page watches.
                        for kid in &tree_kids {
                            db.store.deliver_input(*kid, "leaf").await?;
                        }
                        stdin.write_all(b"go\n").await?;
                        let w = worker(db, &rt, "host-w", &model);
                        background.push(tokio::spawn(async move { w.drain().await }));
                        continue;
                    }
                    "done" => {
                        stdin.write_all(b"go\n").await?;
                        break;
                    }
                    other => bail!("unknown step {other:?} from the browser script"),
                }
            }
            anyhow::Ok(())
        };
        let result = tokio::time::timeout(Duration::from_secs(180), steps).await;
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        server.stop().await;
        for task in background {
            task.await??;
        }
        result.context("the browser script took over 180 s")??;
        let status = status.context("the browser script did not exit")??;
        ensure!(status.success(), "the browser script failed ({status}) after steps {seen:?}; see its output above and {}", shots.display());
        ensure!(seen == ["submitted", "input", "crash", "tree", "done"], "steps {seen:?}");
        for page in ["runs", "run", "retract", "plugins", "hosts", "tree"] {
            let png = shots.join(format!("{page}.png"));
            ensure!(std::fs::metadata(&png).map(|m| m.len() > 1000).unwrap_or(false), "no screenshot {}", png.display());
        }
        ensure!(db.store.get_run(asleep).await?.status == RunStatus::Cancelled);
        ensure!(db.store.get_run(wait).await?.output.as_deref() == Some("hello operator"));
        let tree = db.store.get_run(tree).await?;
        ensure!(tree.output.as_deref() == Some(r#"["hello leaf","hello leaf"]"#), "the tree's output {:?}", tree.output);
        Ok(())
    }
}
