//! A closed run's `message` event: an `events` row written by the close
//! until the contract step `derived_messages` is taken, then read from the
//! run row (store::contract). A thread's log reads the same either way, and
//! across the switch. Both backends.

use anyhow::{Result, ensure};
use leasehold::store::contract::Step;
use leasehold::store::{Event, NewRun, Outcome, Store};
use serde_json::{Value, json};

use crate::harness::{TTL, both};

/// Submits `n` runs on `thread`, claims them, and closes them at once (so
/// closes of one thread share batches): every third fails, every other one
/// streams two deltas first. Returns the run ids in submit order.
async fn round(s: &Store, thread: &str, tag: &str, n: usize) -> Result<Vec<i64>> {
    let mut leases = Vec::new();
    for _ in 0..n {
        let mut new = NewRun::new("p", "{}");
        new.thread_id = Some(thread.into());
        let id = s.create_run(&new).await?.0.id;
        let c = s.claim("w", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        ensure!(c.run.id == id, "{c:?}");
        leases.push(c.lease);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (i, lease) in leases.iter().enumerate() {
        let (s, lease, tag) = (s.clone(), lease.clone(), tag.to_string());
        tasks.spawn(async move {
            let deltas: Vec<String> = if i % 2 == 0 { vec![format!("{tag}a{i}"), format!("{tag}b{i}")] } else { vec![] };
            let deltas: Vec<&str> = deltas.iter().map(String::as_str).collect();
            let outcome = if i % 3 == 2 {
                Outcome::Failed { error: format!("\"{tag} {i} failed\"") }
            } else {
                Outcome::Completed { output: format!("{{\"i\":{i},\"tag\":\"{tag}\"}}") }
            };
            s.close_with_deltas(&lease, &deltas, &outcome).await
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(leases.iter().map(|l| l.run_id).collect())
}

/// What run `id`'s message must say.
fn said(i: usize, tag: &str) -> Value {
    if i % 3 == 2 {
        json!({ "error": format!("\"{tag} {i} failed\""), "output": null, "status": "failed" })
    } else {
        json!({ "error": null, "output": format!("{{\"i\":{i},\"tag\":\"{tag}\"}}"), "status": "completed" })
    }
}

/// The thread's log is gap-free from 1, and each run of `runs` has its
/// submit, then its deltas, and exactly one message, saying what it should,
/// after them.
fn check_log(events: &[Event], runs: &[(i64, usize, &str)]) -> Result<()> {
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    ensure!(seqs == (1..=events.len() as i64).collect::<Vec<_>>(), "gaps: {seqs:?}");
    for (id, i, tag) in runs {
        let of: Vec<&Event> = events.iter().filter(|e| e.run_id == *id).collect();
        let kinds: Vec<&str> = of.iter().map(|e| e.kind.as_str()).collect();
        let want: &[&str] = if i % 2 == 0 { &["submitted", "delta", "delta", "message"] } else { &["submitted", "message"] };
        ensure!(kinds == want, "run {id}: {kinds:?}");
        let message: Value = serde_json::from_str(&of[of.len() - 1].payload)?;
        ensure!(message == said(*i, tag), "run {id}: {message}");
    }
    Ok(())
}

both! {
    async fn a_close_writes_its_message_as_a_row_until_the_contract_step_and_the_log_reads_the_same_after(db) {
        let s = &db.store;
        // A database this release made starts contracted.
        ensure!(s.read_contract_steps().await? == Step::ALL, "a new database is not contracted");
        // As a rolling upgrade leaves it: messages are rows.
        s.expand_only().await?;
        ensure!(!s.contracted(Step::DerivedMessages).await?);
        let before = round(s, "m", "x", 9).await?;
        let rows = |s: &Store| {
            let s = s.clone();
            async move { Ok::<i64, anyhow::Error>(sqlx::query_scalar("SELECT COUNT(*) FROM events WHERE thread_id = 'm' AND kind = 'message'").fetch_one(s.pool()).await?) }
        };
        ensure!(rows(s).await? == 9, "{} message rows for 9 closes", rows(s).await?);
        let written = s.events_after("m", 0, 1000).await?;

        // The operator's step; then the same closes once more.
        ensure!(s.contract().await? == Step::ALL);
        ensure!(s.contract().await?.is_empty(), "a step was taken twice");
        let after = round(s, "m", "x", 9).await?;
        ensure!(rows(s).await? == 9, "the contracted closes wrote message rows");
        let derived: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE thread_id = 'm' AND message_seq IS NOT NULL").fetch_one(s.pool()).await?;
        ensure!(derived == 9, "{derived} runs with a message_seq");

        let events = s.events_after("m", 0, 1000).await?;
        ensure!(events[..written.len()] == written[..], "the rows written before read differently after the step");
        let runs: Vec<(i64, usize, &str)> = before.iter().chain(&after).enumerate().map(|(k, id)| (*id, k % 9, "x")).collect();
        check_log(&events, &runs)?;
        // The same outcome says the same bytes, written or derived.
        for (a, b) in before.iter().zip(&after) {
            let payload = |id: &i64| events.iter().find(|e| e.run_id == *id && e.kind == "message").map(|e| e.payload.clone());
            ensure!(payload(a) == payload(b) && payload(a).is_some(), "{:?} against {:?}", payload(a), payload(b));
        }
        // A run's own events, pages of a few bytes, and the thread's head
        // agree with the whole log.
        for id in before.iter().chain(&after) {
            let own = s.run_events(*id).await?;
            ensure!(own == events.iter().filter(|e| e.run_id == *id).cloned().collect::<Vec<_>>(), "run {id}: {own:?}");
        }
        let mut paged = Vec::new();
        while paged.len() < events.len() {
            let page = s.events_page("m", paged.last().map_or(0, |e: &Event| e.seq), 1000, 60).await?;
            ensure!(!page.is_empty() && page.len() < events.len(), "a page of {} events", page.len());
            paged.extend(page);
        }
        ensure!(paged == events, "pages read differently");
        ensure!(s.thread_heads(&["m".to_string()]).await? == [("m".to_string(), events.len() as i64)]);
        Ok(())
    }
}

/// `leasehold schema ARGS --database-url URL`: its exit code, stdout and
/// stderr.
fn schema(url: &str, args: &[&str]) -> Result<(i32, String, String)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .arg("schema")
        .args(args)
        .args(["--database-url", url])
        .env("LEASEHOLD_LOG", "error")
        .output()?;
    Ok((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into()))
}

both! {
    async fn schema_says_which_steps_are_taken_takes_them_once_and_refuses_a_database_this_release_never_migrated(db) {
        let taken = |out: &str| out.lines().any(|l| l.starts_with("derived_messages") && l.ends_with("taken"));
        let (code, out, err) = schema(db.url(), &["status"])?;
        ensure!(code == 0 && taken(&out), "status of a new database: {code} {out}{err}");
        db.store.expand_only().await?;
        let (code, out, err) = schema(db.url(), &["status"])?;
        ensure!(code == 0 && out.lines().any(|l| l.starts_with("derived_messages") && l.ends_with("pending")), "{code} {out}{err}");
        let (code, out, err) = schema(db.url(), &["contract"])?;
        ensure!(code == 0 && out.contains("taken: derived_messages") && out.contains("taken: run_counters"), "{code} {out}{err}");
        ensure!(db.store.read_contract_steps().await? == Step::ALL);
        let (code, out, err) = schema(db.url(), &["contract"])?;
        ensure!(code == 0 && out.contains("already taken"), "{code} {out}{err}");

        // A database only a previous release migrated: no step to take
        // until this release's `serve` migrates it.
        let old = crate::harness::TestDb::empty(db.backend).await?;
        let previous = match db.backend { leasehold::Backend::Postgres => 36, leasehold::Backend::Sqlite => 32 };
        old.store.migrate_to(previous).await?;
        let (code, out, err) = schema(old.url(), &["contract"])?;
        ensure!(code != 0 && err.contains("not been migrated by this release"), "{code} {out}{err}");
        old.cleanup().await?;
        Ok(())
    }
}

both! {
    async fn a_page_of_a_long_thread_reads_about_a_page_not_the_rest_of_the_thread(db) {
        use sqlx::Row;
        let s = &db.store;
        // 400 runs on one thread, then 20,000 events and their 400 derived
        // messages after their submits (from seq 1,000).
        let mut ids = Vec::new();
        for _ in 0..400 {
            let mut new = NewRun::new("p", "{}");
            new.thread_id = Some("long".into());
            ids.push(s.create_run(&new).await?.0.id);
        }
        sqlx::query("INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
                     SELECT 'long', 1000 + g.n, $1, 0, 'delta', '{\"delta\":\"x\",\"pos\":0}', 0 FROM (WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 20400) SELECT n FROM g) AS g WHERE g.n % 51 <> 0")
            .bind(ids[0]).execute(s.pool()).await?;
        for (k, id) in ids.iter().enumerate() {
            sqlx::query("UPDATE runs SET status = 'completed', output = '1', finished_at = 0, message_seq = $2 WHERE id = $1").bind(id).bind(1000 + (k as i64 + 1) * 51).execute(s.pool()).await?;
        }
        let page = s.events_page("long", 1000, 60, 1 << 20).await?;
        ensure!(page.len() == 60 && page[0].seq == 1001 && page[60 - 1].seq == 1060 && page.iter().any(|e| e.kind == "message"), "{:?}", page.iter().map(|e| (e.seq, e.kind.as_str())).collect::<Vec<_>>());
        let sql = leasehold::store::log::events_page_sql(s);
        match db.backend {
            leasehold::Backend::Postgres => {
                sqlx::query("ANALYZE events").execute(s.pool()).await?;
                sqlx::query("ANALYZE runs").execute(s.pool()).await?;
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN (ANALYZE, COSTS OFF) {sql}")))
                    .bind("long").bind(1000_i64).bind(60_i64).bind(1_i64 << 20).fetch_all(s.pool()).await?;
                let plan: Vec<String> = rows.iter().map(|r| r.try_get::<String, _>(0).unwrap_or_default()).collect();
                // Every node's rows: at most a page from each side.
                let most = plan.iter().filter_map(|l| l.split("rows=").nth(1)).filter_map(|r| r.split(' ').next()?.parse::<i64>().ok()).max().unwrap_or(0);
                ensure!(most <= 2 * 60 + 1, "a page of 60 read {most} rows of a node:\n{}", plan.join("\n"));
            }
            leasehold::Backend::Sqlite => {
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                    .bind("long").bind(1000_i64).bind(60_i64).bind(1_i64 << 20).fetch_all(s.pool()).await?;
                let plan: Vec<String> = rows.iter().map(|r| r.try_get::<String, _>(3).unwrap_or_default()).collect();
                // Each side from its index, in its order: no full scan, no
                // sort of a side.
                ensure!(!plan.iter().any(|l| l.starts_with("SCAN events") || l.starts_with("SCAN runs")), "{}", plan.join("\n"));
                ensure!(plan.iter().any(|l| l.contains("runs_messages")), "{}", plan.join("\n"));
            }
        }
        Ok(())
    }
}
