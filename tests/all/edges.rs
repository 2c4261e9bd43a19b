//! The protocol at its edges, on both backends: attempts that deliberate
//! suspensions must not use up, a reaper and a renewal that must not wait
//! on a frozen host's row locks, the stream cut, reaper races, and
//! idempotency keys that must not repeat across databases.

use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::store::{EffectCall, EffectClass, LocalOp, NewRun, Outcome, RunStatus, Store, Suspend};
use leasehold::maintenance::reaper::{self, ReapReport, ReaperConfig};

use crate::harness::{TTL, TestDb, both, only, run_on};

async fn submit(store: &Store, max_attempts: i64) -> Result<i64> {
    let mut new = NewRun::new("p", "{}");
    new.max_attempts = Some(max_attempts);
    Ok(store.create_run(&new).await?.0.id)
}

fn call(seq: i64, name: &str, emit_pos: i64) -> EffectCall {
    EffectCall { seq, name: name.into(), request_hash: format!("h{seq}"), request: String::new(), emit_pos }
}

both! {
    async fn a_new_connection_opens_at_once_while_a_write_transaction_is_open(db) {
        // SQLite once set `auto_vacuum` on every new connection, which asks
        // for the write lock: a reader opening while a segment's write was
        // in flight waited out its busy timeout, over and over, until the
        // segment lost its lease.
        let s = &db.store;
        submit(s, 1).await?;
        let mut writing = s.pool().begin().await?;
        sqlx::query("UPDATE runs SET updated_at = updated_at + 1").execute(&mut *writing).await?;
        let opened = async {
            // More than the pool holds open yet: each is a new connection.
            let mut conns = Vec::new();
            for _ in 0..6 {
                let mut c = s.pool().acquire().await?;
                sqlx::query("SELECT COUNT(*) FROM runs").execute(&mut *c).await?;
                conns.push(c);
            }
            anyhow::Ok(conns.len())
        };
        let n = tokio::time::timeout(Duration::from_secs(3), opened).await;
        writing.rollback().await?;
        ensure!(matches!(n, Ok(Ok(6))), "connections waited on the open write: {n:?}");
        if db.backend == leasehold::store::Backend::Sqlite {
            // A new database still gives freed pages back (2: incremental).
            let mode: i64 = sqlx::query_scalar("PRAGMA auto_vacuum").fetch_one(s.pool()).await?;
            ensure!(mode == 2, "auto_vacuum {mode}");
        }
        Ok(())
    }


    async fn a_deliberate_suspension_never_uses_up_an_attempt(db) {
        // max_attempts bounds consecutive failed segments. A segment that
        // suspends on purpose (wait-input, sleep, a slice, a shutdown
        // hand-over) did not fail, whether or not it wrote a ledger row:
        // with max_attempts 1 the run must still be claimable afterwards.
        let s = &db.store;
        for how in [
            Suspend::WaitInput { prompt: "name?".into() },
            Suspend::Sleep { delay_ms: 0 },
            Suspend::Takeover,
        ] {
            let id = submit(s, 1).await?;
            let first = s.claim("a", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
            ensure!(first.run.id == id && first.run.attempt == 1);
            s.suspend(&first.lease, &how).await?;
            if let Suspend::WaitInput { .. } = how {
                s.deliver_input(id, "\"Ada\"").await?;
            }
            let again = s.claim("b", TTL).await?;
            ensure!(
                again.as_ref().map(|c| c.run.id) == Some(id),
                "{how:?}: the run was not claimable after its suspension: {:?}",
                s.get_run(id).await?
            );
            let report = reaper::tick(s, &ReaperConfig::default()).await?;
            ensure!(report.aborted.is_empty(), "{how:?}: {report:?}");
            s.close(&again.unwrap().lease, &Outcome::Completed { output: "done".into() }).await?;
        }
        Ok(())
    }

    async fn an_aborted_run_says_why_in_words_an_operator_understands(db) {
        let s = &db.store;
        let id = submit(s, 2).await?;
        for owner in ["host-a", "host-b"] {
            s.claim(owner, TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
            db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        }
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report.aborted == vec![id], "{report:?}");
        let error = s.get_run(id).await?.error.unwrap_or_default();
        for words in ["2 segments in a row", "max_attempts", "host-b", "fence 2", "lease"] {
            ensure!(error.contains(words), "the error does not say {words:?}: {error:?}");
        }
        Ok(())
    }

    async fn an_abort_with_nothing_streamed_has_no_output(db) {
        let s = &db.store;
        let id = submit(s, 1).await?;
        s.claim("a", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        ensure!(reaper::tick(s, &ReaperConfig::default()).await?.aborted == vec![id]);
        let run = s.get_run(id).await?;
        ensure!(run.status == RunStatus::Aborted && run.output.is_none(), "{run:?}");
        let message = s.run_events(id).await?.pop().unwrap();
        let payload: serde_json::Value = serde_json::from_str(&message.payload)?;
        ensure!(message.kind == "message" && payload["output"].is_null(), "{payload}");
        Ok(())
    }

    async fn the_reaper_leaves_a_run_closed_or_cancelled_after_it_looked(db) {
        let s = &db.store;
        let closed = submit(s, 1).await?;
        let a = s.claim("a", TTL).await?.unwrap();
        let cancelled = submit(s, 1).await?;
        let b = s.claim("b", TTL).await?.unwrap();
        // The reaper has seen both expired on their last attempt (a look
        // since gone stale: a lease that ran out writes nothing, so the
        // close below is of a lease still live); then the owner closes one
        // and an operator cancels the other.
        s.close(&a.lease, &Outcome::Completed { output: "in time".into() }).await?;
        s.cancel(cancelled).await?;
        let mut report = ReapReport::default();
        reaper::reap_run(s, closed, a.lease.fence, RunStatus::Running, &mut report).await?;
        reaper::reap_run(s, cancelled, b.lease.fence, RunStatus::Running, &mut report).await?;
        ensure!(report.raced == 2 && report.aborted.is_empty(), "{report:?}");
        ensure!(s.get_run(closed).await?.status == RunStatus::Completed);
        ensure!(s.get_run(cancelled).await?.status == RunStatus::Cancelled);
        // A second tick finds nothing to do.
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report == ReapReport::default(), "{report:?}");
        Ok(())
    }

    async fn a_second_reaper_tick_reports_a_resumable_run_again_and_changes_nothing(db) {
        let s = &db.store;
        let id = submit(s, 3).await?;
        let a = s.claim("a", TTL).await?.unwrap();
        s.begin_effect(&a.lease, &call(0, "http", 0), EffectClass::Keyed).await?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        let first = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(first.resumable == vec![id] && first.in_doubt == 1, "{first:?}");
        let (run, ledger) = (s.get_run(id).await?, s.effects(id).await?);
        let second = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(second.resumable == vec![id] && second.in_doubt == 0, "{second:?}");
        ensure!(s.get_run(id).await? == run && s.effects(id).await? == ledger);
        Ok(())
    }

    async fn retract_cuts_the_stream_back_and_tells_readers_which_positions_are_void(db) {
        let s = &db.store;
        let mut new = NewRun::new("p", "{}");
        new.thread_id = Some("cut".into());
        let id = s.create_run(&new).await?.0.id;
        let a = s.claim("a", TTL).await?.unwrap();
        s.emit_deltas(&a.lease, &["kept ", "half ", "answer"]).await?;
        db.backdate_lease(id, TTL.as_millis() as i64 + 1).await?;
        let b = s.claim("b", TTL).await?.unwrap();
        // A stale segment cannot cut.
        ensure!(s.retract(&a.lease, 1).await.unwrap_err().is_lease_lost());
        ensure!(s.retract(&b.lease, 1).await? == 1);
        let run = s.get_run(id).await?;
        ensure!(run.partial == "kept " && run.emit_pos == 1, "{run:?}");
        let events = s.run_events(id).await?;
        let last = events.last().unwrap();
        let payload: serde_json::Value = serde_json::from_str(&last.payload)?;
        ensure!(last.kind == "retract" && last.fence == b.lease.fence, "{last:?}");
        ensure!(payload == serde_json::json!({ "from": 1, "to": 3 }), "{payload}");
        let stream = leasehold::store::log::replay_stream(events.iter().map(|e| (e.kind.as_str(), e.payload.as_str())));
        ensure!(stream == vec!["kept ".to_string()], "{stream:?}");
        // Nothing past the cut: a no-op that writes no event.
        ensure!(s.retract(&b.lease, 1).await? == 1);
        ensure!(s.run_events(id).await?.len() == events.len());
        s.emit(&b.lease, "whole").await?;
        let events = s.run_events(id).await?;
        let stream = leasehold::store::log::replay_stream(events.iter().map(|e| (e.kind.as_str(), e.payload.as_str())));
        ensure!(stream.concat() == "kept whole" && s.get_run(id).await?.partial == "kept whole", "{stream:?}");
        Ok(())
    }

    async fn idempotency_keys_never_repeat_across_databases(db) {
        // Run 1's first call exists in every deployment, and again after a
        // database reset: an upstream that caches by key must not hand one
        // another's answer.
        let other = TestDb::new(db.backend).await?;
        let mut keys = Vec::new();
        for s in [&db.store, &other.store] {
            let id = submit(s, 3).await?;
            let a = s.claim("a", TTL).await?.unwrap();
            let row = s.begin_effect(&a.lease, &call(0, "http", 0), EffectClass::Keyed).await?;
            ensure!(row.idempotency_key.ends_with(&format!(":{id}:0")), "{row:?}");
            let local = s.local_effect(&a.lease, &call(1, "clock", 0), &LocalOp::Record { value: "1".into() }).await?;
            ensure!(local.idempotency_key.ends_with(&format!(":{id}:1")), "{local:?}");
            keys.push(row.idempotency_key);
        }
        other.cleanup().await?;
        ensure!(keys[0] != keys[1], "two databases gave run 1, call 0 the same key {:?}", keys[0]);
        Ok(())
    }
}

only! { postgres:
    async fn a_renewal_after_the_database_dropped_its_sessions_is_not_lost_to_a_dead_connection(db) {
        // After a PostgreSQL restart every idle pooled session is dead, and
        // the pool finds out only by using it. A segment past its local
        // deadline asks once before it gives its run up: that ask failed on
        // a dead session, so a zombie in the chaos suite gave its run up
        // with no refusal seen, and a live host would give a good lease up.
        let s = &db.store;
        submit(s, 3).await?;
        let a = s.claim("a", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))?;
        // Renewals' sessions are open and idle.
        s.renew(&a.lease, TTL).await?;
        use sqlx::Connection;
        let mut outside = sqlx::PgConnection::connect(db.url()).await?;
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_all(&mut outside)
        .await?;
        ensure!(!ended.is_empty(), "no session to end");
        outside.close().await?;
        let renewed = s.renew(&a.lease, TTL).await;
        ensure!(renewed.is_ok(), "the renewal failed: {renewed:?}");
        Ok(())
    }
}

