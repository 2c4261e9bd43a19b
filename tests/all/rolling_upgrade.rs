//! A rolling upgrade (docs/operations.md, "Upgrades"): a host of the
//! previous release, already serving, keeps serving once a host of this
//! release has joined and migrated the database further (expand), and the
//! two complete each other's runs. The previous release's binary is built by
//! `scripts/previous-release` (`scripts/test` runs it first). And a host of
//! this release starts on a database a newer release has migrated.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use leasehold::store::Store;
use serde_json::{Value, json};

use crate::harness::{TestDb, both};
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
    let deadline = Instant::now() + within;
    for id in ids {
        while !["completed", "failed", "aborted", "cancelled"].contains(&status_of(store, *id).await?.0.as_str()) {
            ensure!(Instant::now() < deadline, "run {id} is not finished after {within:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

both! {
    async fn a_previous_release_host_keeps_working_beside_this_release_on_its_schema(db) {
        let previous = previous_release()?;
        // A database the previous release creates, as it was before.
        let fresh = TestDb::empty(db.backend).await?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let mut old_args = ServeArgs::new(fresh.url(), dir.path(), "old".into())?;
        old_args.binary = Some(previous);
        let old = ServeProc::spawn(&old_args)?;
        old.wait_healthy(&http, Duration::from_secs(60)).await.with_context(|| {
            format!("the previous release's host: {}", std::fs::read_to_string(&old_args.log).unwrap_or_default())
        })?;
        let steps = |i: usize| json!({
            "plugin": "testkit", "input": { "steps": 3, "spin": 1 << 20, "prefix": format!("r{i}") }, "idempotency_key": format!("r{i}"),
        });
        let before = submit(&http, &old_args, &old.base, &(0..10).map(steps).collect::<Vec<_>>()).await?;
        all_finished(&fresh.store, &before, Duration::from_secs(60)).await?;
        all_completed(&fresh.store, &before).await?;
        let old_before = completed_segments(&http, &old.base).await?;

        // This release joins and migrates further.
        let new_args = ServeArgs::new(fresh.url(), dir.path(), "new".into())?;
        let new = ServeProc::spawn(&new_args)?;
        new.wait_healthy(&http, Duration::from_secs(60)).await.with_context(|| {
            format!("this release's host: {}", std::fs::read_to_string(&new_args.log).unwrap_or_default())
        })?;
        let latest: i64 = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(fresh.store.pool()).await?;
        ensure!(latest >= 14, "this release did not migrate the database further (at {latest})");

        // Both take runs submitted through both, the new kinds too (a
        // priority, a key), for a while.
        let mut after = Vec::new();
        for round in 0..4 {
            let runs: Vec<Value> = (0..10).map(|i| steps(100 * (round + 1) + i)).collect();
            after.extend(submit(&http, &old_args, &old.base, &runs).await?);
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
        ensure!(by_old > 0 && by_new > 0, "after the migration the old host completed {by_old} segments and the new one {by_new}");
        // And the previous release still answers its API.
        let resp = http.get(format!("{}/v1/runs/{}", old.base, after[after.len() - 1])).send().await?;
        ensure!(resp.status() == 200, "the previous release's API: {}", resp.status());
        drop(old);
        drop(new);
        fresh.cleanup().await?;
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
