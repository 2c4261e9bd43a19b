//! The operator's commands against a real service (`leasehold serve`):
//! `submit` with a priority and a key, `runs input/pause/resume/cancel/
//! budget/rerun/resolve`, `limits set/show/list/pause/resume/rm`; each
//! does what it says, and a bad call prints why and exits non-zero.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::harness::both;
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc, TEST_TOKEN};

struct Cli {
    base: String,
}

impl Cli {
    /// Runs `leasehold ARGS --json` against the service: its exit code,
    /// stdout and stderr.
    fn run(&self, args: &[&str]) -> Result<(i32, String, String)> {
        let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(args)
            .args(["--server", &self.base, "--token", TEST_TOKEN, "--json"])
            .env("LEASEHOLD_LOG", "error")
            .output()
            .context("running the CLI")?;
        Ok((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into()))
    }

    /// `args`, which must succeed; its JSON.
    fn ok(&self, args: &[&str]) -> Result<Value> {
        let (code, out, err) = self.run(args)?;
        ensure!(code == 0, "leasehold {args:?} exited {code}: {err}{out}");
        if out.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&out).with_context(|| format!("leasehold {args:?} printed no JSON: {out}"))
    }

    /// `args`, which must fail with a non-zero exit and a message holding
    /// `says`.
    fn refused(&self, args: &[&str], says: &str) -> Result<()> {
        let (code, out, err) = self.run(args)?;
        ensure!(code != 0, "leasehold {args:?} exited 0: {out}");
        ensure!(err.contains(says), "leasehold {args:?} exited {code} without saying {says:?}: {err}");
        Ok(())
    }

    /// Polls `runs show ID` until `done` holds for the run.
    fn until(&self, id: i64, what: &str, done: impl Fn(&Value) -> bool) -> Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let run = self.ok(&["runs", "show", &id.to_string()])?;
            if done(&run) {
                return Ok(run);
            }
            ensure!(Instant::now() < deadline, "run {id} never {what}: {run}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn id_of(run: &Value) -> Result<i64> {
    run["id"].as_i64().with_context(|| format!("no id in {run}"))
}

both! {
    async fn every_operator_command_works_against_a_service_and_a_bad_call_exits_non_zero(db) {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let args = ServeArgs::new(db.url(), dir.path(), "cli-host".into())?;
        let host = ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let cli = Cli { base: host.base.clone() };
        tokio::task::spawn_blocking(move || commands(&cli)).await??;
        Ok(())
    }
}

fn commands(cli: &Cli) -> Result<()> {
    // submit --priority --key; runs input.
    let run = cli.ok(&["submit", "testkit", r#"{"mode": "wait"}"#, "--priority", "5", "--key", "tenant-a"])?;
    ensure!(run["priority"] == 5 && run["concurrency_key"] == "tenant-a", "{run}");
    let waiting = id_of(&run)?;
    cli.until(waiting, "waited for input", |r| r["status"] == "waiting_input")?;
    cli.ok(&["runs", "input", &waiting.to_string(), "Ada"])?;
    let done = cli.until(waiting, "completed", |r| r["status"] == "completed")?;
    ensure!(done["output"] == "hello Ada", "{done}");

    // runs pause, resume, cancel.
    let sleeper = id_of(&cli.ok(&["submit", "testkit", r#"{"mode": "sleep", "ms": 60000}"#])?)?;
    let s = sleeper.to_string();
    let paused = cli.ok(&["runs", "pause", &s])?;
    ensure!(paused["paused_at"].is_i64(), "{paused}");
    let resumed = cli.ok(&["runs", "resume", &s])?;
    ensure!(resumed["paused_at"].is_null(), "{resumed}");
    cli.ok(&["runs", "cancel", &s])?;
    cli.until(sleeper, "was cancelled", |r| r["status"] == "cancelled")?;
    cli.refused(&["runs", "pause", &s], "finished")?;

    // runs budget: shown, raised; a bad one refused.
    let budgeted = id_of(&cli.ok(&["submit", "testkit", r#"{"steps": 3}"#, "--budget-tokens", "1000"])?)?;
    let b = budgeted.to_string();
    let budget = cli.ok(&["runs", "budget", &b])?;
    ensure!(budget["tokens"] == 1000 && budget["holder_id"] == budgeted, "{budget}");
    let raised = cli.ok(&["runs", "budget", &b, "--tokens", "2000"])?;
    ensure!(raised["tokens"] == 2000, "{raised}");
    cli.refused(&["runs", "budget", &b, "--tokens=-1"], "tokens")?;
    cli.until(budgeted, "completed", |r| r["status"] == "completed")?;

    // runs rerun from a point in the ledger; runs resolve of a row that
    // is not in doubt is refused.
    let stepper = id_of(&cli.ok(&["submit", "testkit", r#"{"steps": 3}"#])?)?;
    cli.until(stepper, "completed", |r| r["status"] == "completed")?;
    let rerun = cli.ok(&["runs", "rerun", &stepper.to_string(), "--from", "1"])?;
    ensure!(rerun["rerun_of"] == stepper && rerun["rerun_from"] == 1, "{rerun}");
    cli.until(id_of(&rerun)?, "completed", |r| r["status"] == "completed")?;
    cli.refused(&["runs", "rerun", &stepper.to_string(), "--from", "99"], "ledger")?;
    let (code, _, err) = cli.run(&["runs", "resolve", &stepper.to_string(), "0", "--result", "{}"])?;
    ensure!(code != 0 && !err.is_empty(), "resolving a committed row exited {code}: {err}");

    // limits set, show, list, pause, resume, rm.
    let set = cli.ok(&["limits", "set", "tenant-a", "--concurrency", "2"])?;
    ensure!(set["key"] == "tenant-a" && set["concurrency"] == 2 && set["paused"] == false, "{set}");
    let shown = cli.ok(&["limits", "show", "tenant-a"])?;
    ensure!(shown["concurrency"] == 2, "{shown}");
    let listed = cli.ok(&["limits", "list"])?;
    let keys: Vec<&str> = listed["limits"].as_array().map(|l| l.iter().filter_map(|k| k["key"].as_str()).collect()).unwrap_or_default();
    ensure!(keys.contains(&"tenant-a"), "{listed}");
    let paused = cli.ok(&["limits", "pause", "tenant-a"])?;
    ensure!(paused["paused"] == true && paused["concurrency"] == 2, "{paused}");
    let resumed = cli.ok(&["limits", "resume", "tenant-a"])?;
    ensure!(resumed["paused"] == false && resumed["concurrency"] == 2, "{resumed}");
    cli.ok(&["limits", "rm", "tenant-a"])?;
    cli.refused(&["limits", "show", "tenant-a"], "404")?;
    let rate = cli.ok(&["limits", "set", "http:api.example.com:443", "--per-minute", "60"])?;
    ensure!(rate["per_minute"] == 60, "{rate}");

    // Bad calls: a message and a non-zero exit each.
    cli.refused(&["limits", "set", "tenant-b", "--concurrency", "0"], "concurrency")?;
    cli.refused(&["limits", "rm", "no-such-key"], "404")?;
    cli.refused(&["runs", "cancel", "999999"], "404")?;
    cli.refused(&["runs", "input", "999999", "x"], "404")?;
    cli.refused(&["submit", "testkit", "--priority", "5000"], "priority")?;
    cli.refused(&["submit", "no-such-plugin"], "no-such-plugin")?;
    let (code, _, _) = cli.run(&["runs", "resume", "not-a-number"])?;
    if code == 0 {
        bail!("a run id that is not a number was taken");
    }
    Ok(())
}
