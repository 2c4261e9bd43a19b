//! Statement 3: a segment's streamed output (its deltas, to its thread's
//! log, moving the run's `emit_pos` on; see `store::partial`) and its held `kv.put`s, written
//! together; and the cut of the stream after a death (`retract`).

use serde_json::json;
use sqlx::{AnyConnection, Row};

use crate::store::guard::{guard, guarded, rejected};
use crate::store::local::{HeldPut, held_puts_json, insert_held_puts, pg_held_puts};
use crate::store::log::{self, kind};
use crate::store::{Backend, Lease, Store, StoreError, sql};

/// PostgreSQL: CTE `d`, the deltas of the JSON list in parameter `$list`,
/// one row each: `delta`, and `ord` from 1.
macro_rules! pg_deltas {
    ($list:literal) => {
        concat!(
            "WITH d AS (SELECT value AS delta, ordinality AS ord FROM jsonb_array_elements_text(",
            $list,
            "::text::jsonb) WITH ORDINALITY), "
        )
    };
}

/// PostgreSQL: the CTEs of a one-statement write that appends events. The
/// statement starts with CTE `d` (see `pg_deltas!`), then `r`, which writes
/// the run (moving its `emit_pos` and any thread counter it holds on by
/// the deltas' count `$n`) and returns its `id`, `fence`, `thread_id`, the
/// first new position as `first` and the count it held before as `held`
/// (no row: nothing is appended). `t` moves the thread's counter on by
/// every event appended when the run holds none (the upsert locks the
/// counter row until commit, as [`log::append`] does), `nb` is the number
/// before the first event, and `e` inserts one `delta` event per delta.
///
/// Why one statement: each statement is a round trip, and a transaction
/// adds two more (`BEGIN`, `COMMIT`). One statement is one implicit
/// transaction, with the same work and the same atomicity. SQLite has no
/// data-modifying CTEs, and its round trips are function calls, so it
/// keeps the transaction.
macro_rules! pg_append_deltas {
    ($n:literal) => {
        concat!(
            ", t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, ", $n, " FROM r WHERE ",
            $n, " > 0 AND r.held IS NULL ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + ", $n,
            " RETURNING id, last_seq - ", $n, " AS base), \
             nb AS (SELECT COALESCE(r.held, (SELECT base FROM t)) AS base FROM r), \
             e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
             SELECT r.thread_id, nb.base + d.ord, r.id, r.fence, 'delta', \
             jsonb_build_object('pos', r.first + d.ord - 1, 'delta', d.delta)::text, {now} FROM nb, r, d \
             RETURNING seq) "
        )
    };
}

/// Statement 3 inside the caller's transaction: appends one `delta` event
/// per delta and moves the run's `emit_pos` on. `None` when the guard does
/// not hold; otherwise the thread and the first delta's position.
pub(crate) async fn append_deltas(
    store: &Store,
    conn: &mut AnyConnection,
    lease: &Lease,
    deltas: &[&str],
) -> Result<Option<(String, i64)>, StoreError> {
    let Some(row) = sqlx::query(sql!(
        store,
        concat!(
            "UPDATE runs SET emit_pos = emit_pos + $4, thread_seq = thread_seq + $4, heartbeat_at = {now}, updated_at = {now} WHERE ",
            guarded!(),
            " RETURNING thread_id, emit_pos, thread_seq"
        )
    ))
    .bind(lease.run_id)
    .bind(&lease.owner)
    .bind(lease.fence)
    .bind(deltas.len() as i64)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let thread_id: String = row.try_get("thread_id")?;
    let first = row.try_get::<i64, _>("emit_pos")? - deltas.len() as i64;
    // A run that holds its thread's counter moved it in the update.
    let held = row.try_get::<Option<i64>, _>("thread_seq")?;
    sqlite_append_events(store, conn, &thread_id, lease, first, deltas, held).await?;
    Ok(Some((thread_id, first)))
}

