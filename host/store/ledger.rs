//! The effect ledger (docs/concepts.md). One row per effect, `(run_id, seq)`
//! unique, written under the same (owner, fence) guard as every other
//! corrupting write.

use crate::store::guard::{guard, guarded, rejected};
use crate::store::{Backend, EffectClass, EffectRow, EffectState, Lease, Store, StoreError, sql};

/// The identity of an effect at one position of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectCall {
    /// Position in the turn's host-call order, from 0.
    pub seq: i64,
    pub name: String,
    /// A hash of the request; replay compares it to detect non-determinism.
    pub request_hash: String,
    /// The request's first [`REQUEST_PREVIEW`] bytes, for divergence
    /// reports (see `runtime::text::request_preview`).
    pub request: String,
    /// The run's emit position when the effect was made.
    pub emit_pos: i64,
}

/// How much of a request the ledger keeps beside its hash: 1,024 bytes.
pub const REQUEST_PREVIEW: usize = 1024;

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
    /// Bytes of names and results, and of the keys and values of the
    /// `kv.put`s made (a put is counted by its size).
    pub bytes: i64,
    pub last: Option<EffectRow>,
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
pub(super) async fn insert_row(
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
         result, emit_pos, fence_started, fence_completed, created_at, updated_at, request) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, {now}, {now}, $12) \
         ON CONFLICT (run_id, seq) DO NOTHING RETURNING {effects}"
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
    .bind(&call.request)
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
/// completing fence (NULL for `started`), `$12` the request preview; `$13`..
/// belong to `$result` and `$after`.
macro_rules! pg_ledger_row {
    ($result:literal, $after:literal) => {
        concat!(
            "WITH g AS (UPDATE runs SET heartbeat_at = {now} WHERE ",
            guarded!(),
            " RETURNING id), \
             e AS (INSERT INTO effects (run_id, seq, name, request_hash, idempotency_key, class, state, \
             result, emit_pos, fence_started, fence_completed, created_at, updated_at, request) \
             SELECT $1, $4, $5, $6, $7, $8, $9, ",
            $result,
            ", $10, $3, $11, {now}, {now}, $12 FROM g ON CONFLICT (run_id, seq) DO NOTHING RETURNING {effects})",
            $after,
            " SELECT g.id AS guard_run_id, {effects@e} FROM g LEFT JOIN e ON true"
        )
    };
}
pub(super) use pg_ledger_row;

/// Runs a `pg_ledger_row!` statement on `conn`: binds `$1`..`$12` from the
/// lease and the call, then `extra` in order.
#[allow(clippy::too_many_arguments)]
pub(super) async fn pg_ledger_row_on(
    store: &Store,
    conn: &mut sqlx::AnyConnection,
    statement: &'static str,
    lease: &Lease,
    call: &EffectCall,
    class: EffectClass,
    state: EffectState,
    extra: &[Option<&str>],
) -> Result<EffectRow, StoreError> {
    let completed = (state != EffectState::Started).then_some(lease.fence);
    let key = idempotency_key(&store.database_id().await?, lease.run_id, call.seq);
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
        .bind(completed)
        .bind(&call.request);
    for value in extra {
        q = q.bind(*value);
    }
    let Some(row) = q.fetch_optional(&mut *conn).await? else {
        return Err(rejected(lease));
    };
    use sqlx::Row;
    if row.try_get::<Option<i64>, _>("seq")?.is_none() {
        return Err(StoreError::EffectExists { run_id: lease.run_id, seq: call.seq });
    }
    EffectRow::from_row(&row)
}

impl Store {
    /// [`Store::begin_effect`]'s statements on `conn` (SQLite: inside a
    /// transaction).
    pub(super) async fn begin_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        lease: &Lease,
        call: &EffectCall,
        class: EffectClass,
    ) -> Result<EffectRow, StoreError> {
        if self.backend() == Backend::Postgres {
            let statement = sql!(self, pg_ledger_row!("$13", ""));
            return pg_ledger_row_on(self, conn, statement, lease, call, class, EffectState::Started, &[None]).await;
        }
        guard(self, conn, lease).await?;
        insert_row(self, conn, lease, call, class, EffectState::Started, None).await
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

    /// [`Store::complete_streamed`]'s statements on `conn` (SQLite: inside
    /// a transaction).
    pub(super) async fn complete_in(
        &self,
        conn: &mut sqlx::AnyConnection,
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
            let row = sqlx::query(sql!(
                self,
                concat!(
                    "WITH g AS (UPDATE runs SET heartbeat_at = {now} WHERE ",
                    guarded!(),
                    " RETURNING id), \
                     u AS (UPDATE effects SET state = $5, result = $6, fence_completed = $3, \
                     deltas = $7, delta_bytes = $8, \
                     updated_at = {now} WHERE run_id IN (SELECT id FROM g) AND seq = $4 \
                     AND state IN ('started','in_doubt') RETURNING {effects}) \
                     SELECT g.id AS guard_run_id, {effects@u} FROM g LEFT JOIN u ON true"
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
            .fetch_optional(&mut *conn)
            .await?;
            let row = row.ok_or_else(|| rejected(lease))?;
            use sqlx::Row;
            if row.try_get::<Option<i64>, _>("seq")?.is_none() {
                return Err(StoreError::EffectNotOpen { run_id: lease.run_id, seq });
            }
            return EffectRow::from_row(&row);
        }
        guard(self, conn, lease).await?;
        let row = sqlx::query(sql!(
            self,
            "UPDATE effects SET state = $3, result = $4, fence_completed = $5, deltas = $6, \
             delta_bytes = $7, updated_at = {now} \
             WHERE run_id = $1 AND seq = $2 AND state IN ('started','in_doubt') RETURNING {effects}"
        ))
        .bind(lease.run_id)
        .bind(seq)
        .bind(state.as_str())
        .bind(result)
        .bind(lease.fence)
        .bind(deltas)
        .bind(bytes)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or(StoreError::EffectNotOpen { run_id: lease.run_id, seq })?;
        EffectRow::from_row(&row)
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
                 WHERE run_id = $1 AND seq = $2 AND state = 'in_doubt' AND class = 'keyed' RETURNING {effects}"
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
            let statement = sql!(self, pg_ledger_row!("$13", ""));
            let (local, failed) = (EffectClass::Local, EffectState::Failed);
            return self
                .retry(|| async move {
                    let mut conn = self.writer().acquire().await?;
                    pg_ledger_row_on(self, &mut conn, statement, lease, call, local, failed, &[Some(result)]).await
                })
                .await;
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
            "SELECT {effects} FROM effects WHERE run_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3"
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
            "SELECT * FROM (SELECT {effects@e}, SUM(COALESCE(LENGTH(e.result), 0) + LENGTH(e.name)) OVER (ORDER BY e.seq) AS running \
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
            "SELECT COUNT(*) AS n, CAST(COALESCE(SUM(LENGTH(name) + COALESCE(LENGTH(result), 0) \
             + kv_bytes), 0) AS BIGINT) AS bytes \
             FROM effects WHERE run_id = $1"
        ))
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        let last = sqlx::query(sql!(self, "SELECT {effects} FROM effects WHERE run_id = $1 ORDER BY seq DESC LIMIT 1"))
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
            "SELECT {effects} FROM effects WHERE run_id = $1 ORDER BY seq"
        ))
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(EffectRow::from_row).collect()
    }
}
