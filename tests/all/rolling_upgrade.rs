//! Upgrades (docs/operations.md, "Upgrades"). From the previous release
//! (its binary built by `scripts/previous-release`, which `scripts/test`
//! runs first), rolled: this release's host joins beside the previous
//! release's, both serve, and every run finishes, those in flight as the
//! upgrade begins too. For the
//! next release: a host of this release keeps working when columns are
//! added under it, and starts on a database a newer release migrated.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::store::Store;
use serde_json::{Value, json};

use crate::harness::{TestDb, both, eventually_some};
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc};

fn previous_release() -> Result<PathBuf> {
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/previous/leasehold");
    ensure!(bin.exists(), "{} not found: run scripts/previous-release (scripts/test does)", bin.display());
    Ok(bin)
}

/// Submits a batch through `base`, as a client does: a 503 is tried again
/// (the same idempotency keys, so nothing runs twice). A previous release's
/// host on SQLite answers one 503 per pooled connection after the schema
/// changes under it (see docs/operations.md, "Upgrades").
async fn submit(http: &reqwest::Client, host: &ServeArgs<'_>, base: &str, runs: &[Value]) -> Result<Vec<i64>> {
    let mut tries = 0;
    loop {
        let resp = http.post(format!("{base}/v1/runs:batch")).json(&json!({ "runs": runs })).send().await?;
        let status = resp.status();
        let body: Value = resp.json().await?;
        if status == 503 && tries < 20 {
            tries += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let log = std::fs::read_to_string(&host.log).unwrap_or_default();
        ensure!(status.is_success(), "{} ({base}): {status} {body}\nits log:\n{log}", host.owner);
        return body["results"].as_array().context("results")?.iter().map(|r| r["run"]["id"].as_i64().context("an id")).collect();
    }
}

/// A run's status and error, read with a statement both schemas answer
/// (this release's `Run` wants columns the previous one lacks).
async fn status_of(store: &Store, id: i64) -> Result<(String, Option<String>)> {
    Ok(sqlx::query_as("SELECT status, error FROM runs WHERE id = $1").bind(id).fetch_one(store.pool()).await?)
}

async fn all_completed(store: &Store, ids: &[i64]) -> Result<()> {
    for id in ids {
        let (status, error) = status_of(store, *id).await?;
        ensure!(status == "completed", "run {id}: {status} {error:?}");
    }
    Ok(())
}

/// The segments a host has completed (`/metrics`, the same line in both
/// releases).
async fn completed_segments(http: &reqwest::Client, base: &str) -> Result<u64> {
    let text = http.get(format!("{base}/metrics")).send().await?.text().await?;
    let line = text.lines().find(|l| l.starts_with("leasehold_segments_total{outcome=\"completed\"}")).context("no completed segments line")?;
    Ok(line.rsplit(' ').next().unwrap_or("").parse()?)
}

async fn all_finished(store: &Store, ids: &[i64], within: Duration) -> Result<()> {
    let finished = async |id: i64| -> Result<bool> { Ok(["completed", "failed", "aborted", "cancelled"].contains(&status_of(store, id).await?.0.as_str())) };
    let unfinished = async || {
        for id in ids {
            if !finished(*id).await? {
                return Ok(format!("run {id} is not finished: {:?}", status_of(store, *id).await?));
            }
        }
        Ok("every run finished just after the wait".into())
    };
    // One run at a time, in order: those seen finished are not asked again.
    let mut next = 0;
    eventually_some(within, unfinished, async || {
        while next < ids.len() && finished(ids[next]).await? {
            next += 1;
        }
        Ok((next == ids.len()).then_some(()))
    })
    .await
}

/// SIGTERM, then waits for a clean exit (the host hands its runs over).
async fn stop(host: &mut ServeProc, args: &ServeArgs<'_>) -> Result<()> {
    std::process::Command::new("kill").args(["-TERM", &host.pid().to_string()]).status()?;
    let exit = eventually_some(
        Duration::from_secs(30),
        async || Ok(format!("{} did not exit within 30 s of SIGTERM", args.owner)),
        async || Ok(host.child.try_wait()?),
    )
    .await?;
    ensure!(exit.code() == Some(0), "{} exited with {exit:?}; log:\n{}", args.owner, std::fs::read_to_string(&args.log)?);
    Ok(())
}

both! {
    async fn an_upgrade_from_the_previous_release_finishes_every_run(db) {
        let previous = previous_release()?;
        // A database the previous release creates, as it was before.
        let fresh = TestDb::empty(db.backend).await?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let mut old_args = ServeArgs::new(fresh.url(), dir.path(), "old".into())?;
        old_args.binary = Some(previous);
        let mut old = ServeProc::spawn(&old_args)?;
        old.wait_healthy(&http, Duration::from_secs(60)).await.with_context(|| {
            format!("the previous release's host: {}", std::fs::read_to_string(&old_args.log).unwrap_or_default())
        })?;
        let steps = |i: usize| json!({
            "plugin": "testkit", "input": { "steps": 3, "spin": 1 << 22, "prefix": format!("r{i}") }, "idempotency_key": format!("r{i}"),
        });
        let before = submit(&http, &old_args, &old.base, &(0..10).map(steps).collect::<Vec<_>>()).await?;
        all_finished(&fresh.store, &before, Duration::from_secs(60)).await?;
        all_completed(&fresh.store, &before).await?;
        // Runs in flight and queued as the upgrade begins.
        let in_flight = submit(&http, &old_args, &old.base, &(10..40).map(steps).collect::<Vec<_>>()).await?;

        let old_version: i64 = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(fresh.store.pool()).await?;
        let old_before = completed_segments(&http, &old.base).await?;

        // A rolling upgrade: this release's host joins while the previous
        // release's goes on serving, and migrates the database under it.
        let mut new_args = ServeArgs::new(fresh.url(), dir.path(), "new".into())?;
        // Its info lines too: it says when it sees a contract step.
        new_args.env.push(("LEASEHOLD_LOG".into(), "info".into()));
        let new = ServeProc::spawn(&new_args)?;
        new.wait_healthy(&http, Duration::from_secs(60)).await.with_context(|| {
            format!("this release's host: {}", std::fs::read_to_string(&new_args.log).unwrap_or_default())
        })?;
        let latest: i64 = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(fresh.store.pool()).await?;
        ensure!(latest > old_version, "this release did not migrate the database further (at {latest}, the previous release at {old_version})");

        let mut after = in_flight;
        for round in 0..4 {
            // Both hosts take runs, the previous release's on the schema
            // this release migrated.
            let runs: Vec<Value> = (0..10).map(|i| steps(100 * (round + 1) + i)).collect();
            after.extend(submit(&http, &old_args, &old.base, &runs).await?);
            // The new kinds too: a priority, a key.
            let mut fancy: Vec<Value> = (0..10).map(|i| steps(1000 * (round + 1) + i)).collect();
            fancy[0]["priority"] = json!(5);
            fancy[1]["concurrency_key"] = json!("tenant");
            after.extend(submit(&http, &new_args, &new.base, &fancy).await?);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        all_finished(&fresh.store, &after, Duration::from_secs(120)).await?;
        all_completed(&fresh.store, &after).await?;
        let by_old = completed_segments(&http, &old.base).await? - old_before;
        let by_new = completed_segments(&http, &new.base).await?;
        let old_log = std::fs::read_to_string(&old_args.log).unwrap_or_default();
        ensure!(
            by_old > 0 && by_new > 0,
            "the hosts did not both serve: the previous release completed {by_old} segments, this one {by_new}; the previous release's log:\n{old_log}"
        );
        // Then the previous release's host is rolled: SIGTERM, a clean exit.
        stop(&mut old, &old_args).await?;
        // Until the operator takes the contract steps, this release's
        // hosts wrote what the previous release reads: message rows.
        let message_rows = async |ids: &[i64]| -> Result<usize> {
            let mut n = 0;
            for id in ids {
                let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM events WHERE run_id = $1 AND kind = 'message'").bind(id).fetch_one(fresh.store.pool()).await?;
                n += rows as usize;
            }
            Ok(n)
        };
        ensure!(message_rows(&after).await? == after.len(), "a run closed beside the previous release has no message row");
        // Nor did a run hold its thread's counter, which the previous
        // release's host would not have numbered from.
        let held = async |ids: &[i64]| -> Result<usize> {
            let mut n = 0;
            for id in ids {
                let holds: Option<i64> = sqlx::query_scalar("SELECT thread_seq FROM runs WHERE id = $1").bind(id).fetch_one(fresh.store.pool()).await?;
                n += usize::from(holds.is_some());
            }
            Ok(n)
        };
        ensure!(held(&after).await? == 0, "a run submitted beside the previous release holds its thread's counter");
        let schema = |command: &str| -> Result<String> {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold")).args(["schema", command, "--database-url", fresh.url()]).output()?;
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr));
            ensure!(out.status.success(), "schema {command}: {:?}\n{stdout}{stderr}", out.status);
            Ok(stdout)
        };
        let status = schema("status")?;
        ensure!(status.lines().any(|l| l.starts_with("derived_messages") && l.ends_with("pending")), "{status}");
        let taken = schema("contract")?;
        ensure!(taken.contains("taken: derived_messages") && taken.contains("taken: run_counters"), "{taken}");
        ensure!(schema("status")?.lines().any(|l| l.starts_with("derived_messages") && l.ends_with("taken")));
        // The host sees the step within its recheck.
        tokio::time::sleep(leasehold::store::contract::RECHECK + Duration::from_millis(500)).await;
        let last = submit(&http, &new_args, &new.base, &(5000..5010).map(steps).collect::<Vec<_>>()).await?;
        all_finished(&fresh.store, &last, Duration::from_secs(60)).await?;
        all_completed(&fresh.store, &last).await?;
        ensure!(message_rows(&last).await? == 0, "closes after the contract step wrote message rows");
        ensure!(held(&last).await? == last.len(), "runs submitted after the contract step do not hold their threads' counters");
        let new_log = std::fs::read_to_string(&new_args.log).unwrap_or_default();
        ensure!(new_log.contains("a contract step was taken") && new_log.contains("derived_messages"), "this release's host did not say it saw the step:\n{new_log}");
        // Every run's thread reads its message through the API, written
        // as a row or derived from its run.
        for id in after.iter().chain(&last) {
            let run: Value = http.get(format!("{}/v1/runs/{id}", new.base)).send().await?.json().await?;
            let thread = run["run"]["thread_id"].as_str().or(run["thread_id"].as_str()).context("a thread id")?.to_string();
            let page: Value = http.get(format!("{}/v1/threads/{thread}/events", new.base)).send().await?.json().await?;
            let said = page["events"].as_array().context("events")?.iter().filter(|e| e["run_id"] == *id && e["kind"] == "message").count();
            ensure!(said == 1, "run {id}: {said} messages in {page}");
        }
        drop(old);
        drop(new);
        fresh.cleanup().await?;
        Ok(())
    }

    async fn a_host_keeps_working_when_a_newer_release_adds_columns_under_it(db) {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let args = ServeArgs::new(db.url(), dir.path(), "host".into())?;
        let host = ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let ops = |i: usize| json!({
            "plugin": "testkit", "idempotency_key": format!("c{i}"),
            "input": { "mode": "script", "ops": [{ "op": "put", "key": "k", "value": i }, { "op": "emit", "text": "x" }, { "op": "sleep", "ms": 1 }] },
        });
        // Every statement this host prepares, prepared.
        let first = submit(&http, &args, &host.base, &(0..20).map(ops).collect::<Vec<_>>()).await?;
        all_finished(&db.store, &first, Duration::from_secs(60)).await?;
        all_completed(&db.store, &first).await?;
        let _ = http.get(format!("{}/v1/runs/{}/effects", host.base, first[0])).send().await?;
        let _ = http.get(format!("{}/v1/runs?limit=5", host.base)).send().await?;
        // What a newer release's migration does: columns added everywhere.
        for table in ["runs", "effects", "events"] {
            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE {table} ADD COLUMN from_a_newer_release TEXT"))).execute(db.store.pool()).await?;
        }
        let second = submit(&http, &args, &host.base, &(20..60).map(ops).collect::<Vec<_>>()).await?;
        all_finished(&db.store, &second, Duration::from_secs(60)).await?;
        all_completed(&db.store, &second).await?;
        for path in [format!("/v1/runs/{}", second[0]), format!("/v1/runs/{}/effects", second[0]), "/v1/runs?limit=5".to_string()] {
            let resp = http.get(format!("{}{path}", host.base)).send().await?;
            ensure!(resp.status() == 200, "{path}: {}", resp.status());
        }
        let log = std::fs::read_to_string(&args.log).unwrap_or_default();
        ensure!(!log.contains("ERROR") && !log.contains("panicked"), "the host's log:\n{log}");
        Ok(())
    }

    async fn this_release_starts_on_a_database_a_newer_release_migrated(db) {
        // A migration this release does not know, as a newer release leaves.
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99999, 'a newer release', true, $1, 0)",
        )
        .bind(vec![0u8; 48])
        .execute(db.store.pool())
        .await?;
        let again = Store::connect(db.url()).await.context("starting on a database a newer release migrated")?;
        again.shutdown().await;
        Ok(())
    }
}

