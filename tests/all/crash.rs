//! Crash points (docs/concepts.md, "The ledger"): a worker dies before an effect is
//! `started`, between `started` and `committed`, or after `committed` but
//! before close; another worker resumes the run by replay. A counting HTTP
//! sink shows what was applied. The worker "dies" by having its segment
//! future dropped (its task aborted); the lease is then backdated instead of
//! waited out.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, SegmentOutcome};
use leasehold::runtime::Runtime;
use leasehold::store::{EffectState, NewRun, RunStatus};

use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

/// About half a second of guest CPU on this kind of machine: a window to
/// kill the worker in.
const SPIN: u64 = 1 << 28;

fn runtime(sink: &Sink) -> Result<Arc<Runtime>> {
    let rt = plugins::runtime()?;
    let mut limits = plugins::test_limits();
    limits.http_allow = vec![sink.allow()];
    limits.segment_budget = Duration::from_secs(20);
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    Ok(rt)
}

fn worker(db: &TestDb, rt: &Arc<Runtime>, owner: &str) -> Executor {
    crate::harness::executor(db, rt, owner)
}

/// Starts worker A on a new run, waits until `dead_when` holds, kills A,
/// then lets worker B resume the run to its end. Returns the run id.
async fn kill_and_resume(
    db: &TestDb,
    input: serde_json::Value,
    sink: &Sink,
    dead_when: impl AsyncFn() -> Result<bool>,
) -> Result<i64> {
    let rt = runtime(sink)?;
    let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
    crate::harness::kill_when(db, worker(db, &rt, "worker-a"), id, dead_when).await?;
    sink.hold(false);
    let outcomes = worker(db, &rt, "worker-b").drain().await?;
    ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "B: {outcomes:?}");
    Ok(id)
}

