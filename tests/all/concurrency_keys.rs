//! Concurrency keys: a key's limit holds across hosts (checked from the
//! runs' own lease intervals), a slot comes back by the run's state alone,
//! a paused key runs nothing, keys take turns, and priorities order the
//! runs within a key.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::store::{NewRun, Outcome, RunStatus, Store, StoreError, Suspend};

use crate::harness::{TTL, both};

async fn keyed(store: &Store, key: &str, n: usize) -> Result<Vec<i64>> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let (run, _) = store.create_run(&NewRun { concurrency_key: Some(key.into()), ..NewRun::new("p", "{}") }).await?;
        ensure!(run.concurrency_key.as_deref() == Some(key), "the run came back with key {:?}", run.concurrency_key);
        ids.push(run.id);
    }
    Ok(ids)
}

async fn plain(store: &Store, n: usize) -> Result<Vec<i64>> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(store.create_run(&NewRun::new("p", "{}")).await?.0.id);
    }
    Ok(ids)
}

async fn claim_ids(store: &Store, n: i64) -> Result<Vec<i64>> {
    Ok(store.claim_batch("w", TTL, n).await?.iter().map(|c| c.run.id).collect())
}

/// The most of `intervals` ([start, end) on the database's clock) that
/// overlap at once.
fn most_at_once(intervals: &[(i64, i64)]) -> usize {
    // Ends sort before starts at the same instant.
    let mut edges: Vec<(i64, i64)> = intervals.iter().flat_map(|&(s, f)| [(s, 1), (f, -1)]).collect();
    edges.sort();
    let (mut now, mut most) = (0_i64, 0_i64);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    most as usize
}

