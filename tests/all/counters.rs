//! A thread's event counter held by its one run (`runs.thread_seq`,
//! contract step `run_counters`): a run submitted without a thread writes
//! no `threads` row, and its emits and close move no second row; the first
//! other writer to its thread moves the count to a `threads` row. The log
//! reads gap-free either way. Both backends.

use anyhow::{Context, Result, ensure};
use leasehold::store::contract::Step;
use leasehold::store::{Event, NewRun, Outcome, Store};

use crate::harness::{TTL, both};

/// The thread's `threads` row counter, if it has one, and the counters its
/// runs hold.
async fn counters(s: &Store, thread: &str) -> Result<(Option<i64>, Vec<i64>)> {
    let row: Option<i64> = sqlx::query_scalar("SELECT last_seq FROM threads WHERE id = $1").bind(thread).fetch_optional(s.pool()).await?;
    let held: Vec<i64> = sqlx::query_scalar("SELECT thread_seq FROM runs WHERE thread_id = $1 AND thread_seq IS NOT NULL")
        .bind(thread)
        .fetch_all(s.pool())
        .await?;
    Ok((row, held))
}

/// `events` is the thread's whole log, numbered 1, 2, … with no gap, and
/// its kinds are `kinds`.
fn gap_free(events: &[Event], kinds: &[&str]) -> Result<()> {
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    ensure!(seqs == (1..=events.len() as i64).collect::<Vec<_>>(), "gaps: {seqs:?}");
    let got: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    ensure!(got == kinds, "{got:?}");
    Ok(())
}

async fn head(s: &Store, thread: &str) -> Result<i64> {
    let heads = s.thread_heads(&[thread.to_string(), "no such thread".to_string()]).await?;
    ensure!(heads.len() == 1 && heads[0].0 == thread, "{heads:?}");
    Ok(heads[0].1)
}

