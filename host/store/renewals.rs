//! Group commit of renewals, on both backends (statement 2).
//!
//! A host with many long segments renews each lease every `ttl / 3`. Each
//! renewal is a statement and a commit of its own, so a renewal made
//! while another batch is in flight waits, and the waiting ones go to the
//! database together as one `UPDATE … FROM` over a JSON list. A renewal
//! on a quiet host goes at once.
//!
//! Each lease keeps its own (owner, fence) guard in the join: one that
//! fails it matches no row, is renewed by nothing and gets
//! [`StoreError::LeaseLost`], and the others are renewed. A lease that ran
//! out is never renewed, taken or not: a claim counts a key's slots from
//! live leases and may have given its slot away. Nor is one with less
//! than an eighth of its length left (at most 1 s): on PostgreSQL a claim
//! reads the runs as they were when its statement began, so a renewal
//! that lands in that instant must not have been of a lease the claim
//! already counted as gone. Renewals come every third of a lease, so a
//! live segment always has that much left. On PostgreSQL
//! the statement runs with the lock timeout of the maintenance pool: one
//! row a frozen session holds fails the batch, which is then written
//! lease by lease, so only that lease waits (see [`group::write_batches`]).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use sqlx::Row;

use crate::store::guard::{ms, rejected};
use crate::store::group;
use crate::store::{Lease, Store, StoreError, sql};

/// Most leases renewed by one statement.
pub(crate) const MAX_BATCH: usize = 256;

/// Batches in flight at once: one. A renewal is not urgent to within a
/// round trip (it has a third of a lease to land), so renewals wait for
/// the batch in flight and grow the next one.
pub(crate) const WRITERS: usize = 1;

/// One renewal: a lease and the length to extend it to, and whether it
/// counts the segment's attempt too (its claim did not).
#[derive(Debug, Clone)]
pub(crate) struct Renewal {
    pub lease: Lease,
    pub ttl: Duration,
    pub charge: bool,
}

/// Renewals waiting to be group-committed. Each gets the lease's new
/// expiry (epoch ms on the database clock) and whether its run is paused
/// (`store::pause`).
pub(crate) type Queue = group::Queue<Renewal, (i64, bool)>;

/// Queues `renewal` and returns the new expiry, and whether the run is
/// paused, once its batch is written.
pub(crate) async fn renew(store: &Store, renewal: Renewal) -> Result<(i64, bool), StoreError> {
    store
        .renewals
        .push(renewal, WRITERS, || {
            tokio::spawn(group::write_batches::<Renewal>(store.clone()));
        })
        .await
}

impl group::Batched for Renewal {
    type Out = (i64, bool);
    const WHAT: &'static str = "renewals";

    fn queue(store: &Store) -> &std::sync::Arc<Queue> {
        &store.renewals
    }

    fn take(store: &Store) -> Vec<(Renewal, group::Reply<(i64, bool)>)> {
        store.renewals.take(MAX_BATCH, |_| true)
    }

    async fn write(store: &Store, renewals: &[Renewal]) -> Result<Vec<Result<(i64, bool), StoreError>>, StoreError> {
        store.renew_batch(renewals).await
    }

    fn written(store: &Store, n: usize) {
        store.renewals.count(n);
    }
}

impl Store {
    /// Statement 2 for many leases in one statement: extends each to its
    /// `ttl` from the database's now. Each renewal's result, in order: the
    /// new expiry and whether the run is paused, or
    /// [`StoreError::LeaseLost`] for a lease its guard refused (that lease
    /// is left as it was).
    pub(crate) async fn renew_batch(&self, renewals: &[Renewal]) -> Result<Vec<Result<(i64, bool), StoreError>>, StoreError> {
        // In run order: PostgreSQL locks the rows as it meets them, so
        // batches that share runs lock them in one order.
        let mut sorted: Vec<&Renewal> = renewals.iter().collect();
        sorted.sort_by_key(|r| r.lease.run_id);
        let list = json!(
            sorted
                .iter()
                .map(|r| json!({ "id": r.lease.run_id, "owner": r.lease.owner, "fence": r.lease.fence, "ttl": ms(r.ttl), "charge": i64::from(r.charge) }))
                .collect::<Vec<_>>()
        )
        .to_string();
        let statement = match self.backend() {
            crate::store::Backend::Postgres => sql!(
                self,
                "UPDATE runs SET lease_expires_at = r.t + r.ttl, heartbeat_at = r.t, updated_at = {now}, \
                 attempt = runs.attempt + r.charge \
                 FROM (SELECT l.*, {clock} AS t FROM jsonb_to_recordset($1::text::jsonb) \
                 AS l(id bigint, owner text, fence bigint, ttl bigint, charge bigint)) AS r \
                 WHERE runs.id = r.id AND runs.lease_owner = r.owner AND runs.fence = r.fence \
                 AND runs.status = 'running' AND runs.lease_expires_at >= r.t + LEAST(r.ttl / 8, 1000) \
                 RETURNING runs.id, runs.lease_owner, runs.fence, runs.lease_expires_at, runs.paused_at"
            ),
            crate::store::Backend::Sqlite => sql!(
                self,
                "UPDATE runs SET lease_expires_at = {clock} + r.ttl, heartbeat_at = {clock}, updated_at = {now}, \
                 attempt = runs.attempt + r.charge \
                 FROM (SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.owner') AS owner, \
                 json_extract(value, '$.fence') AS fence, json_extract(value, '$.ttl') AS ttl, \
                 json_extract(value, '$.charge') AS charge FROM jsonb_each($1)) AS r \
                 WHERE runs.id = r.id AND runs.lease_owner = r.owner AND runs.fence = r.fence \
                 AND runs.status = 'running' AND runs.lease_expires_at >= {clock} + MIN(r.ttl / 8, 1000) \
                 RETURNING runs.id, runs.lease_owner, runs.fence, runs.lease_expires_at, runs.paused_at"
            ),
        };
        let list = list.as_str();
        let rows = self.retry(|| async move { Ok(sqlx::query(statement).bind(list).fetch_all(self.maint()).await?) }).await?;
        let mut renewed: HashMap<(i64, String, i64), (i64, bool)> = HashMap::with_capacity(rows.len());
        for row in &rows {
            let key = (row.try_get("id")?, row.try_get("lease_owner")?, row.try_get("fence")?);
            let paused: Option<i64> = row.try_get("paused_at")?;
            renewed.insert(key, (row.try_get("lease_expires_at")?, paused.is_some()));
        }
        Ok(renewals
            .iter()
            .map(|r| {
                let key = (r.lease.run_id, r.lease.owner.clone(), r.lease.fence);
                renewed.get(&key).copied().ok_or_else(|| rejected(&r.lease))
            })
            .collect())
    }
}