only! { sqlite:
    async fn the_sqlite_writer_keeps_a_small_page_cache_and_its_temporary_files_in_memory(db) {
        // The writer keeps SQLite's 2 MiB: a larger cache is walked whole
        // by every commit that split a b-tree page. Without temp_store it
        // spilled statement journals to a file in /var/tmp. Readers keep
        // more for pages read while the database is quiet.
        let s = &db.store;
        let writer: (i64, i64) = (
            sqlx::query_scalar("PRAGMA cache_size").fetch_one(s.writer()).await?,
            sqlx::query_scalar("PRAGMA temp_store").fetch_one(s.writer()).await?,
        );
        ensure!(writer == (-2000, 2), "writer: cache_size, temp_store = {writer:?}");
        let reader: i64 = sqlx::query_scalar("PRAGMA cache_size").fetch_one(s.pool()).await?;
        ensure!(reader == -16384, "reader cache_size {reader}");
        Ok(())
    }
}

/// PostgreSQL only: SQLite has one writer and no row locks, and its
/// busy timeout already bounds every wait for the file lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_and_a_renewal_do_not_wait_on_a_row_a_frozen_host_has_locked() -> Result<()> {
    run_on(leasehold::Backend::Postgres, async |db: &TestDb| {
        let s = &db.store;
        let locked = submit(s, 1).await?;
        let held = s.claim("owner", TTL).await?.unwrap();
        let free = submit(s, 1).await?;
        s.claim("dead", TTL).await?.unwrap();
        sqlx::query("UPDATE runs SET lease_expires_at = lease_expires_at - 60000").execute(s.pool()).await?;
        // A frozen host's statement holds the first run's row lock and never
        // finishes (its own session has no idle timeout).
        use sqlx::Connection;
        let mut frozen = sqlx::PgConnection::connect(db.url()).await?;
        sqlx::raw_sql("BEGIN").execute(&mut frozen).await?;
        sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE").bind(locked).fetch_all(&mut frozen).await?;

        let tick = tokio::time::timeout(Duration::from_secs(20), reaper::tick(s, &ReaperConfig::default())).await;
        let report = tick.map_err(|_| anyhow::anyhow!("the reaper waited on the locked row for 20 s"))??;
        ensure!(report.aborted == vec![free], "the reaper must still reap the other run: {report:?}");
        let renew = tokio::time::timeout(Duration::from_secs(20), s.renew(&held.lease, TTL)).await;
        let renewed = renew.map_err(|_| anyhow::anyhow!("the renewal waited on the locked row for 20 s"))?;
        // Refused either way: the lease ran out (seen without waiting for
        // the row), or, had it been live, the lock timeout.
        ensure!(renewed.is_err(), "{renewed:?}");

        sqlx::raw_sql("ROLLBACK").execute(&mut frozen).await?;
        // Unlocked, both go through: the renewal answers at once, refusing
        // a lease that ran out.
        let after = s.renew(&held.lease, TTL).await;
        ensure!(after.as_ref().is_err_and(|e| e.is_lease_lost()), "{after:?}");
        ensure!(s.get_run(free).await?.status == RunStatus::Aborted);
        Ok(())
    })
    .await
}

