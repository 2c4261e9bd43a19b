//! What a plugin may store, on both backends: its kv namespace holds at
//! most its quota over all its runs, a put counts against its run's ledger
//! budget by its size, and a turn's emits are capped by count as well as
//! bytes. The guest is `plugins/testkit`.

use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::runtime::Limits;
use leasehold::store::{EffectState, KvQuota, KvUsage, NewRun, Store};
use serde_json::{Value, json};

use crate::harness::{TestDb, both, only};
use crate::plugins;

fn executor(db: &TestDb, limits: Limits) -> Result<Executor> {
    let rt = plugins::runtime()?;
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    let config = crate::harness::worker("w");
    Ok(Executor::new(db.store.clone(), rt, config))
}

/// Runs a new run of `ops` (testkit's `script` mode) to its end; returns
/// its id, the last segment's outcome, and its output or error.
async fn run(db: &TestDb, exec: &Executor, ops: Value) -> Result<(i64, Option<SegmentOutcome>, String)> {
    let input = json!({ "mode": "script", "ops": ops }).to_string();
    let id = db.store.create_run(&NewRun::new("testkit", input)).await?.0.id;
    let out = tokio::time::timeout(Duration::from_secs(60), exec.run_once()).await??.map(|(_, o)| o);
    let run = db.store.get_run(id).await?;
    Ok((id, out, run.output.or(run.error).unwrap_or_default()))
}

/// A `kv.put` whose error the script returns rather than raises.
fn put(key: &str, value: &str) -> Value {
    json!({ "op": "effect", "name": "kv.put", "request": json!({ "key": key, "value": value }).to_string() })
}

/// What the namespace holds, counted from `kv` itself.
async fn counted(store: &Store, namespace: &str) -> Result<KvUsage> {
    let statement = if store.backend() == leasehold::store::Backend::Postgres {
        "SELECT COUNT(*), COALESCE(SUM(octet_length(key) + octet_length(value)), 0)::bigint FROM kv WHERE namespace = $1"
    } else {
        "SELECT COUNT(*), COALESCE(SUM(length(CAST(key AS BLOB)) + length(CAST(value AS BLOB))), 0) FROM kv WHERE namespace = $1"
    };
    let (keys, bytes): (i64, i64) = sqlx::query_as(statement).bind(namespace).fetch_one(store.pool()).await?;
    Ok(KvUsage { keys, bytes })
}

both! {
    async fn a_put_past_the_plugins_kv_quota_is_refused_recorded_and_the_turn_goes_on(db) {
        let quota = KvQuota { max_keys: 3, max_bytes: 1 << 20 };
        let exec = executor(db, Limits { kv: quota, ..plugins::test_limits() })?;
        let (id, out, output) =
            run(db, &exec, json!([put("a", "1"), put("b", "2"), put("c", "3"), put("d", "4"), put("a", "overwritten")])).await?;
        ensure!(out == Some(SegmentOutcome::Completed), "{out:?} {output}");
        let results: Vec<Value> = serde_json::from_str(&output)?;
        ensure!(results[..3].iter().all(|r| r == "null") && results[4] == "null", "{results:?}");
        let refused = results[3].as_str().unwrap_or_default();
        ensure!(refused.starts_with("denied: kv.put: plugin \"testkit\"'s kv would hold") && refused.contains("quota is"), "{refused}");
        // The refusal is recorded, so a replay returns it again.
        let row = &db.store.effects(id).await?[3];
        ensure!(row.state == EffectState::Failed && row.result.as_deref().is_some_and(|r| r.contains("quota")), "{row:?}");

        // The quota holds across runs; a key it holds may still change.
        let (_, _, output) = run(db, &exec, json!([put("e", "5"), put("b", "changed")])).await?;
        let results: Vec<Value> = serde_json::from_str(&output)?;
        ensure!(results[0].as_str().is_some_and(|r| r.starts_with("denied: ")) && results[1] == "null", "{results:?}");

        // The usage the check reads is what the namespace holds.
        let usage = db.store.kv_usage("testkit").await?;
        ensure!(usage == counted(&db.store, "testkit").await? && usage.keys == 3, "{usage:?}");
        Ok(())
    }

    async fn the_kv_quota_counts_bytes_of_keys_and_values_exactly_at_its_edge(db) {
        // Each key is 1 byte and each value as JSON: 42 (40 x's, two
        // quotes) or 3 ("1").
        let x40 = "x".repeat(40);
        let quota = KvQuota { max_keys: 100, max_bytes: 86 };
        let exec = executor(db, Limits { kv: quota, ..plugins::test_limits() })?;
        let (_, _, output) = run(db, &exec, json!([put("a", &x40), put("b", &x40), put("c", "1"), put("a", "1"), put("c", "1")])).await?;
        let results: Vec<Value> = serde_json::from_str(&output)?;
        // 86 bytes for a and b: full. c does not fit until a shrinks.
        ensure!(results[0] == "null" && results[1] == "null", "{results:?}");
        ensure!(results[2].as_str().is_some_and(|r| r.contains("90 bytes")), "{results:?}");
        ensure!(results[3] == "null" && results[4] == "null", "{results:?}");
        let usage = db.store.kv_usage("testkit").await?;
        ensure!(usage == counted(&db.store, "testkit").await? && usage == KvUsage { keys: 3, bytes: 4 + 43 + 4 }, "{usage:?}");
        Ok(())
    }

    async fn a_put_counts_against_its_runs_ledger_budget_by_its_size(db) {
        let exec = executor(db, Limits { max_ledger_bytes: 10_000, ..plugins::test_limits() })?;
        let big = "y".repeat(3_000);
        let ops: Vec<Value> = (0..5).map(|i| json!({ "op": "put", "key": format!("k{i}"), "value": big })).collect();
        let (_, out, error) = run(db, &exec, json!(ops)).await?;
        ensure!(matches!(out, Some(SegmentOutcome::Failed(_))) && error.starts_with("ledger-too-large: "), "{out:?} {error}");
        // A resumed segment reads the puts' sizes back from the ledger.
        let (id, out, _) = run(db, &exec, json!(ops[..2])).await?;
        ensure!(out == Some(SegmentOutcome::Completed), "{out:?}");
        let summary = db.store.ledger_summary(id).await?;
        ensure!(summary.bytes >= 2 * 3_000 && summary.bytes < 2 * 3_100, "{summary:?}");
        Ok(())
    }

    async fn a_turn_that_emits_more_times_than_its_cap_fails_as_too_large(db) {
        let exec = executor(db, Limits { max_emits: 10, ..plugins::test_limits() })?;
        let ops: Vec<Value> = (0..11).map(|_| json!({ "op": "emit", "text": "x" })).collect();
        let (_, out, error) = run(db, &exec, json!(ops)).await?;
        ensure!(matches!(out, Some(SegmentOutcome::Failed(_))) && error.starts_with("output-too-large: emitted more than 10 times"), "{out:?} {error}");
        let ops: Vec<Value> = (0..10).map(|_| json!({ "op": "emit", "text": "x" })).collect();
        let (_, out, _) = run(db, &exec, json!(ops)).await?;
        ensure!(out == Some(SegmentOutcome::Completed), "ten emits are within the cap: {out:?}");
        Ok(())
    }
}

