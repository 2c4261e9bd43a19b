//! Statement 1, the claim: which runs are claimable, the index that holds
//! them, and the claim statements (their SQL per backend is in
//! [`super::sqlite`] and [`super::postgres`]).

use std::time::Duration;

use crate::store::guard::ms;
use crate::store::{Claimed, Lease, Run, Store, StoreError, dialect_sql};

/// A run is claimable (docs/design.md, "How claims work") when it is open (`queued`,
/// `waiting_takeover`, `waiting_input` with its input delivered) or
/// `running`, has attempts left, and its *eligible time* has passed:
/// `not_before` for an open run, just after `lease_expires_at` for a running
/// one. One partial expression index, `runs_claim (eligible_at!(), id)` with
/// `claimable!()` as its predicate, serves the whole claim as one range scan:
/// finished and waiting runs are not in it, in-flight runs sort after `now`,
/// and expired leases and open runs come out in the order they became
/// eligible, so neither can starve the other.
///
/// Queries that should use the index repeat these texts verbatim (both
/// planners match partial-index predicates and index expressions by text).
/// So does PostgreSQL's `leasehold_claimable` (migration 0004), written
/// out in SQL; the claim plan tests fail if it stops matching the index.
#[doc(hidden)]
#[macro_export]
macro_rules! claimable {
    () => {
        "(status IN ('queued','waiting_takeover','running') \
          OR (status = 'waiting_input' AND pending_input IS NOT NULL))"
    };
}

/// See [`claimable!`]. `+ 1` makes `eligible <= now` mean
/// `lease_expires_at < now` for a running run.
#[doc(hidden)]
#[macro_export]
macro_rules! eligible_at {
    () => {
        "(CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END)"
    };
}

/// The runs in the rows a claim returned, leased to `owner`.
pub(crate) fn claimed_rows(rows: &[sqlx::any::AnyRow], owner: &str) -> Result<Vec<Claimed>, StoreError> {
    rows.iter()
        .map(|row| {
            let run = Run::from_row(row)?;
            let lease = Lease { run_id: run.id, owner: owner.to_string(), fence: run.fence };
            Ok(Claimed { run, lease })
        })
        .collect()
}

impl Store {
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
}

/// The bench baseline statement for `store`'s backend and a batch size (see
/// [`Dialect::baseline_claim`]).
#[doc(hidden)]
pub fn baseline_sql(store: &Store, batch: i64) -> &'static str {
    if batch == 1 {
        dialect_sql!(store, baseline_claim_one)
    } else {
        dialect_sql!(store, baseline_claim)
    }
}

/// The claim statement for `store`'s backend and a batch size, for plan
/// tests and operators who want to `EXPLAIN` it.
#[doc(hidden)]
pub fn claim_sql(store: &Store, batch: i64) -> &'static str {
    if batch == 1 {
        dialect_sql!(store, claim_one)
    } else {
        dialect_sql!(store, claim)
    }
}
