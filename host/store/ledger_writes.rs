//! Group commit of ledger writes of different runs, on both backends: a
//! segment's `started` rows, their completions, and local effects with
//! their rows.
//!
//! A ledger write made while [`writers`] batches are in flight waits, and
//! the waiting ones go to the database together in one transaction with
//! one commit (one fsync under SQLite's `synchronous=FULL`). A write on a
//! quiet host goes at once, as its own statement.
//!
//! Each write keeps its own (owner, fence) guard inside the batch: one that
//! fails it writes nothing and gets [`StoreError::LeaseLost`]; one whose
//! position is already recorded gets [`StoreError::EffectExists`] and
//! applies nothing (a local effect writes its ledger row before the
//! effect); the others are written. When a batch fails as a whole,
//! each write is tried on its own (see [`group::write_batches`]).

use crate::store::ledger::{Completion, EffectCall, Streamed};
use crate::store::local::LocalOp;
use crate::store::{Backend, EffectClass, EffectRow, Lease, Store, StoreError, group};

/// Most ledger writes in one batch.
pub(crate) const MAX_BATCH: usize = 64;

/// Batches in flight at once. SQLite has one writer, so one; PostgreSQL
/// takes several transactions at once, and a batch there is a round trip
/// per write, so four keep the others flowing while one commits.
fn writers(store: &Store) -> usize {
    match store.backend() {
        Backend::Sqlite => 1,
        Backend::Postgres => 4,
    }
}

/// One ledger write of a segment.
#[derive(Debug, Clone)]
pub(crate) enum LedgerWrite {
    /// A `started` row, before the effect is performed.
    Begin { lease: Lease, call: EffectCall, class: EffectClass },
    /// A `started` (or re-issued) row moved to `committed` or `failed`.
    Complete { lease: Lease, seq: i64, completion: Completion, streamed: Streamed },
    /// A local effect applied with its `committed` row.
    Local { lease: Lease, call: EffectCall, op: LocalOp },
}

impl LedgerWrite {
    fn lease(&self) -> &Lease {
        match self {
            LedgerWrite::Begin { lease, .. } | LedgerWrite::Complete { lease, .. } | LedgerWrite::Local { lease, .. } => lease,
        }
    }

    /// Written as several statements behind one guard (every write on
    /// SQLite; consuming input on PostgreSQL): on its own, a transaction.
    fn several_statements(&self, backend: Backend) -> bool {
        backend == Backend::Sqlite || matches!(self, LedgerWrite::Local { op: LocalOp::TakeInput { .. } | LocalOp::KvPut { .. }, .. })
    }
}

/// The answers a write in a batch gets that leave the others to be written.
fn refused(e: &StoreError) -> bool {
    matches!(e, StoreError::LeaseLost(_) | StoreError::EffectExists { .. } | StoreError::EffectNotOpen { .. })
}

/// Ledger writes waiting to be group-committed.
pub(crate) type Queue = group::Queue<LedgerWrite, EffectRow>;

/// Queues `write` and returns its row once its batch is written.
pub(crate) async fn write(store: &Store, write: LedgerWrite) -> Result<EffectRow, StoreError> {
    store
        .ledger_writes
        .push(write, writers(store), || {
            // Its own task: a caller that gives up must not stop the batch
            // that carries other callers' writes.
            tokio::spawn(group::write_batches::<LedgerWrite>(store.clone()));
        })
        .await
}

impl group::Batched for LedgerWrite {
    type Out = EffectRow;
    const WHAT: &'static str = "ledger writes";

    fn queue(store: &Store) -> &std::sync::Arc<Queue> {
        &store.ledger_writes
    }

    fn take(store: &Store) -> Vec<(LedgerWrite, group::Reply<EffectRow>)> {
        store.ledger_writes.take(MAX_BATCH, |_| true)
    }

