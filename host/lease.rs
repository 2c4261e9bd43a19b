//! The lease protocol: DESIGN.md §2, one function per statement.
//!
//! Every write except `create_run` and `claim` is guarded by
//! `id = $run AND lease_owner = $owner AND fence = $fence AND status = 'running'`
//! and returns [`StoreError::LeaseLost`] when that guard matches no row.
//! Multi-statement writes start with the guard, inside one transaction: on
//! PostgreSQL it row-locks the run (a racing claim waits, then sees the new
//! state), on SQLite it takes the write lock first.

use std::time::Duration;

use serde_json::json;
use sqlx::{AnyConnection, Row};

use crate::events::{self, kind};
use crate::ledger::{HeldPut, held_put_json, held_puts_json, insert_held_puts, pg_held_puts};
use crate::store::closes::Close;
use crate::store::submits::Submit;
use crate::store::{
    Backend, Claimed, Lease, NewRun, Outcome, Run, RunStatus, Store, StoreError, Suspend, sql,
};

/// The runs in the rows a claim returned, leased to `owner`.
fn claimed_rows(rows: &[sqlx::any::AnyRow], owner: &str) -> Result<Vec<Claimed>, StoreError> {
    rows.iter()
        .map(|row| {
            let run = Run::from_row(row)?;
            let lease = Lease { run_id: run.id, owner: owner.to_string(), fence: run.fence };
            Ok(Claimed { run, lease })
        })
        .collect()
}

/// The (owner, fence) guard of every guarded write, on a statement whose
/// run id, owner and fence are `$1`, `$2`, `$3`.
macro_rules! guarded {
    () => {
        "id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running'"
    };
}
pub(crate) use guarded;

/// Checks (owner, fence) on `conn` and refreshes the heartbeat. The first
/// statement of every guarded transaction.
pub(crate) async fn guard(
    store: &Store,
    conn: &mut AnyConnection,
    lease: &Lease,
) -> Result<(), StoreError> {
    let row = sqlx::query(sql!(
        store,
        "UPDATE runs SET heartbeat_at = {now} \
         WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' \
         RETURNING id"
    ))
    .bind(lease.run_id)
    .bind(&lease.owner)
    .bind(lease.fence)
    .fetch_optional(&mut *conn)
    .await?;
    match row {
        Some(_) => Ok(()),
        None => Err(rejected(lease)),
    }
}

