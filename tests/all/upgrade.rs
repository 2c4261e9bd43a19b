//! Upgrade policies: with `auto`, a run in flight moves to the current
//! version at its next segment only if its recorded ledger replays clean
//! on it; otherwise it stays, completes on its own version, and says why.
//! With `pinned` (the default) nothing moves.

use std::sync::Arc;

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::runtime::{Plugin, Runtime};
use leasehold::store::{NewRun, RunStatus, UpgradePolicy};
use serde_json::json;

use crate::harness::{TestDb, both};
use crate::plugins;

fn executor(db: &TestDb, rt: &Arc<Runtime>) -> Executor {
    crate::harness::executor(db, rt, "worker-a")
}

/// A run of `v1` (`steps` 3, keys `k-<i>`) stopped after its first `kept`
/// calls, as if its host had died there; then `v2` is registered as the
/// current version under `policy`.
async fn in_flight(db: &TestDb, kept: i64, policy: UpgradePolicy) -> Result<(Arc<Runtime>, Arc<Plugin>, Arc<Plugin>, i64)> {
    let rt = plugins::runtime()?;
    let v1 = rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
    let id = db.store.create_run(&NewRun { plugin_digest: v1.digest.clone(), ..NewRun::new("testkit", json!({ "steps": 3, "prefix": "k" }).to_string()) }).await?.0.id;
    ensure!(executor(db, &rt).run_once().await? == Some((id, SegmentOutcome::Completed)));
    let partial: String = (0..kept).map(|i| format!("step {i} ")).collect();
    sqlx::query(
        "UPDATE runs SET status = 'waiting_takeover', output = NULL, finished_at = NULL, lease_owner = NULL, \
         partial = $2, emit_pos = $3, partial_pos = $3, \
         partial_seq = (SELECT MAX(seq) FROM events WHERE run_id = $1) WHERE id = $1",
    )
    .bind(id)
    .bind(partial)
    .bind(kept)
    .execute(db.store.pool())
    .await?;
    sqlx::query("DELETE FROM effects WHERE run_id = $1 AND seq >= $2").bind(id).bind(kept).execute(db.store.pool()).await?;
    sqlx::query("DELETE FROM kv").execute(db.store.pool()).await?;
    let v2 = rt.add_plugin("testkit", &plugins::testkit_v2()?, plugins::test_limits())?;
    rt.set_upgrade_policy("testkit", policy);
    Ok((rt, v1, v2, id))
}

async fn keys(db: &TestDb) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar("SELECT key FROM kv ORDER BY key").fetch_all(db.store.pool()).await?)
}

both! {
    async fn with_auto_a_run_whose_ledger_replays_clean_moves_and_completes_on_the_new_version(db) {
        let (rt, v1, v2, id) = in_flight(db, 1, UpgradePolicy::Auto).await?;
        ensure!(executor(db, &rt).run_once().await? == Some((id, SegmentOutcome::Completed)));
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("did 3 steps"), "{run:?}");
        ensure!(run.plugin_digest == v2.digest, "the run is on the new version now: {run:?}");
        let note = run.upgrade_note.unwrap_or_default();
        ensure!(note.starts_with(&format!("moved from {} to {}", v1.digest, v2.digest)), "{note}");
        ensure!(keys(db).await? == ["k-1-v2", "k-2"], "the new version made the rest of the calls");
        Ok(())
    }

    async fn with_auto_a_run_that_diverges_stays_on_its_version_completes_there_and_says_why(db) {
        let (rt, v1, v2, id) = in_flight(db, 2, UpgradePolicy::Auto).await?;
        ensure!(executor(db, &rt).run_once().await? == Some((id, SegmentOutcome::Completed)));
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("did 3 steps"), "{run:?}");
        ensure!(run.plugin_digest == v1.digest, "{run:?}");
        ensure!(run.upgrade_checked.as_deref() == Some(v2.digest.as_str()), "{run:?}");
        let note = run.upgrade_note.unwrap_or_default();
        ensure!(note.starts_with(&format!("stays on {}", v1.digest)) && note.contains("diverges at call 1"), "{note}");
        ensure!(keys(db).await? == ["k-2"], "the old version made the rest of the calls");
        Ok(())
    }

    async fn with_pinned_nothing_moves(db) {
        let (rt, v1, _v2, id) = in_flight(db, 1, UpgradePolicy::Pinned).await?;
        ensure!(executor(db, &rt).run_once().await? == Some((id, SegmentOutcome::Completed)));
        let run = db.store.get_run(id).await?;
        ensure!(run.plugin_digest == v1.digest && run.upgrade_note.is_none() && run.upgrade_checked.is_none(), "{run:?}");
        ensure!(keys(db).await? == ["k-1", "k-2"], "the old version made the rest of the calls");
        Ok(())
    }
}

both! {
    async fn versions_no_open_run_uses_are_unloaded_and_load_again_when_a_run_needs_one(db) {
        let rt = plugins::runtime()?;
        let settings = leasehold::plugins::PluginSettings::default();
        let v1 = leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, settings.clone()).await?;
        let on_v1 = |key: &str| NewRun { plugin_digest: v1.digest.clone(), ..NewRun::new("testkit", json!({ "steps": 1, "prefix": key }).to_string()) };
        let a = db.store.create_run(&on_v1("a")).await?.0.id;
        let v2 = leasehold::plugins::register(&db.store, &rt, "testkit", plugins::testkit_v2()?, settings).await?;
        ensure!(rt.loaded_versions() == 2);
        // Run a is open on v1: both stay.
        ensure!(leasehold::versions::tick(&db.store, &rt).await? == 0 && rt.version("testkit", &v1.digest).is_some());
        ensure!(executor(db, &rt).run_once().await? == Some((a, SegmentOutcome::Completed)));
        // Nothing open uses v1 now; the current version stays.
        ensure!(leasehold::versions::tick(&db.store, &rt).await? == 1, "v1 unloaded");
        ensure!(rt.version("testkit", &v1.digest).is_none() && rt.version("testkit", &v2.digest).is_some());
        // A run on v1 loads it again from the database.
        let b = db.store.create_run(&on_v1("b")).await?.0.id;
        ensure!(executor(db, &rt).run_once().await? == Some((b, SegmentOutcome::Completed)));
        ensure!(db.store.get_run(b).await?.plugin_digest == v1.digest && rt.version("testkit", &v1.digest).is_some());
        Ok(())
    }
}
