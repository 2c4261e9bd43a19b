//! Retention: the cleaner deletes finished runs past the retention period
//! with their ledgers and events (a thread with its last run), a batch at
//! a time, and leaves open runs, recent runs and kv alone; on SQLite the
//! file stops growing under constant load once it deletes.

use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::Backend;
use leasehold::maintenance::cleaner::{self, RetentionConfig};
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::store::NewRun;
use serde_json::json;

use crate::harness::{TestDb, both};
use crate::plugins;

const DAY_MS: i64 = 86_400_000;

fn executor(db: &TestDb) -> Result<Executor> {
    let rt = plugins::runtime()?;
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
    Ok(Executor::new(db.store.clone(), rt, crate::harness::worker("w")))
}

async fn count(db: &TestDb, table_where: &'static str, id: i64) -> Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table_where}"))).bind(id).fetch_one(db.store.pool()).await?)
}

async fn backdate(db: &TestDb, id: i64, ms: i64) -> Result<()> {
    sqlx::query("UPDATE runs SET finished_at = finished_at - $2 WHERE id = $1").bind(id).bind(ms).execute(db.store.pool()).await?;
    Ok(())
}

async fn thread_exists(db: &TestDb, thread: &str) -> Result<bool> {
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM threads WHERE id = $1").bind(thread).fetch_one(db.store.pool()).await?;
    Ok(n == 1)
}

both! {
    async fn with_retention_off_the_cleaner_still_forgets_spent_holds_and_idle_keys(db) {
        db.store.hold("http:spent.example:443", Duration::ZERO).await?;
        db.store.set_limit("idle", None, false).await?;
        db.store.remove_limit("idle").await.ok();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let off = RetentionConfig { keep: Duration::ZERO, ..RetentionConfig::default() };
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let cleaner = tokio::spawn(cleaner::run(db.store.clone(), off, Duration::from_millis(10), stopped));
        crate::harness::eventually("the cleaner loop forgot nothing with retention off", async || Ok(!(db.store.rate("http:spent.example:443").await?.is_some() || db.store.limit("idle").await?.is_some()))).await?;
        stop.send(true)?;
        cleaner.await?;
        Ok(())
    }

    async fn finished_runs_past_retention_go_with_their_ledger_and_events_and_the_rest_stay(db) {
        let exec = executor(db)?;
        let run = |steps: u64, thread: Option<&str>| NewRun {
            thread_id: thread.map(str::to_string),
            ..NewRun::new("testkit", json!({ "steps": steps, "prefix": "r" }).to_string())
        };
        // old: finished 8 days ago, alone in its thread; shared: finished 8
        // days ago in a thread whose other run is open; recent: finished now.
        let old = db.store.create_run(&run(2, Some("t-old"))).await?.0.id;
        let shared = db.store.create_run(&run(1, Some("t-shared"))).await?.0.id;
        let recent = db.store.create_run(&run(1, None)).await?.0.id;
        for id in [old, shared, recent] {
            ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Completed)));
        }
        let open = db.store.create_run(&run(1, Some("t-shared"))).await?.0.id;
        for id in [old, shared] {
            backdate(db, id, 8 * DAY_MS).await?;
        }
        ensure!(count(db, "effects WHERE run_id = $1", old).await? == 2 && count(db, "events WHERE run_id = $1", old).await? > 0);

        // Off: nothing goes.
        let off = RetentionConfig { keep: Duration::ZERO, ..RetentionConfig::default() };
        ensure!(cleaner::tick(&db.store, &off).await?.runs == 0);
        // One batch at a time.
        let one = RetentionConfig { batch: 1, ..RetentionConfig::default() };
        let first = cleaner::tick(&db.store, &one).await?;
        ensure!(first.runs == 1 && first.effects == 2 && first.events > 0 && first.threads == 1, "{first:?}");
        let second = cleaner::tick(&db.store, &one).await?;
        ensure!(second.runs == 1 && second.threads == 0, "the thread keeps its open run: {second:?}");
        ensure!(cleaner::tick(&db.store, &RetentionConfig::default()).await?.runs == 0, "nothing more is past retention");

        for id in [old, shared] {
            ensure!(db.store.get_run(id).await.is_err(), "run {id} is gone");
            ensure!(count(db, "effects WHERE run_id = $1", id).await? == 0 && count(db, "events WHERE run_id = $1", id).await? == 0);
        }
        ensure!(!thread_exists(db, "t-old").await? && thread_exists(db, "t-shared").await?);
        for id in [recent, open] {
            ensure!(db.store.get_run(id).await.is_ok(), "run {id} stays");
        }
        ensure!(count(db, "effects WHERE run_id = $1", recent).await? == 1);
        let kv: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM kv").fetch_one(db.store.pool()).await?;
        ensure!(kv == 2, "kv data stays: {kv} keys");
        Ok(())
    }

    async fn under_constant_load_the_database_stops_growing_once_retention_deletes(db) {
        let exec = executor(db)?;
        let size = || -> u64 {
            let path = db.url().trim_start_matches("sqlite://").split('?').next().unwrap_or_default().to_string();
            ["", "-wal"].iter().map(|s| std::fs::metadata(format!("{path}{s}")).map_or(0, |m| m.len())).sum()
        };
        let mut sizes = Vec::new();
        let mut rows = Vec::new();
        for _ in 0..10 {
            let news: Vec<NewRun> = (0..300).map(|_| NewRun::new("testkit", json!({ "steps": 1, "prefix": "soak" }).to_string())).collect();
            db.store.create_runs(&news).await?;
            exec.drain().await?;
            sqlx::query("UPDATE runs SET finished_at = finished_at - $1 WHERE finished_at IS NOT NULL")
                .bind(8 * DAY_MS)
                .execute(db.store.pool())
                .await?;
            while cleaner::tick(&db.store, &RetentionConfig { batch: 100, ..RetentionConfig::default() }).await?.runs > 0 {}
            sizes.push(size());
            rows.push(sqlx::query_scalar::<_, i64>("SELECT (SELECT COUNT(*) FROM runs) + (SELECT COUNT(*) FROM events) + (SELECT COUNT(*) FROM effects)").fetch_one(db.store.pool()).await?);
        }
        ensure!(rows.iter().all(|n| *n == 0), "every round's runs were deleted: {rows:?}");
        if db.store.backend() == Backend::Sqlite {
            // Once the first rounds have sized the file, it stays within a bound.
            let settled = sizes[2];
            ensure!(sizes.iter().skip(3).all(|s| *s <= settled + settled / 4), "the file kept growing: {sizes:?}");
            eprintln!("retention soak (SQLite, bytes after each round of 300 runs): {sizes:?}");
        }
        Ok(())
    }
}

