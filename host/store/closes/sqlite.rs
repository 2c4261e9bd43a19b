//! SQLite's close batch: one transaction of a few set-based statements
//! (see [`crate::store::closes`]).

use serde_json::json;
use sqlx::Row;

use super::{Close, closing, wanted_next};
use crate::store::contract::Step;
use crate::store::guard::rejected;
use crate::store::local::{insert_held_puts_json, sqlite_held_put_json};
use crate::store::{Claimed, Store, StoreError, sql};

impl Store {
    /// SQLite: a batch of closes in one transaction and one commit (one
    /// fsync under `synchronous=FULL`), written set-based: one guarded
    /// `UPDATE … FROM jsonb_each(…)` for every close (moving the counters
    /// its runs hold), one bump of the other threads' counters, one insert
    /// of every event, the held puts, and one claim for the closes that
    /// want a next run. Each close is matched
    /// by its own (owner, fence) in the update: one that fails it writes
    /// nothing (its events and puts hang off the update's result) and gets
    /// [`StoreError::LeaseLost`]; the others are written.
    ///
    /// A batch holds each run once ([`take`]): the update's `RETURNING`
    /// names only the run, so two closes of one run could not be told apart.
    pub(crate) async fn close_batch_sqlite(
        &self,
        closes: &[Close],
    ) -> Result<Vec<Result<Option<Claimed>, StoreError>>, StoreError> {
        let database = self.database_id().await?;
        let next = wanted_next(closes)?;
        let derived = self.contracted(Step::DerivedMessages).await?;
        let (mut list, mut payloads) = (Vec::with_capacity(closes.len()), Vec::with_capacity(closes.len()));
        let mut runs = std::collections::HashSet::with_capacity(closes.len());
        for c in closes {
            if !runs.insert(c.lease.run_id) {
                return Err(StoreError::Config(format!("a batch closes run {} twice", c.lease.run_id)));
            }
            let (status, output, error, payload) = closing(&c.outcome, derived);
            payloads.push(payload);
            list.push(json!({
                "id": c.lease.run_id, "owner": c.lease.owner, "fence": c.lease.fence,
                "status": status.as_str(), "output": output, "error": error,
                "tail": c.deltas.concat(), "n": c.deltas.len(), "charge": i64::from(c.charge),
            }));
        }
        let list = serde_json::Value::Array(list).to_string();
        let (list, database, payloads): (&str, &str, &[Option<String>]) = (&list, &database, &payloads);
        let (results, threads) = self
            .retry(|| async move {
                let mut tx = self.writer().begin().await?;
                let conn: &mut sqlx::AnyConnection = &mut tx;
                // Statements 3 and 4 for every close, each behind its guard.
                let rows = sqlx::query(sql!(
                    self,
                    "UPDATE runs SET status = b.value ->> 'status', output = b.value ->> 'output', \
                     error = b.value ->> 'error', lease_owner = NULL, lease_expires_at = NULL, closed_by = b.value ->> 'owner', \
                     attempt = runs.attempt + (b.value ->> 'charge'), \
                     finished_at = {now}, updated_at = {now}, partial = runs.partial || {unfolded} || (b.value ->> 'tail'), \
                     emit_pos = runs.emit_pos + (b.value ->> 'n'), partial_pos = runs.emit_pos + (b.value ->> 'n'), \
                     message_seq = CASE WHEN $2 THEN COALESCE(runs.thread_seq, (SELECT last_seq FROM threads WHERE id = runs.thread_id), 0) \
                     + (b.value ->> 'n') + 1 END, thread_seq = runs.thread_seq + (b.value ->> 'n') + 1 \
                     FROM jsonb_each($1) AS b \
                     WHERE runs.id = b.value ->> 'id' AND runs.lease_owner = b.value ->> 'owner' \
                     AND runs.fence = b.value ->> 'fence' AND runs.status = 'running' \
                     AND runs.lease_expires_at >= {clock} \
                     RETURNING runs.id, runs.fence, runs.thread_id, runs.emit_pos, runs.message_seq, runs.thread_seq"
                ))
                .bind(list)
                .bind(derived)
                .fetch_all(&mut *conn)
                .await?;
                // (run, fence) -> (thread, emit position after the close,
                // message number, the count the run holds after it): a
                // close is written if its lease's run and fence came back
                // (one fence has one owner; the update checked which).
                let mut done = std::collections::HashMap::with_capacity(rows.len());
                for row in &rows {
                    let key: (i64, i64) = (row.try_get("id")?, row.try_get("fence")?);
                    let message_seq: Option<i64> = row.try_get("message_seq")?;
                    let held: Option<i64> = row.try_get("thread_seq")?;
                    done.insert(key, (row.try_get::<String, _>("thread_id")?, row.try_get::<i64, _>("emit_pos")?, message_seq, held));
                }
                // Each thread's counter moves on once, by all its closes'
                // events; each close's events then take their numbers in
                // batch order. A run that holds its thread's counter (its
                // thread's one run) moved it in the update.
                let mut counts: std::collections::BTreeMap<&str, i64> = Default::default();
                for c in closes {
                    if let Some((thread, _, _, None)) = done.get(&(c.lease.run_id, c.lease.fence)) {
                        *counts.entry(thread.as_str()).or_default() += c.deltas.len() as i64 + 1;
                    }
                }
                let mut base = std::collections::HashMap::with_capacity(counts.len());
                if !counts.is_empty() {
                    let bumps = serde_json::to_string(&counts.iter().map(|(t, n)| json!([t, n])).collect::<Vec<_>>())
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                    let rows = sqlx::query(sql!(
                        self,
                        "INSERT INTO threads (id, last_seq) SELECT value ->> 0, value ->> 1 FROM jsonb_each($1) WHERE true \
                         ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + excluded.last_seq \
                         RETURNING id, last_seq"
                    ))
                    .bind(bumps)
                    .fetch_all(&mut *conn)
                    .await?;
                    for row in &rows {
                        let (id, last): (String, i64) = (row.try_get("id")?, row.try_get("last_seq")?);
                        let first = last - counts.get(id.as_str()).copied().unwrap_or(0);
                        base.insert(id, first);
                    }
                }
                let (mut events, mut puts, mut results, mut threads) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                // Derived messages the update numbered as if each were its
                // thread's only close in the batch, where it was not.
                let mut renumbered = Vec::new();
                let mut wanted = 0;
                for (c, payload) in closes.iter().zip(payloads) {
                    let Some((thread, pos, message_seq, held)) = done.get(&(c.lease.run_id, c.lease.fence)) else {
                        results.push(Err(rejected(&c.lease)));
                        continue;
                    };
                    let mut own = held.map(|last| last - c.deltas.len() as i64 - 1);
                    let seq = match own.as_mut() {
                        Some(own) => own,
                        None => base.get_mut(thread).ok_or_else(|| StoreError::Corrupt(format!("thread {thread} not bumped")))?,
                    };
                    let (run, fence) = (c.lease.run_id, c.lease.fence);
                    let first = pos - c.deltas.len() as i64;
                    for (k, delta) in c.deltas.iter().enumerate() {
                        *seq += 1;
                        events.push(json!([thread, *seq, run, fence, "delta", delta, first + k as i64]));
                    }
                    *seq += 1;
                    match payload {
                        Some(payload) => events.push(json!([thread, *seq, run, fence, "message", payload, null])),
                        None if *message_seq != Some(*seq) => renumbered.push(json!([run, *seq, fence])),
                        None => {}
                    }
                    puts.extend(c.puts.iter().map(|p| sqlite_held_put_json(database, &c.lease, p)));
                    wanted += usize::from(c.next.is_some());
                    threads.push(thread.clone());
                    results.push(Ok(None));
                }
                if !events.is_empty() {
                    sqlx::query(sql!(
                        self,
                        "INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
                         SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, \
                         CASE WHEN value ->> 4 = 'delta' THEN json_object('delta', value ->> 5, 'pos', value ->> 6) \
                         ELSE value ->> 5 END, {now} FROM jsonb_each($1)"
                    ))
                    .bind(serde_json::Value::Array(events).to_string())
                    .execute(&mut *conn)
                    .await?;
                }
                if !renumbered.is_empty() {
                    // Only runs this transaction has just closed, at the
                    // fence their guard matched: each must be there.
                    let want = renumbered.len() as u64;
                    let moved = sqlx::query(sql!(
                        self,
                        "UPDATE runs SET message_seq = b.value ->> 1 FROM jsonb_each($1) AS b \
                         WHERE runs.id = b.value ->> 0 AND runs.fence = b.value ->> 2"
                    ))
                    .bind(serde_json::Value::Array(renumbered).to_string())
                    .execute(&mut *conn)
                    .await?
                    .rows_affected();
                    if moved != want {
                        return Err(StoreError::Corrupt(format!("renumbered {moved} of {want} closed runs' messages")));
                    }
                }
                if !puts.is_empty() {
                    insert_held_puts_json(self, conn, &serde_json::Value::Array(puts).to_string()).await?;
                }
                if let (Some((owner, ttl)), true) = (next, wanted > 0) {
                    // The closed runs are no longer claimable: this
                    // transaction has just finished them.
                    let mut claimed = self.claim_sqlite(conn, owner, ttl, wanted as i64).await?.into_iter();
                    for (c, result) in closes.iter().zip(results.iter_mut()) {
                        if let (Ok(slot), true) = (result.as_mut(), c.next.is_some()) {
                            *slot = claimed.next();
                        }
                    }
                }
                tx.commit().await?;
                Ok((results, threads))
            })
            .await?;
        for thread in threads {
            self.hub().wake(&thread);
        }
        Ok(results)
    }
}