/// SQLite, inside the caller's guarded transaction: one `delta` event per
/// delta (positions from `first`). Two statements however many events:
/// one bump of the thread's counter ([`log::bump`]) and one insert,
/// reading the deltas from a JSON list. Each statement is a round trip to
/// the connection's worker thread, which bounds SQLite's throughput more
/// than the writes themselves. `held`: the counter the run holds, already
/// moved on by the deltas (no bump).
async fn sqlite_append_events(
    store: &Store,
    conn: &mut AnyConnection,
    thread_id: &str,
    lease: &Lease,
    first: i64,
    deltas: &[&str],
    held: Option<i64>,
) -> Result<(), StoreError> {
    let count = deltas.len() as i64;
    if count == 0 {
        return Ok(());
    }
    let last = match held {
        Some(last) => last,
        None => log::bump(store, conn, thread_id, count).await?,
    };
    sqlx::query(sql!(
        store,
        "INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
         SELECT $1, $2 + key + 1, $3, $4, 'delta', json_object('delta', value, 'pos', $5 + key), {now} \
         FROM json_each($6)"
    ))
    .bind(thread_id)
    .bind(last - count)
    .bind(lease.run_id)
    .bind(lease.fence)
    .bind(first)
    .bind(json!(deltas).to_string())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Store {
    /// Statement 3: appends `delta` to the run's stream (its thread log), and refreshes the heartbeat. Returns the delta's position.
    pub async fn emit(&self, lease: &Lease, delta: &str) -> Result<i64, StoreError> {
        self.emit_deltas(lease, &[delta]).await
    }

    /// Statement 3 for several deltas at once (a segment buffers its deltas
    /// for a few milliseconds, see `runtime::host`): appends them, in order,
    /// as one `delta` event each. Returns the position of
    /// the first. One write however many deltas.
    pub async fn emit_deltas(&self, lease: &Lease, deltas: &[&str]) -> Result<i64, StoreError> {
        if deltas.is_empty() {
            return Err(StoreError::Config("emit_deltas needs at least one delta".into()));
        }
        self.append_held(lease, deltas, &[])
            .await?
            .ok_or_else(|| StoreError::Config("no delta position returned".into()))
    }

    /// Statement 3 with the segment's held puts (see [`HeldPut`]): writes
    /// `deltas` as [`Store::emit_deltas`] does and each put with its
    /// `committed` ledger row, in one write. Nothing to write is a no-op.
    pub async fn write_held(&self, lease: &Lease, deltas: &[&str], puts: &[HeldPut]) -> Result<(), StoreError> {
        if deltas.is_empty() && puts.is_empty() {
            return Ok(());
        }
        self.append_held(lease, deltas, puts).await.map(drop)
    }

    /// Statement 3: `deltas` and `puts` in one guarded write. Returns the
    /// first delta's position, `None` when there are no deltas.
    async fn append_held(&self, lease: &Lease, deltas: &[&str], puts: &[HeldPut]) -> Result<Option<i64>, StoreError> {
        if self.backend() == Backend::Postgres {
            let database = self.database_id().await?;
            let (list, n, held) = (json!(deltas).to_string(), deltas.len() as i64, held_puts_json(&database, lease.run_id, puts));
            let (list, held) = (list.as_str(), held.as_str());
            let first = self
                .retry(|| async move {
                    Ok(sqlx::query_as::<_, (i64, String)>(sql!(
                        self,
                        concat!(
                            pg_deltas!("$4"),
                            "r AS (UPDATE runs SET emit_pos = emit_pos + $5, thread_seq = thread_seq + $5, heartbeat_at = {now}, \
                             updated_at = {now} WHERE ",
                            guarded!(),
                            " RETURNING id, fence, thread_id, emit_pos - $5 AS first, thread_seq - $5 AS held)",
                            pg_append_deltas!("$5"),
                            pg_held_puts!("$6", "true"),
                            "SELECT r.first, r.thread_id FROM r"
                        )
                    ))
                    .bind(lease.run_id)
                    .bind(&lease.owner)
                    .bind(lease.fence)
                    .bind(list)
                    .bind(n)
                    .bind(held)
                    .fetch_optional(self.writer())
                    .await?)
                })
                .await?;
            let (first, thread) = first.ok_or_else(|| rejected(lease))?;
            if !deltas.is_empty() {
                self.hub().wake(&thread);
            }
            return Ok((!deltas.is_empty()).then_some(first));
        }
        let appended = self
            .retry(|| async move {
                let mut tx = self.writer().begin().await?;
                let appended = if deltas.is_empty() {
                    guard(self, &mut tx, lease).await?;
                    None
                } else {
                    Some(append_deltas(self, &mut tx, lease, deltas).await?.ok_or_else(|| rejected(lease))?)
                };
                insert_held_puts(self, &mut tx, lease, puts).await?;
                tx.commit().await?;
                Ok(appended)
            })
            .await?;
        Ok(appended.map(|(thread, first)| {
            self.hub().wake(&thread);
            first
        }))
    }

    /// After a death: cuts the run's stream back to position `cut` (every
    /// delta from `cut` on came from a dead segment after a call whose result
    /// was never recorded, so the replay may stream something else there).
    /// Rebuilds `partial` from the kept deltas and appends a `retract` event
    /// `{from, to}` that voids the earlier deltas at positions `from..to`.
    /// Returns the new `emit_pos`; a no-op when nothing is past `cut`.
    pub async fn retract(&self, lease: &Lease, cut: i64) -> Result<i64, StoreError> {
        let (pos, thread) = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let (thread_id, emit_pos): (String, i64) =
                sqlx::query_as(sql!(self, "SELECT thread_id, emit_pos FROM runs WHERE id = $1"))
                    .bind(lease.run_id)
                    .fetch_one(&mut *tx)
                    .await?;
            if emit_pos <= cut {
                tx.rollback().await?;
                return Ok((emit_pos, None));
            }
            let payloads: Vec<(String, String)> = sqlx::query_as(sql!(
                self,
                "SELECT kind, payload FROM events WHERE run_id = $1 AND kind IN ('delta', 'retract') ORDER BY seq"
            ))
            .bind(lease.run_id)
            .fetch_all(&mut *tx)
            .await?;
            let kept = log::replay_stream(payloads.iter().map(|(k, p)| (k.as_str(), p.as_str())));
            let partial: String = kept.iter().take(cut.max(0) as usize).map(String::as_str).collect();
            let payload = json!({ "from": cut, "to": emit_pos });
            let seq = log::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::RETRACT, &payload).await?;
            // The cut folds the stream (`store::partial`): what stands up to
            // `cut`, and no event before the retract is read again.
            sqlx::query(sql!(
                self,
                "UPDATE runs SET partial = $4, emit_pos = $5, partial_pos = $5, partial_seq = $6, updated_at = {now} \
                 WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' AND lease_expires_at >= {clock}"
            ))
            .bind(lease.run_id)
            .bind(&lease.owner)
            .bind(lease.fence)
            .bind(&partial)
            .bind(cut)
            .bind(seq)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok((cut, Some(thread_id)))
        })
        .await?;
        if let Some(thread) = thread {
            self.hub().wake(&thread);
        }
        Ok(pos)
    }
}