// SQLite has one writer: transactions never write at once there.
only! { postgres:
    async fn writers_of_one_namespace_on_two_connections_do_not_wait_on_one_usage_counter(db) {
        use sqlx::Connection;
        // Two connections whose backends count in different shards (pid
        // modulo 64), as two hosts' (or one host's two) connections do.
        let mut conns = Vec::new();
        let mut shards = std::collections::HashSet::new();
        while conns.len() < 2 {
            let mut c = sqlx::PgConnection::connect(db.url()).await?;
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut c).await?;
            if shards.insert(pid % 64) {
                conns.push(c);
            }
        }
        let mut txs = Vec::new();
        for (i, c) in conns.iter_mut().enumerate() {
            let mut tx = c.begin().await?;
            // Waiting on the other's counter row fails at once, not after a hang.
            sqlx::query("SET LOCAL lock_timeout = '2s'").execute(&mut *tx).await?;
            sqlx::query("INSERT INTO kv (namespace, key, value, updated_at) VALUES ('testkit', $1, '1', 0)")
                .bind(format!("k{i}"))
                .execute(&mut *tx)
                .await
                .map_err(|e| anyhow::anyhow!("put {i} waited on the other's uncommitted put: {e}"))?;
            txs.push(tx);
        }
        for tx in txs {
            tx.commit().await?;
        }
        let usage = db.store.kv_usage("testkit").await?;
        ensure!(usage == KvUsage { keys: 2, bytes: 2 * 3 } && usage == counted(&db.store, "testkit").await?, "{usage:?}");
        Ok(())
    }
}

both! {
    async fn runs_putting_within_a_second_of_the_hosts_last_usage_read_start_their_estimate_from_it(db) {
        let exec = executor(db, plugins::test_limits())?;
        let before = db.store.kv_usage_reads();
        let started = std::time::Instant::now();
        for i in 0..3 {
            let (_, out, _) = run(db, &exec, json!([put(&format!("r{i}"), "1")])).await?;
            ensure!(out == Some(SegmentOutcome::Completed), "{out:?}");
        }
        let took = started.elapsed();
        let reads = db.store.kv_usage_reads() - before;
        // One read serves the second after it: a loaded machine whose runs
        // took longer reads once more for each second past the first.
        ensure!(reads >= 1 && reads <= 1 + took.as_secs(), "three one-put runs read the usage {reads} times in {took:?}");
        // A refusal is still decided from a read: the estimate counts the
        // puts since, and one over the quota reads again.
        let exec = executor(db, Limits { kv: KvQuota { max_keys: 3, max_bytes: 1 << 20 }, ..plugins::test_limits() })?;
        let (_, _, output) = run(db, &exec, json!([put("r3", "1")])).await?;
        let results: Vec<Value> = serde_json::from_str(&output)?;
        ensure!(results[0].as_str().is_some_and(|r| r.starts_with("denied: ")), "{results:?}");
        ensure!(db.store.kv_usage_reads() - before == reads + 1, "the refusal was not decided from a read");
        Ok(())
    }
}
