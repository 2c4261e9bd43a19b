//! The per-minute rollup the dashboard's charts draw (`rollup`,
//! `store::rollup`, `GET /v1/stats/history`): each minute's finished runs
//! counted once however many hosts count, queued and running sampled,
//! first claims' waits added up from every host. Both backends.

use anyhow::{Context, Result, ensure};
use leasehold::store::rollup::MINUTE_MS;
use leasehold::store::{NewRun, Store};
use serde_json::Value;

use crate::harness::both;

/// A run finished with `status` at `at` (epoch ms).
async fn finished(store: &Store, status: &str, at: i64) -> Result<()> {
    let id = store.create_run(&NewRun::new("p", "{}")).await?.0.id;
    sqlx::query("UPDATE runs SET status = $1, finished_at = $2 WHERE id = $3").bind(status).bind(at).bind(id).execute(store.pool()).await?;
    Ok(())
}

async fn rows(store: &Store, minute: i64) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as("SELECT series, n FROM stats_minutes WHERE minute = $1 ORDER BY series").bind(minute).fetch_all(store.pool()).await?)
}

both! {
    async fn each_minute_is_counted_once_however_many_hosts_count_it(db) {
        let m = 1_800_000_000_000 / MINUTE_MS * MINUTE_MS;
        for (status, at) in [("completed", m + 1), ("completed", m + 59_999), ("failed", m + 30_000), ("completed", m + 60_000), ("cancelled", m - 1)] {
            finished(&db.store, status, at).await?;
        }
        db.store.create_run(&NewRun::new("p", "{}")).await?; // queued
        // Too soon: minute m ended less than 10 s ago.
        ensure!(db.store.count_minutes(m + 60_000 + 9_999).await? == 60, "the hour before m is counted, m is not yet");
        ensure!(rows(&db.store, m).await?.is_empty());
        // Two hosts count at once: each minute once.
        let other = db.another_store(2).await?;
        let now = m + 60_000 + 10_000;
        let (a, b) = tokio::join!(db.store.count_minutes(now), other.count_minutes(now));
        ensure!(a? + b? == 1, "minute m counted once");
        let got = rows(&db.store, m).await?;
        let want: Vec<(String, i64)> = [("counted", 1), ("finished:completed", 2), ("finished:failed", 1), ("queued", 1), ("sampled", 1)]
            .iter()
            .map(|(s, n)| (s.to_string(), *n))
            .collect();
        ensure!(got == want, "{got:?}");
        // The newest minute of the first count was sampled too.
        let before: Vec<(String, i64)> = [("counted", 1), ("finished:cancelled", 1), ("queued", 1), ("sampled", 1)].iter().map(|(s, n)| (s.to_string(), *n)).collect();
        ensure!(rows(&db.store, m - MINUTE_MS).await? == before, "the minute before: {:?}", rows(&db.store, m - MINUTE_MS).await?);
        ensure!(rows(&db.store, m - 2 * MINUTE_MS).await? == vec![("counted".to_string(), 1)], "an older minute: counted, not sampled");
        ensure!(db.store.count_minutes(now).await? == 0, "counted again");
        Ok(())
    }

    async fn first_claims_waits_are_added_up_and_the_history_shows_percentiles(db) {
        let now = db.store.now_ms().await?;
        let current = now / MINUTE_MS * MINUTE_MS;
        // Two minutes ago: two runs finished, counted below.
        finished(&db.store, "completed", current - 2 * MINUTE_MS + 5).await?;
        finished(&db.store, "aborted", current - 2 * MINUTE_MS + 50_000).await?;
        // Waits observed in the previous minute: 98 quick, one of 2 s, one
        // over an hour.
        let at = current - MINUTE_MS + 1;
        for _ in 0..98 {
            leasehold::maintenance::rollup::observe_wait(&db.store, at, 7);
        }
        leasehold::maintenance::rollup::observe_wait(&db.store, at, 2000);
        leasehold::maintenance::rollup::observe_wait(&db.store, at, 5_000_000);
        // The previous minute is counted as if 10 s after it ended.
        let pass = leasehold::maintenance::rollup::tick_at(&db.store, current + 10_000).await?;
        ensure!(pass.waits == 3 && pass.counted == 60, "{pass:?}");
        // Another host's waits for the same minute add to them.
        db.store.add_waits(&[(current - MINUTE_MS, 0, 2)]).await?;
        let (base, http, _stop) = crate::schedules::api(db).await?;
        let history: Value = http.get(format!("{base}/v1/stats/history?minutes=5")).send().await?.json().await?;
        let points = history["minutes"].as_array().context("minutes")?;
        // The newest point is this minute, or the next if the clock turned
        // a minute since `current` was read: points are found by minute.
        let newest = points.last().and_then(|p| p["minute"].as_i64()).unwrap_or_default();
        ensure!(points.len() == 5 && (newest == current || newest == current + MINUTE_MS), "{history}");
        let at = |minute: i64| points.iter().find(|p| p["minute"] == minute).with_context(|| format!("no minute {minute}: {history}"));
        let before = at(current - 2 * MINUTE_MS)?;
        ensure!(before["finished"] == serde_json::json!({"completed": 1, "failed": 0, "aborted": 1, "cancelled": 0}), "{before}");
        let last = at(current - MINUTE_MS)?;
        ensure!(last["started"] == 102 && last["start_wait_p50_ms"] == 10 && last["start_wait_p99_ms"] == 2500, "{last}");
        ensure!(last["queued"] == 0 && last["running"] == 0, "sampled with none: {last}");
        let this = at(current)?;
        ensure!(this["finished"].is_null(), "the current minute is not counted: {this}");
        let r = http.get(format!("{base}/v1/stats/history?minutes=0")).send().await?;
        ensure!(r.status() == 400, "{}", r.text().await?);
        Ok(())
    }
}