both! {
    async fn three_hosts_never_run_more_of_a_key_than_its_limit(db) {
        const LIMIT: i64 = 3;
        let s = &db.store;
        s.set_limit("tenant", Some(LIMIT), false).await?;
        keyed(s, "tenant", 60).await?;
        plain(s, 30).await?;
        // Each keyed run's lease: from when the claim gave it (its expiry
        // less the lease length, the database's clock once the claim had
        // counted the key's slots) to its close (the close statement's
        // start, before its commit frees the slot).
        let leases = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = tokio::task::JoinSet::new();
        for host in 0..3 {
            let store = db.another_store(4).await?;
            for worker in 0..4 {
                let store = store.clone();
                let leases = leases.clone();
                let owner = format!("host{host}-{worker}");
                tasks.spawn(async move {
                    let mut idle = 0;
                    while idle < 20 {
                        let claimed = store.claim_batch(&owner, TTL, 2).await?;
                        if claimed.is_empty() {
                            idle += 1;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                        idle = 0;
                        for c in claimed {
                            // Hold the slot a while, so that runs overlap.
                            tokio::time::sleep(Duration::from_millis(5 + (c.run.id % 4) as u64 * 5)).await;
                            store.close(&c.lease, &Outcome::Completed { output: "ok".into() }).await?;
                            if c.run.concurrency_key.is_some() {
                                let given = c.run.lease_expires_at.expect("a lease") - TTL.as_millis() as i64;
                                let closed = store.get_run(c.run.id).await?.finished_at.expect("finished");
                                leases.lock().unwrap().push((given, closed));
                            }
                        }
                    }
                    Ok::<_, StoreError>(())
                });
            }
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let done: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = 'completed'").fetch_one(s.pool()).await?;
        ensure!(done == 90, "{done} of 90 runs completed");
        let leases = leases.lock().unwrap().clone();
        ensure!(leases.len() == 60, "{} keyed leases recorded", leases.len());
        let most = most_at_once(&leases);
        ensure!(most as i64 <= LIMIT, "{most} runs of the key ran at once, over its limit {LIMIT}");
        ensure!(most >= 2, "the key's runs never overlapped ({most}): the test proves nothing");
        Ok(())
    }

    async fn a_keys_slot_comes_back_when_its_run_sleeps_waits_is_cancelled_or_dies(db) {
        let s = &db.store;
        s.set_limit("k", Some(1), false).await?;
        let ids = keyed(s, "k", 4).await?;
        let other = plain(s, 1).await?;
        let take = |n| claim_ids(s, n);
        let one = |got: Vec<i64>, want: i64, why: &str| -> Result<()> {
            ensure!(got == vec![want], "{why}: claimed {got:?}, want [{want}]");
            Ok(())
        };
        let a = s.claim_batch("w", TTL, 1).await?.pop().expect("a run");
        ensure!(a.run.id == ids[0] || a.run.id == other[0]);
        // Whichever came first, the rest of this batch: the key's one slot
        // is taken, so only the run without a key is left to claim.
        let first = if a.run.id == ids[0] { a } else { s.claim_batch("w", TTL, 1).await?.pop().expect("the key's run") };
        ensure!(first.run.id == ids[0]);
        ensure!(take(5).await?.iter().all(|id| !ids.contains(id)), "the key ran a second run while at its limit");
        // Sleeps: its slot is free.
        s.suspend(&first.lease, &Suspend::Sleep { delay_ms: 600_000 }).await?;
        let second = s.claim_batch("w", TTL, 5).await?;
        one(second.iter().map(|c| c.run.id).collect(), ids[1], "after the first slept")?;
        // Waits for input.
        s.suspend(&second[0].lease, &Suspend::WaitInput { prompt: "?".into() }).await?;
        let third = s.claim_batch("w", TTL, 5).await?;
        one(third.iter().map(|c| c.run.id).collect(), ids[2], "after the second waited for input")?;
        // Cancelled.
        s.cancel(ids[2]).await?;
        let fourth = s.claim_batch("w", TTL, 5).await?;
        one(fourth.iter().map(|c| c.run.id).collect(), ids[3], "after the third was cancelled")?;
        // Input arrives while the slot is held: it waits for the slot.
        s.deliver_input(ids[1], "\"yes\"").await?;
        ensure!(take(5).await?.is_empty(), "a run took the slot of a live lease");
        // Dies: its lease expires, and its slot with it; the claim takes
        // the oldest claimable run of the key, the one whose input came.
        db.backdate_lease(ids[3], TTL.as_millis() as i64 + 1_000).await?;
        let got = take(1).await?;
        ensure!(got.len() == 1 && (got[0] == ids[1] || got[0] == ids[3]), "after the fourth died: claimed {got:?}");
        ensure!(take(5).await?.is_empty(), "two runs of the key hold a slot");
        Ok(())
    }

    async fn a_lease_that_ran_out_is_never_renewed_nor_written_once_its_slot_is_given_away(db) {
        let s = &db.store;
        s.set_limit("k", Some(1), false).await?;
        // On its one attempt: once its lease runs out it is not taken over,
        // so the slot goes to the next run.
        let (first, _) = s.create_run(&NewRun { max_attempts: Some(1), concurrency_key: Some("k".into()), ..NewRun::new("p", "{}") }).await?;
        let a = s.claim_batch("frozen", TTL, 1).await?.pop().expect("the key's first run");
        ensure!(a.run.id == first.id);
        let (next, _) = s.create_run(&NewRun { concurrency_key: Some("k".into()), ..NewRun::new("p", "{}") }).await?;
        ensure!(claim_ids(s, 5).await?.is_empty(), "a second run took the key's one live slot");
        // The host of the first run freezes past its lease: the slot is free.
        db.backdate_lease(first.id, TTL.as_millis() as i64 + 1_000).await?;
        let b = s.claim_batch("other", TTL, 1).await?.pop().expect("the key's slot, free again");
        ensure!(b.run.id == next.id, "claimed {}, want {}", b.run.id, next.id);
        // The frozen host wakes: neither its renewal nor its close may take the slot back.
        let renewed = s.renew(&a.lease, TTL).await;
        ensure!(matches!(renewed, Err(StoreError::LeaseLost(_))), "a lease that ran out was renewed: {renewed:?}");
        let closed = s.close(&a.lease, &Outcome::Completed { output: "late".into() }).await;
        ensure!(matches!(closed, Err(StoreError::LeaseLost(_))), "a lease that ran out closed its run: {closed:?}");
        let view = s.limit("k").await?.expect("the key");
        ensure!(view.running == 1, "{view:?}");
        Ok(())
    }

    async fn a_lease_that_ran_out_writes_nothing_even_if_nobody_took_the_run(db) {
        let s = &db.store;
        let (run, _) = s.create_run(&NewRun::new("p", "{}")).await?;
        let a = s.claim_batch("frozen", TTL, 1).await?.pop().expect("the run");
        ensure!(a.run.id == run.id);
        db.backdate_lease(run.id, TTL.as_millis() as i64 + 1_000).await?;
        let suspended = s.suspend(&a.lease, &Suspend::Sleep { delay_ms: 10 }).await;
        ensure!(matches!(suspended, Err(StoreError::LeaseLost(_))), "an expired lease suspended its run: {suspended:?}");
        let renewed = s.renew(&a.lease, TTL).await;
        ensure!(matches!(renewed, Err(StoreError::LeaseLost(_))), "an expired lease was renewed: {renewed:?}");
        let closed = s.close(&a.lease, &Outcome::Completed { output: "late".into() }).await;
        ensure!(matches!(closed, Err(StoreError::LeaseLost(_))), "an expired lease closed its run: {closed:?}");
        // The next claim takes it over under a new fence.
        let b = s.claim_batch("other", TTL, 1).await?.pop().expect("the run, taken over");
        ensure!(b.run.id == run.id && b.lease.fence == a.lease.fence + 1);
        s.close(&b.lease, &Outcome::Completed { output: "ok".into() }).await?;
        Ok(())
    }

    async fn a_removed_limit_on_a_key_without_runs_leaves_nothing_to_show(db) {
        let s = &db.store;
        s.set_limit("solo", Some(3), false).await?;
        keyed(s, "solo", 1).await?;
        let c = s.claim_batch("w", TTL, 1).await?.pop().expect("the key's run");
        s.close(&c.lease, &Outcome::Completed { output: String::new() }).await?;
        ensure!(s.remove_limit("solo").await?);
        ensure!(s.limit("solo").await?.is_none(), "{:?}", s.limit("solo").await?);
        // Through the API: a key never used, limited then cleared, is a 404.
        let (base, http, stop) = crate::schedules::api(db).await?;
        let url = format!("{base}/v1/limits/x");
        let put = http.put(&url).json(&serde_json::json!({ "concurrency": 2 })).send().await?;
        ensure!(put.status() == 200, "{}", put.status());
        ensure!(http.delete(&url).send().await?.status() == 204);
        let got = http.get(&url).send().await?.status();
        ensure!(got == 404, "GET after DELETE: {got}");
        stop.stop().await;
        Ok(())
    }

    async fn pausing_a_key_keeps_its_plugins_default_limit(db) {
        let s = &db.store;
        let settings = leasehold::store::PluginSettings { key_concurrency: Some(2), ..Default::default() };
        s.put_plugin("capped", "sha256:capped", b"not run", &settings).await?;
        s.create_run(&NewRun { concurrency_key: Some("fresh".into()), ..NewRun::new("capped", "{}") }).await?;
        let (base, http, stop) = crate::schedules::api(db).await?;
        let url = format!("{base}/v1/limits/fresh");
        let put = async |body: serde_json::Value| -> Result<serde_json::Value> { Ok(http.put(&url).json(&body).send().await?.json().await?) };
        let paused = put(serde_json::json!({ "paused": true })).await?;
        ensure!(paused["concurrency"] == 2 && paused["paused"] == true, "{paused}");
        let resumed = put(serde_json::json!({ "paused": false })).await?;
        ensure!(resumed["concurrency"] == 2 && resumed["updated_at"] == 0, "{resumed}");
        let cleared = put(serde_json::json!({ "concurrency": null })).await?;
        ensure!(cleared["concurrency"].is_null(), "{cleared}");
        stop.stop().await;
        Ok(())
    }

    async fn keys_whose_runs_all_sleep_leave_the_turns_and_one_due_is_claimed_at_once(db) {
        let s = &db.store;
        let mut sleepers = Vec::new();
        for k in 0..30 {
            sleepers.extend(keyed(s, &format!("d{k:02}"), 1).await?);
        }
        let soon = keyed(s, "zz-soon", 1).await?[0];
        let mut claimed = Vec::new();
        loop {
            let got = s.claim_batch("w", TTL, 64).await?;
            if got.is_empty() {
                break;
            }
            claimed.extend(got);
        }
        ensure!(claimed.len() == 31, "claimed {}", claimed.len());
        for c in &claimed {
            let delay_ms = if c.run.id == soon { 1_500 } else { 3_600_000 };
            s.suspend(&c.lease, &Suspend::Sleep { delay_ms }).await?;
        }
        ensure!(claim_ids(s, 64).await?.is_empty(), "a sleeping run was claimed");
        // The claim found each key with nothing due: all leave the turns.
        let ready: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM concurrency_keys WHERE active AND NOT paused AND due_at IS NULL")
            .fetch_one(s.pool())
            .await?;
        ensure!(ready == 0, "{ready} keys with nothing due still take turns");
        // Time alone wakes the key whose run is due: a claim of one takes it.
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        ensure!(claim_ids(s, 1).await? == vec![soon], "the due run waited for the turns to reach its key");
        // A wake (a sleep cut short) brings a dormant key back at once.
        let woken = sleepers[5];
        sqlx::query("UPDATE runs SET not_before = 0 WHERE id = $1").bind(woken).execute(s.writer()).await?;
        ensure!(claim_ids(s, 1).await? == vec![woken], "a woken run waited for its dormant key");
        // A submit to a dormant key wakes it too.
        let fresh = keyed(s, "d07", 1).await?[0];
        ensure!(claim_ids(s, 1).await? == vec![fresh], "a submit waited for its dormant key");
        Ok(())
    }

    async fn a_paused_key_runs_nothing_until_resumed(db) {
        let s = &db.store;
        s.set_limit("held", None, true).await?;
        let ids = keyed(s, "held", 3).await?;
        let other = plain(s, 1).await?;
        let got = claim_ids(s, 10).await?;
        ensure!(got == other, "a paused key's runs were claimed: {got:?}");
        let view = s.limit("held").await?.expect("the key");
        ensure!(view.paused && view.queued == 3 && view.running == 0, "{view:?}");
        s.set_limit("held", None, false).await?;
        let mut got = claim_ids(s, 10).await?;
        got.sort();
        ensure!(got == ids, "resumed, claimed {got:?}, want {ids:?}");
        let view = s.limit("held").await?.expect("the key");
        ensure!(!view.paused && view.queued == 0 && view.running == 3, "{view:?}");
        Ok(())
    }

    async fn a_small_key_is_not_held_behind_a_large_ones_backlog(db) {
        let s = &db.store;
        keyed(s, "large", 400).await?;
        plain(s, 100).await?;
        let small: HashSet<i64> = keyed(s, "small", 6).await?.into_iter().collect();
        let mut batches = 0;
        let mut left = small.clone();
        while !left.is_empty() {
            batches += 1;
            ensure!(batches <= 5, "after {batches} batches of 8 the small key still waits for {left:?}");
            for c in s.claim_batch("w", TTL, 8).await? {
                left.remove(&c.run.id);
                s.close(&c.lease, &Outcome::Completed { output: String::new() }).await?;
            }
        }
        // In eligible order alone, the small key would have waited for 500
        // runs: 63 batches.
        Ok(())
    }

    async fn runs_without_a_key_get_their_share_beside_many_keys(db) {
        let s = &db.store;
        for k in 0..20 {
            keyed(s, &format!("k{k}"), 10).await?;
        }
        let plain: HashSet<i64> = plain(s, 5).await?.into_iter().collect();
        // Claims of one run: the keyless lane takes a random place among
        // the 20 keys' turns, so it waits about 10 claims, not 200.
        let mut claims = 0;
        let mut left = plain.clone();
        while !left.is_empty() {
            claims += 1;
            ensure!(claims <= 150, "after {claims} claims of one run, runs without a key still wait: {left:?}");
            let c = s.claim("w", TTL).await?.expect("a run");
            left.remove(&c.run.id);
            s.close(&c.lease, &Outcome::Completed { output: String::new() }).await?;
        }
        Ok(())
    }

    async fn priorities_order_the_runs_within_a_key(db) {
        let s = &db.store;
        let mut want = Vec::new();
        for p in [0, 5, -3, 5, 0] {
            let (run, _) = s.create_run(&NewRun { priority: p, concurrency_key: Some("k".into()), ..NewRun::new("p", "{}") }).await?;
            want.push((-p, run.id));
        }
        want.sort();
        let want: Vec<i64> = want.into_iter().map(|(_, id)| id).collect();
        let mut got = Vec::new();
        while let Some(c) = s.claim("w", TTL).await? {
            got.push(c.run.id);
        }
        ensure!(got == want, "claimed {got:?}, want {want:?}");
        Ok(())
    }

    async fn a_key_left_without_claimable_runs_comes_back_when_its_input_arrives(db) {
        let s = &db.store;
        let ids = keyed(s, "k", 1).await?;
        let c = s.claim("w", TTL).await?.expect("the run");
        s.suspend(&c.lease, &Suspend::WaitInput { prompt: "?".into() }).await?;
        // Nothing of the key is claimable: a claim takes it out of turn.
        ensure!(claim_ids(s, 5).await?.is_empty());
        let active: i64 = sqlx::query_scalar("SELECT CASE WHEN active THEN 1 ELSE 0 END FROM concurrency_keys WHERE key = 'k'").fetch_one(s.pool()).await?;
        ensure!(active == 0, "a key without claimable runs still takes turns");
        s.deliver_input(ids[0], "\"go\"").await?;
        ensure!(claim_ids(s, 5).await? == ids, "the key did not come back with its run's input");
        let done = s.get_run(ids[0]).await?;
        ensure!(done.status == RunStatus::Running);
        Ok(())
    }

    async fn idle_keys_without_a_limit_are_forgotten_and_written_again_by_a_submit(db) {
        let s = &db.store;
        s.set_limit("kept", Some(1), false).await?;
        keyed(s, "gone", 1).await?;
        keyed(s, "kept", 1).await?;
        for c in s.claim_batch("w", TTL, 10).await? {
            s.close(&c.lease, &Outcome::Completed { output: String::new() }).await?;
        }
        // A claim finds both keys without a run to claim.
        ensure!(claim_ids(s, 10).await?.is_empty());
        ensure!(s.forget_idle_keys(100).await? == 1, "not exactly the idle key without a limit was forgotten");
        ensure!(s.limit("gone").await?.is_none() && s.limit("kept").await?.is_some());
        let ids = keyed(s, "gone", 1).await?;
        ensure!(claim_ids(s, 10).await? == ids, "a forgotten key's new run was not claimed");
        Ok(())
    }

    async fn limits_are_set_shown_listed_and_removed(db) {
        let s = &db.store;
        for bad in ["", "http:api.example.com:443", "model:gpt", "a\u{0}b", "tab\there"] {
            ensure!(matches!(s.set_limit(bad, Some(1), false).await, Err(StoreError::Config(_))), "key {bad:?} was taken");
        }
        let long = "x".repeat(257);
        ensure!(matches!(s.set_limit(&long, Some(1), false).await, Err(StoreError::Config(_))));
        for n in [0, -1, 1_000_001] {
            ensure!(matches!(s.set_limit("k", Some(n), false).await, Err(StoreError::Config(_))), "limit {n} was taken");
        }
        ensure!(matches!(
            s.create_run(&NewRun { concurrency_key: Some("model:x".into()), ..NewRun::new("p", "{}") }).await,
            Err(StoreError::Config(_))
        ));
        ensure!(s.limit("k").await?.is_none());
        let set = s.set_limit("k", Some(2), false).await?;
        ensure!(set.concurrency == Some(2) && !set.paused && set.queued == 0 && set.updated_at > 0, "{set:?}");
        keyed(s, "k", 3).await?;
        keyed(s, "j", 1).await?;
        claim_ids(s, 10).await?;
        let k = s.limit("k").await?.expect("k");
        ensure!(k.running == 2 && k.queued == 1, "{k:?}");
        let all: Vec<String> = s.limits("", 100).await?.into_iter().map(|l| l.key).collect();
        ensure!(all == ["j", "k"], "{all:?}");
        let page: Vec<String> = s.limits("j", 100).await?.into_iter().map(|l| l.key).collect();
        ensure!(page == ["k"], "{page:?}");
        ensure!(s.remove_limit("k").await?);
        ensure!(!s.remove_limit("k").await?, "a second removal found a limit");
        let k = s.limit("k").await?.expect("k has runs");
        ensure!(k.concurrency.is_none() && !k.paused, "{k:?}");
        // Without its limit, the key's last run is claimed.
        ensure!(claim_ids(s, 10).await?.len() == 1);
        Ok(())
    }

    async fn a_plugins_default_limit_goes_to_its_runs_keys_no_operator_set(db) {
        let s = &db.store;
        let settings = leasehold::store::PluginSettings { key_concurrency: Some(2), ..Default::default() };
        s.put_plugin("capped", "sha256:capped", b"not run", &settings).await?;
        let shown = s.plugin("capped").await?.expect("registered").settings;
        ensure!(shown.key_concurrency == Some(2), "{shown:?}");
        let submit = |key: &'static str, plugin: &'static str| async move {
            s.create_run(&NewRun { concurrency_key: Some(key.into()), ..NewRun::new(plugin, "{}") }).await
        };
        // A new key takes the default.
        submit("fresh", "capped").await?;
        ensure!(s.limit("fresh").await?.and_then(|k| k.concurrency) == Some(2), "{:?}", s.limit("fresh").await?);
        // A key first seen without a default takes it on a later submit.
        submit("later", "p").await?;
        ensure!(s.limit("later").await?.and_then(|k| k.concurrency).is_none());
        submit("later", "capped").await?;
        ensure!(s.limit("later").await?.and_then(|k| k.concurrency) == Some(2));
        // An operator's limit, or an operator's removal of one, stands.
        s.set_limit("set", Some(5), false).await?;
        submit("set", "capped").await?;
        ensure!(s.limit("set").await?.and_then(|k| k.concurrency) == Some(5));
        s.set_limit("cleared", None, false).await?;
        submit("cleared", "capped").await?;
        ensure!(s.limit("cleared").await?.and_then(|k| k.concurrency).is_none(), "the default overrode an operator's 'no limit'");
        // And the default limits the claim like any limit.
        submit("fresh", "capped").await?;
        submit("fresh", "capped").await?;
        let claimed = s.claim_batch("w", TTL, 10).await?;
        let fresh = claimed.iter().filter(|c| c.run.concurrency_key.as_deref() == Some("fresh")).count();
        ensure!(fresh == 2, "{fresh} runs of a key limited to 2 claimed at once");
        Ok(())
    }

    async fn a_keys_turn_serves_up_to_the_quantum_on_postgres_and_a_share_on_sqlite(db) {
        let s = &db.store;
        for k in 0..10 {
            keyed(s, &format!("k{k}"), 8).await?;
        }
        let claimed = s.claim_batch("w", TTL, 8).await?;
        ensure!(claimed.len() == 8, "{} claimed", claimed.len());
        let keys: HashSet<String> = claimed.iter().filter_map(|c| c.run.concurrency_key.clone()).collect();
        // PostgreSQL: 4 runs a turn (migration 0016), so two keys; SQLite:
        // the batch over the lanes, one run a key.
        let want = if db.backend == leasehold::Backend::Postgres { 2 } else { 8 };
        ensure!(keys.len() == want, "a batch of 8 over 10 keys served {} keys: {keys:?}", keys.len());
        // The keys served went to the back: the next batch serves first
        // those the last one did not reach.
        let next: HashSet<String> = s.claim_batch("w", TTL, 8).await?.iter().filter_map(|c| c.run.concurrency_key.clone()).collect();
        let unserved: HashSet<String> = (0..10).map(|k| format!("k{k}")).filter(|k| !keys.contains(k)).collect();
        if db.backend == leasehold::Backend::Postgres {
            ensure!(next.is_disjoint(&keys) && next.is_subset(&unserved), "served again at once: {next:?} after {keys:?}");
        } else {
            ensure!(unserved.is_subset(&next), "{unserved:?} waited again: {next:?}");
        }
        Ok(())
    }
}