/// A write refused by the (owner, fence) guard. Counted, so an operator
/// (and the fault-injection suite) can see how often a stale segment (a
/// zombie) tried to write after losing its lease.
pub(crate) fn rejected(lease: &Lease) -> StoreError {
    crate::metrics::global().fenced_writes_rejected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    StoreError::LeaseLost(lease.clone())
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

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
/// the run (moving its `emit_pos` on by the deltas' count `$n`) and returns
/// its `id`, `fence`, `thread_id` and the first new position as `first`
/// (no row: nothing is appended). `t` moves the thread's counter on by
/// every event appended (the upsert locks the counter row until commit, as
/// [`events::append`] does) and `e` inserts one `delta` event per delta;
/// `$more` (`""` or `UNION ALL SELECT …`) adds `$extra` more events,
/// numbered from `t.base + $n + 1`.
///
/// Why one statement: each statement is a round trip, and a transaction
/// adds two more (`BEGIN`, `COMMIT`). One statement is one implicit
/// transaction, with the same work and the same atomicity. SQLite has no
/// data-modifying CTEs, and its round trips are function calls, so it
/// keeps the transaction.
macro_rules! pg_append_deltas {
    ($n:literal, $extra:literal, $more:literal) => {
        concat!(
            ", t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, ", $n, " + ", $extra, " FROM r WHERE ",
            $n, " + ", $extra, " > 0 ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + ", $n, " + ", $extra,
            " RETURNING id, last_seq - ", $n, " - ", $extra, " AS base), \
             e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
             SELECT t.id, t.base + d.ord, r.id, r.fence, 'delta', \
             jsonb_build_object('pos', r.first + d.ord - 1, 'delta', d.delta)::text, {now} FROM t, r, d",
            $more,
            " RETURNING seq) "
        )
    };
}

/// A close's final status, output, error and `message` event payload.
fn closing(outcome: &Outcome) -> (RunStatus, Option<&str>, Option<&str>, String) {
    let (status, output, error) = match outcome {
        Outcome::Completed { output } => (RunStatus::Completed, Some(output.as_str()), None),
        Outcome::Failed { error } => (RunStatus::Failed, None, Some(error.as_str())),
    };
    let payload = json!({ "status": status, "output": output, "error": error }).to_string();
    (status, output, error, payload)
}

/// Statement 3 inside the caller's transaction: appends `deltas` to the
/// run's `partial` and one `delta` event each. `None` when the guard does
/// not hold; otherwise the thread and the first delta's position.
async fn append_deltas(
    store: &Store,
    conn: &mut AnyConnection,
    lease: &Lease,
    deltas: &[&str],
) -> Result<Option<(String, i64)>, StoreError> {
    let joined: String = deltas.concat();
    let Some(row) = sqlx::query(sql!(
        store,
        concat!(
            "UPDATE runs SET partial = partial || $4, emit_pos = emit_pos + $5, \
             heartbeat_at = {now}, updated_at = {now} WHERE ",
            guarded!(),
            " RETURNING thread_id, emit_pos"
        )
    ))
    .bind(lease.run_id)
    .bind(&lease.owner)
    .bind(lease.fence)
    .bind(&joined)
    .bind(deltas.len() as i64)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let thread_id: String = row.try_get("thread_id")?;
    let first = row.try_get::<i64, _>("emit_pos")? - deltas.len() as i64;
    sqlite_append_events(store, conn, &thread_id, lease, first, deltas, None).await?;
    Ok(Some((thread_id, first)))
}

/// SQLite, inside the caller's guarded transaction: one `delta` event per
/// delta (positions from `first`), then, with `message`, the final
/// `message` event with that payload. Two statements however many events:
/// one bump of the thread's counter ([`events::bump`]) and one insert,
/// reading the deltas from a JSON list. Each statement is a round trip to
/// the connection's worker thread, which bounds SQLite's throughput more
/// than the writes themselves.
async fn sqlite_append_events(
    store: &Store,
    conn: &mut AnyConnection,
    thread_id: &str,
    lease: &Lease,
    first: i64,
    deltas: &[&str],
    message: Option<&str>,
) -> Result<(), StoreError> {
    let count = deltas.len() as i64 + i64::from(message.is_some());
    if count == 0 {
        return Ok(());
    }
    let last = events::bump(store, conn, thread_id, count).await?;
    sqlx::query(sql!(
        store,
        "INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
         SELECT $1, $2 + key + 1, $3, $4, 'delta', json_object('delta', value, 'pos', $5 + key), {now} \
         FROM json_each($6) \
         UNION ALL SELECT $1, $2 + $7 + 1, $3, $4, 'message', $8, {now} WHERE $8 IS NOT NULL"
    ))
    .bind(thread_id)
    .bind(last - count)
    .bind(lease.run_id)
    .bind(lease.fence)
    .bind(first)
    .bind(json!(deltas).to_string())
    .bind(deltas.len() as i64)
    .bind(message)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The `submitted` event's payload for `new`.
fn submitted_payload(new: &NewRun) -> serde_json::Value {
    json!({ "plugin": new.plugin, "input": new.input })
}

/// SQLite: inserts one submit's run and its `submitted` event inside the
/// caller's transaction; a taken idempotency key returns the run holding it.
async fn insert_run(store: &Store, conn: &mut AnyConnection, submit: &Submit) -> Result<(Run, bool), StoreError> {
    let new = &submit.new;
    let inserted = sqlx::query(sql!(
        store,
        "INSERT INTO runs (thread_id, plugin, plugin_digest, input, idempotency_key, status, \
         max_attempts, not_before, created_at, updated_at, secret) \
         VALUES ($1, $2, $3, $4, $5, 'queued', $6, {now}, {now}, {now}, $7) \
         ON CONFLICT (idempotency_key) DO NOTHING RETURNING *"
    ))
    .bind(&submit.thread_id)
    .bind(&new.plugin)
    .bind(&new.plugin_digest)
    .bind(&new.input)
    .bind(&new.idempotency_key)
    .bind(submit.max_attempts)
    .bind(&submit.secret)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = inserted else {
        // Only a taken key gets here (a NULL key never conflicts).
        let row = sqlx::query(sql!(store, "SELECT * FROM runs WHERE idempotency_key = $1"))
            .bind(&new.idempotency_key)
            .fetch_one(&mut *conn)
            .await?;
        return Ok((Run::from_row(&row)?, false));
    };
    let run = Run::from_row(&row)?;
    events::append(store, conn, &run.thread_id, run.id, 0, kind::SUBMITTED, &submitted_payload(new)).await?;
    Ok((run, true))
}

impl Store {
    /// Enqueues a run. With an `idempotency_key` that already exists, returns
    /// the existing run and `false`; nothing new is written.
    ///
    /// Submits made while another is being written are group-committed
    /// (see [`crate::store::submits`]).
    pub async fn create_run(&self, new: &NewRun) -> Result<(Run, bool), StoreError> {
        let thread_id = new
            .thread_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let max_attempts = new.max_attempts.unwrap_or(NewRun::DEFAULT_MAX_ATTEMPTS);
        if max_attempts < 1 {
            return Err(StoreError::Config(format!(
                "max_attempts must be at least 1, got {max_attempts}"
            )));
        }
        let secret = format!("{:032x}", rand::random::<u128>());
        let submit = Submit { new: new.clone(), thread_id, max_attempts, secret };
        crate::store::submits::submit(self, submit).await
    }

    /// Writes `submits` (distinct threads, distinct idempotency keys) as one
    /// commit: each run and its `submitted` event. Returns, in order, each
    /// run and whether it is new (`false`: its key was taken; the run that
    /// holds it). Wakes workers for the new runs.
    pub(crate) async fn insert_runs(&self, submits: &[Submit]) -> Result<Vec<(Run, bool)>, StoreError> {
        let created = match (self.backend(), submits) {
            (_, []) => Vec::new(),
            (Backend::Postgres, _) => self.insert_runs_pg(submits).await?,
            (Backend::Sqlite, _) => {
                self.retry(|| async move {
                    let mut tx = self.writer().begin().await?;
                    let mut created = Vec::with_capacity(submits.len());
                    for submit in submits {
                        created.push(insert_run(self, &mut tx, submit).await?);
                    }
                    tx.commit().await?;
                    Ok(created)
                })
                .await?
            }
        };
        // Wakes this process's workers only: on PostgreSQL the statement
        // itself announced the runs to other hosts, or left the
        // announcement owed (see `carry_announcement`); SQLite hosts in
        // other processes poll.
        for (run, _) in created.iter().filter(|(_, new)| *new) {
            self.hub().wake(&run.thread_id);
            self.signal_work(false).await;
        }
        Ok(created)
    }

    /// PostgreSQL: the submits' runs and `submitted` events in one
    /// statement, reading them from a JSON list (bind parameters are per
    /// statement, not per row), one submit or many. Other hosts hear of new
    /// runs by a `NOTIFY` that this statement carries, or that a later one
    /// (or one sent on its own) does (see [`Store::carry_announcement`]).
    /// Thread counters are locked in thread order, as a batch of closes
    /// locks them, so two batches sharing threads wait rather than
    /// deadlock.
    async fn insert_runs_pg(&self, submits: &[Submit]) -> Result<Vec<(Run, bool)>, StoreError> {
        let list: Vec<serde_json::Value> = submits
            .iter()
            .enumerate()
            .map(|(i, s)| {
                json!({
                    "i": i, "thread_id": s.thread_id, "plugin": s.new.plugin,
                    "digest": s.new.plugin_digest, "input": s.new.input,
                    "key": s.new.idempotency_key, "max_attempts": s.max_attempts,
                    "payload": submitted_payload(&s.new).to_string(), "secret": s.secret,
                })
            })
            .collect();
        let list = serde_json::Value::Array(list).to_string();
        let list = list.as_str();
        let carry = self.carry_announcement();
        let rows = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    "WITH l AS (SELECT * FROM jsonb_to_recordset($1::text::jsonb) AS l(i bigint, thread_id text, \
                     plugin text, digest text, input text, key text, max_attempts bigint, payload text, secret text)), \
                     r AS (INSERT INTO runs (thread_id, plugin, plugin_digest, input, idempotency_key, \
                     status, max_attempts, not_before, created_at, updated_at, secret) \
                     SELECT thread_id, plugin, digest, input, key, 'queued', max_attempts, {now}, {now}, {now}, secret \
                     FROM l ORDER BY i ON CONFLICT (idempotency_key) DO NOTHING RETURNING *), \
                     t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, 1 FROM r ORDER BY thread_id \
                     ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + 1 RETURNING id, last_seq), \
                     e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
                     SELECT t.id, t.last_seq, r.id, r.fence, 'submitted', l.payload, {now} \
                     FROM t JOIN r ON r.thread_id = t.id JOIN l ON l.thread_id = t.id RETURNING seq), \
                     n AS MATERIALIZED (SELECT pg_notify($2, $3) WHERE $4 AND EXISTS (SELECT 1 FROM r)) \
                     SELECT r.* FROM r LEFT JOIN n ON true"
                ))
                .bind(list)
                .bind(crate::store::WORK_CHANNEL)
                .bind(self.node())
                .bind(carry)
                .fetch_all(self.writer())
                .await?)
            })
            .await;
        self.announcement_carried(carry, rows.as_ref().is_ok_and(|r| !r.is_empty()), rows.is_err());
        let rows = rows?;
        // Threads are distinct within a batch, so a thread names its run.
        let mut inserted = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let run = Run::from_row(row)?;
            inserted.insert(run.thread_id.clone(), run);
        }
        let mut created = Vec::with_capacity(submits.len());
        for submit in submits {
            created.push(match inserted.remove(&submit.thread_id) {
                Some(run) => (run, true),
                None => (self.run_with_key(submit).await?, false),
            });
        }
        Ok(created)
    }

    /// The run holding `submit`'s idempotency key, for a submit that was not
    /// inserted. Only a taken key gets here (a NULL key never conflicts), and
    /// `ON CONFLICT` has waited for the other insert to commit.
    async fn run_with_key(&self, submit: &Submit) -> Result<Run, StoreError> {
        let Some(key) = &submit.new.idempotency_key else {
            return Err(StoreError::Config("a submit without an idempotency key was not inserted".into()));
        };
        let row = sqlx::query(sql!(self, "SELECT * FROM runs WHERE idempotency_key = $1"))
            .bind(key)
            .fetch_one(self.pool())
            .await?;
        Run::from_row(&row)
    }

    /// The run with `id`.
    pub async fn get_run(&self, id: i64) -> Result<Run, StoreError> {
        let row = sqlx::query(sql!(self, "SELECT * FROM runs WHERE id = $1"))
            .bind(id)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::RunNotFound(id))?;
        Run::from_row(&row)
    }

    /// Runs, newest first, optionally filtered; `before` is a cursor (an id).
    pub async fn list_runs(
        &self,
        status: Option<RunStatus>,
        plugin: Option<&str>,
        before: Option<i64>,
        limit: i64,
    ) -> Result<Vec<Run>, StoreError> {
        Ok(self.runs_page(status, plugin, before, limit, i64::MAX).await?.0)
    }

    /// [`Store::list_runs`], with no more than about `max_bytes` of inputs,
    /// outputs and partials (always at least one run). Also returns whether
    /// the page was cut short by its size.
    ///
    /// One fixed statement per combination of filters, rather than
    /// `($1 IS NULL OR status = $1)`, so each can use its index.
    pub async fn runs_page(
        &self,
        status: Option<RunStatus>,
        plugin: Option<&str>,
        before: Option<i64>,
        limit: i64,
        max_bytes: i64,
    ) -> Result<(Vec<Run>, bool), StoreError> {
        macro_rules! page {
            ($filter:literal) => {
                concat!(
                    "SELECT * FROM (SELECT r.*, SUM(LENGTH(r.input) + LENGTH(r.partial) + COALESCE(LENGTH(r.output), 0) \
                     + COALESCE(LENGTH(r.error), 0)) OVER (ORDER BY r.id DESC) AS running FROM runs r \
                     WHERE r.id < $1", $filter, " ORDER BY r.id DESC LIMIT $2) AS p WHERE p.running - \
                     (LENGTH(p.input) + LENGTH(p.partial) + COALESCE(LENGTH(p.output), 0) + COALESCE(LENGTH(p.error), 0)) < $3 \
                     ORDER BY p.id DESC"
                )
            };
        }
        let before = before.unwrap_or(i64::MAX);
        let query = match (status, plugin) {
            (None, None) => sqlx::query(sql!(self, page!(""))),
            (Some(_), None) => sqlx::query(sql!(self, page!(" AND r.status = $4"))),
            (None, Some(_)) => sqlx::query(sql!(self, page!(" AND r.plugin = $4"))),
            (Some(_), Some(_)) => sqlx::query(sql!(self, page!(" AND r.status = $4 AND r.plugin = $5"))),
        };
        let mut query = query.bind(before).bind(limit).bind(max_bytes);
        if let Some(s) = status {
            query = query.bind(s.as_str());
        }
        if let Some(p) = plugin {
            query = query.bind(p);
        }
        let rows = query.fetch_all(self.pool()).await?;
        let cut = match rows.last() {
            Some(last) => last.try_get::<i64, _>("running")? >= max_bytes,
            None => false,
        };
        Ok((rows.iter().map(Run::from_row).collect::<Result<_, _>>()?, cut))
    }

    /// Statement 1: claims one run, if any is claimable.
    pub async fn claim(&self, owner: &str, ttl: Duration) -> Result<Option<Claimed>, StoreError> {
        Ok(self.claim_batch(owner, ttl, 1).await?.pop())
    }

    /// Statement 1, batched: claims up to `max` runs in one statement, oldest
    /// first. A run is claimable when it is open (`queued`,
    /// `waiting_takeover`, or `waiting_input` with its input delivered) or
    /// `running` with an expired lease, has attempts left, and its
    /// `not_before` has passed. Each claimed run gets `fence + 1`,
    /// `attempt + 1` and a lease of `ttl` from the database's now.
    pub async fn claim_batch(
        &self,
        owner: &str,
        ttl: Duration,
        max: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let rows = self
            .retry(|| async move {
                Ok(sqlx::query(crate::store::claim_sql(self, max))
                    .bind(owner)
                    .bind(ms(ttl))
                    .bind(max)
                    .fetch_all(self.writer())
                    .await?)
            })
            .await?;
        let mut claimed = claimed_rows(&rows, owner)?;
        claimed.sort_by_key(|c| c.run.id);
        Ok(claimed)
    }

    /// Statement 2: extends the lease to `ttl` from the database's now and
    /// returns the new expiry. `LeaseLost` means: stop the guest, write nothing.
    /// On PostgreSQL it gives up after the lock timeout rather than wait on
    /// a row another (frozen) session holds: the caller retries, and its
    /// lease deadline stops the guest if no renewal lands.
    pub async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<i64, StoreError> {
        let expires = self
            .retry(|| async move {
                Ok(sqlx::query_scalar::<_, i64>(sql!(
                    self,
                    "UPDATE runs SET lease_expires_at = {now} + $4, heartbeat_at = {now}, updated_at = {now} \
                     WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' \
                     RETURNING lease_expires_at"
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(ms(ttl))
                .fetch_optional(self.maint())
                .await?)
            })
            .await?;
        expires.ok_or_else(|| rejected(lease))
    }

    /// Statement 3: appends `delta` to the run's `partial` and to its thread
    /// log, and refreshes the heartbeat. Returns the delta's position.
    pub async fn emit(&self, lease: &Lease, delta: &str) -> Result<i64, StoreError> {
        self.emit_deltas(lease, &[delta]).await
    }

    /// Statement 3 for several deltas at once (a segment buffers its deltas
    /// for a few milliseconds, see `runtime::host`): appends them, in order,
    /// to `partial` and as one `delta` event each. Returns the position of
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
                            "r AS (UPDATE runs SET \
                             partial = partial || COALESCE((SELECT string_agg(delta, '' ORDER BY ord) FROM d), ''), \
                             emit_pos = emit_pos + $5, heartbeat_at = {now}, updated_at = {now} WHERE ",
                            guarded!(),
                            " RETURNING id, fence, thread_id, emit_pos - $5 AS first)",
                            pg_append_deltas!("$5", "0", ""),
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
            let kept = events::replay_stream(payloads.iter().map(|(k, p)| (k.as_str(), p.as_str())));
            let partial: String = kept.iter().take(cut.max(0) as usize).map(String::as_str).collect();
            sqlx::query(sql!(
                self,
                "UPDATE runs SET partial = $4, emit_pos = $5, updated_at = {now} \
                 WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running'"
            ))
            .bind(lease.run_id)
            .bind(&lease.owner)
            .bind(lease.fence)
            .bind(&partial)
            .bind(cut)
            .execute(&mut *tx)
            .await?;
            let payload = json!({ "from": cut, "to": emit_pos });
            events::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::RETRACT, &payload).await?;
            tx.commit().await?;
            Ok((cut, Some(thread_id)))
        })
        .await?;
        if let Some(thread) = thread {
            self.hub().wake(&thread);
        }
        Ok(pos)
    }

    /// Statement 4: finishes the turn. Sets the final status and output (or
    /// error), appends the final `message` event and clears the lease, in one
    /// transaction.
    pub async fn close(&self, lease: &Lease, outcome: &Outcome) -> Result<(), StoreError> {
        self.close_with_deltas(lease, &[], outcome).await
    }

    /// Statement 4 preceded by statement 3 for `deltas` (the segment's
    /// last buffered deltas), in one transaction: the stream's tail and the
    /// final message are written together.
    pub async fn close_with_deltas(&self, lease: &Lease, deltas: &[&str], outcome: &Outcome) -> Result<(), StoreError> {
        self.close_and_claim(lease, deltas, &[], outcome, None).await.map(drop)
    }

    /// [`Store::close_with_deltas`] with the segment's held puts (see
    /// [`HeldPut`]), then, when `next` names an owner and a
    /// lease length, statement 1 for one run in the same transaction: the
    /// worker that finishes a turn takes the next claimable run without a
    /// claim round trip of its own. Nothing is claimed when the close is
    /// rejected. Returns the run claimed, if any; its lease is running.
    pub async fn close_and_claim(
        &self,
        lease: &Lease,
        deltas: &[&str],
        puts: &[HeldPut],
        outcome: &Outcome,
        next: Option<(&str, Duration)>,
    ) -> Result<Option<Claimed>, StoreError> {
        if self.backend() == Backend::Postgres {
            let close = Close {
                lease: lease.clone(),
                deltas: deltas.iter().map(|d| d.to_string()).collect(),
                puts: puts.to_vec(),
                outcome: outcome.clone(),
                next: next.map(|(owner, ttl)| (owner.to_string(), ttl)),
            };
            return crate::store::closes::close(self, close).await;
        }
        let (status, output, error, payload) = closing(outcome);
        let payload = payload.as_str();
        let (next_owner, next_ttl, next_max) = match next {
            Some((owner, ttl)) => (owner, ms(ttl), 1i64),
            None => ("", 0, 0),
        };
        let joined: String = deltas.concat();
        let joined = joined.as_str();
        let (claimed, thread) = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            // Statements 3 and 4 in one guarded write: the tail's deltas
            // and the final status.
            let row = sqlx::query(sql!(
                self,
                concat!(
                    "UPDATE runs SET status = $4, output = $5, error = $6, lease_owner = NULL, \
                     lease_expires_at = NULL, finished_at = {now}, updated_at = {now}, \
                     partial = partial || $7, emit_pos = emit_pos + $8 WHERE ",
                    guarded!(),
                    " RETURNING thread_id, emit_pos - $8 AS first"
                )
            ))
            .bind(lease.run_id)
            .bind(&lease.owner)
            .bind(lease.fence)
            .bind(status.as_str())
            .bind(output)
            .bind(error)
            .bind(joined)
            .bind(deltas.len() as i64)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| rejected(lease))?;
            let thread_id: String = row.try_get("thread_id")?;
            let first: i64 = row.try_get("first")?;
            sqlite_append_events(self, &mut tx, &thread_id, lease, first, deltas, Some(payload)).await?;
            insert_held_puts(self, &mut tx, lease, puts).await?;
            let thread = Some(thread_id);
            let mut claimed = Vec::new();
            if next_max > 0 {
                // The closed run is no longer claimable: this transaction
                // has just finished it.
                let rows = sqlx::query(crate::store::claim_sql(self, 1))
                    .bind(next_owner)
                    .bind(next_ttl)
                    .bind(next_max)
                    .fetch_all(&mut *tx)
                    .await?;
                claimed = claimed_rows(&rows, next_owner)?;
            }
            tx.commit().await?;
            Ok((claimed.pop(), thread))
        })
        .await?;
        if let Some(thread) = thread {
            self.hub().wake(&thread);
        }
        Ok(claimed)
    }

    /// PostgreSQL: statement 4 for a batch of closes (see
    /// [`crate::store::closes`]), each with its tail's deltas and held
    /// puts, and statement 1 for as many runs as closes that held and want
    /// a next run, in one statement. Returns each close's result in order:
    /// the run it claimed, if any, or [`StoreError::LeaseLost`].
    ///
    /// Each close is guarded by its own (owner, fence); a close that fails
    /// its guard writes nothing and does not stop the others. Closes on
    /// one thread may share a batch: the thread's counter moves on once by
    /// all of their events, and each close's events are numbered in batch
    /// order. The wanting closes of a batch share one owner and lease
    /// length.
    pub(crate) async fn close_batch(&self, closes: &[Close]) -> Result<Vec<Result<Option<Claimed>, StoreError>>, StoreError> {
        let database = self.database_id().await?;
        let (mut list, mut held) = (Vec::with_capacity(closes.len()), Vec::new());
        let mut next: Option<(&str, Duration)> = None;
        for (i, c) in closes.iter().enumerate() {
            let (status, output, error, payload) = closing(&c.outcome);
            list.push(json!({
                "i": i, "id": c.lease.run_id, "owner": c.lease.owner, "fence": c.lease.fence,
                "status": status.as_str(), "output": output, "error": error, "payload": payload,
                "deltas": c.deltas, "n": c.deltas.len(), "want": c.next.is_some(),
            }));
            held.extend(c.puts.iter().map(|p| held_put_json(i, &database, c.lease.run_id, p)));
            if let Some((owner, ttl)) = &c.next {
                match next {
                    None => next = Some((owner, *ttl)),
                    Some(n) if n == (owner.as_str(), *ttl) => {}
                    Some(_) => {
                        return Err(StoreError::Config("the closes of a batch want leases for different owners".into()));
                    }
                }
            }
        }
        let (list, held) = (serde_json::Value::Array(list).to_string(), serde_json::Value::Array(held).to_string());
        let (list, held) = (list.as_str(), held.as_str());
        let (next_owner, next_ttl) = next.map_or(("", 0), |(o, t)| (o, ms(t)));
        let rows = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    concat!(
                        "WITH b AS (SELECT * FROM jsonb_to_recordset($1::text::jsonb) AS b(i bigint, id bigint, \
                         owner text, fence bigint, status text, output text, error text, payload text, deltas jsonb, \
                         n bigint, want boolean)), \
                         d AS (SELECT b.i, x.delta, x.ord FROM b, \
                         jsonb_array_elements_text(b.deltas) WITH ORDINALITY AS x(delta, ord)), \
                         r AS (UPDATE runs SET status = b.status, output = b.output, error = b.error, \
                         lease_owner = NULL, lease_expires_at = NULL, finished_at = {now}, updated_at = {now}, \
                         partial = runs.partial || COALESCE((SELECT string_agg(d.delta, '' ORDER BY d.ord) \
                         FROM d WHERE d.i = b.i), ''), emit_pos = runs.emit_pos + b.n \
                         FROM b WHERE runs.id = b.id AND runs.lease_owner = b.owner AND runs.fence = b.fence \
                         AND runs.status = 'running' \
                         RETURNING runs.id, runs.fence, runs.thread_id, runs.emit_pos - b.n AS first, b.i, b.n, \
                         b.payload, b.want), ",
                        // Each thread's counter moves on once, by all its
                        // closes' events (a row may be updated only once per
                        // statement), in thread order: two batches lock
                        // the threads they share in one order.
                        "t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, SUM(n + 1)::bigint FROM r \
                         GROUP BY thread_id ORDER BY thread_id \
                         ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + excluded.last_seq \
                         RETURNING id, last_seq), ",
                        // A close's first event: the thread's new counter,
                        // less the events of its closes from this one on.
                        "s AS (SELECT r.*, t.last_seq - (SUM(r.n + 1) OVER (PARTITION BY r.thread_id ORDER BY r.i \
                         ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING))::bigint AS base FROM r JOIN t ON t.id = r.thread_id), \
                         e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
                         SELECT s.thread_id, s.base + d.ord, s.id, s.fence, 'delta', \
                         jsonb_build_object('pos', s.first + d.ord - 1, 'delta', d.delta)::text, {now} \
                         FROM s JOIN d ON d.i = s.i \
                         UNION ALL SELECT s.thread_id, s.base + s.n + 1, s.id, s.fence, 'message', s.payload, {now} \
                         FROM s)",
                        pg_held_puts!("$2", "l.i = r.i"),
                        // Never a run of this batch: a row updated twice in
                        // one statement keeps one update, unpredictably.
                        ", ",
                        crate::store::postgres::claim_ctes!(
                            "$3",
                            "$4",
                            "(SELECT COUNT(*) FROM r WHERE r.want)",
                            "ARRAY(SELECT id FROM b)"
                        ),
                        " SELECT (SELECT string_agg(i::text, ',') FROM r) AS closed, \
                         (SELECT json_agg(DISTINCT thread_id)::text FROM r) AS closed_threads, n.* \
                         FROM (SELECT 1) o LEFT JOIN n ON true"
                    )
                ))
                .bind(list)
                .bind(held)
                .bind(next_owner)
                .bind(next_ttl)
                .fetch_all(self.writer())
                .await?)
            })
            .await?;
        if let Some(row) = rows.first() {
            let threads: Option<String> = row.try_get("closed_threads")?;
            for thread in serde_json::from_str::<Vec<String>>(threads.as_deref().unwrap_or("[]")).unwrap_or_default() {
                self.hub().wake(&thread);
            }
        }
        let closed: std::collections::HashSet<usize> = match rows.first() {
            Some(row) => row
                .try_get::<Option<String>, _>("closed")?
                .unwrap_or_default()
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().map_err(|_| StoreError::Corrupt(format!("closed: {s:?}"))))
                .collect::<Result<_, _>>()?,
            None => Default::default(),
        };
        let mut claimed = Vec::new();
        for row in &rows {
            if row.try_get::<Option<i64>, _>("id")?.is_some() {
                claimed.extend(claimed_rows(std::slice::from_ref(row), next_owner)?);
            }
        }
        // The runs claimed go to the closes that held and wanted one, in
        // batch order; there are never more of them than such closes.
        let mut claimed = claimed.into_iter();
        Ok(closes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if !closed.contains(&i) {
                    return Err(rejected(&c.lease));
                }
                Ok(if c.next.is_some() { claimed.next() } else { None })
            })
            .collect())
    }

    /// Statement 5: releases the lease without finishing the turn.
    ///
    /// `attempt` is reset to 0 in the same write: `max_attempts` bounds
    /// consecutive *failed* segments (a death, a lost lease), and a segment
    /// that suspends on purpose (`wait-input`, `sleep`, a slice that made
    /// progress, a shutdown hand-over) did not fail, whether or not it
    /// wrote a ledger row. (A slice that made no progress is not suspended:
    /// the executor fails the run as a timeout.)
    pub async fn suspend(&self, lease: &Lease, how: &Suspend) -> Result<RunStatus, StoreError> {
        let (status, delay, prompt) = match how {
            Suspend::WaitInput { prompt } => (RunStatus::WaitingInput, 0, Some(prompt.as_str())),
            Suspend::Takeover => (RunStatus::WaitingTakeover, 0, None),
            Suspend::Sleep { delay_ms } => (RunStatus::Queued, (*delay_ms).max(0), None),
        };
        let status = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let row = sqlx::query(sql!(
                self,
                "UPDATE runs SET status = $4, lease_owner = NULL, lease_expires_at = NULL, \
                 not_before = {now} + $5, \
                 pending_input = CASE WHEN $4 = 'waiting_input' THEN NULL ELSE pending_input END, \
                 attempt = 0, updated_at = {now} \
                 WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' \
                 RETURNING thread_id, not_before"
            ))
            .bind(lease.run_id)
            .bind(&lease.owner)
            .bind(lease.fence)
            .bind(status.as_str())
            .bind(delay)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| rejected(lease))?;
            let thread_id: String = row.try_get("thread_id")?;
            let not_before: i64 = row.try_get("not_before")?;
            let payload = json!({ "status": status, "prompt": prompt, "not_before": not_before });
            events::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::SUSPENDED, &payload)
                .await?;
            tx.commit().await?;
            Ok((status, thread_id))
        })
        .await?;
        let (status, thread) = status;
        self.hub().wake(&thread);
        if status == RunStatus::WaitingTakeover {
            self.signal_work(false).await;
        }
        Ok(status)
    }

    /// Delivers input to a `waiting_input` run, making it claimable.
    ///
    /// Not a lease-holder write: a waiting run has no lease. It is guarded by
    /// state instead (`waiting_input`, no owner, no input yet), so a second
    /// delivery is a `Conflict`, never an overwrite.
    pub async fn deliver_input(&self, run_id: i64, input: &str) -> Result<Run, StoreError> {
        let run = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let row = sqlx::query(sql!(
                self,
                "UPDATE runs SET pending_input = $2, updated_at = {now} \
                 WHERE id = $1 AND status = 'waiting_input' AND pending_input IS NULL \
                 AND lease_owner IS NULL RETURNING *"
            ))
            .bind(run_id)
            .bind(input)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else {
                drop(tx);
                let run = self.get_run(run_id).await?;
                return Err(StoreError::Conflict {
                    run_id,
                    status: run.status,
                    message: if run.status == RunStatus::WaitingInput {
                        "input was already delivered"
                    } else {
                        "run is not waiting for input"
                    },
                });
            };
            let run = Run::from_row(&row)?;
            let payload = json!({ "input": input });
            events::append(self, &mut tx, &run.thread_id, run.id, run.fence, kind::INPUT, &payload)
                .await?;
            tx.commit().await?;
            Ok(run)
        })
        .await?;
        self.hub().wake(&run.thread_id);
        self.signal_work(true).await;
        Ok(run)
    }

    /// Statement 6: cancels a run that is not terminal. Bumps the fence, so
    /// every later write of a segment still running fails its guard.
    pub async fn cancel(&self, run_id: i64) -> Result<Run, StoreError> {
        let run = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let row = sqlx::query(sql!(
                self,
                "UPDATE runs SET status = 'cancelled', fence = fence + 1, lease_owner = NULL, \
                 lease_expires_at = NULL, finished_at = {now}, updated_at = {now} \
                 WHERE id = $1 AND status NOT IN ('completed','failed','aborted','cancelled') \
                 RETURNING *"
            ))
            .bind(run_id)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else {
                drop(tx);
                let run = self.get_run(run_id).await?;
                return Err(StoreError::Conflict {
                    run_id,
                    status: run.status,
                    message: "run is already finished",
                });
            };
            let run = Run::from_row(&row)?;
            events::append(self, &mut tx, &run.thread_id, run.id, run.fence, kind::CANCELLED, &json!({}))
                .await?;
            tx.commit().await?;
            Ok(run)
        })
        .await?;
        self.hub().wake(&run.thread_id);
        Ok(run)
    }
}