both! {
    async fn a_worker_killed_before_its_effect_started_leaves_it_to_be_performed_once(db) {
        let sink = Sink::start().await?;
        let input = serde_json::json!({ "mode": "http", "url": sink.url, "spin_before": SPIN * 4 });
        // Killed once claimed, before the effect (it spins first): nothing
        // recorded.
        let claimed_by_a = async || {
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE lease_owner = 'worker-a'")
                .fetch_one(db.store.pool()).await?;
            Ok(n == 1)
        };
        let id = kill_and_resume(db, input, &sink, claimed_by_a).await?;
        let hits = sink.hits();
        ensure!(hits.len() == 1 && hits[0].key == crate::harness::key(&db.store, id, 0).await? && hits[0].fence == "2", "{hits:?}");
        Ok(())
    }

    async fn a_keyed_effect_in_flight_when_its_worker_dies_is_reissued_under_the_same_key(db) {
        let sink = Sink::start().await?;
        sink.hold(true);
        let input = serde_json::json!({ "mode": "http", "url": sink.url, "keyed": true });
        let id = kill_and_resume(db, input, &sink, async || Ok(!sink.hits().is_empty())).await?;
        let hits = sink.hits();
        ensure!(hits.len() == 2, "re-issued once: {hits:?}");
        let key = crate::harness::key(&db.store, id, 0).await?;
        ensure!(hits.iter().all(|h| h.key == key), "one idempotency key: {hits:?}");
        ensure!(hits[0].fence == "1" && hits[1].fence == "2", "{hits:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref().is_some_and(|o| o.contains("applied")), "{run:?}");
        let ledger = db.store.effects(id).await?;
        ensure!(ledger.len() == 1 && ledger[0].state == EffectState::Committed && ledger[0].fence_completed == Some(2));
        Ok(())
    }

    async fn an_unkeyed_effect_in_flight_when_its_worker_dies_is_never_repeated_and_the_turn_sees_in_doubt(db) {
        let sink = Sink::start().await?;
        sink.hold(true);
        let input = serde_json::json!({ "mode": "http", "url": sink.url, "keyed": false });
        let id = kill_and_resume(db, input, &sink, async || Ok(!sink.hits().is_empty())).await?;
        ensure!(sink.hits().len() == 1, "never repeated: {:?}", sink.hits());
        let run = db.store.get_run(id).await?;
        ensure!(run.status == RunStatus::Completed);
        ensure!(run.output.as_deref().is_some_and(|o| o.starts_with("in-doubt: ")), "the turn saw in-doubt: {:?}", run.output);
        ensure!(db.store.effects(id).await?[0].state == EffectState::InDoubt);
        Ok(())
    }

    async fn an_effect_committed_before_its_worker_died_is_not_performed_again(db) {
        for keyed in [true, false] {
            let sink = Sink::start().await?;
            let input = serde_json::json!({ "mode": "http", "url": sink.url, "keyed": keyed, "spin_after": SPIN * 4 });
            let committed = async || {
                let run: Option<i64> = sqlx::query_scalar("SELECT MAX(run_id) FROM effects WHERE state = 'committed'")
                    .fetch_one(db.store.pool()).await?;
                Ok(run.is_some() && sink.hits().len() == 1)
            };
            let id = kill_and_resume(db, input, &sink, committed).await?;
            ensure!(sink.hits().len() == 1, "keyed={keyed}: replayed, not repeated: {:?}", sink.hits());
            let ledger = db.store.effects(id).await?;
            ensure!(ledger[0].fence_completed == Some(1), "keyed={keyed}: the committed row is A's: {ledger:?}");
            sqlx::query("DELETE FROM effects").execute(db.store.writer()).await?;
        }
        Ok(())
    }

    async fn a_sliced_run_completes_over_several_segments_with_the_same_output_as_an_unsliced_one(db) {
        // Each step waits 500 ms on the sink; a 2 s budget slices the
        // turn, and each slice has time for about four steps, well clear of
        // a slow one. Slices end between host calls, after their effects
        // commit, so replay skips them and no step reaches the sink twice.
        let sink = Sink::start_with_delay(Duration::from_millis(500)).await?;
        let input = serde_json::json!({ "mode": "http-steps", "steps": 6, "url": sink.url });
        let mut results = Vec::new();
        for budget in [Duration::from_secs(2), Duration::from_secs(60)] {
            let rt = plugins::runtime()?;
            let mut limits = plugins::test_limits();
            limits.http_allow = vec![sink.allow()];
            limits.segment_budget = budget;
            rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
            let id = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
            let outcomes = worker(db, &rt, "w").drain().await?;
            let run = db.store.get_run(id).await?;
            let prefix = crate::harness::key(&db.store, id, 0).await?.trim_end_matches('0').to_string();
            let keys: Vec<String> = sink.hits().into_iter().map(|h| h.key).filter(|k| k.starts_with(&prefix)).collect();
            ensure!(keys.len() == 6, "budget {budget:?}: each step reached the sink once: {keys:?}");
            results.push((outcomes.len(), run.output, run.partial, run.status));
        }
        let (sliced, whole) = (&results[0], &results[1]);
        ensure!(sliced.0 >= 2 && whole.0 == 1, "segments: sliced {}, unsliced {}", sliced.0, whole.0);
        ensure!(sliced.3 == RunStatus::Completed && whole.3 == RunStatus::Completed);
        ensure!(sliced.1 == whole.1 && sliced.2 == whole.2, "same output and stream: {sliced:?} vs {whole:?}");
        ensure!(whole.1.as_deref() == Some("did 6 http steps"));
        Ok(())
    }

    async fn http_to_a_host_off_the_allow_list_is_denied_and_recorded(db) {
        let rt = runtime(&Sink::start().await?)?;
        let id = db.store.create_run(&NewRun::new("testkit",
            serde_json::json!({ "mode": "http", "url": "http://10.0.0.1:9/effect" }).to_string())).await?.0.id;
        let out = worker(db, &rt, "w").run_once().await?;
        ensure!(out == Some((id, SegmentOutcome::Failed(leasehold::executor::GuestErrorKind::TurnError))), "{out:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.error.as_deref().is_some_and(|e| e.contains("denied") && e.contains("allow-list")), "{:?}", run.error);
        let ledger = db.store.effects(id).await?;
        ensure!(ledger.len() == 1 && ledger[0].state == EffectState::Failed, "the refusal is recorded for replay");
        Ok(())
    }
}

/// Found by the fault-injection suite: a host SIGSTOPped inside a
/// transaction held its run's row lock, so no other host could take the run
/// over (claims skip locked rows) until it woke. PostgreSQL now ends such a
/// session (`idle_in_transaction_session_timeout`), releasing the lock.
/// PostgreSQL only: on SQLite one stalled writer holds the whole file, which
/// is why several hosts need PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_ends_a_stalled_hosts_transaction_so_its_run_can_be_taken_over() -> Result<()> {
    crate::harness::run_on(leasehold::Backend::Postgres, async |db: &TestDb| {
        let options = leasehold::StoreOptions {
            migrate: false,
            pg_idle_in_transaction_timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let stalled = leasehold::Store::connect_with(db.url(), options).await?;
        let (run, _) = db.store.create_run(&NewRun::new("testkit", "{}")).await?;
        let held = stalled.claim("stalled", Duration::from_millis(200)).await?.expect("claimable");
        // The stalled host is inside a write transaction on its run's row
        // when it stops.
        let mut tx = stalled.pool().begin().await?;
        sqlx::query("UPDATE runs SET heartbeat_at = heartbeat_at WHERE id = $1")
            .bind(run.id)
            .execute(&mut *tx)
            .await?;
        // Wait for the server to end the stalled session (no fixed sleep:
        // that is the server's to do, on its own time).
        crate::harness::eventually("the stalled session was not ended within 30 s", async || {
            let stalled: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'",
            )
            .fetch_one(db.store.pool())
            .await?;
            let expired: bool = sqlx::query_scalar(
                "SELECT lease_expires_at < (extract(epoch from now()) * 1000)::bigint FROM runs WHERE id = $1",
            )
            .bind(run.id)
            .fetch_one(db.store.pool())
            .await?;
            Ok(stalled == 0 && expired)
        })
        .await?;
        let taken = db.store.claim("other", Duration::from_secs(30)).await?;
        ensure!(
            taken.as_ref().is_some_and(|c| c.run.id == run.id && c.lease.fence == held.lease.fence + 1),
            "the expired run was not taken over while the stalled transaction was open: {:?}",
            taken.map(|c| c.lease)
        );
        ensure!(tx.commit().await.is_err(), "the stalled transaction committed after the takeover");
        stalled.shutdown().await;
        Ok(())
    })
    .await
}