/// On SQLite the rollup's counts and the reaper's orphan sweep read
/// indexes, never the whole `runs` table (each tick of every host runs
/// them; a scan there grows with every run kept).
#[tokio::test]
async fn the_rollup_and_the_orphan_sweep_read_indexes_not_the_runs_table() -> anyhow::Result<()> {
    use sqlx::Row;
    crate::harness::run_on(leasehold::store::Backend::Sqlite, async |db| {
        let s = &db.store;
        let plan = async |sql: &str, binds: usize| -> anyhow::Result<String> {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")));
            for _ in 0..binds {
                q = q.bind(1_i64);
            }
            let rows = q.fetch_all(s.pool()).await?;
            Ok(rows.iter().map(|r| r.try_get::<String, _>(3).unwrap_or_default()).collect::<Vec<_>>().join("\n"))
        };
        let [finished, queued, running] = leasehold::store::rollup::count_sql(s);
        let [_, recent] = s.orphans_sql();
        for (sql, binds) in [(finished, 2), (queued, 0), (running, 0), (recent, 2)] {
            let p = plan(sql, binds).await?;
            let scans = p.lines().any(|l| {
                let l = l.trim();
                l.starts_with("SCAN ") && !l.contains("USING")
            });
            anyhow::ensure!(!scans, "{sql}\nreads the runs table whole:\n{p}");
        }
        anyhow::ensure!(plan(recent, 2).await?.contains("runs_ended"), "the sweep does not start from recently ended parents");
        Ok(())
    })
    .await
}

/// A budget hold reads its tree's spend under the root's lock: through the
/// tree's index and the ledgers' committed chat calls, never a scan of
/// `runs` or of every ledger row in the tree.
#[tokio::test]
async fn a_budget_hold_reads_its_trees_chat_calls_not_its_ledgers() -> anyhow::Result<()> {
    use sqlx::Row;
    crate::harness::run_on(leasehold::store::Backend::Sqlite, async |db| {
        let s = &db.store;
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {}", s.spend_sql()))).bind(1_i64).fetch_all(s.pool()).await?;
        let plan: Vec<String> = rows.iter().map(|r| r.try_get::<String, _>(3).unwrap_or_default()).collect();
        let plan = plan.join("\n");
        anyhow::ensure!(plan.contains("effects_chat") && plan.contains("runs_root"), "{plan}");
        let tables = ["SCAN runs", "SCAN r", "SCAN e", "SCAN effects", "SCAN h", "SCAN budget_holds"];
        anyhow::ensure!(!plan.lines().any(|l| tables.contains(&l.trim()) || tables.iter().any(|t| l.trim().starts_with(&format!("{t} ")) && !l.contains("USING"))), "a scan:\n{plan}");
        Ok(())
    })
    .await
}