both! {
    async fn a_run_submitted_without_a_thread_holds_its_counter_until_another_writer_takes_it_over(db) {
        let s = &db.store;
        ensure!(s.contracted(Step::RunCounters).await?, "a new database starts with the step taken");
        let a = s.create_run(&NewRun::new("p", "{}")).await?.0;
        let t = a.thread_id.clone();
        ensure!(counters(s, &t).await? == (None, vec![1]), "after the submit: {:?}", counters(s, &t).await?);
        let c = s.claim("w", TTL).await?.context("a claim")?;
        ensure!(c.run.id == a.id);
        s.emit_deltas(&c.lease, &["a", "b"]).await?;
        ensure!(counters(s, &t).await? == (None, vec![3]), "after two deltas: {:?}", counters(s, &t).await?);
        ensure!(head(s, &t).await? == 3);
        s.close_with_deltas(&c.lease, &["c"], &Outcome::Completed { output: "1".into() }).await?;
        ensure!(counters(s, &t).await? == (None, vec![5]), "after the close: {:?}", counters(s, &t).await?);
        ensure!(head(s, &t).await? == 5);
        gap_free(&s.events_after(&t, 0, 100).await?, &["submitted", "delta", "delta", "delta", "message"])?;

        // A second run on the thread takes the count over, for good.
        let mut next = NewRun::new("p", "{}");
        next.thread_id = Some(t.clone());
        let b = s.create_run(&next).await?.0;
        ensure!(counters(s, &t).await? == (Some(6), vec![]), "after a second run's submit: {:?}", counters(s, &t).await?);
        let c = s.claim("w", TTL).await?.context("a claim")?;
        ensure!(c.run.id == b.id);
        s.emit_deltas(&c.lease, &["d"]).await?;
        s.close(&c.lease, &Outcome::Failed { error: "\"no\"".into() }).await?;
        ensure!(counters(s, &t).await? == (Some(8), vec![]), "{:?}", counters(s, &t).await?);
        ensure!(head(s, &t).await? == 8);
        let events = s.events_after(&t, 0, 100).await?;
        gap_free(&events, &["submitted", "delta", "delta", "delta", "message", "submitted", "delta", "message"])?;
        ensure!(events[4].run_id == a.id && events[7].run_id == b.id);
        Ok(())
    }

    async fn a_batch_submit_holds_counters_for_new_threads_and_takes_over_a_named_holders(db) {
        let s = &db.store;
        let a = s.create_run(&NewRun::new("p", "{}")).await?.0;
        let mut named = NewRun::new("p", "{}");
        named.thread_id = Some(a.thread_id.clone());
        let mut fresh = NewRun::new("p", "{}");
        fresh.thread_id = Some("named-new".into());
        let created = s.create_runs(&[NewRun::new("p", "{}"), named, fresh, NewRun::new("p", "{}")]).await?;
        ensure!(created.iter().all(|(_, new)| *new));
        for i in [0, 3] {
            let t = &created[i].0.thread_id;
            ensure!(counters(s, t).await? == (None, vec![1]), "run {i}: {:?}", counters(s, t).await?);
        }
        ensure!(counters(s, &a.thread_id).await? == (Some(2), vec![]), "{:?}", counters(s, &a.thread_id).await?);
        ensure!(counters(s, "named-new").await? == (Some(1), vec![]), "{:?}", counters(s, "named-new").await?);
        gap_free(&s.events_after(&a.thread_id, 0, 100).await?, &["submitted", "submitted"])?;

        // Before the step, a submit writes the thread's row as the previous
        // release does.
        s.expand_only().await?;
        let old = s.create_run(&NewRun::new("p", "{}")).await?.0;
        let batch = s.create_runs(&[NewRun::new("p", "{}")]).await?;
        for t in [&old.thread_id, &batch[0].0.thread_id] {
            ensure!(counters(s, t).await? == (Some(1), vec![]), "{t}: {:?}", counters(s, t).await?);
        }
        Ok(())
    }

    async fn a_host_that_has_not_seen_the_step_numbers_a_holding_run_from_its_counter(db) {
        let s = &db.store;
        let a = s.create_run(&NewRun::new("p", "{}")).await?.0;
        // This host's view: the step not (yet) taken. Messages are rows.
        s.expand_only().await?;
        let c = s.claim("w", TTL).await?.context("a claim")?;
        ensure!(c.run.id == a.id);
        s.emit_deltas(&c.lease, &["a"]).await?;
        s.close_with_deltas(&c.lease, &["b"], &Outcome::Completed { output: "2".into() }).await?;
        ensure!(counters(s, &a.thread_id).await? == (None, vec![4]), "{:?}", counters(s, &a.thread_id).await?);
        let events = s.events_after(&a.thread_id, 0, 100).await?;
        gap_free(&events, &["submitted", "delta", "delta", "message"])?;
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM events WHERE thread_id = $1 AND kind = 'message'")
            .bind(&a.thread_id)
            .fetch_one(s.pool())
            .await?;
        ensure!(rows == 1, "the message is a row before the step: {rows}");
        Ok(())
    }

    async fn a_holding_run_streaming_while_others_write_to_its_thread_keeps_the_log_gap_free(db) {
        let s = &db.store;
        for round in 0..4 {
            let a = s.create_run(&NewRun::new("p", "{}")).await?.0;
            let t = a.thread_id.clone();
            let c = s.claim("w", TTL).await?.context("a claim")?;
            ensure!(c.run.id == a.id);
            let streamer = {
                let (s, lease) = (s.clone(), c.lease.clone());
                tokio::spawn(async move {
                    for i in 0..30 {
                        s.emit_deltas(&lease, &[&format!("{i}")]).await?;
                    }
                    anyhow::Ok(())
                })
            };
            // Other writers: named input to the running run, and runs
            // submitted to its thread, one at a time and in a batch.
            let mut writers = tokio::task::JoinSet::new();
            for k in 0..6 {
                let (s, t, id) = (s.clone(), t.clone(), a.id);
                writers.spawn(async move {
                    match k % 3 {
                        0 => drop(s.deliver_named(id, &format!("x{k}"), &format!("{k}")).await?),
                        1 => {
                            let mut new = NewRun::new("p", "{}");
                            new.thread_id = Some(t);
                            s.create_run(&new).await?;
                        }
                        _ => {
                            let mut new = NewRun::new("p", "{}");
                            new.thread_id = Some(t);
                            s.create_runs(&[new, NewRun::new("p", "{}")]).await?;
                        }
                    }
                    anyhow::Ok(())
                });
            }
            while let Some(done) = writers.join_next().await {
                done??;
            }
            streamer.await??;
            s.close(&c.lease, &Outcome::Completed { output: "0".into() }).await?;
            let events = s.events_after(&t, 0, 1000).await?;
            let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
            ensure!(seqs == (1..=events.len() as i64).collect::<Vec<_>>(), "round {round}: gaps: {seqs:?}");
            let deltas = events.iter().filter(|e| e.kind == "delta").count();
            let submits = events.iter().filter(|e| e.kind == "submitted").count();
            ensure!(deltas == 30 && submits == 5, "round {round}: {deltas} deltas, {submits} submits");
            ensure!(counters(s, &t).await? == (Some(events.len() as i64), vec![]), "round {round}: {:?}", counters(s, &t).await?);
            ensure!(head(s, &t).await? == events.len() as i64);
            // Leave nothing claimable behind for the next round's claim.
            while let Some(c) = s.claim("w", TTL).await? {
                s.close(&c.lease, &Outcome::Completed { output: "0".into() }).await?;
            }
        }
        Ok(())
    }
}