/// SQLite only: the file holds every input, output, kv value and run
/// secret, so it and its `-wal` and `-shm` are created for their owner
/// alone, whatever the umask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_database_and_its_wal_and_shm_are_readable_by_their_owner_only() -> Result<()> {
    run_on(leasehold::Backend::Sqlite, async |db: &TestDb| {
        use std::os::unix::fs::PermissionsExt;
        submit(&db.store, 1).await?;
        let path = db.url().strip_prefix("sqlite://").unwrap_or(db.url()).split('?').next().unwrap_or_default().to_string();
        for suffix in ["", "-wal", "-shm"] {
            let file = format!("{path}{suffix}");
            let mode = std::fs::metadata(&file)?.permissions().mode() & 0o777;
            ensure!(mode == 0o600, "{file} has mode {mode:o}");
        }
        // serve probes the database before it connects: the probe's
        // connection must not create the file first.
        let probed = format!("{path}.probed");
        leasehold::Store::probe(&format!("sqlite://{probed}"), Duration::from_secs(10)).await?;
        let mode = std::fs::metadata(&probed)?.permissions().mode() & 0o777;
        ensure!(mode == 0o600, "a probe created {probed} with mode {mode:o}");
        Ok(())
    })
    .await
}

/// SQLite only: commits are durable by default; a regression to `NORMAL`
/// (which may lose the last commits in a power cut) fails here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_writer_commits_with_synchronous_full() -> Result<()> {
    run_on(leasehold::Backend::Sqlite, async |db: &TestDb| {
        let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous").fetch_one(db.store.writer()).await?;
        ensure!(synchronous == 2, "the writer's synchronous is {synchronous}, not FULL (2)");
        Ok(())
    })
    .await
}

