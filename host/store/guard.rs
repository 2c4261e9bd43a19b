//! The guard of every write that can corrupt a run: `(owner, fence)`.
//!
//! Every write except create and claim matches
//! `id = $run AND lease_owner = $owner AND fence = $fence AND status = 'running'
//! AND lease_expires_at >= now` and returns [`StoreError::LeaseLost`] when
//! that matches no row. A lease that ran out is gone even if nobody has
//! taken the run yet: a key's slot is derived from live leases, so a claim
//! may already have given it away, and a late write must not take it back.
//! Multi-statement writes start with the guard, inside one transaction: on
//! PostgreSQL it row-locks the run (a racing claim waits, then sees the new
//! state), on SQLite it takes the write lock first.

use std::time::Duration;

use sqlx::AnyConnection;

use crate::store::{Lease, Store, StoreError, sql};

/// The (owner, fence) guard of every guarded write, on a statement whose
/// run id, owner and fence are `$1`, `$2`, `$3`.
macro_rules! guarded {
    () => {
        "id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' AND lease_expires_at >= {clock}"
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
        concat!("UPDATE runs SET heartbeat_at = {now} WHERE ", guarded!(), " RETURNING id")
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

/// `d` in whole milliseconds, as statements take it.
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
