//! Offline replay (`leasehold replay`, `runtime::offline`): a component is
//! checked against a run's recorded ledger and performs nothing; the first
//! call that differs is reported with both calls.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::runtime::offline::{self, Outcome, Recording};
use leasehold::runtime::{Limits, Plugin, Runtime};
use leasehold::store::{NewRun, RunStatus, Store};
use serde_json::json;

use crate::harness::{TestDb, both, eventually_some};
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc, TEST_TOKEN};
use crate::sink::Sink;

const BUDGET: Duration = Duration::from_secs(20);

fn worker() -> ExecutorConfig {
    crate::harness::worker("worker-a")
}

/// A runtime with the test plugin, allowed to reach `allow`.
fn setup(allow: Vec<String>) -> Result<(Arc<Runtime>, Arc<Plugin>)> {
    let rt = plugins::runtime()?;
    let plugin = rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, Limits { http_allow: allow, ..plugins::test_limits() })?;
    Ok((rt, plugin))
}

/// Submits a run of the test plugin and runs it to completion.
async fn run_to_end(db: &TestDb, rt: &Arc<Runtime>, input: serde_json::Value) -> Result<i64> {
    let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
    let exec = Executor::new(db.store.clone(), rt.clone(), worker());
    ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Completed)));
    Ok(id)
}

async fn recording(store: &Store, id: i64) -> Result<Recording> {
    Ok(Recording::of(store.get_run(id).await?, store.effects(id).await?))
}