/// PostgreSQL only: a close that waited on a row lock and then claimed the
/// next run leases it for the length it says, counted from when the claim
/// was made, not from when its statement began (`now()` is the start of
/// the transaction). SQLite's statements wait before they start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_handed_out_after_a_lock_wait_is_as_long_as_it_says() -> Result<()> {
    use leasehold::store::Outcome;
    use sqlx::Connection;
    run_on(leasehold::Backend::Postgres, async |db: &TestDb| {
        let s = &db.store;
        let a = submit(s, 1).await?;
        let held = s.claim("w", TTL).await?.unwrap();
        let b = submit(s, 1).await?;
        // Another session holds A's row for a second: A's close (which
        // claims B in the same statement) waits for it.
        let mut holder = sqlx::PgConnection::connect(db.url()).await?;
        sqlx::raw_sql("BEGIN").execute(&mut holder).await?;
        sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE").bind(a).fetch_all(&mut holder).await?;
        let store = s.clone();
        let close = tokio::spawn(async move {
            store.close_and_claim(&held.lease, &[], &[], &Outcome::Completed { output: "a".into() }, Some(("w", TTL))).await
        });
        // The close is seen waiting on the lock, then left waiting a second.
        crate::harness::until_lock_waiter(db, 1).await?;
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        sqlx::raw_sql("ROLLBACK").execute(&mut holder).await?;
        let next = close.await??.ok_or_else(|| anyhow::anyhow!("the close claimed nothing"))?;
        ensure!(next.run.id == b, "{next:?}");
        let now = s.now_ms().await?;
        let left = next.run.lease_expires_at.unwrap_or(0) - now;
        let ttl = TTL.as_millis() as i64;
        ensure!(left >= ttl - 400, "a lease of {ttl} ms was handed out with {left} ms left: shortened by the lock wait");
        Ok(())
    })
    .await
}
