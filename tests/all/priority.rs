//! Priorities: higher is claimed first, by every form of the claim; within
//! one priority, runs go in the order they became eligible; a priority
//! whose runs are asleep or leased holds nothing back.

use anyhow::{Context, Result, ensure};
use leasehold::store::{NewRun, Store};
use serde_json::json;

use crate::harness::{TTL, both};

async fn submit(store: &Store, priority: i64) -> Result<i64> {
    let new = NewRun { priority, ..NewRun::new("p", "{}") };
    let (run, _) = store.create_run(&new).await?;
    ensure!(run.priority == priority, "the run came back with priority {}, not {priority}", run.priority);
    Ok(run.id)
}

/// Submits runs of `priorities` in that order; returns their ids in the
/// order a claim must take them: highest priority first, then oldest.
async fn queue(store: &Store, priorities: &[i64]) -> Result<Vec<i64>> {
    let mut runs = Vec::new();
    for &p in priorities {
        runs.push((p, submit(store, p).await?));
    }
    runs.sort_by_key(|&(p, id)| (-p, id));
    Ok(runs.into_iter().map(|(_, id)| id).collect())
}

const MIXED: [i64; 9] = [0, 5, -3, 5, 0, 1000, -1000, 0, 5];

both! {
    async fn claims_take_higher_priorities_first_and_the_oldest_within_one(db) {
        let s = &db.store;
        // One at a time (the one-run statement).
        let want = queue(s, &MIXED).await?;
        let mut got = Vec::new();
        while let Some(c) = s.claim("w", TTL).await? {
            got.push(c.run.id);
        }
        ensure!(got == want, "one at a time: claimed {got:?}, want {want:?}");
        Ok(())
    }

    async fn batched_claims_take_higher_priorities_first(db) {
        let s = &db.store;
        let want = queue(s, &MIXED).await?;
        // Batches that span priorities; the claim returns a batch by id,
        // so compare each batch as a set against the next slice of `want`.
        let mut at = 0;
        for n in [4, 3, 2] {
            let mut got: Vec<i64> = s.claim_batch("w", TTL, n).await?.iter().map(|c| c.run.id).collect();
            let mut expected = want[at..at + n as usize].to_vec();
            got.sort();
            expected.sort();
            ensure!(got == expected, "batch of {n} at {at}: claimed {got:?}, want {expected:?} (queue order {want:?})");
            at += n as usize;
        }
        ensure!(s.claim_batch("w", TTL, 5).await?.is_empty());
        Ok(())
    }

    async fn claims_for_a_local_queue_take_higher_priorities_first(db) {
        // A claim that counts an attempt for only some of its runs (a
        // worker with a local queue) goes through another statement on
        // SQLite (one slot per run).
        let s = &db.store;
        let want = queue(s, &MIXED).await?;
        let mut got: Vec<i64> = s.claim_batch_charging("w", TTL, 5, 2).await?.iter().map(|c| c.run.id).collect();
        let mut expected = want[..5].to_vec();
        got.sort();
        expected.sort();
        ensure!(got == expected, "claimed {got:?}, want {expected:?}");
        Ok(())
    }

    async fn a_priority_whose_runs_are_asleep_or_leased_holds_no_lower_one_back(db) {
        let s = &db.store;
        // Priority 9: one run leased (its lease live), one asleep for an
        // hour. Priority 0: one ready run, which the next claim must take.
        let leased = submit(s, 9).await?;
        let claimed = s.claim("a", TTL).await?.map(|c| c.run.id);
        ensure!(claimed == Some(leased));
        let asleep = submit(s, 9).await?;
        sqlx::query("UPDATE runs SET not_before = not_before + 3600000 WHERE id = $1").bind(asleep).execute(s.pool()).await?;
        let ready = submit(s, 0).await?;
        let next = s.claim("b", TTL).await?.map(|c| c.run.id);
        ensure!(next == Some(ready), "claimed {next:?}, want the ready run {ready}");
        // Once its lease runs out, the leased run of priority 9 comes
        // before a newer ready run of priority 0.
        let newer = submit(s, 0).await?;
        db.backdate_lease(leased, TTL.as_millis() as i64 + 1_000).await?;
        let next = s.claim("b", TTL).await?.map(|c| c.run.id);
        ensure!(next == Some(leased), "claimed {next:?}, want the expired run {leased} before {newer}");
        Ok(())
    }

    async fn a_priority_outside_the_range_is_refused_and_writes_nothing(db) {
        let s = &db.store;
        for p in [1001, -1001, i64::MAX] {
            let one = s.create_run(&NewRun { priority: p, ..NewRun::new("p", "{}") }).await;
            ensure!(one.as_ref().is_err_and(|e| e.to_string().contains("priority must be between -1000 and 1000")), "{p}: {one:?}");
            let batch = s.create_runs(&[NewRun::new("p", "{}"), NewRun { priority: p, ..NewRun::new("p", "{}") }]).await;
            ensure!(batch.as_ref().is_err_and(|e| e.to_string().contains("run 1: priority")), "{p}: {batch:?}");
        }
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(s.pool()).await?;
        ensure!(n == 0, "{n} runs written");
        // Both ends of the range are allowed, in a batch too.
        let batch = s.create_runs(&[
            NewRun { priority: 1000, thread_id: Some("hi".into()), ..NewRun::new("p", "{}") },
            NewRun { priority: -1000, thread_id: Some("lo".into()), ..NewRun::new("p", "{}") },
        ]).await?;
        ensure!(batch.iter().map(|(r, _)| r.priority).collect::<Vec<_>>() == [1000, -1000], "{batch:?}");
        let shown = serde_json::to_value(&batch[0].0)?;
        ensure!(shown["priority"] == json!(1000), "the run as the API shows it: {shown}");
        Ok(())
    }
}

both! {
    async fn a_dead_runs_lease_is_taken_over_before_a_higher_priority_backlog(db) {
        let s = &db.store;
        let dead_lease = crate::harness::TTL.as_millis() as i64 + 1_000;
        // Without a key.
        let old = s.create_run(&NewRun::new("p", "{}")).await?.0.id;
        ensure!(s.claim("dead", crate::harness::TTL).await?.context("the run")?.lease.run_id == old);
        for _ in 0..3 {
            s.create_run(&NewRun { priority: 10, ..NewRun::new("p", "{}") }).await?;
        }
        db.backdate_lease(old, dead_lease).await?;
        let got = s.claim("b", crate::harness::TTL).await?.context("a run")?;
        ensure!(got.run.id == old, "the takeover waited behind priority 10: claimed {}", got.run.id);
        while let Some(c) = s.claim("b", crate::harness::TTL).await? {
            s.close(&c.lease, &leasehold::store::Outcome::Completed { output: String::new() }).await?;
        }
        // In a key's lane.
        let keyed = |priority| NewRun { priority, concurrency_key: Some("k".into()), ..NewRun::new("p", "{}") };
        let old = s.create_run(&keyed(0)).await?.0.id;
        ensure!(s.claim("dead", crate::harness::TTL).await?.context("the keyed run")?.lease.run_id == old);
        for _ in 0..3 {
            s.create_run(&keyed(10)).await?;
        }
        db.backdate_lease(old, dead_lease).await?;
        let got = s.claim("b", crate::harness::TTL).await?.context("a keyed run")?;
        ensure!(got.run.id == old, "the key's takeover waited behind its priority 10: claimed {}", got.run.id);
        Ok(())
    }
}