    async fn write(store: &Store, writes: &[LedgerWrite]) -> Result<Vec<Result<EffectRow, StoreError>>, StoreError> {
        if let [one] = writes {
            return match store.ledger_write_one(one).await {
                Err(e) if !refused(&e) => Err(e),
                result => Ok(vec![result]),
            };
        }
        store.ledger_batch(writes).await
    }

    fn written(store: &Store, n: usize) {
        store.ledger_writes.count(n);
    }
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
        write(self, LedgerWrite::Begin { lease: lease.clone(), call: call.clone(), class }).await
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
        write(self, LedgerWrite::Complete { lease: lease.clone(), seq, completion: completion.clone(), streamed }).await
    }

    /// Performs a local effect and writes its `committed` ledger row in one
    /// transaction, so it happens exactly once however often the run dies.
    pub async fn local_effect(
        &self,
        lease: &Lease,
        call: &EffectCall,
        op: &LocalOp,
    ) -> Result<EffectRow, StoreError> {
        write(self, LedgerWrite::Local { lease: lease.clone(), call: call.clone(), op: op.clone() }).await
    }

    /// One ledger write on its own: a statement, or a transaction of its
    /// statements.
    pub(crate) async fn ledger_write_one(&self, write: &LedgerWrite) -> Result<EffectRow, StoreError> {
        self.retry(|| async move {
            if write.several_statements(self.backend()) {
                let mut tx = self.writer().begin().await?;
                // An error drops the transaction, rolling back what it did.
                let row = self.ledger_write_in(&mut tx, write).await?;
                tx.commit().await?;
                Ok(row)
            } else {
                let mut conn = self.writer().acquire().await?;
                self.ledger_write_in(&mut conn, write).await
            }
        })
        .await
    }

    /// Ledger writes of different runs in one transaction and one commit.
    /// Each write's result, in order.
    pub(crate) async fn ledger_batch(&self, writes: &[LedgerWrite]) -> Result<Vec<Result<EffectRow, StoreError>>, StoreError> {
        // In run order, as the other batches (closes, renewals) list
        // them: batches that share runs (a zombie's and its successor's)
        // lock them in one order. A deadlock is still retried.
        let mut order: Vec<usize> = (0..writes.len()).collect();
        order.sort_by_key(|&i| writes[i].lease().run_id);
        let order = &order;
        let sorted = self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let mut results = Vec::with_capacity(writes.len());
            for write in order.iter().map(|&i| &writes[i]) {
                // A refused write has applied nothing (each writes its
                // ledger row before its effect), so it needs no savepoint.
                let result = self.ledger_write_in(&mut tx, write).await;
                match result {
                    Err(e) if !refused(&e) => return Err(e),
                    result => results.push(result),
                }
            }
            tx.commit().await?;
            Ok(results)
        })
        .await?;
        let mut results: Vec<Option<Result<EffectRow, StoreError>>> = (0..writes.len()).map(|_| None).collect();
        for (&i, result) in order.iter().zip(sorted) {
            results[i] = Some(result);
        }
        Ok(results.into_iter().map(|r| r.expect("every write has a result")).collect())
    }

    /// One ledger write's statements on `conn`. A write of several
    /// statements must be inside a transaction.
    async fn ledger_write_in(&self, conn: &mut sqlx::AnyConnection, write: &LedgerWrite) -> Result<EffectRow, StoreError> {
        match write {
            LedgerWrite::Begin { lease, call, class } => self.begin_in(conn, lease, call, *class).await,
            LedgerWrite::Complete { lease, seq, completion, streamed } => {
                self.complete_in(conn, lease, *seq, completion, *streamed).await
            }
            LedgerWrite::Local { lease, call, op } => self.local_in(conn, lease, call, op).await,
        }
    }

    /// Ledger writes written through the queue, and the commits that
    /// wrote them: fewer commits when writes of different runs were
    /// batched.
    pub fn ledger_writes_written(&self) -> (u64, u64) {
        self.ledger_writes.written()
    }
}
