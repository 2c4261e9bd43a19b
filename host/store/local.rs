//! Local effects: applied in the host's own database in the same
//! transaction (PostgreSQL: statement) as their `committed` ledger row, so
//! exactly once: the `kv` table, recorded observations and consumed input.
//! And the `kv.put`s a segment holds until its next write.

use serde::{Deserialize, Serialize};

use super::guard::guard;
use super::guard::guarded;
use super::ledger::{EffectCall, idempotency_key, insert_row, pg_ledger_row, pg_ledger_row_on};
use crate::store::{Backend, EffectClass, EffectRow, EffectState, Lease, Store, StoreError, sql};

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
             l(i bigint, seq bigint, name text, hash text, request text, emit_pos bigint, ns text, key text, value text, ikey text, size bigint)), \
             w AS (INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, \
             result, emit_pos, fence_started, fence_completed, created_at, updated_at, request, kv_bytes) \
             SELECT r.id, l.seq, l.name, l.hash, l.ikey, 'local', 'committed', 'null', \
             l.emit_pos, r.fence, r.fence, {now}, {now}, l.request, l.size FROM r JOIN l ON ", $on, " RETURNING run_id, seq), \
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
        "i": i, "seq": p.call.seq, "name": p.call.name, "hash": p.call.request_hash, "request": p.call.request,
        "emit_pos": p.call.emit_pos, "ns": p.namespace, "key": p.key, "value": p.value,
        "ikey": idempotency_key(database, run_id, p.call.seq), "size": p.key.len() + p.value.len(),
    })
}

/// SQLite: writes the held puts inside the caller's guarded transaction.
pub(crate) async fn insert_held_puts(
    store: &Store,
    conn: &mut sqlx::AnyConnection,
    lease: &Lease,
    puts: &[HeldPut],
) -> Result<(), StoreError> {
    if puts.is_empty() {
        return Ok(());
    }
    let database = store.database_id().await?;
    let list: Vec<_> = puts.iter().map(|p| sqlite_held_put_json(&database, lease, p)).collect();
    insert_held_puts_json(store, conn, &serde_json::Value::Array(list).to_string()).await
}

/// One entry of the list [`insert_held_puts_json`] reads: put `p` of the
/// run `lease` holds.
pub(crate) fn sqlite_held_put_json(database: &str, lease: &Lease, p: &HeldPut) -> serde_json::Value {
    let mut put = held_put_json(0, database, lease.run_id, p);
    put["run"] = lease.run_id.into();
    put["fence"] = lease.fence.into();
    put
}

/// SQLite: writes a JSON list of held puts ([`sqlite_held_put_json`]),
/// of one run or of a batch's, inside the caller's guarded transaction,
/// in two statements however many: their `committed` ledger rows, then
/// the keys, in list order (a later put of a key wins). A position
/// already recorded fails the statement, and so the transaction.
pub(crate) async fn insert_held_puts_json(store: &Store, conn: &mut sqlx::AnyConnection, list: &str) -> Result<(), StoreError> {
    sqlx::query(sql!(
        store,
        "INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, \
         result, emit_pos, fence_started, fence_completed, created_at, updated_at, request, kv_bytes) \
         SELECT value ->> 'run', value ->> 'seq', value ->> 'name', value ->> 'hash', value ->> 'ikey', \
         'local', 'committed', 'null', value ->> 'emit_pos', value ->> 'fence', value ->> 'fence', \
         {now}, {now}, value ->> 'request', value ->> 'size' FROM jsonb_each($1)"
    ))
    .bind(list)
    .execute(&mut *conn)
    .await?;
    sqlx::query(sql!(
        store,
        "INSERT INTO kv (namespace, key, value, updated_at) \
         SELECT l.value ->> 'ns', l.value ->> 'key', l.value ->> 'value', {now} FROM jsonb_each($1) AS l \
         WHERE true ORDER BY l.key \
         ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at"
    ))
    .bind(list)
    .execute(&mut *conn)
    .await?;
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

impl Store {
    /// [`Store::local_effect`]'s statements on `conn`: one statement on
    /// PostgreSQL (but for `TakeInput`); otherwise, inside a transaction,
    /// the guard, the ledger row, then the effect, so a duplicate position
    /// applies nothing.
    pub(super) async fn local_in(
        &self,
        conn: &mut sqlx::AnyConnection,
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
                            "COALESCE((SELECT value FROM kv WHERE namespace = $13 AND key = $14), 'null')",
                            ""
                        )
                    );
                    let extra = [Some(namespace.as_str()), Some(key.as_str())];
                    return pg_ledger_row_on(self, conn, statement, lease, call, local, committed, &extra).await;
                }
                LocalOp::Record { value } => {
                    let statement = sql!(self, pg_ledger_row!("$13", ""));
                    return pg_ledger_row_on(self, conn, statement, lease, call, local, committed, &[Some(value.as_str())])
                        .await;
                }
                // It writes the run row, which the guard CTE already updates
                // (a row may be updated once per statement): a transaction.
                // A put (held and written with the segment's next write by
                // the runtime; here only for callers of the store) sets its
                // row's `kv_bytes` after inserting it: a transaction too.
                LocalOp::TakeInput { .. } | LocalOp::KvPut { .. } => {}
            }
        }
        guard(self, conn, lease).await?;
        let result = match op {
            LocalOp::KvGet { namespace, key } => {
                let value: Option<String> =
                    sqlx::query_scalar(sql!(self, "SELECT value FROM kv WHERE namespace = $1 AND key = $2"))
                        .bind(namespace)
                        .bind(key)
                        .fetch_optional(&mut *conn)
                        .await?;
                value.unwrap_or_else(|| "null".to_string())
            }
            LocalOp::KvPut { .. } => "null".to_string(),
            LocalOp::Record { value } | LocalOp::TakeInput { value } => value.clone(),
        };
        // The row first: on a duplicate position nothing has been applied
        // yet, so a write in a batch needs no savepoint of its own.
        let row = insert_row(self, conn, lease, call, EffectClass::Local, EffectState::Committed, Some(&result)).await?;
        match op {
            LocalOp::KvPut { namespace, key, value } => {
                kv_put(self, conn, namespace, key, value).await?;
                sqlx::query(sql!(self, "UPDATE effects SET kv_bytes = $3 WHERE run_id = $1 AND seq = $2"))
                    .bind(lease.run_id)
                    .bind(call.seq)
                    .bind((key.len() + value.len()) as i64)
                    .execute(&mut *conn)
                    .await?;
            }
            LocalOp::TakeInput { .. } => {
                sqlx::query(sql!(
                    self,
                    "UPDATE runs SET pending_input = NULL, updated_at = {now} \
                     WHERE id = $1 AND lease_owner = $2 AND fence = $3"
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .execute(&mut *conn)
                .await?;
            }
            LocalOp::KvGet { .. } | LocalOp::Record { .. } => {}
        }
        Ok(row)
    }
}