#[test]
fn a_bad_retention_setting_is_refused_with_its_reason() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("r.db").display());
    for (value, says) in [("7x", "the unit must be s, m, h or d"), ("d", "give a whole number and a unit"), ("-1d", "give a whole number")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(["serve", "--database-url", &url, &format!("--retention={value}")])
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success() && stderr.contains("--retention") && stderr.contains(says), "{value}: {stderr}");
    }
    Ok(())
}

/// PostgreSQL only: a submit to a thread whose last run retention is
/// deleting, made at the same moment, keeps its thread: the thread row is
/// not deleted from under the submit's committed run (its counter then
/// started again at 1 and the next submit to the thread clashed with the
/// run's event, for good). SQLite's one writer orders the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_racing_retentions_delete_of_its_thread_keeps_the_thread() -> Result<()> {
    use sqlx::Connection;
    crate::harness::run_on(Backend::Postgres, async |db: &TestDb| {
        let thread = "racing-thread";
        let mut old = NewRun::new("testkit", "{}");
        old.thread_id = Some(thread.into());
        let (old, _) = db.store.create_run(&old).await?;
        sqlx::query("UPDATE runs SET status = 'completed', finished_at = 0 WHERE id = $1").bind(old.id).execute(db.store.pool()).await?;
        // A submit to the thread, in flight: its run and its event written,
        // the thread's counter moved on and locked, not yet committed.
        let mut submit = sqlx::PgConnection::connect(db.url()).await?;
        sqlx::raw_sql("BEGIN").execute(&mut submit).await?;
        let new_id: i64 = sqlx::query_scalar(
            "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, created_at, updated_at) \
             VALUES ($1, 'testkit', '', '{}', 'queued', 3, 0, 0, 0) RETURNING id",
        )
        .bind(thread)
        .fetch_one(&mut submit)
        .await?;
        let seq: i64 = sqlx::query_scalar("UPDATE threads SET last_seq = last_seq + 1 WHERE id = $1 RETURNING last_seq")
            .bind(thread)
            .fetch_one(&mut submit)
            .await?;
        sqlx::query("INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) VALUES ($1, $2, $3, 0, 'submitted', '{}', 0)")
            .bind(thread)
            .bind(seq)
            .bind(new_id)
            .execute(&mut submit)
            .await?;
        let store = db.store.clone();
        let clean = tokio::spawn(async move { store.delete_finished(DAY_MS, 100).await });
        crate::harness::wait_for_count(
            db,
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            "retention waits on the submit's lock on the thread",
        )
        .await?;
        sqlx::raw_sql("COMMIT").execute(&mut submit).await?;
        let deleted = clean.await??;
        ensure!(deleted.runs == 1, "{deleted:?}");
        ensure!(thread_exists(db, thread).await?, "retention deleted the thread of a run submitted as it ran");
        // The thread goes on where it was.
        let mut next = NewRun::new("testkit", "{}");
        next.thread_id = Some(thread.into());
        let (next, _) = db.store.create_run(&next).await?;
        let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM events WHERE thread_id = $1 ORDER BY seq").bind(thread).fetch_all(db.store.pool()).await?;
        ensure!(seqs == vec![seq, seq + 1], "the thread's events after the race: {seqs:?} (run {})", next.id);
        Ok(())
    })
    .await
}