/// A migration run while hosts serve can deadlock with them: migration 33
/// alters `concurrency_keys`, then adds a trigger on `runs`, while a
/// previous release's claim holds `runs` and wants `concurrency_keys`.
/// PostgreSQL rolls the migration back; the host tries it again and
/// starts, rather than exiting with "deadlock detected".
mod a_migration_that_loses_a_deadlock_to_running_hosts_is_tried_again {
    use super::*;
    use crate::harness::until_lock_waiter;
    use leasehold::Backend;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() -> Result<()> {
        crate::harness::init_logs();
        let db = TestDb::empty(Backend::Postgres).await?;
        let result = async {
            db.store.migrate_to(32).await?;
            // A claim of the previous release: it has taken `runs`...
            let mut claim = db.store.pool().begin().await?;
            sqlx::query("UPDATE runs SET status = status WHERE false").execute(&mut *claim).await?;
            let store = db.store.clone();
            let migration = tokio::spawn(async move { store.migrate().await });
            // ...the migration has taken `concurrency_keys` and waits for
            // `runs`; the claim now wants `concurrency_keys`.
            until_lock_waiter(&db, 1).await?;
            let keys = sqlx::query("SELECT COUNT(*) FROM concurrency_keys").execute(&mut *claim).await;
            // The migration waited first, so its deadlock check found the
            // cycle first: it was the one rolled back.
            ensure!(keys.is_ok(), "the claim lost the deadlock instead: {keys:?}");
            claim.commit().await?;
            migration.await?.context("the migration after a deadlock")?;
            let applied: i64 = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(db.store.pool()).await?;
            ensure!(applied >= 35, "migrated to {applied}");
            anyhow::Ok(())
        }
        .await;
        db.cleanup().await?;
        result
    }
}
