//! The lease protocol conformance suite (docs/concepts.md), one body per case,
//! run on both backends.

use anyhow::{Result, ensure};
use leasehold::store::{Claimed, Completion, EffectCall, EffectClass, EffectState, HeldPut, LocalOp, NewRun, Outcome, RunStatus, Store, StoreError, Suspend};
use leasehold::maintenance::reaper::{self, ReaperConfig};

use crate::harness::{TTL, TestDb, both};

async fn submit(store: &Store, max_attempts: i64) -> Result<i64> {
    let mut new = NewRun::new("p", r#"{"q":1}"#);
    new.max_attempts = Some(max_attempts);
    Ok(store.create_run(&new).await?.0.id)
}

async fn claim(store: &Store, owner: &str) -> Result<Claimed> {
    store
        .claim(owner, TTL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{owner} found nothing to claim"))
}

fn call(seq: i64, name: &str) -> EffectCall {
    EffectCall { seq, name: name.into(), request_hash: format!("h{seq}"), request: String::new(), emit_pos: 0 }
}

fn completed(output: &str) -> Outcome {
    Outcome::Completed { output: output.into() }
}

both! {
    async fn claim_accepts_each_open_state_and_an_expired_lease(db) {
        let s = &db.store;
        // running, then its lease expires
        let expired = submit(s, 5).await?;
        let first = claim(s, "dead").await?;
        ensure!(first.run.id == expired);
        // waiting_takeover, and waiting_input with its input delivered
        let takeover = submit(s, 5).await?;
        let input = submit(s, 5).await?;
        let pair = s.claim_batch("setup", TTL, 2).await?;
        ensure!(pair.iter().map(|c| c.run.id).collect::<Vec<_>>() == vec![takeover, input]);
        s.suspend(&pair[0].lease, &Suspend::Takeover).await?;
        s.suspend(&pair[1].lease, &Suspend::WaitInput { prompt: "?".into() }).await?;
        s.deliver_input(input, r#""answer""#).await?;
        // queued
        let queued = submit(s, 5).await?;
        db.backdate_lease(expired, TTL.as_millis() as i64 + 1).await?;

        let got = s.claim_batch("other", TTL, 10).await?;
        let mut ids: Vec<i64> = got.iter().map(|c| c.run.id).collect();
        ids.sort();
        let mut want = vec![expired, takeover, input, queued];
        want.sort();
        ensure!(ids == want, "claimed {ids:?}, want {want:?}");
        let again = got.iter().find(|c| c.run.id == expired).unwrap();
        ensure!(again.run.fence == first.run.fence + 1 && again.run.lease_owner.as_deref() == Some("other"));
        // The lease runs exactly its TTL, in milliseconds, from when the
        // database gave it (which the same statement wrote as heartbeat_at).
        let ttl = again.run.lease_expires_at.unwrap() - again.run.heartbeat_at.unwrap();
        ensure!(ttl == TTL.as_millis() as i64, "a lease of {ttl} ms for a TTL of {TTL:?}");
        let with_input = got.iter().find(|c| c.run.id == input).unwrap();
        ensure!(with_input.run.pending_input.as_deref() == Some(r#""answer""#), "the claim sees the delivered input");
        ensure!(got.iter().all(|c| c.run.status == RunStatus::Running));
        Ok(())
    }

    async fn an_unexpired_lease_is_not_claimable_until_it_expires(db) {
        // The run is the only candidate: nothing else can be claimed in its
        // place.
        let s = &db.store;
        let id = submit(s, 5).await?;
        let a = claim(s, "a").await?;
        // One second left.
        db.backdate_lease(id, TTL.as_millis() as i64 - 1000).await?;
        ensure!(s.claim("b", TTL).await?.is_none(), "a lease with a second left was taken");
        db.backdate_lease(id, 1001).await?;
        let b = claim(s, "b").await?;
        ensure!(b.run.id == id && b.lease.fence == a.lease.fence + 1);
        ensure!(s.get_run(id).await?.lease_owner.as_deref() == Some("b"));
        Ok(())
    }

    async fn claim_refuses_runs_that_are_not_claimable(db) {
        let s = &db.store;
        // running, lease not expired
        submit(s, 5).await?;
        claim(s, "a").await?;
        // waiting_input, no input yet
        submit(s, 5).await?;
        let c = claim(s, "a").await?;
        s.suspend(&c.lease, &Suspend::WaitInput { prompt: "name?".into() }).await?;
        // attempts exhausted (expired lease, max_attempts = 1)
        let exhausted = submit(s, 1).await?;
        claim(s, "a").await?;
        db.backdate_lease(exhausted, 60_000).await?;
        // not_before in the future
        submit(s, 5).await?;
        let c = claim(s, "a").await?;
        s.suspend(&c.lease, &Suspend::Sleep { delay_ms: 3_600_000 }).await?;
        // every terminal state
        submit(s, 5).await?;
        let c = claim(s, "a").await?;
        s.close(&c.lease, &completed("done")).await?;
        submit(s, 5).await?;
        let c = claim(s, "a").await?;
        s.close(&c.lease, &Outcome::Failed { error: "boom".into() }).await?;
        let aborted = submit(s, 1).await?;
        claim(s, "a").await?;
        db.backdate_lease(aborted, 60_000).await?;
        let cancelled = submit(s, 5).await?;
        s.cancel(cancelled).await?;
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report.aborted == vec![exhausted, aborted], "{report:?}");

        let statuses: Vec<RunStatus> = s.list_runs(None, None, None, 100).await?.iter().map(|r| r.status).collect();
        ensure!(statuses.len() == 8, "{statuses:?}");
        for st in [RunStatus::Completed, RunStatus::Failed, RunStatus::Aborted, RunStatus::Cancelled] {
            ensure!(statuses.contains(&st), "setup reached {st}");
        }
        let got = s.claim("b", std::time::Duration::from_secs(30)).await?;
        ensure!(got.is_none(), "claimed {:?}", got.map(|c| (c.run.id, c.run.status)));
        Ok(())
    }

    async fn each_claim_increments_fence_and_attempt_by_exactly_one(db) {
        let s = &db.store;
        let id = submit(s, 10).await?;
        ensure!(s.get_run(id).await?.started_at.is_none(), "not started before its first claim");
        let before = s.now_ms().await?;
        let mut first_start = None;
        for n in 1..=4 {
            let c = claim(s, &format!("w{n}")).await?;
            ensure!(c.run.fence == n && c.run.attempt == n, "claim {n}: fence {} attempt {}", c.run.fence, c.run.attempt);
            ensure!(c.lease.fence == n);
            // The first claim sets `started_at` from the database clock;
            // later claims keep it.
            let started = c.run.started_at.ok_or_else(|| anyhow::anyhow!("claim {n} left started_at unset"))?;
            ensure!(started >= before && *first_start.get_or_insert(started) == started, "claim {n}: {started}");
            db.backdate_lease(id, 60_000).await?;
        }
        let batch = s.claim_batch("w", TTL, 10).await?;
        ensure!(batch.len() == 1 && batch[0].run.fence == 5 && batch[0].run.attempt == 5);
        ensure!(batch[0].run.started_at == first_start);
        Ok(())
    }

    async fn zombie_writes_are_rejected_and_change_nothing(db) {
        zombie_case(db, "worker-b").await
    }

    async fn zombie_of_the_same_owner_is_told_apart_by_its_fence(db) {
        // The same worker id claims again (a restarted process reusing its
        // host id): only the fence separates the old segment from the new.
        zombie_case(db, "worker-a").await
    }

    async fn reaper_leaves_an_expired_run_with_attempts_left_for_the_next_claim(db) {
        let s = &db.store;
        let id = submit(s, 3).await?;
        let a = claim(s, "a").await?;
        s.emit(&a.lease, "half an ans").await?;
        s.begin_effect(&a.lease, &call(0, "http"), EffectClass::Keyed).await?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        let before = s.get_run(id).await?;
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report.resumable == vec![id] && report.aborted.is_empty() && report.in_doubt == 1, "{report:?}");
        let after = s.get_run(id).await?;
        ensure!(after == before, "the reaper must not touch a resumable run:\n{before:?}\n{after:?}");
        ensure!(after.status == RunStatus::Running && after.output.is_none(), "partial not promoted");
        ensure!(s.effects(id).await?[0].state == EffectState::InDoubt);
        let b = claim(s, "b").await?;
        ensure!(b.run.id == id && b.run.fence == a.run.fence + 1 && s.get_run(id).await?.partial == "half an ans");
        Ok(())
    }

    async fn reaper_aborts_a_run_with_no_attempts_left_and_salvages_its_partial(db) {
        let s = &db.store;
        let id = submit(s, 1).await?;
        let a = claim(s, "a").await?;
        s.emit(&a.lease, "half ").await?;
        s.emit(&a.lease, "answer").await?;
        s.begin_effect(&a.lease, &call(0, "http"), EffectClass::Unkeyed).await?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report.aborted == vec![id] && report.in_doubt == 1, "{report:?}");
        let run = s.get_run(id).await?;
        ensure!(run.status == RunStatus::Aborted);
        ensure!(run.output.as_deref() == Some("half answer"), "{:?}", run.output);
        ensure!(run.lease_owner.is_none() && run.finished_at.is_some());
        let events = s.run_events(id).await?;
        let last = events.last().unwrap();
        ensure!(last.kind == "message" && last.fence == a.lease.fence, "{last:?}");
        let payload: serde_json::Value = serde_json::from_str(&last.payload)?;
        ensure!(payload["output"] == "half answer" && payload["status"] == "aborted", "{payload}");
        // Terminal: a second tick and a claim change nothing.
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report == Default::default(), "{report:?}");
        ensure!(s.claim("b", TTL).await?.is_none());
        ensure!(s.get_run(id).await? == run);
        Ok(())
    }

    async fn reaper_does_not_abort_a_run_renewed_after_it_observed_the_expiry(db) {
        // Regression: the reaper's re-check once accepted `attempt >=
        // max_attempts` alone, so a running run on its last attempt whose
        // owner renewed between the reaper's scan and its write was aborted.
        // A lease that ran out cannot be renewed any more, so the renewal
        // here lands while the lease is live: the reaper's observation
        // (expired) is stale by the time it writes.
        let s = &db.store;
        let id = submit(s, 1).await?;
        let a = claim(s, "a").await?;
        // The reaper has observed (id, fence, running, expired); then:
        s.renew(&a.lease, TTL).await?;
        let mut report = leasehold::maintenance::reaper::ReapReport::default();
        reaper::reap_run(s, id, a.lease.fence, RunStatus::Running, &mut report).await?;
        ensure!(report.raced == 1 && report.aborted.is_empty(), "{report:?}");
        ensure!(s.get_run(id).await?.status == RunStatus::Running);
        s.close(&a.lease, &completed("finished in time")).await?;
        Ok(())
    }

    async fn reaper_aborts_an_open_run_whose_attempts_are_used_up(db) {
        // A suspension resets the count now; a run the previous release
        // suspended could still be left open with its attempts used up.
        let s = &db.store;
        let id = submit(s, 1).await?;
        let a = claim(s, "a").await?;
        s.suspend(&a.lease, &Suspend::Takeover).await?;
        sqlx::query("UPDATE runs SET attempt = max_attempts WHERE id = $1").bind(id).execute(s.pool()).await?;
        ensure!(s.claim("b", TTL).await?.is_none());
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report.aborted == vec![id], "{report:?}");
        let error = s.get_run(id).await?.error.unwrap_or_default();
        ensure!(error.contains("max_attempts is 1"), "{error}");
        Ok(())
    }

    async fn a_suspension_resets_attempts_with_or_without_progress(db) {
        let s = &db.store;
        let id = submit(s, 2).await?;
        let a = claim(s, "a").await?;
        s.local_effect(&a.lease, &call(0, "clock"), &LocalOp::Record { value: "1".into() }).await?;
        s.suspend(&a.lease, &Suspend::Takeover).await?;
        ensure!(s.get_run(id).await?.attempt == 0, "a suspension after progress resets the attempt count");
        let b = claim(s, "b").await?;
        ensure!(b.run.attempt == 1);
        s.suspend(&b.lease, &Suspend::Takeover).await?;
        ensure!(s.get_run(id).await?.attempt == 0, "so does one without");
        // A death does not: the next claim counts it.
        let c = claim(s, "c").await?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        let d = claim(s, "d").await?;
        ensure!(c.run.attempt == 1 && d.run.attempt == 2, "{} {}", c.run.attempt, d.run.attempt);
        Ok(())
    }

    async fn claim_and_reaper_racing_on_expired_runs_never_both_win(db) {
        // Half the runs have an attempt left (the claim must win), half have
        // none (the reaper must abort and no claim may take them). Two
        // claimers and two reapers race over all of them.
        let s = &db.store;
        let mut ids = Vec::new();
        for i in 0..40 {
            let id = submit(s, if i % 2 == 0 { 2 } else { 1 }).await?;
            ids.push(id);
        }
        let first = s.claim_batch("dead", TTL, 100).await?;
        ensure!(first.len() == 40);
        for c in &first {
            s.begin_effect(&c.lease, &call(0, "http"), EffectClass::Keyed).await?;
        }
        sqlx::query("UPDATE runs SET lease_expires_at = lease_expires_at - 60000").execute(s.pool()).await?;

        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..2 {
            let st = db.another_store(2).await?;
            tasks.spawn(async move {
                let mut won = Vec::new();
                while let Some(c) = st.claim(&format!("claimer-{w}"), TTL).await? {
                    won.push(c.run.id);
                }
                Ok::<_, StoreError>((won, vec![]))
            });
            let st = db.another_store(2).await?;
            tasks.spawn(async move {
                let mut aborted = Vec::new();
                for _ in 0..5 {
                    aborted.extend(reaper::tick(&st, &ReaperConfig::default()).await?.aborted);
                }
                Ok::<_, StoreError>((vec![], aborted))
            });
        }
        let (mut claimed, mut aborted) = (Vec::new(), Vec::new());
        while let Some(r) = tasks.join_next().await {
            let (c, a) = r??;
            claimed.extend(c);
            aborted.extend(a);
        }
        aborted.extend(reaper::tick(s, &ReaperConfig::default()).await?.aborted);
        // A claimer stops at its first empty claim, which can come while a
        // reaper holds the last claimable row's lock (SKIP LOCKED skips it):
        // a final claimer takes what they left.
        while let Some(c) = s.claim("claimer-last", TTL).await? {
            claimed.push(c.run.id);
        }
        claimed.sort();
        aborted.sort();
        let even: Vec<i64> = ids.iter().copied().step_by(2).collect();
        let odd: Vec<i64> = ids.iter().copied().skip(1).step_by(2).collect();
        ensure!(claimed == even, "each run with an attempt left is claimed exactly once: {claimed:?}");
        ensure!(aborted == odd, "each exhausted run is aborted exactly once: {aborted:?}");
        for id in odd {
            let messages = s.run_events(id).await?.iter().filter(|e| e.kind == "message").count();
            ensure!(messages == 1, "run {id} has {messages} final messages");
        }
        Ok(())
    }

    async fn reconcile_marks_older_started_rows_in_doubt_and_is_idempotent(db) {
        let s = &db.store;
        let id = submit(s, 5).await?;
        let a = claim(s, "a").await?;
        s.begin_effect(&a.lease, &call(0, "http"), EffectClass::Keyed).await?;
        s.complete_effect(&a.lease, 0, &Completion::Committed("200".into())).await?;
        s.begin_effect(&a.lease, &call(1, "http"), EffectClass::Unkeyed).await?;
        s.local_effect(&a.lease, &call(2, "kv.put"), &LocalOp::KvPut { namespace: "p".into(), key: "k".into(), value: "v".into() }).await?;
        ensure!(s.reconcile(&a.lease).await? == 0, "nothing is in doubt for its own segment");
        db.backdate_lease(id, 60_000).await?;
        let b = claim(s, "b").await?;
        let committed_before = s.effects(id).await?[0].clone();
        ensure!(s.reconcile(&b.lease).await? == 1);
        let after_once = s.effects(id).await?;
        ensure!(after_once[0] == committed_before, "committed rows are untouched");
        ensure!(after_once[1].state == EffectState::InDoubt && after_once[1].fence_started == a.lease.fence);
        ensure!(after_once[2].state == EffectState::Committed && after_once[2].class == EffectClass::Local);
        ensure!(s.reconcile(&b.lease).await? == 0);
        ensure!(s.effects(id).await? == after_once, "a second reconcile changes nothing");
        // In doubt and unkeyed: never re-issued.
        ensure!(matches!(s.reissue_effect(&b.lease, 1).await, Err(StoreError::EffectNotOpen { .. })));
        Ok(())
    }

    async fn ledger_positions_are_recorded_once_and_local_effects_apply_once(db) {
        let s = &db.store;
        let id = submit(s, 5).await?;
        let a = claim(s, "a").await?;
        let put = |v: &str| LocalOp::KvPut { namespace: "ns".into(), key: "note".into(), value: v.into() };
        let row = s.local_effect(&a.lease, &call(0, "kv.put"), &put(r#""first""#)).await?;
        ensure!(row.state == EffectState::Committed && row.idempotency_key == crate::harness::key(s, id, 0).await?, "{row:?}");
        ensure!(row.idempotency_key.len() > format!(":{id}:0").len(), "the key starts with the database's id: {row:?}");
        ensure!(row.fence_started == a.lease.fence && row.fence_completed == Some(a.lease.fence));
        // Replaying the same position must not apply the effect again.
        let dup = s.local_effect(&a.lease, &call(0, "kv.put"), &put(r#""second""#)).await;
        ensure!(matches!(dup, Err(StoreError::EffectExists { seq: 0, .. })), "{dup:?}");
        let got = s.local_effect(&a.lease, &call(1, "kv.get"), &LocalOp::KvGet { namespace: "ns".into(), key: "note".into() }).await?;
        ensure!(got.result.as_deref() == Some(r#""first""#), "{:?}", got.result);
        let dup = s.begin_effect(&a.lease, &call(1, "http"), EffectClass::Keyed).await;
        ensure!(matches!(dup, Err(StoreError::EffectExists { seq: 1, .. })));
        let missing = s.complete_effect(&a.lease, 7, &Completion::Committed("x".into())).await;
        ensure!(matches!(missing, Err(StoreError::EffectNotOpen { seq: 7, .. })));
        Ok(())
    }

    async fn create_with_the_same_idempotency_key_returns_the_same_run(db) {
        let s = &db.store;
        let mut new = NewRun::new("p", "{}");
        new.idempotency_key = Some("order-42".into());
        let (first, created) = s.create_run(&new).await?;
        ensure!(created);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let st = db.another_store(1).await?;
            let new = new.clone();
            tasks.spawn(async move { st.create_run(&new).await });
        }
        while let Some(r) = tasks.join_next().await {
            let (run, created) = r??;
            ensure!(!created && run.id == first.id);
        }
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(s.pool()).await?;
        ensure!(n == 1);
        let submitted = s.run_events(first.id).await?;
        ensure!(submitted.len() == 1 && submitted[0].kind == "submitted" && submitted[0].seq == 1);
        Ok(())
    }

    async fn input_is_delivered_once_and_only_to_a_waiting_run(db) {
        let s = &db.store;
        let id = submit(s, 5).await?;
        let refused = s.deliver_input(id, "\"early\"").await;
        ensure!(matches!(refused, Err(StoreError::Conflict { status: RunStatus::Queued, .. })), "{refused:?}");
        let a = claim(s, "a").await?;
        s.suspend(&a.lease, &Suspend::WaitInput { prompt: "name?".into() }).await?;
        s.deliver_input(id, "\"Ada\"").await?;
        let twice = s.deliver_input(id, "\"Bob\"").await;
        ensure!(matches!(twice, Err(StoreError::Conflict { status: RunStatus::WaitingInput, .. })), "{twice:?}");
        ensure!(s.get_run(id).await?.pending_input.as_deref() == Some("\"Ada\""));
        ensure!(matches!(s.deliver_input(9999, "1").await, Err(StoreError::RunNotFound(9999))));
        Ok(())
    }

    async fn cancel_bumps_the_fence_so_the_running_segment_loses_its_lease(db) {
        let s = &db.store;
        let id = submit(s, 5).await?;
        let a = claim(s, "a").await?;
        let cancelled = s.cancel(id).await?;
        ensure!(cancelled.status == RunStatus::Cancelled && cancelled.fence == a.lease.fence + 1);
        ensure!(s.emit(&a.lease, "late").await.unwrap_err().is_lease_lost());
        ensure!(s.close(&a.lease, &completed("late")).await.unwrap_err().is_lease_lost());
        ensure!(matches!(s.cancel(id).await, Err(StoreError::Conflict { status: RunStatus::Cancelled, .. })));
        ensure!(s.get_run(id).await? == cancelled);
        let last = s.run_events(id).await?.pop().unwrap();
        ensure!(last.kind == "cancelled" && last.fence == cancelled.fence);
        Ok(())
    }

    async fn thread_log_is_gap_free_and_every_event_carries_run_and_fence(db) {
        let s = &db.store;
        let mut new = NewRun::new("p", "{}");
        new.thread_id = Some("t1".into());
        let (r1, _) = s.create_run(&new).await?;
        let (r2, _) = s.create_run(&new).await?;
        let a = claim(s, "a").await?;
        let b = claim(s, "b").await?;
        ensure!(s.emit(&a.lease, "a0").await? == 0);
        ensure!(s.emit(&b.lease, "b0").await? == 0);
        ensure!(s.emit(&a.lease, "a1").await? == 1);
        s.close(&a.lease, &completed("A")).await?;
        s.close(&b.lease, &completed("B")).await?;
        let events = s.events_after("t1", 0, 100).await?;
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        ensure!(seqs == (1..=7).collect::<Vec<_>>(), "{seqs:?}");
        for e in &events {
            let expected = if e.kind == "submitted" { 0 } else if e.run_id == r1.id { a.lease.fence } else { b.lease.fence };
            ensure!(e.fence == expected && (e.run_id == r1.id || e.run_id == r2.id), "{e:?}");
        }
        ensure!(s.events_after("t1", 5, 100).await?.len() == 2);
        Ok(())
    }

    async fn buffered_deltas_are_written_in_order_with_one_event_each_and_the_close_takes_the_tail(db) {
        let s = &db.store;
        let mut new = NewRun::new("p", "{}");
        new.thread_id = Some("t2".into());
        let (run, _) = s.create_run(&new).await?;
        let a = claim(s, "a").await?;
        ensure!(s.emit_deltas(&a.lease, &["he", "llo", " "]).await? == 0);
        ensure!(s.emit(&a.lease, "wor").await? == 3);
        // A quote, a backslash and non-ASCII survive the JSON list.
        s.close_with_deltas(&a.lease, &["ld \"q\" \\ é", "!"], &completed("done")).await?;
        let run = s.get_run(run.id).await?;
        ensure!(run.partial == "hello world \"q\" \\ é!" && run.emit_pos == 6, "{run:?}");
        ensure!(run.status == RunStatus::Completed && run.lease_owner.is_none(), "{run:?}");
        let events = s.events_after("t2", 0, 100).await?;
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        ensure!(seqs == (1..=8).collect::<Vec<_>>(), "{seqs:?}");
        let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
        ensure!(kinds == ["submitted", "delta", "delta", "delta", "delta", "delta", "delta", "message"], "{kinds:?}");
        let stream = leasehold::store::log::replay_stream(events.iter().map(|e| (e.kind.as_str(), e.payload.as_str())));
        ensure!(stream.concat() == run.partial, "{stream:?}");
        for (i, e) in events.iter().filter(|e| e.kind == "delta").enumerate() {
            let v: serde_json::Value = serde_json::from_str(&e.payload)?;
            ensure!(v["pos"] == i as i64 && e.fence == a.lease.fence, "{e:?}");
        }
        let message: serde_json::Value = serde_json::from_str(&events[7].payload)?;
        ensure!(message["status"] == "completed" && message["output"] == "done", "{message}");

        // A stale lease writes none of it, and no thread sequence is used.
        s.create_run(&NewRun::new("p", "{}")).await?;
        let b = claim(s, "b").await?;
        let stale = leasehold::store::Lease { fence: b.lease.fence + 1, ..b.lease.clone() };
        ensure!(s.emit_deltas(&stale, &["x", "y"]).await.unwrap_err().is_lease_lost());
        ensure!(s.close_with_deltas(&stale, &["z"], &completed("late")).await.unwrap_err().is_lease_lost());
        let after = s.get_run(b.run.id).await?;
        ensure!(after.partial.is_empty() && after.emit_pos == 0 && after.status == RunStatus::Running, "{after:?}");
        let thread = s.events_after(&after.thread_id, 0, 100).await?;
        ensure!(thread.len() == 1 && thread[0].kind == "submitted", "{thread:?}");
        Ok(())
    }

    async fn held_puts_are_written_with_their_ledger_rows_and_the_last_put_of_a_key_wins(db) {
        let s = &db.store;
        let mut new = NewRun::new("p", "{}");
        new.thread_id = Some("held".into());
        let (run, _) = s.create_run(&new).await?;
        let a = claim(s, "a").await?;
        let put = |seq: i64, key: &str, value: &str| HeldPut {
            call: EffectCall { seq, name: "kv.put".into(), request_hash: format!("h{seq}"), request: String::new(), emit_pos: seq.min(1) },
            namespace: "ns".into(),
            key: key.into(),
            value: value.into(),
        };
        let value = |key: &'static str| async move {
            sqlx::query_scalar::<_, String>("SELECT value FROM kv WHERE namespace = 'ns' AND key = $1")
                .bind(key)
                .fetch_optional(s.pool())
                .await
        };
        s.write_held(&a.lease, &["x"], &[put(0, "k", "1"), put(1, "k", "2"), put(2, "j", "\"v\"")]).await?;
        let rows = s.effects(run.id).await?;
        ensure!(rows.len() == 3, "{rows:?}");
        for (i, r) in rows.iter().enumerate() {
            ensure!(r.seq == i as i64 && r.state == EffectState::Committed && r.class == EffectClass::Local, "{r:?}");
            ensure!(r.fence_started == a.lease.fence && r.fence_completed == Some(a.lease.fence), "{r:?}");
            ensure!(r.result.as_deref() == Some("null") && r.emit_pos == (i as i64).min(1), "{r:?}");
            ensure!(r.idempotency_key == crate::harness::key(s, run.id, i as i64).await?, "{r:?}");
        }
        ensure!(value("k").await?.as_deref() == Some("2") && value("j").await?.as_deref() == Some("\"v\""));
        let after = s.get_run(run.id).await?;
        ensure!(after.partial == "x" && after.emit_pos == 1, "{after:?}");

        // Puts alone append no event.
        s.write_held(&a.lease, &[], &[put(3, "m", "3")]).await?;
        ensure!(value("m").await?.as_deref() == Some("3"));
        let kinds: Vec<String> = s.events_after("held", 0, 100).await?.into_iter().map(|e| e.kind).collect();
        ensure!(kinds == ["submitted", "delta"], "{kinds:?}");

        // A stale lease writes none of it.
        let stale = leasehold::store::Lease { fence: a.lease.fence + 1, ..a.lease.clone() };
        ensure!(s.write_held(&stale, &["y"], &[put(4, "z", "9")]).await.unwrap_err().is_lease_lost());
        ensure!(s.close_and_claim(&stale, &[], &[put(4, "z", "9")], &completed("late"), None).await.unwrap_err().is_lease_lost());
        ensure!(s.effects(run.id).await?.len() == 4 && value("z").await?.is_none());

        // The close takes the last ones.
        s.close_and_claim(&a.lease, &["!"], &[put(4, "k", "4")], &completed("done"), None).await?;
        ensure!(s.effects(run.id).await?.len() == 5 && value("k").await?.as_deref() == Some("4"));
        let done = s.get_run(run.id).await?;
        ensure!(done.status == RunStatus::Completed && done.partial == "x!", "{done:?}");
        Ok(())
    }

    async fn a_close_that_holds_claims_the_next_run_in_the_same_write(db) {
        let s = &db.store;
        let first = submit(s, 3).await?;
        let a = claim(s, "a").await?;
        ensure!(a.run.id == first);
        let second = submit(s, 3).await?;

        // A rejected close claims nothing.
        let stale = leasehold::store::Lease { fence: a.lease.fence + 1, ..a.lease.clone() };
        let err = s.close_and_claim(&stale, &[], &[], &completed("late"), Some(("z", TTL))).await.unwrap_err();
        ensure!(err.is_lease_lost(), "{err:?}");
        let waiting = s.get_run(second).await?;
        ensure!(waiting.status == RunStatus::Queued && waiting.fence == 0, "{waiting:?}");

        // The close holds: the run is finished with its tail, and the next
        // one is leased to the closer with the next fence, from the
        // database clock.
        let now = s.now_ms().await?;
        let next = s.close_and_claim(&a.lease, &["tail"], &[], &completed("one"), Some(("a", TTL))).await?;
        let done = s.get_run(first).await?;
        ensure!(done.status == RunStatus::Completed && done.partial == "tail" && done.lease_owner.is_none(), "{done:?}");
        let Some(next) = next else { anyhow::bail!("the close claimed nothing") };
        ensure!(next.run.id == second && next.run.fence == 1 && next.run.lease_owner.as_deref() == Some("a"), "{next:?}");
        let leased = s.get_run(second).await?;
        ensure!(leased.status == RunStatus::Running && leased.lease_owner.as_deref() == Some("a"), "{leased:?}");
        ensure!(leased.attempt == 1 && leased.fence == 1, "{leased:?}");
        let expires = leased.lease_expires_at.unwrap_or(0);
        ensure!(expires >= now + TTL.as_millis() as i64 && expires < now + TTL.as_millis() as i64 + 60_000, "{leased:?}");

        // Nothing claimable: the close still holds and claims nothing; and
        // a close that is not asked to claim leaves the queue alone.
        ensure!(s.close_and_claim(&next.lease, &[], &[], &completed("two"), Some(("a", TTL))).await?.is_none());
        ensure!(s.get_run(second).await?.status == RunStatus::Completed);
        let third = submit(s, 3).await?;
        let fourth = submit(s, 3).await?;
        let c = claim(s, "c").await?;
        ensure!(c.run.id == third);
        ensure!(s.close_and_claim(&c.lease, &[], &[], &completed("three"), None).await?.is_none());
        ensure!(s.get_run(fourth).await?.status == RunStatus::Queued);
        Ok(())
    }

    async fn concurrent_submits_each_get_their_run_and_keys_and_thread_order_hold(db) {
        // Concurrent submits sharing threads and idempotency keys: each gets
        // its run, a key gets one run, a thread's log stays gap-free, though
        // they are group-committed (a batch never holds two submits to one
        // thread or key, and one that fails is retried alone).
        let s = &db.store;
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..60 {
            let s = s.clone();
            tasks.spawn(async move {
                let mut new = NewRun::new("p", format!(r#"{{"i":{}}}"#, i % 7));
                new.thread_id = Some(format!("shared-{}", i % 3));
                if i % 4 == 0 {
                    new.idempotency_key = Some(format!("key-{}", i % 8));
                }
                (i, s.create_run(&new).await)
            });
        }
        // An input PostgreSQL refuses (NUL) fails alone (SQLite stores it).
        let bad = {
            let s = s.clone();
            tokio::spawn(async move { s.create_run(&NewRun::new("p", "{\"nul\":\"\u{0}\"}")).await })
        };
        let mut by_key: std::collections::HashMap<String, Vec<(i64, bool)>> = Default::default();
        let mut ids = std::collections::HashSet::new();
        while let Some(joined) = tasks.join_next().await {
            let (i, got) = joined?;
            let (run, created) = got?;
            ensure!(run.input == format!(r#"{{"i":{}}}"#, i % 7) || !created, "{i}: {run:?}");
            match &run.idempotency_key {
                Some(key) => by_key.entry(key.clone()).or_default().push((run.id, created)),
                None => ensure!(created && ids.insert(run.id), "{i}: {run:?}"),
            }
        }
        ensure!(by_key.len() == 2, "{by_key:?}");
        for (key, got) in &by_key {
            ensure!(got.iter().filter(|(_, created)| *created).count() == 1, "{key}: {got:?}");
            ensure!(got.iter().all(|(id, _)| *id == got[0].0), "{key}: {got:?}");
        }
        match (s.backend(), bad.await?) {
            (leasehold::Backend::Postgres, Err(_)) | (leasehold::Backend::Sqlite, Ok(_)) => {}
            (backend, other) => anyhow::bail!("{backend:?}: {other:?}"),
        }
        let runs: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE thread_id LIKE 'shared-%'")
            .fetch_one(s.pool())
            .await?;
        ensure!(runs == 45 + 2, "{runs}");
        for t in 0..3 {
            let thread = format!("shared-{t}");
            let events = s.events_after(&thread, 0, 1000).await?;
            let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
            ensure!(seqs == (1..=events.len() as i64).collect::<Vec<_>>(), "{thread}: {seqs:?}");
            ensure!(events.iter().all(|e| e.kind == "submitted" && e.fence == 0), "{events:?}");
            // One event per run (run ids come from a sequence taken before
            // the thread's counter row is locked, so they need not be in
            // thread order).
            let mut runs: Vec<i64> = events.iter().map(|e| e.run_id).collect();
            runs.sort();
            runs.dedup();
            ensure!(runs.len() == events.len(), "{events:?}");
        }
        let total: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM events WHERE thread_id LIKE 'shared-%'")
            .fetch_one(s.pool())
            .await?;
        ensure!(total == runs, "{total} events for {runs} runs");
        // Submits made at once shared commits (group commit).
        let (written, commits) = s.submits_written();
        ensure!(written >= 60 && commits < written, "{written} submits in {commits} commits");
        Ok(())
    }

    async fn concurrent_closes_each_keep_their_guard_and_thread_order(db) {
        // Closes made at once, sharing threads and put keys, some stale and
        // some claiming a next run: on PostgreSQL they are group-committed
        // (one statement for several), and each still gets its own result.
        let s = &db.store;
        let mut leases = Vec::new();
        for i in 0..24 {
            let mut new = NewRun::new("p", "{}");
            new.thread_id = Some(format!("closes-{}", i % 3));
            let id = s.create_run(&new).await?.0.id;
            let c = claim(s, "w").await?;
            ensure!(c.run.id == id, "{c:?}");
            leases.push(c.lease);
        }
        // Ten runs for the 12 closes that want one (even i) to claim.
        let mut extra = std::collections::HashSet::new();
        for _ in 0..10 {
            extra.insert(submit(s, 3).await?);
        }
        let stale = |i: usize| i % 6 == 3;
        let mut tasks = tokio::task::JoinSet::new();
        for (i, lease) in leases.iter().enumerate() {
            let s = s.clone();
            let mut lease = lease.clone();
            if stale(i) {
                lease.fence += 1;
            }
            tasks.spawn(async move {
                let deltas: Vec<String> = if i % 2 == 0 { vec![format!("a{i}"), format!("b{i}")] } else { vec![] };
                let deltas: Vec<&str> = deltas.iter().map(String::as_str).collect();
                let put = HeldPut {
                    call: EffectCall { seq: 0, name: "kv.put".into(), request_hash: "h".into(), request: String::new(), emit_pos: 0 },
                    namespace: "closes".into(),
                    key: format!("k{}", i % 4),
                    value: format!("{i}"),
                };
                let next = (i % 2 == 0).then_some(("w", TTL));
                (i, s.close_and_claim(&lease, &deltas, &[put], &completed(&format!("out {i}")), next).await)
            });
        }
        let mut claimed = std::collections::HashSet::new();
        while let Some(joined) = tasks.join_next().await {
            let (i, got) = joined?;
            if stale(i) {
                ensure!(got.as_ref().is_err_and(|e| e.is_lease_lost()), "{i}: {got:?}");
                continue;
            }
            // Twelve want one; two of them find the queue empty.
            if let Some(next) = got? {
                ensure!(i % 2 == 0, "{i} claimed {next:?} without asking");
                ensure!(extra.contains(&next.run.id) && next.run.fence == 1 && next.run.lease_owner.as_deref() == Some("w"), "{next:?}");
                ensure!(claimed.insert(next.run.id), "{} claimed twice", next.run.id);
            }
        }
        ensure!(claimed.len() == 10, "{claimed:?}");
        for (i, lease) in leases.iter().enumerate() {
            let run = s.get_run(lease.run_id).await?;
            let effects = s.effects(run.id).await?;
            if stale(i) {
                ensure!(run.status == RunStatus::Running && run.partial.is_empty() && effects.is_empty(), "{i}: {run:?}");
                continue;
            }
            let partial = if i % 2 == 0 { format!("a{i}b{i}") } else { String::new() };
            ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some(format!("out {i}").as_str()), "{run:?}");
            ensure!(run.partial == partial && run.lease_owner.is_none(), "{i}: {run:?}");
            ensure!(effects.len() == 1 && effects[0].fence_completed == Some(lease.fence), "{effects:?}");
        }
        // Each key holds the value of one of the closes that held and put it.
        for k in 0..4 {
            let value: String = sqlx::query_scalar("SELECT value FROM kv WHERE namespace = 'closes' AND key = $1")
                .bind(format!("k{k}"))
                .fetch_one(s.pool())
                .await?;
            let i: usize = value.parse()?;
            ensure!(i % 4 == k && !stale(i), "k{k} = {value}");
        }
        // Each thread's log is gap-free, and a close's events are together:
        // its deltas at their positions, then its message.
        for t in 0..3 {
            let thread = format!("closes-{t}");
            let events = s.events_after(&thread, 0, 1000).await?;
            let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
            ensure!(seqs == (1..=events.len() as i64).collect::<Vec<_>>(), "{thread}: {seqs:?}");
            let closing: Vec<&leasehold::store::Event> = events.iter().filter(|e| e.kind != "submitted").collect();
            let mut at = 0;
            while at < closing.len() {
                let run = closing[at].run_id;
                let i = leases.iter().position(|l| l.run_id == run).unwrap_or(usize::MAX);
                let want: Vec<String> = if i % 2 == 0 {
                    vec![
                        format!(r#"{{"delta":"a{i}","pos":0}}"#),
                        format!(r#"{{"delta":"b{i}","pos":1}}"#),
                        "message".into(),
                    ]
                } else {
                    vec!["message".into()]
                };
                let got: Vec<String> = closing[at..(at + want.len()).min(closing.len())]
                    .iter()
                    .map(|e| {
                        if e.kind == "message" {
                            "message".to_string()
                        } else {
                            let v: serde_json::Value = serde_json::from_str(&e.payload).unwrap_or_default();
                            v.to_string()
                        }
                    })
                    .collect();
                ensure!(got == want && closing[at..at + want.len()].iter().all(|e| e.run_id == run), "{thread} run {run}: {got:?}");
                at += want.len();
            }
            ensure!(closing.len() == (0..24).filter(|i| i % 3 == t && !stale(*i)).map(|i| if i % 2 == 0 { 3 } else { 1 }).sum::<usize>());
        }
        // Both backends wrote them in fewer commits than closes.
        let (written, commits) = s.closes_written();
        ensure!(written >= 20 && commits < written, "{written} closes in {commits} commits");
        Ok(())
    }

    async fn batched_submits_and_closes_keep_text_byte_for_byte(db) {
        // The batch statements read each run's fields out of one JSON list;
        // whatever form the database parses that list into, what comes out
        // is exactly what went in: quotes, backslashes, escape-looking
        // text, control characters, astral-plane and bidi characters.
        let s = &db.store;
        let odd = [
            "q\"uote", "back\\slash", "\\u0041 is not A", "line\nbreak\ttab\r", "\u{7f}\u{1b}[0m", "😀 \u{202e}rtl",
            "{\"json\": [1, \"two\"]}", "", "   ", "'; --", "%s %n",
        ];
        let mut tasks = tokio::task::JoinSet::new();
        for (i, text) in odd.iter().enumerate() {
            let s = s.clone();
            let input = serde_json::json!({ "text": text }).to_string();
            tasks.spawn(async move {
                let mut new = NewRun::new("p", &input);
                new.thread_id = Some(format!("odd-{i}"));
                s.create_run(&new).await.map(|(run, _)| (i, run, input))
            });
        }
        let mut runs = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            let (i, run, input) = joined??;
            ensure!(run.input == input, "{i}: {:?} != {input:?}", run.input);
            runs.push((i, run.id));
        }
        let mut leases = std::collections::HashMap::new();
        for _ in 0..odd.len() {
            let c = claim(s, "w").await?;
            leases.insert(c.run.id, c.lease);
        }
        let mut tasks = tokio::task::JoinSet::new();
        for (i, id) in &runs {
            let (s, i, text) = (s.clone(), *i, odd[*i]);
            let lease = leases[id].clone();
            tasks.spawn(async move {
                let put = HeldPut { call: call(0, "kv.put"), namespace: "odd".into(), key: format!("k{i}\u{1}{text}"), value: text.into() };
                s.close_and_claim(&lease, &[text, "·"], &[put], &completed(text), None).await.map(|_| i)
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined??;
        }
        for (i, id) in &runs {
            let text = odd[*i];
            let run = s.get_run(*id).await?;
            ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some(text), "{i}: {run:?}");
            ensure!(run.partial == format!("{text}·"), "{i}: {:?}", run.partial);
            let events = s.events_after(&format!("odd-{i}"), 0, 10).await?;
            let deltas: Vec<String> = events
                .iter()
                .filter(|e| e.kind == "delta")
                .map(|e| serde_json::from_str::<serde_json::Value>(&e.payload).map(|v| v["delta"].as_str().unwrap_or_default().to_string()))
                .collect::<Result<_, _>>()?;
            ensure!(deltas == [text, "·"], "{i}: {deltas:?}");
            let message = events.iter().find(|e| e.kind == "message").ok_or_else(|| anyhow::anyhow!("{i}: no message"))?;
            let message: serde_json::Value = serde_json::from_str(&message.payload)?;
            ensure!(message["output"] == text, "{i}: {message}");
            let value: String = sqlx::query_scalar("SELECT value FROM kv WHERE namespace = 'odd' AND key = $1")
                .bind(format!("k{i}\u{1}{text}"))
                .fetch_one(s.pool())
                .await?;
            ensure!(value == text, "{i}: {value:?}");
        }
        let (written, commits) = s.closes_written();
        ensure!(commits < written, "the closes were not batched: {written} in {commits} commits");
        Ok(())
    }

    async fn a_zombies_close_made_with_its_successors_is_refused_and_the_successors_lands(db) {
        // Closes made at the same moment go to the database together: a
        // zombie's close and its successor's may share a batch, and the
        // zombie's must still write nothing and be told so. Half the
        // successors are the zombie's own owner: only the fence tells
        // them apart.
        let s = &db.store;
        let mut pairs = Vec::new();
        for i in 0..12 {
            let id = submit(s, 5).await?;
            let a = claim(s, "worker-a").await?;
            ensure!(a.run.id == id, "{a:?}");
            db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
            let b = claim(s, if i % 2 == 0 { "worker-a" } else { "worker-b" }).await?;
            ensure!(b.run.id == id && b.lease.fence == a.lease.fence + 1, "{b:?}");
            pairs.push((a.lease, b.lease));
        }
        let (written, commits) = s.closes_written();
        let mut tasks = tokio::task::JoinSet::new();
        for (a, b) in &pairs {
            for (zombie, lease) in [(true, a.clone()), (false, b.clone())] {
                let s = s.clone();
                tasks.spawn(async move {
                    let (delta, output) = if zombie { ("z", "zombie") } else { ("b", "successor") };
                    (lease.clone(), zombie, s.close_with_deltas(&lease, &[delta], &completed(output)).await)
                });
            }
        }
        while let Some(joined) = tasks.join_next().await {
            let (lease, zombie, got) = joined?;
            if zombie {
                ensure!(got.as_ref().is_err_and(|e| e.is_lease_lost()), "zombie {lease:?}: {got:?}");
            } else {
                got?;
            }
        }
        for (_, b) in &pairs {
            let run = s.get_run(b.run_id).await?;
            ensure!(run.status == RunStatus::Completed && run.output.as_deref() == Some("successor") && run.partial == "b", "{run:?}");
            let events = s.run_events(b.run_id).await?;
            let closing: Vec<_> = events.iter().filter(|e| e.kind != "submitted").map(|e| (e.kind.as_str(), e.fence)).collect();
            ensure!(closing == [("delta", b.fence), ("message", b.fence)], "{closing:?}");
        }
        let (written_now, commits_now) = s.closes_written();
        ensure!(written_now - written == 24 && commits_now - commits < 24, "{} closes in {} commits", written_now - written, commits_now - commits);
        Ok(())
    }

    async fn a_run_submitted_on_the_current_version_keeps_the_one_its_write_read(db) {
        // The API names no digest: the statement that writes the runs reads
        // the plugin's current version, for a single submit and a batch.
        let s = &db.store;
        let settings = leasehold::plugins::PluginSettings::default();
        ensure!(!s.plugin_exists("versioned").await?);
        s.put_plugin("versioned", "sha256:one", b"1", &settings).await?;
        ensure!(s.plugin_exists("versioned").await?);
        let current = |k: &str| NewRun {
            plugin_digest: NewRun::CURRENT_VERSION.into(),
            idempotency_key: Some(k.into()),
            ..NewRun::new("versioned", "{}")
        };
        let (first, _) = s.create_run(&current("a")).await?;
        s.put_plugin("versioned", "sha256:two", b"2", &settings).await?;
        let (second, _) = s.create_run(&current("b")).await?;
        let batch = s.create_runs(&[current("c"), current("d")]).await?;
        ensure!(first.plugin_digest == "sha256:one" && second.plugin_digest == "sha256:two", "{first:?} {second:?}");
        ensure!(batch.iter().all(|(r, new)| *new && r.plugin_digest == "sha256:two"), "{batch:?}");
        ensure!(s.get_run(first.id).await?.plugin_digest == "sha256:one");
        // A plugin nobody registered fails the write, and writes nothing.
        let unknown = NewRun { plugin_digest: NewRun::CURRENT_VERSION.into(), ..NewRun::new("nobody", "{}") };
        ensure!(s.create_run(&unknown).await.is_err());
        ensure!(s.create_runs(&[unknown.clone(), current("e")]).await.is_err());
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(s.pool()).await?;
        ensure!(n == 4, "{n} runs");
        Ok(())
    }

    async fn renew_extends_the_lease_from_the_database_clock(db) {
        let s = &db.store;
        submit(s, 5).await?;
        let a = claim(s, "a").await?;
        let now = s.now_ms().await?;
        let expires = s.renew(&a.lease, std::time::Duration::from_secs(600)).await?;
        ensure!(expires >= now + 599_000 && expires <= now + 601_000 + 5_000, "now {now}, expires {expires}");
        Ok(())
    }

    async fn concurrent_renewals_share_statements_and_each_keeps_its_guard(db) {
        // Renewals made at once, some with a stale fence or owner, go to
        // the database together: each good lease is extended, each stale
        // one is refused and leaves its row as it was.
        let s = &db.store;
        let mut leases = Vec::new();
        for _ in 0..40 {
            submit(s, 3).await?;
            leases.push(claim(s, "w").await?.lease);
        }
        let stale = |i: usize| i % 5 == 2;
        let before: Vec<Option<i64>> = {
            let mut v = Vec::new();
            for l in &leases {
                v.push(s.get_run(l.run_id).await?.lease_expires_at);
            }
            v
        };
        let now = s.now_ms().await?;
        let mut tasks = tokio::task::JoinSet::new();
        for (i, lease) in leases.iter().enumerate() {
            let (s, mut lease) = (s.clone(), lease.clone());
            if stale(i) {
                if i % 2 == 0 {
                    lease.fence += 1;
                } else {
                    lease.owner = "zombie".into();
                }
            }
            tasks.spawn(async move { (i, s.renew(&lease, std::time::Duration::from_secs(600)).await) });
        }
        while let Some(joined) = tasks.join_next().await {
            let (i, got) = joined?;
            let run = s.get_run(leases[i].run_id).await?;
            if stale(i) {
                ensure!(got.as_ref().is_err_and(|e| e.is_lease_lost()), "{i}: {got:?}");
                ensure!(run.lease_expires_at == before[i] && run.lease_owner.as_deref() == Some("w"), "{i}: {run:?}");
            } else {
                let expires = got?;
                ensure!(expires >= now + 599_000 && expires <= now + 601_000 + 5_000, "{i}: now {now}, expires {expires}");
                ensure!(run.lease_expires_at == Some(expires), "{i}: {run:?}");
            }
        }
        let (written, commits) = s.renewals_written();
        ensure!(written >= 40 && commits < written, "{written} renewals in {commits} statements");
        Ok(())
    }

    async fn concurrent_ledger_writes_of_different_runs_share_commits_and_each_keeps_its_guard(db) {
        // Ledger writes of 30 runs made at once go to the database in
        // batches: each stale one writes nothing, and of two writes racing
        // for one position exactly one is applied, its effect with it.
        let s = &db.store;
        let mut leases = Vec::new();
        for _ in 0..30 {
            submit(s, 3).await?;
            leases.push(claim(s, "w").await?.lease);
        }
        let stale = |i: usize| i % 7 == 3;
        let put = |i: usize, side: &str| LocalOp::KvPut { namespace: "batch".into(), key: format!("k{i}-{side}"), value: format!("{i}") };
        let mut tasks = tokio::task::JoinSet::new();
        for (i, lease) in leases.iter().enumerate() {
            let (s, mut lease) = (s.clone(), lease.clone());
            if stale(i) {
                lease.fence += 1;
            }
            match i % 3 {
                0 => {
                    tasks.spawn(async move { (i, "begin", s.begin_effect(&lease, &call(0, "http"), EffectClass::Keyed).await) });
                }
                1 => {
                    let record = LocalOp::Record { value: format!("r{i}") };
                    tasks.spawn(async move { (i, "record", s.local_effect(&lease, &call(0, "clock"), &record).await) });
                }
                _ => {
                    let (s2, lease2) = (s.clone(), lease.clone());
                    tasks.spawn(async move { (i, "put", s.local_effect(&lease, &call(0, "kv.put"), &put(i, "a")).await) });
                    tasks.spawn(async move { (i, "put", s2.local_effect(&lease2, &call(0, "kv.put"), &put(i, "b")).await) });
                }
            }
        }
        let mut puts_won = std::collections::HashMap::<usize, usize>::new();
        while let Some(joined) = tasks.join_next().await {
            let (i, what, got) = joined?;
            if stale(i) {
                ensure!(got.as_ref().is_err_and(|e| e.is_lease_lost()), "{i} {what}: {got:?}");
                continue;
            }
            match (what, got) {
                ("put", Err(StoreError::EffectExists { .. })) => {}
                ("put", Ok(row)) => {
                    ensure!(row.state == EffectState::Committed, "{i}: {row:?}");
                    *puts_won.entry(i).or_default() += 1;
                }
                ("begin", Ok(row)) => ensure!(row.state == EffectState::Started && row.fence_started == leases[i].fence, "{i}: {row:?}"),
                ("record", Ok(row)) => ensure!(row.result.as_deref() == Some(format!("r{i}").as_str()), "{i}: {row:?}"),
                (what, got) => anyhow::bail!("{i} {what}: {got:?}"),
            }
        }
        // Completions of the started rows, racing with completions of
        // positions that were never started.
        let mut tasks = tokio::task::JoinSet::new();
        for (i, lease) in leases.iter().enumerate().filter(|(i, _)| !stale(*i)) {
            let (s, lease) = (s.clone(), lease.clone());
            let seq = if i % 3 == 0 { 0 } else { 5 };
            tasks.spawn(async move { (i, s.complete_effect(&lease, seq, &Completion::Committed(format!("c{i}"))).await) });
        }
        while let Some(joined) = tasks.join_next().await {
            let (i, got) = joined?;
            if i % 3 == 0 {
                let row = got?;
                ensure!(row.state == EffectState::Committed && row.result.as_deref() == Some(format!("c{i}").as_str()), "{i}: {row:?}");
            } else {
                ensure!(matches!(got, Err(StoreError::EffectNotOpen { .. })), "{i}: {got:?}");
            }
        }
        for (i, lease) in leases.iter().enumerate() {
            let effects = s.effects(lease.run_id).await?;
            if stale(i) {
                ensure!(effects.is_empty(), "{i}: {effects:?}");
                continue;
            }
            ensure!(effects.len() == 1, "{i}: {effects:?}");
            if i % 3 == 2 {
                // One put won the position; only its key was written.
                ensure!(puts_won.get(&i) == Some(&1), "{i}: {puts_won:?}");
                let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM kv WHERE namespace = 'batch' AND key LIKE $1")
                    .bind(format!("k{i}-%"))
                    .fetch_all(s.pool())
                    .await?;
                ensure!(keys.len() == 1, "{i}: {keys:?}");
            }
        }
        let (written, commits) = s.ledger_writes_written();
        ensure!(written >= 40 && commits < written, "{written} ledger writes in {commits} commits");
        Ok(())
    }
}

#[tokio::test]
async fn unknown_database_urls_are_a_clear_error() {
    let err = Store::connect("mysql://x").await.unwrap_err();
    assert!(err.to_string().contains("unsupported database URL"), "{err}");
}

#[tokio::test]
async fn a_missing_sqlite_file_is_created() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("fresh.db");
    let store = Store::connect(&format!("sqlite://{}", path.display())).await?;
    ensure!(path.exists());
    ensure!(store.list_runs(None, None, None, 10).await?.is_empty());
    Ok(())
}

/// Worker A claims; its lease expires; `successor` claims. Every write of
/// A's segment must return LeaseLost and change nothing; B's work is intact.
async fn zombie_case(db: &TestDb, successor: &str) -> Result<()> {
        let s = &db.store;
        let id = submit(s, 5).await?;
        let a = claim(s, "worker-a").await?;
        s.emit(&a.lease, "from A ").await?;
        s.begin_effect(&a.lease, &call(0, "http"), EffectClass::Keyed).await?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        let b = claim(s, successor).await?;
        ensure!(b.lease.fence == a.lease.fence + 1);
        s.reconcile(&b.lease).await?;
        s.emit(&b.lease, "from B").await?;

        let run_before = s.get_run(id).await?;
        let effects_before = s.effects(id).await?;
        let events_before = s.run_events(id).await?;

        let lost = |r: Result<_, StoreError>, what: &str| -> Result<()> {
            match r {
                Err(StoreError::LeaseLost(l)) if l == a.lease => Ok(()),
                other => anyhow::bail!("zombie {what}: expected LeaseLost, got {other:?}"),
            }
        };
        lost(s.renew(&a.lease, TTL).await.map(drop), "renew")?;
        lost(s.emit(&a.lease, "zombie").await.map(drop), "emit")?;
        lost(s.close(&a.lease, &completed("zombie")).await, "close")?;
        lost(s.close(&a.lease, &Outcome::Failed { error: "zombie".into() }).await, "close failed")?;
        for how in [Suspend::Takeover, Suspend::WaitInput { prompt: "p".into() }, Suspend::Sleep { delay_ms: 5 }] {
            lost(s.suspend(&a.lease, &how).await.map(drop), "suspend")?;
        }
        lost(s.begin_effect(&a.lease, &call(1, "http"), EffectClass::Unkeyed).await.map(drop), "begin_effect")?;
        lost(s.complete_effect(&a.lease, 0, &Completion::Committed("r".into())).await.map(drop), "complete_effect")?;
        lost(s.complete_effect(&a.lease, 0, &Completion::Failed("r".into())).await.map(drop), "fail_effect")?;
        lost(s.reissue_effect(&a.lease, 0).await.map(drop), "reissue_effect")?;
        // Each local operation is its own statement on PostgreSQL.
        let put = LocalOp::KvPut { namespace: "p".into(), key: "k".into(), value: "zombie".into() };
        lost(s.local_effect(&a.lease, &call(1, "kv.put"), &put).await.map(drop), "local_effect kv.put")?;
        let get = LocalOp::KvGet { namespace: "p".into(), key: "k".into() };
        lost(s.local_effect(&a.lease, &call(1, "kv.get"), &get).await.map(drop), "local_effect kv.get")?;
        let record = LocalOp::Record { value: "1".into() };
        lost(s.local_effect(&a.lease, &call(1, "sleep"), &record).await.map(drop), "local_effect record")?;
        let take = LocalOp::TakeInput { value: "\"in\"".into() };
        lost(s.local_effect(&a.lease, &call(1, "wait-input"), &take).await.map(drop), "local_effect take input")?;
        lost(s.record_refusal(&a.lease, &call(1, "nope"), "{}").await.map(drop), "record_refusal")?;
        lost(s.retract(&a.lease, 0).await.map(drop), "retract")?;
        let held = HeldPut { call: call(1, "kv.put"), namespace: "p".into(), key: "k".into(), value: "z".into() };
        lost(s.write_held(&a.lease, &["zombie"], std::slice::from_ref(&held)).await, "write_held")?;
        lost(s.close_and_claim(&a.lease, &[], &[held], &completed("zombie"), Some(("worker-a", TTL))).await.map(drop), "close_and_claim")?;
        lost(s.reconcile(&a.lease).await.map(drop), "reconcile")?;

        let mut run_after = s.get_run(id).await?;
        // Only B may have touched the heartbeat; nothing of A's landed.
        run_after.heartbeat_at = run_before.heartbeat_at;
        ensure!(run_after == run_before, "run changed:\n{run_before:?}\n{run_after:?}");
        ensure!(s.effects(id).await? == effects_before);
        ensure!(s.run_events(id).await? == events_before);
        let kv: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM kv").fetch_one(s.pool()).await?;
        ensure!(kv == 0, "the zombie's kv.put must not apply");

        // B's work is intact and B can finish.
        s.reissue_effect(&b.lease, 0).await?;
        s.complete_effect(&b.lease, 0, &Completion::Committed("ok".into())).await?;
        s.close(&b.lease, &completed("A? no: B")).await?;
        let done = s.get_run(id).await?;
        ensure!(done.status == RunStatus::Completed && done.partial == "from A from B");
        ensure!(done.output.as_deref() == Some("A? no: B"));
        Ok(())
    }


/// What one claim statement reads to choose its runs. SQLite: its query
/// plan (see [`sqlite_claim_walks_the_index`]). PostgreSQL: the
/// shared buffers its choosing CTE touches, from `EXPLAIN (ANALYZE,
/// BUFFERS)` in a transaction that is rolled back, with `planner` (`SET
/// LOCAL …`, or "") set first. The runs are chosen inside
/// `leasehold_claimable`, whose plan the outer EXPLAIN does not show, but
/// whose buffers it counts.
async fn claim_reads(db: &TestDb, batch: i64, planner: &str) -> Result<ClaimReads> {
    use sqlx::Row;
    let s = &db.store;
    let sql = leasehold::store::claim_sql(s, batch);
    match db.backend {
        leasehold::Backend::Sqlite => {
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                .bind("w")
                .bind(1000_i64)
                .bind(batch)
                .fetch_all(s.pool())
                .await?;
            let plan: Vec<String> = rows.iter().map(|r| r.try_get::<String, _>(3).unwrap_or_default()).collect();
            Ok(ClaimReads::Plan(plan.join("\n")))
        }
        leasehold::Backend::Postgres => {
            // One connection, the last of eight tries: the first call in a
            // session also reads the catalog (compiling the function,
            // planning its query), which is not the claim's work; and each
            // statement in the functions is planned anew on each of its
            // first five runs in a session (PostgreSQL's plan cache), so a
            // count from fewer tries swung by 50 blocks with how many claims
            // the pooled connection had run before.
            let mut conn = s.pool().acquire().await?;
            let mut plan = Vec::new();
            for _ in 0..8 {
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                if !planner.is_empty() {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(planner.to_string())).execute(&mut *tx).await?;
                }
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}")))
                    .bind("w")
                    .bind(1000_i64)
                    .bind(batch)
                    .bind(batch)
                    .bind(0_i64)
                    .fetch_all(&mut *tx)
                    .await?;
                tx.rollback().await?;
                plan = rows.iter().map(|r| r.try_get::<String, _>(0).unwrap_or_default()).collect();
            }
            // What choosing the runs read: the first buffer count under the
            // CTE that chooses them (`c`), which counts the nodes under it.
            let line = plan
                .iter()
                .skip_while(|l| l.trim() != "CTE c")
                .find(|l| l.trim_start().starts_with("Buffers:"))
                .cloned()
                .unwrap_or_default();
            let blocks: i64 = ["hit=", "read="]
                .iter()
                .filter_map(|k| line.split(k).nth(1))
                .filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse::<i64>().ok())
                .sum();
            Ok(ClaimReads::Blocks(blocks, plan.join("\n")))
        }
    }
}

/// SQLite: the claim reads each priority's runs from runs_claim in order,
/// bounded by the priority and the clock, and sorts nothing. A claim
/// whose order no longer matches the index sorts, or scans, the whole queue
/// instead; one whose bound the index cannot use reads every leased and
/// sleeping run of its priority. (Its look for a key taking turns scans
/// `concurrency_keys_turn`, a partial index of just those keys, to its
/// first entry.)
fn sqlite_claim_walks_the_index(plan: &str) -> bool {
    let per_priority = plan.contains("SEARCH runs USING INDEX runs_claim (concurrency_key=? AND priority=? AND <expr><?)");
    let full_scans = plan
        .lines()
        .filter(|l| l.contains("SCAN ") && !["USING INDEX runs_claim", "USING INDEX runs_priority", "USING INDEX concurrency_keys_turn", "USING INDEX concurrency_keys_ready", "SCAN lv", "SCAN (subquery", "CONSTANT ROW"].iter().any(|ok| l.contains(ok)))
        .count();
    per_priority && !plan.contains("TEMP B-TREE") && full_scans == 0
}

enum ClaimReads {
    Plan(String),
    Blocks(i64, String),
}

both! {
    async fn claim_uses_the_claim_index_when_the_table_is_full_of_finished_runs(db) {
        // If the index predicate or expression and the claim's text drift
        // apart, PostgreSQL silently falls back to scanning every finished
        // run (SQLite's INDEXED BY fails loudly instead). Both the one-run
        // and the batched form must go through runs_claim: on PostgreSQL,
        // read a few dozen blocks, not the 20000 finished runs' hundreds.
        let s = &db.store;
        s.bulk_load(20_000, "done", RunStatus::Completed).await?;
        s.bulk_load_queued(10, "p").await?;
        sqlx::raw_sql("ANALYZE").execute(s.writer()).await?;
        for batch in [1, 50] {
            match claim_reads(db, batch, "").await? {
                ClaimReads::Plan(plan) => {
                    // INDEXED BY makes SQLite use runs_claim or refuse the
                    // statement; what can drift is the order: a claim whose
                    // ORDER BY no longer matches the index sorts the queue.
                    ensure!(sqlite_claim_walks_the_index(&plan), "batch {batch}: the claim does not walk runs_claim in order:\n{plan}");
                }
                ClaimReads::Blocks(blocks, plan) => {
                    ensure!(blocks > 0 && blocks < 100, "batch {batch}: the claim read {blocks} blocks:\n{plan}");
                }
            }
        }
        let c = s.claim_batch("w", TTL, 5).await?;
        ensure!(c.len() == 5 && c.iter().all(|c| c.run.plugin == "p"));
        Ok(())
    }
}

both! {
    async fn a_claim_takes_the_head_of_a_long_queue_without_sorting_it(db) {
        // A planner that believes the queue is short (statistics or a plan
        // cached while it was) prefers to fetch every claimable run and sort
        // them over walking runs_claim in order; then each claim costs time
        // in proportion to the queue. Turning index scans off for the
        // session makes PostgreSQL's planner prefer that plan here; the
        // claim must still read only the head of the queue.
        let s = &db.store;
        s.bulk_load_queued(10_000, "p").await?;
        sqlx::raw_sql("ANALYZE").execute(s.writer()).await?;
        for batch in [1, 5] {
            match claim_reads(db, batch, "SET LOCAL enable_indexscan = off").await? {
                ClaimReads::Plan(plan) => {
                    ensure!(sqlite_claim_walks_the_index(&plan), "batch {batch}: the claim sorts the queue:\n{plan}");
                }
                ClaimReads::Blocks(blocks, plan) => {
                    ensure!(blocks > 0 && blocks < 100, "batch {batch}: the claim read {blocks} blocks:\n{plan}");
                }
            }
        }
        let head: Vec<i64> = sqlx::query_scalar("SELECT id FROM runs ORDER BY id LIMIT 5").fetch_all(s.pool()).await?;
        let mut c: Vec<i64> = s.claim_batch("w", TTL, 5).await?.iter().map(|c| c.run.id).collect();
        c.sort();
        ensure!(c == head, "the claim took {c:?}, not the head of the queue {head:?}");
        Ok(())
    }
}


both! {
    async fn a_key_at_its_limit_costs_a_claim_nothing_however_long_its_queue(db) {
        // Its runs are a lane of their own: the claim counts its one
        // running run, passes it over, and reads the runs without a key,
        // never the key's 5,000 queued runs.
        let s = &db.store;
        s.set_limit("full", Some(1), false).await?;
        let keyed: Vec<NewRun> = (0..1000).map(|_| NewRun { concurrency_key: Some("full".into()), ..NewRun::new("k", "{}") }).collect();
        for _ in 0..5 {
            s.create_runs(&keyed).await?;
        }
        let held = s.claim_batch("w", TTL, 1).await?;
        ensure!(held.len() == 1 && held[0].run.concurrency_key.as_deref() == Some("full"));
        s.bulk_load_queued(10, "p").await?;
        sqlx::raw_sql("ANALYZE").execute(s.writer()).await?;
        match claim_reads(db, 5, "").await? {
            ClaimReads::Plan(_) => {
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {}", leasehold::store::concurrency::lane_sql())))
                    .bind("full")
                    .bind(5_i64)
                    .fetch_all(s.pool())
                    .await?;
                use sqlx::Row;
                let plan: Vec<String> = rows.iter().map(|r| r.try_get::<String, _>(3).unwrap_or_default()).collect();
                let plan = plan.join("\n");
                ensure!(sqlite_claim_walks_the_index(&plan), "a key's lane is not read in index order:\n{plan}");
            }
            ClaimReads::Blocks(blocks, plan) => {
                // About 50: the keys' turns (the wake of dormant keys, the
                // key's row, its slots) and each lane's takeovers and
                // priorities, a few blocks each; reading the key's 5,000
                // runs would add more than as many again.
                ensure!(blocks > 0 && blocks < 100, "the claim read {blocks} blocks:\n{plan}");
            }
        }
        let c = s.claim_batch("w", TTL, 5).await?;
        ensure!(c.len() == 5 && c.iter().all(|c| c.run.plugin == "p"), "{:?}", c.iter().map(|c| &c.run.plugin).collect::<Vec<_>>());
        Ok(())
    }
}
