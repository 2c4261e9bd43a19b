//! The effect ledger: DESIGN.md §3. One row per effect, `(run_id, seq)`
//! unique, written under the same (owner, fence) guard as every other
//! corrupting write.

use serde::{Deserialize, Serialize};

use crate::lease::{guard, guarded, rejected};
use crate::store::{Backend, EffectClass, EffectRow, EffectState, Lease, Store, StoreError, sql};

/// The identity of an effect at one position of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectCall {
    /// Position in the turn's host-call order, from 0.
    pub seq: i64,
    pub name: String,
    /// A hash of the request; replay compares it to detect non-determinism.
    pub request_hash: String,
    /// The run's emit position when the effect was made.
    pub emit_pos: i64,
}

/// How a started effect ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    Committed(String),
    Failed(String),
}

/// What a call streamed into the turn's output while it ran (the deltas
/// of a `model.chat`), recorded with its outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streamed {
    /// Emits: how far replay moves the stream position on.
    pub deltas: i64,
    /// Their bytes, counted against the turn's emit cap on replay too.
    pub bytes: i64,
}

/// The size of a run's ledger and its last row (see
/// [`Store::ledger_summary`]).
#[derive(Debug, Clone, Default)]
pub struct LedgerSummary {
    pub rows: i64,
    /// Bytes of names and results.
    pub bytes: i64,
    pub last: Option<EffectRow>,
}

/// A local effect: applied in the host's database in the same transaction
/// as its `committed` ledger row, so exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LocalOp {
    /// Reads a key; the result is the stored (JSON) value, or `null`.
    KvGet { namespace: String, key: String },
    /// Writes a key; the result is JSON `null`.
    KvPut {
        namespace: String,
        key: String,
        value: String,
    },
    /// Records an observation the guest must see again on replay (a timer's
    /// wake time, a clock reading); the result is `value`.
    Record { value: String },
    /// Consumes delivered input: records it (the result is `value`) and
    /// clears the run's `pending_input` in the same transaction, so a later
    /// `wait-input` never sees it again.
    TakeInput { value: String },
}

/// A `kv.put` a segment has made and not yet written: it is written, with
/// its `committed` ledger row, by the segment's next write (see
/// `runtime::host::EMIT_FLUSH`). The put and its row are one write, so a
/// host that dies first loses both, and the replay makes the put again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldPut {
    pub call: EffectCall,
    pub namespace: String,
    pub key: String,
    pub value: String,
}

/// PostgreSQL: CTEs that write the held puts in the JSON list `$list`
/// (see [`held_puts_json`]) after CTE `r` (the guarded write of the run,
/// or of the runs of a batch of closes, returning `id` and `fence`): one
/// `committed` local ledger row each (`w`) and the last value per key
/// (`k`; one row may be updated only once per statement). `$on` pairs a
/// put (`l`, with `i`, its close's place in a batch) with its run in `r`:
/// `true` for one run. A run not in `r` writes nothing.
macro_rules! pg_held_puts {
    ($list:literal, $on:literal) => {
        concat!(
            ", l AS (SELECT * FROM jsonb_to_recordset(", $list, "::text::jsonb) AS \
             l(i bigint, seq bigint, name text, hash text, emit_pos bigint, ns text, key text, value text, ikey text)), \
             w AS (INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, \
             result, emit_pos, fence_started, fence_completed, created_at, updated_at) \
             SELECT r.id, l.seq, l.name, l.hash, l.ikey, 'local', 'committed', 'null', \
             l.emit_pos, r.fence, r.fence, {now}, {now} FROM r JOIN l ON ", $on, " RETURNING run_id, seq), \
             k AS (INSERT INTO kv (namespace, key, value, updated_at) \
             SELECT DISTINCT ON (l.ns, l.key) l.ns, l.key, l.value, {now} \
             FROM l JOIN r ON ", $on, " JOIN w ON w.run_id = r.id AND w.seq = l.seq \
             ORDER BY l.ns, l.key, l.i DESC, l.seq DESC \
             ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at) "
        )
    };
}
pub(crate) use pg_held_puts;

/// The JSON list `pg_held_puts!` reads, for one run's puts.
pub(crate) fn held_puts_json(database: &str, run_id: i64, puts: &[HeldPut]) -> String {
    serde_json::Value::Array(puts.iter().map(|p| held_put_json(0, database, run_id, p)).collect()).to_string()
}