both! {
    async fn a_parent_replays_its_spawns_and_its_wait_from_the_ledger_and_spawns_nothing(db) {
        let rt = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, Default::default()).await?;
        let grant = leasehold::plugins::PluginSettings { spawn_allow: vec!["testkit".into()], ..Default::default() };
        let fanout = leasehold::plugins::register(&db.store, &rt, "fanout", plugins::rust_plugin("fanout")?, grant).await?;
        let input = json!({ "n": 2, "input": { "steps": 1 }, "timeout_ms": 60_000 });
        let id = db.store.create_run(&NewRun::new("fanout", input.to_string())).await?.0.id;
        Executor::new(db.store.clone(), rt.clone(), worker()).drain().await?;
        let runs = || async { anyhow::Ok(db.store.list_runs(None, None, None, 100).await?.len()) };
        let (run, before) = (db.store.get_run(id).await?, runs().await?);
        ensure!(run.status == RunStatus::Completed && before == 3, "{:?} with {before} runs", run.status);
        let report = offline::replay(&rt, &fanout, recording(&db.store, id).await?, BUDGET).await?;
        match &report.outcome {
            Outcome::Returned { output } => ensure!(output == r#"["did 1 steps","did 1 steps"]"#, "{report:?}"),
            _ => bail!("not a clean replay: {report:?}"),
        }
        // Two spawns, the wait's deadline and the wait itself.
        ensure!(report.clean() && report.replayed_calls == 4, "{report:?}");
        ensure!(runs().await? == before, "replay made a run");
        Ok(())
    }

    async fn an_unchanged_component_replays_a_finished_run_clean_and_performs_nothing(db) {
        let sink = Sink::start().await?;
        let (rt, plugin) = setup(vec![sink.allow()])?;
        let id = run_to_end(db, &rt, json!({ "mode": "http-steps", "steps": 3, "url": sink.url })).await?;
        ensure!(sink.hits().len() == 3);
        let report = offline::replay(&rt, &plugin, recording(&db.store, id).await?, BUDGET).await?;
        match &report.outcome {
            Outcome::Returned { output } => ensure!(output == "did 3 http steps", "{report:?}"),
            _ => bail!("not a clean replay: {report:?}"),
        }
        ensure!(report.clean() && report.replayed_calls == 3 && report.recorded_calls == 3, "{report:?}");
        ensure!(report.new_emits.is_empty(), "every emit was recorded: {report:?}");
        ensure!(sink.hits().len() == 3, "replay made a request: {:?}", sink.hits());
        Ok(())
    }

    async fn replay_stops_at_the_first_call_with_no_outcome_and_never_reissues_it(db) {
        let sink = Sink::start().await?;
        let (rt, plugin) = setup(vec![sink.allow()])?;
        let id = run_to_end(db, &rt, json!({ "mode": "http-steps", "steps": 3, "url": sink.url })).await?;
        // As if the host had died before its third call was recorded...
        sqlx::query("DELETE FROM effects WHERE run_id = $1 AND seq = 2").bind(id).execute(db.store.pool()).await?;
        let report = offline::replay(&rt, &plugin, recording(&db.store, id).await?, BUDGET).await?;
        let Outcome::Frontier { next } = &report.outcome else { bail!("no frontier: {report:?}") };
        ensure!(next.seq == 2 && next.call.name == "http" && next.why == "not recorded", "{report:?}");
        ensure!(next.call.request.as_deref().is_some_and(|r| r.contains(r#""step":2"#)), "{report:?}");
        ensure!(report.clean() && report.replayed_calls == 2, "{report:?}");
        ensure!(report.stream == "step 0 step 1 step 2 ", "{report:?}");
        // ...and while its second was in flight: a live resume re-issues a
        // keyed call under its key; replay stops before it.
        sqlx::query("UPDATE effects SET state = 'started', result = NULL, fence_completed = NULL WHERE run_id = $1 AND seq = 1")
            .bind(id)
            .execute(db.store.pool())
            .await?;
        let report = offline::replay(&rt, &plugin, recording(&db.store, id).await?, BUDGET).await?;
        let Outcome::Frontier { next } = &report.outcome else { bail!("no frontier: {report:?}") };
        ensure!(next.seq == 1 && next.why.contains("re-issues"), "{report:?}");
        ensure!(sink.hits().len() == 3, "replay made a request: {:?}", sink.hits());
        Ok(())
    }

    async fn a_component_whose_second_call_changed_is_reported_at_seq_1_with_both_calls(db) {
        let (rt, v1) = setup(vec![])?;
        let id = run_to_end(db, &rt, json!({ "steps": 3, "prefix": "k" })).await?;
        let v2 = rt.load_version("testkit", &plugins::testkit_v2()?, plugins::test_limits())?;
        ensure!(v2.digest != v1.digest);
        let report = offline::replay(&rt, &v2, recording(&db.store, id).await?, BUDGET).await?;
        let Outcome::Diverged { divergence: d } = &report.outcome else { bail!("no divergence: {report:?}") };
        ensure!(d.seq == 1 && d.recorded.name == "kv.put" && d.why.contains("different request"), "{report:?}");
        ensure!(d.recorded.request.as_deref() == Some(r#"{"key":"k-1","value":1}"#), "the recorded request: {report:?}");
        let now = d.now.as_ref().context("the new call")?;
        ensure!(now.name == "kv.put" && now.request.as_deref() == Some(r#"{"key":"k-1-v2","value":1}"#), "{report:?}");
        ensure!(!report.clean() && report.replayed_calls == 1, "{report:?}");

        // The version the run started with replays clean.
        let report = offline::replay(&rt, &v1, recording(&db.store, id).await?, BUDGET).await?;
        ensure!(matches!(&report.outcome, Outcome::Returned { output } if output == "did 3 steps"), "{report:?}");

        // A ledger longer than the turn's calls: the turn ends early.
        let mut longer = recording(&db.store, id).await?;
        let mut extra = longer.effects[2].clone();
        extra.seq = 3;
        longer.effects.push(extra);
        let report = offline::replay(&rt, &v1, longer, BUDGET).await?;
        let Outcome::Diverged { divergence: d } = &report.outcome else { bail!("no divergence: {report:?}") };
        ensure!(d.seq == 3 && d.now.is_none() && d.why.contains("ended after 3 calls"), "{report:?}");
        Ok(())
    }

    async fn a_hostile_component_is_stopped_by_replay_with_a_reason(db) {
        let (rt, plugin) = setup(vec![])?;
        let id = run_to_end(db, &rt, json!({ "steps": 1 })).await?;
        for (mode, expected) in [("loop", "longer than"), ("trap", "trap"), ("oom", "memory")] {
            let mut rec = recording(&db.store, id).await?;
            rec.input = json!({ "mode": mode }).to_string();
            // The recorded call at seq 0 is not made: the loop never calls.
            let report = offline::replay(&rt, &plugin, rec, Duration::from_millis(500)).await?;
            let Outcome::Stopped { reason } = &report.outcome else { bail!("{mode}: not stopped: {report:?}") };
            ensure!(reason.contains(expected) && !report.clean(), "{mode}: {report:?}");
        }
        Ok(())
    }

    async fn the_cli_exports_a_run_and_replays_it_exiting_non_zero_on_divergence(db) {
        let dir = tempfile::tempdir()?;
        let plugins_dir = dir.path().join("plugins");
        std::fs::create_dir(&plugins_dir)?;
        std::fs::write(plugins_dir.join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let v2_file = dir.path().join("testkit-v2.wasm");
        std::fs::write(&v2_file, plugins::testkit_v2()?)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let host = ServeProc::spawn(&ServeArgs::new(db.url(), &plugins_dir, "host-a".into())?)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let body = json!({ "plugin": "testkit", "input": { "steps": 3, "prefix": "k" } });
        let run: serde_json::Value = http.post(format!("{}/v1/runs", host.base)).json(&body).send().await?.json().await?;
        let id = run["id"].as_i64().context("run id")?;
        let status = async || Ok(format!("run {id} did not complete: {:?}", db.store.get_run(id).await?.status));
        eventually_some(Duration::from_secs(60), status, async || Ok((db.store.get_run(id).await?.status == RunStatus::Completed).then_some(()))).await?;

        let cache = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache");
        let leasehold = |args: &[&str]| -> Result<(i32, String, String)> {
            let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
                .args(args)
                .arg("--cache-dir")
                .arg(&cache)
                .env("LEASEHOLD_LOG", "warn")
                .env_remove("LEASEHOLD_DATABASE_URL")
                .output()?;
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            Ok((out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr)))
        };
        let export = dir.path().join("run.json");
        let (id_s, export_s) = (id.to_string(), export.display().to_string());
        let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(["runs", "export", &id_s, "-o", &export_s, "--server", &host.base, "--token", TEST_TOKEN])
            .output()?;
        ensure!(out.status.success(), "export: {}", String::from_utf8_lossy(&out.stderr));
        let exported: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&export)?)?;
        ensure!(exported["effects"].as_array().map(Vec::len) == Some(3), "{exported}");
        ensure!(exported["run"].get("secret").is_none(), "an export never holds the run's secret");

        let v2 = v2_file.display().to_string();
        let (code, stdout, stderr) = leasehold(&["replay", "--ledger", &export_s, "--component", &v2])?;
        ensure!(code == 1, "a divergence exits 1, not {code}: {stdout}{stderr}");
        ensure!(stdout.contains("DIVERGED at call 1"), "{stdout}");
        ensure!(stdout.contains(r#"recorded: kv.put {"key":"k-1","value":1}"#), "{stdout}");
        ensure!(stdout.contains(r#"now:      kv.put {"key":"k-1-v2","value":1}"#), "{stdout}");

        let v1 = plugins_dir.join("testkit.wasm").display().to_string();
        let (code, stdout, stderr) = leasehold(&["replay", "--ledger", &export_s, "--component", &v1, "--json"])?;
        ensure!(code == 0, "{stdout}{stderr}");
        let report: serde_json::Value = serde_json::from_str(stdout.trim())?;
        ensure!(report["outcome"] == "returned" && report["output"] == "did 3 steps", "{report}");

        // From the database, on the version the run started with.
        let (code, stdout, stderr) = leasehold(&["replay", &id_s, "--database-url", db.url()])?;
        ensure!(code == 0 && stdout.contains("clean: the turn returns"), "{code}: {stdout}{stderr}");
        let (code, _, stderr) = leasehold(&["replay", "999999", "--database-url", db.url()])?;
        ensure!(code == 1 && stderr.contains("error: reading run 999999"), "{code}: {stderr}");
        let (code, _, stderr) = leasehold(&["replay", "--ledger", &v1, "--component", &v1])?;
        ensure!(code == 1 && stderr.contains("is not a run export"), "{code}: {stderr}");
        Ok(())
    }

    async fn upgrade_check_says_which_open_runs_replay_clean_on_the_new_version_and_changes_nothing(db) {
        let (rt, _) = setup(vec![])?;
        // Runs a and b stopped mid-turn (as if their host had died): a
        // after its first call, b after its second; c finished; d queued.
        let c = run_to_end(db, &rt, json!({ "steps": 3 })).await?;
        let a = run_to_end(db, &rt, json!({ "steps": 3, "prefix": "a" })).await?;
        let b = run_to_end(db, &rt, json!({ "steps": 3, "prefix": "b" })).await?;
        for (id, kept) in [(a, 1), (b, 2)] {
            sqlx::query("UPDATE runs SET status = 'waiting_takeover', output = NULL, finished_at = NULL, lease_owner = NULL WHERE id = $1")
                .bind(id)
                .execute(db.store.pool())
                .await?;
            sqlx::query("DELETE FROM effects WHERE run_id = $1 AND seq >= $2").bind(id).bind(kept).execute(db.store.pool()).await?;
        }
        let d = db.store.create_run(&NewRun::new("testkit", json!({ "steps": 3 }).to_string())).await?.0.id;
        let before: Vec<_> = futures::future::try_join_all([a, b, c, d].map(|id| db.store.get_run(id))).await?;

        let dir = tempfile::tempdir()?;
        let v2 = dir.path().join("v2.wasm");
        std::fs::write(&v2, plugins::testkit_v2()?)?;
        let cache = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache");
        let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(["plugins", "upgrade", "testkit"])
            .arg(&v2)
            .args(["--check", "--json", "--database-url", db.url(), "--cache-dir"])
            .arg(&cache)
            .env("LEASEHOLD_LOG", "warn")
            .output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(out.status.code() == Some(1), "a run that would diverge exits 1: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_str(stdout.trim())?;
        let verdicts: Vec<(i64, String)> = report["runs"]
            .as_array()
            .context("runs")?
            .iter()
            .map(|r| (r["run_id"].as_i64().unwrap_or(0), r["verdict"].as_str().unwrap_or("").to_string()))
            .collect();
        ensure!(verdicts == vec![(a, "moves".into()), (b, "stays".into()), (d, "moves".into())], "{report}");
        ensure!(report["runs"][1]["detail"].as_str().is_some_and(|t| t.starts_with("diverges at call 1")), "{report}");
        let after: Vec<_> = futures::future::try_join_all([a, b, c, d].map(|id| db.store.get_run(id))).await?;
        ensure!(before == after, "the check changed a run");
        Ok(())
    }
}

/// `leasehold run` runs the children a turn spawns, of the plugins given
/// with `--plugin`, as `--spawn-allow` grants; without the grant, spawn is
/// denied and the turn fails with it.
#[test]
fn leasehold_run_runs_a_turns_children_of_the_plugins_it_is_given() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("target/plugins");
    let run = |grant: &str| {
        Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .arg("run")
            .arg(dir.join("fanout.wasm"))
            .args(["--input", r#"{"inputs": [{"steps": 1}, {"steps": 2}]}"#])
            .arg(format!("--plugin=testkit={}", dir.join("testkit.wasm").display()))
            .args(["--spawn-allow", grant])
            .env("LEASEHOLD_CACHE_DIR", root.join("target/component-cache"))
            .env("LEASEHOLD_LOG", "error")
            .output()
    };
    let out = run("testkit")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    ensure!(stdout.trim() == r#"["did 1 steps","did 2 steps"]"#, "output {stdout:?}");
    let out = run("")?;
    ensure!(!out.status.success(), "a spawn without a grant succeeded");
    ensure!(String::from_utf8_lossy(&out.stderr).contains("spawn"), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}