/// One entry of the list `pg_held_puts!` reads: put `p` of run `run_id`,
/// the close at place `i` in a batch (0 outside one).
pub(crate) fn held_put_json(i: usize, database: &str, run_id: i64, p: &HeldPut) -> serde_json::Value {
    serde_json::json!({
        "i": i, "seq": p.call.seq, "name": p.call.name, "hash": p.call.request_hash,
        "emit_pos": p.call.emit_pos, "ns": p.namespace, "key": p.key, "value": p.value,
        "ikey": idempotency_key(database, run_id, p.call.seq),
    })
}

/// SQLite: writes the held puts inside the caller's guarded transaction.
pub(crate) async fn insert_held_puts(
    store: &Store,
    conn: &mut sqlx::AnyConnection,
    lease: &Lease,
    puts: &[HeldPut],
) -> Result<(), StoreError> {
    for put in puts {
        insert_row(store, conn, lease, &put.call, EffectClass::Local, EffectState::Committed, Some("null")).await?;
        kv_put(store, conn, &put.namespace, &put.key, &put.value).await?;
    }
    Ok(())
}

async fn kv_put(
    store: &Store,
    conn: &mut sqlx::AnyConnection,
    namespace: &str,
    key: &str,
    value: &str,
) -> Result<(), StoreError> {
    sqlx::query(sql!(
        store,
        "INSERT INTO kv (namespace, key, value, updated_at) VALUES ($1, $2, $3, {now}) \
         ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, \
         updated_at = excluded.updated_at"
    ))
    .bind(namespace)
    .bind(key)
    .bind(value)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// `<database id>:<run id>:<seq>`: stable across a run's attempts, so a
/// re-issued request is deduplicated by the remote side, and unique across
/// databases (the id is random, made by a migration), so two deployments,
/// or one after a reset, never send the same key.
pub fn idempotency_key(database: &str, run_id: i64, seq: i64) -> String {
    format!("{database}:{run_id}:{seq}")
}

/// Inserts the ledger row for `call` inside the caller's transaction (after
/// its guard). `EffectExists` if the position is already recorded; the
/// caller's transaction is then dropped, rolling back anything it did.
async fn insert_row(
    store: &Store,
    conn: &mut sqlx::AnyConnection,
    lease: &Lease,
    call: &EffectCall,
    class: EffectClass,
    state: EffectState,
    result: Option<&str>,
) -> Result<EffectRow, StoreError> {
    let completed = (state != EffectState::Started).then_some(lease.fence);
    let key = idempotency_key(&store.database_id().await?, lease.run_id, call.seq);
    let row = sqlx::query(sql!(
        store,
        "INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, \
         result, emit_pos, fence_started, fence_completed, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, {now}, {now}) \
         ON CONFLICT (run_id, seq) DO NOTHING RETURNING *"
    ))
    .bind(lease.run_id)
    .bind(call.seq)
    .bind(&call.name)
    .bind(&call.request_hash)
    .bind(key)
    .bind(class.as_str())
    .bind(state.as_str())
    .bind(result)
    .bind(call.emit_pos)
    .bind(lease.fence)
    .bind(completed)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or(StoreError::EffectExists {
        run_id: lease.run_id,
        seq: call.seq,
    })?;
    EffectRow::from_row(&row)
}

/// PostgreSQL: the guard and a ledger row in one statement (see
/// `pg_append_deltas!` in `lease.rs` for why). CTE `g` is the guard; `e`
/// inserts the row, with result `$result` (an SQL expression); `$after`
/// adds CTEs that apply the effect from `e`'s row, so a duplicate position
/// (no row in `e`) applies nothing. The statement returns one row when the
/// guard held, with `guard_run_id` set and the ledger row's columns (NULL
/// when the position was already recorded); no row when the lease is lost.
///
/// Parameters: `$1`..`$3` the lease, `$4` seq, `$5` name, `$6` request hash,
/// `$7` idempotency key, `$8` class, `$9` state, `$10` emit position, `$11`
/// completing fence (NULL for `started`); `$12`.. belong to `$result` and
/// `$after`.
macro_rules! pg_ledger_row {
    ($result:literal, $after:literal) => {
        concat!(
            "WITH g AS (UPDATE runs SET heartbeat_at = {now} WHERE ",
            guarded!(),
            " RETURNING id), \
             e AS (INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, \
             result, emit_pos, fence_started, fence_completed, created_at, updated_at) \
             SELECT $1, $4, $5, $6, $7, $8, $9, ",
            $result,
            ", $10, $3, $11, {now}, {now} FROM g ON CONFLICT (run_id, seq) DO NOTHING RETURNING *)",
            $after,
            " SELECT g.id AS guard_run_id, e.* FROM g LEFT JOIN e ON true"
        )
    };
}

/// Runs a `pg_ledger_row!` statement: binds `$1`..`$11` from the lease and
/// the call, then `extra` in order.
async fn pg_ledger_row(
    store: &Store,
    statement: &'static str,
    lease: &Lease,
    call: &EffectCall,
    class: EffectClass,
    state: EffectState,
    extra: &[Option<&str>],
) -> Result<EffectRow, StoreError> {
    let completed = (state != EffectState::Started).then_some(lease.fence);
    let key = idempotency_key(&store.database_id().await?, lease.run_id, call.seq);
    let key = key.as_str();
    let row = store
        .retry(|| async move {
            let mut q = sqlx::query(statement)
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(call.seq)
                .bind(&call.name)
                .bind(&call.request_hash)
                .bind(key)
                .bind(class.as_str())
                .bind(state.as_str())
                .bind(call.emit_pos)
                .bind(completed);
            for value in extra {
                q = q.bind(*value);
            }
            Ok(q.fetch_optional(store.writer()).await?)
        })
        .await?;
    let Some(row) = row else {
        return Err(rejected(lease));
    };
    use sqlx::Row;
    if row.try_get::<Option<i64>, _>("seq")?.is_none() {
        return Err(StoreError::EffectExists { run_id: lease.run_id, seq: call.seq });
    }
    EffectRow::from_row(&row)
}

impl Store {
    /// Writes a `started` row for a keyed or unkeyed effect, before it is
    /// performed. `EffectExists` means the position is already recorded and
    /// must be replayed, not performed.
    pub async fn begin_effect(
        &self,
        lease: &Lease,
        call: &EffectCall,
        class: EffectClass,
    ) -> Result<EffectRow, StoreError> {
        if self.backend() == Backend::Postgres {
            let statement = sql!(self, pg_ledger_row!("$12", ""));
            return pg_ledger_row(self, statement, lease, call, class, EffectState::Started, &[None]).await;
        }
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let row = insert_row(self, &mut tx, lease, call, class, EffectState::Started, None).await?;
            tx.commit().await?;
            Ok(row)
        })
        .await
    }

    /// Moves a `started` (or `in_doubt`, when this segment re-issued it) row
    /// to `committed` or `failed` with its result.
    pub async fn complete_effect(
        &self,
        lease: &Lease,
        seq: i64,
        completion: &Completion,
    ) -> Result<EffectRow, StoreError> {
        self.complete_streamed(lease, seq, completion, Streamed::default()).await
    }

    /// [`Store::complete_effect`] for a call that streamed `streamed` into
    /// the turn's output (`model.chat`), failed or not: replay moves the
    /// stream position on by as many.
    pub async fn complete_streamed(
        &self,
        lease: &Lease,
        seq: i64,
        completion: &Completion,
        streamed: Streamed,
    ) -> Result<EffectRow, StoreError> {
        let Streamed { deltas, bytes } = streamed;
        let (state, result) = match completion {
            Completion::Committed(r) => (EffectState::Committed, r),
            Completion::Failed(r) => (EffectState::Failed, r),
        };
        if self.backend() == Backend::Postgres {
            let row = self
                .retry(|| async move {
                    Ok(sqlx::query(sql!(
                        self,
                        concat!(
                            "WITH g AS (UPDATE runs SET heartbeat_at = {now} WHERE ",
                            guarded!(),
                            " RETURNING id), \
                             u AS (UPDATE effects SET state = $5, result = $6, fence_completed = $3, \
                             deltas = $7, delta_bytes = $8, \
                             updated_at = {now} WHERE run_id IN (SELECT id FROM g) AND seq = $4 \
                             AND state IN ('started','in_doubt') RETURNING *) \
                             SELECT g.id AS guard_run_id, u.* FROM g LEFT JOIN u ON true"
                        )
                    ))
                    .bind(lease.run_id)
                    .bind(&lease.owner)
                    .bind(lease.fence)
                    .bind(seq)
                    .bind(state.as_str())
                    .bind(result)
                    .bind(deltas)
                    .bind(bytes)
                    .fetch_optional(self.writer())
                    .await?)
                })
                .await?;
            let row = row.ok_or_else(|| rejected(lease))?;
            use sqlx::Row;
            if row.try_get::<Option<i64>, _>("seq")?.is_none() {
                return Err(StoreError::EffectNotOpen { run_id: lease.run_id, seq });
            }
            return EffectRow::from_row(&row);
        }
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let row = sqlx::query(sql!(
                self,
                "UPDATE effects SET state = $3, result = $4, fence_completed = $5, deltas = $6, \
                 delta_bytes = $7, updated_at = {now} \
                 WHERE run_id = $1 AND seq = $2 AND state IN ('started','in_doubt') RETURNING *"
            ))
            .bind(lease.run_id)
            .bind(seq)
            .bind(state.as_str())
            .bind(result)
            .bind(lease.fence)
            .bind(deltas)
            .bind(bytes)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::EffectNotOpen {
                run_id: lease.run_id,
                seq,
            })?;
            let row = EffectRow::from_row(&row)?;
            tx.commit().await?;
            Ok(row)
        })
        .await
    }

    /// Re-opens an `in_doubt` keyed effect for re-issue by this segment, with
    /// the same idempotency key. Unkeyed effects are never re-issued.
    pub async fn reissue_effect(&self, lease: &Lease, seq: i64) -> Result<EffectRow, StoreError> {
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let row = sqlx::query(sql!(
                self,
                "UPDATE effects SET state = 'started', fence_started = $3, updated_at = {now} \
                 WHERE run_id = $1 AND seq = $2 AND state = 'in_doubt' AND class = 'keyed' RETURNING *"
            ))
            .bind(lease.run_id)
            .bind(seq)
            .bind(lease.fence)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::EffectNotOpen {
                run_id: lease.run_id,
                seq,
            })?;
            let row = EffectRow::from_row(&row)?;
            tx.commit().await?;
            Ok(row)
        })
        .await
    }

    /// Performs a local effect and writes its `committed` ledger row in one
    /// transaction, so it happens exactly once however often the run dies.
    pub async fn local_effect(
        &self,
        lease: &Lease,
        call: &EffectCall,
        op: &LocalOp,
    ) -> Result<EffectRow, StoreError> {
        if self.backend() == Backend::Postgres {
            let (local, committed) = (EffectClass::Local, EffectState::Committed);
            match op {
                LocalOp::KvGet { namespace, key } => {
                    let statement = sql!(
                        self,
                        pg_ledger_row!(
                            "COALESCE((SELECT value FROM kv WHERE namespace = $12 AND key = $13), 'null')",
                            ""
                        )
                    );
                    let extra = [Some(namespace.as_str()), Some(key.as_str())];
                    return pg_ledger_row(self, statement, lease, call, local, committed, &extra).await;
                }
                LocalOp::KvPut { namespace, key, value } => {
                    let statement = sql!(
                        self,
                        pg_ledger_row!(
                            "'null'",
                            ", k AS (INSERT INTO kv (namespace, key, value, updated_at) \
                             SELECT $12, $13, $14, {now} FROM e \
                             ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, \
                             updated_at = excluded.updated_at)"
                        )
                    );
                    let extra = [Some(namespace.as_str()), Some(key.as_str()), Some(value.as_str())];
                    return pg_ledger_row(self, statement, lease, call, local, committed, &extra).await;
                }
                LocalOp::Record { value } => {
                    let statement = sql!(self, pg_ledger_row!("$12", ""));
                    return pg_ledger_row(self, statement, lease, call, local, committed, &[Some(value.as_str())])
                        .await;
                }
                // It writes the run row, which the guard CTE already updates
                // (a row may be updated once per statement): a transaction.
                LocalOp::TakeInput { .. } => {}
            }
        }
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let result = match op {
                LocalOp::KvGet { namespace, key } => {
                    let value: Option<String> = sqlx::query_scalar(sql!(
                        self,
                        "SELECT value FROM kv WHERE namespace = $1 AND key = $2"
                    ))
                    .bind(namespace)
                    .bind(key)
                    .fetch_optional(&mut *tx)
                    .await?;
                    value.unwrap_or_else(|| "null".to_string())
                }
                LocalOp::KvPut {
                    namespace,
                    key,
                    value,
                } => {
                    kv_put(self, &mut tx, namespace, key, value).await?;
                    "null".to_string()
                }
                LocalOp::Record { value } => value.clone(),
                LocalOp::TakeInput { value } => {
                    sqlx::query(sql!(
                        self,
                        "UPDATE runs SET pending_input = NULL, updated_at = {now} \
                         WHERE id = $1 AND lease_owner = $2 AND fence = $3"
                    ))
                    .bind(lease.run_id)
                    .bind(&lease.owner)
                    .bind(lease.fence)
                    .execute(&mut *tx)
                    .await?;
                    value.clone()
                }
            };
            // On a duplicate position the transaction is dropped, which rolls
            // the effect back with it: nothing is applied twice.
            let row = insert_row(self, &mut tx, lease, call, EffectClass::Local, EffectState::Committed, Some(&result)).await?;
            tx.commit().await?;
            Ok(row)
        })
        .await
    }

    /// Records a refusal (an effect the host declined without performing
    /// anything: unknown provider, not allowed, over a cap) as a `failed`
    /// row in one transaction, so replay returns the same refusal. Class
    /// `local`: the decision was the host's own.
    pub async fn record_refusal(
        &self,
        lease: &Lease,
        call: &EffectCall,
        result: &str,
    ) -> Result<EffectRow, StoreError> {
        if self.backend() == Backend::Postgres {
            let statement = sql!(self, pg_ledger_row!("$12", ""));
            let (local, failed) = (EffectClass::Local, EffectState::Failed);
            return pg_ledger_row(self, statement, lease, call, local, failed, &[Some(result)]).await;
        }
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let row = insert_row(self, &mut tx, lease, call, EffectClass::Local, EffectState::Failed, Some(result)).await?;
            tx.commit().await?;
            Ok(row)
        })
        .await
    }

    /// Reconciles the ledger before a resume: every `started` row from an
    /// older fence becomes `in_doubt`. Idempotent; returns how many changed.
    pub async fn reconcile(&self, lease: &Lease) -> Result<u64, StoreError> {
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let n = sqlx::query(sql!(
                self,
                "UPDATE effects SET state = 'in_doubt', updated_at = {now} \
                 WHERE run_id = $1 AND state = 'started' AND fence_started < $2"
            ))
            .bind(lease.run_id)
            .bind(lease.fence)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            tx.commit().await?;
            Ok(n)
        })
        .await
    }

    /// Up to `limit` ledger rows of a run from position `from` on, in
    /// order: a resumed segment reads its ledger a page at a time, as its
    /// replay reaches it.
    pub async fn effects_page(&self, run_id: i64, from: i64, limit: i64) -> Result<Vec<EffectRow>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT * FROM effects WHERE run_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3"
        ))
        .bind(run_id)
        .bind(from)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(EffectRow::from_row).collect()
    }

    /// Ledger rows of a run after position `after`, in order: at most
    /// `limit`, and no more than about `max_bytes` of results (always at
    /// least one). Also returns whether the page was cut short by its size.
    pub async fn effects_capped(&self, run_id: i64, after: i64, limit: i64, max_bytes: i64) -> Result<(Vec<EffectRow>, bool), StoreError> {
        use sqlx::Row;
        let rows = sqlx::query(sql!(
            self,
            "SELECT * FROM (SELECT e.*, SUM(COALESCE(LENGTH(e.result), 0) + LENGTH(e.name)) OVER (ORDER BY e.seq) AS running \
             FROM effects e WHERE e.run_id = $1 AND e.seq > $2 ORDER BY e.seq LIMIT $3) AS p \
             WHERE p.running - (COALESCE(LENGTH(p.result), 0) + LENGTH(p.name)) < $4 ORDER BY p.seq"
        ))
        .bind(run_id)
        .bind(after)
        .bind(limit)
        .bind(max_bytes)
        .fetch_all(self.pool())
        .await?;
        let cut = match rows.last() {
            Some(last) => last.try_get::<i64, _>("running")? >= max_bytes,
            None => false,
        };
        Ok((rows.iter().map(EffectRow::from_row).collect::<Result<_, _>>()?, cut))
    }

    /// How large a run's ledger is (rows, and bytes of names and results),
    /// and its last row: what a resumed segment needs before it replays.
    pub async fn ledger_summary(&self, run_id: i64) -> Result<LedgerSummary, StoreError> {
        use sqlx::Row;
        let totals = sqlx::query(sql!(
            self,
            "SELECT COUNT(*) AS n, COALESCE(SUM(LENGTH(name) + COALESCE(LENGTH(result), 0)), 0) AS bytes \
             FROM effects WHERE run_id = $1"
        ))
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        let last = sqlx::query(sql!(self, "SELECT * FROM effects WHERE run_id = $1 ORDER BY seq DESC LIMIT 1"))
            .bind(run_id)
            .fetch_optional(self.pool())
            .await?;
        Ok(LedgerSummary {
            rows: totals.try_get("n")?,
            bytes: totals.try_get("bytes")?,
            last: last.as_ref().map(EffectRow::from_row).transpose()?,
        })
    }

    /// The ledger of a run, by position.
    pub async fn effects(&self, run_id: i64) -> Result<Vec<EffectRow>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT * FROM effects WHERE run_id = $1 ORDER BY seq"
        ))
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(EffectRow::from_row).collect()
    }
}
