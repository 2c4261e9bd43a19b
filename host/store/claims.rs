//! Statement 1, the claim: which runs are claimable, the index that holds
//! them, and the claim statements (their SQL per backend is in
//! [`super::sqlite`] and [`super::postgres`]).

use std::time::Duration;

use crate::store::guard::ms;
use crate::store::{Backend, Claimed, Lease, Run, Store, StoreError, concurrency, dialect_sql, group};

/// A run is claimable (docs/design.md, "How claims work") when it is open (`queued`,
/// `waiting_takeover`, `waiting_input` with its input delivered) or
/// `running`, has attempts left, and its *eligible time* has passed:
/// `not_before` for an open run, just after `lease_expires_at` for a running
/// one. One partial expression index, `runs_claim (priority DESC,
/// eligible_at!(), id)` with `claimable!()` as its predicate, serves the
/// claim as one range scan per priority that claimable runs hold, highest
/// first: finished and waiting runs are not in it, in-flight runs sort
/// after `now`, and within a priority expired leases and open runs come
/// out in the order they became eligible, so neither can starve the other.
///
/// Queries that should use the index repeat these texts verbatim (both
/// planners match partial-index predicates and index expressions by text).
/// So does PostgreSQL's `leasehold_claimable` (migrations 0004 and 0012), written
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

/// The runs in the rows a claim returned, leased to `owner`; each counted
/// an attempt unless the row says `charged` is false.
pub(crate) fn claimed_rows(rows: &[sqlx::any::AnyRow], owner: &str) -> Result<Vec<Claimed>, StoreError> {
    rows.iter()
        .map(|row| {
            let run = Run::from_row(row)?;
            let lease = Lease { run_id: run.id, owner: owner.to_string(), fence: run.fence };
            Ok(Claimed { run, lease, charged: charged(row) })
        })
        .collect()
}

/// A claimed row's `charged` column (PostgreSQL's claims return it); true
/// where there is none.
fn charged(row: &sqlx::any::AnyRow) -> bool {
    use sqlx::Row;
    match row.try_get::<bool, _>("charged") {
        Ok(b) => b,
        Err(_) => row.try_get::<i64, _>("charged").map_or(true, |n| n != 0),
    }
}

impl Store {
    /// Statement 1: claims one run, if any is claimable.
    pub async fn claim(&self, owner: &str, ttl: Duration) -> Result<Option<Claimed>, StoreError> {
        Ok(self.claim_batch(owner, ttl, 1).await?.pop())
    }

    /// Statement 1, batched: claims up to `max` runs in one statement,
    /// highest priority first, then in the order they became eligible. A run is claimable when it is open (`queued`,
    /// `waiting_takeover`, or `waiting_input` with its input delivered) or
    /// `running` with an expired lease, has attempts left, and its
    /// `not_before` has passed. Each claimed run gets `fence + 1`,
    /// `attempt + 1` and a lease of `ttl` from the database's now.
    ///
    /// On SQLite, which has one writer, claims made while another is being
    /// written wait and go together, one transaction and one commit for
    /// the lot ([`Store::claim_batch_sqlite`]); a claim on a quiet host
    /// goes at once.
    pub async fn claim_batch(&self, owner: &str, ttl: Duration, max: i64) -> Result<Vec<Claimed>, StoreError> {
        self.claim_batch_charging(owner, ttl, max, max).await
    }

    /// [`Store::claim_batch`], counting an attempt for at most `charged` of
    /// the runs (those whose guest starts at once); the others are for a
    /// local queue, and their segments count it when they start (see
    /// [`Claimed::charged`]). Each run says which it is.
    pub async fn claim_batch_charging(&self, owner: &str, ttl: Duration, max: i64, charged: i64) -> Result<Vec<Claimed>, StoreError> {
        let (max, charged) = (max.max(1), charged.clamp(0, max.max(1)));
        if self.backend() == Backend::Sqlite {
            let want = Claim { owner: owner.to_string(), ttl, max, charged };
            return self
                .claims
                .push(want, WRITERS, || {
                    tokio::spawn(group::write_batches::<Claim>(self.clone()));
                })
                .await;
        }
        let token = crate::store::orphans::token();
        let claimed = self.retry(|| self.claim_on(self.writer(), owner, ttl, max, charged, token)).await;
        if let Err(e) = &claimed {
            self.hand_back_lost_claims(owner, token, ttl, e).await;
        }
        claimed
    }

    /// The claim statement for up to `max` runs on `conn` (a pool, or a
    /// batch's transaction): the runs claimed for `owner`, oldest id first,
    /// at most `charged` of them counting an attempt (PostgreSQL; SQLite's
    /// statement counts one for every run, and its uncharged claims go
    /// through [`super::sqlite::CLAIM_SLOTS`]). PostgreSQL writes `token`
    /// on the runs it claims (see [`super::orphans`]).
    pub(crate) async fn claim_on<'c, E>(
        &self,
        conn: E,
        owner: &str,
        ttl: Duration,
        max: i64,
        charged: i64,
        token: i64,
    ) -> Result<Vec<Claimed>, StoreError>
    where
        E: sqlx::Executor<'c, Database = sqlx::Any>,
    {
        let query = sqlx::query(crate::store::claim_sql(self, max)).bind(owner).bind(ms(ttl)).bind(max);
        let query = match self.backend() {
            Backend::Postgres => query.bind(charged).bind(token),
            Backend::Sqlite => query,
        };
        let rows = query.fetch_all(conn).await?;
        if self.backend() == Backend::Postgres {
            self.faults().after_claim()?;
        }
        let mut claimed = claimed_rows(&rows, owner)?;
        claimed.sort_by_key(|c| c.run.id);
        Ok(claimed)
    }

    /// SQLite: claims up to `max` runs for `owner` inside `conn`'s
    /// transaction: with the one claim statement, which claims nothing
    /// while a concurrency key takes turns, and then through the turns.
    /// Every run counts an attempt.
    pub(crate) async fn claim_sqlite(&self, conn: &mut sqlx::AnyConnection, owner: &str, ttl: Duration, max: i64) -> Result<Vec<Claimed>, StoreError> {
        let claimed = self.claim_on(&mut *conn, owner, ttl, max, max, 0).await?;
        if !claimed.is_empty() {
            return Ok(claimed);
        }
        self.claim_turns_sqlite(conn, owner, ttl, max).await
    }

    /// SQLite: claims up to `max` runs for `owner` through the keys' turns
    /// ([`concurrency::claim_lanes_sqlite`], whose first statement writes)
    /// inside `conn`'s transaction; none while no key takes turns.
    async fn claim_turns_sqlite(&self, conn: &mut sqlx::AnyConnection, owner: &str, ttl: Duration, max: i64) -> Result<Vec<Claimed>, StoreError> {
        let ids = match concurrency::claim_lanes_sqlite(self, conn, max).await? {
            Some(ids) if !ids.is_empty() => ids,
            _ => return Ok(Vec::new()),
        };
        let rows = sqlx::query(crate::store::sql!(self, super::sqlite::CLAIM_OF))
            .bind(owner)
            .bind(ms(ttl))
            .bind(serde_json::json!(ids).to_string())
            .fetch_all(&mut *conn)
            .await?;
        let mut claimed = claimed_rows(&rows, owner)?;
        claimed.sort_by_key(|c| c.run.id);
        Ok(claimed)
    }

    /// SQLite: a batch of claims in one statement and one commit (one
    /// fsync under `synchronous=FULL`). Claims of one owner take their runs
    /// from one claim statement; a batch with several owners gives every
    /// wanted run a slot `[owner, ttl]` and leases each run it claims to
    /// its slot's owner ([`super::sqlite::CLAIM_SLOTS`]). Each claim then
    /// takes its own owner's runs, in queue order, oldest run first (a
    /// batch holds one lease length per owner: `Claim`'s `take`).
    async fn claim_batch_sqlite(&self, claims: &[Claim]) -> Result<Vec<Result<Vec<Claimed>, StoreError>>, StoreError> {
        let first = &claims[0];
        let all_charged = claims.iter().all(|c| c.charged == c.max);
        if all_charged && claims.iter().all(|c| c.owner == first.owner) {
            let total: i64 = claims.iter().map(|c| c.max).sum();
            // One statement while no key takes turns; else the turns, in
            // a transaction.
            let mut claimed = self.retry(|| self.claim_on(self.writer(), &first.owner, first.ttl, total, total, 0)).await?;
            if claimed.is_empty() {
                claimed = self
                    .retry(|| async {
                        let mut tx = self.writer().begin().await?;
                        let claimed = self.claim_turns_sqlite(&mut tx, &first.owner, first.ttl, total).await?;
                        tx.commit().await?;
                        Ok(claimed)
                    })
                    .await?;
            }
            return Ok(deal(claims, claimed));
        }
        // A slot per wanted run: the runs that count an attempt first, then
        // (in the same transaction, so one commit) those for local queues.
        let slots = |charged: bool| -> Vec<serde_json::Value> {
            claims
                .iter()
                .flat_map(|c| {
                    let n = if charged { c.charged } else { c.max - c.charged };
                    std::iter::repeat_n(serde_json::json!([c.owner, ms(c.ttl)]), n as usize)
                })
                .collect()
        };
        let (charged, queued) = (slots(true), slots(false));
        let (charged_n, queued_n) = (charged.len() as i64, queued.len() as i64);
        let (charged, queued) = (serde_json::Value::Array(charged).to_string(), serde_json::Value::Array(queued).to_string());
        let (charged, queued) = (charged.as_str(), queued.as_str());
        let rows = self
            .retry(|| async move {
                let mut tx = self.writer().begin().await?;
                let mut rows = Vec::new();
                for (slots, n, charge) in [(charged, charged_n, 1_i64), (queued, queued_n, 0)] {
                    if n == 0 {
                        continue;
                    }
                    let mut claimed = sqlx::query(crate::store::sql!(self, super::sqlite::CLAIM_SLOTS))
                        .bind(slots)
                        .bind(n)
                        .bind(charge)
                        .fetch_all(&mut *tx)
                        .await?;
                    // None while a key takes turns: the claim goes through them.
                    if claimed.is_empty()
                        && let Some(ids) = concurrency::claim_lanes_sqlite(self, &mut tx, n).await?
                    {
                        claimed = sqlx::query(crate::store::sql!(self, super::sqlite::CLAIM_SLOTS_OF))
                            .bind(slots)
                            .bind(serde_json::json!(ids).to_string())
                            .bind(charge)
                            .fetch_all(&mut *tx)
                            .await?;
                    }
                    rows.extend(claimed.into_iter().map(|row| (row, charge == 1)));
                }
                tx.commit().await?;
                Ok(rows)
            })
            .await?;
        let mut claimed = Vec::with_capacity(rows.len());
        for (row, charged) in &rows {
            let run = Run::from_row(row)?;
            let owner = run.lease_owner.clone().ok_or_else(|| StoreError::Corrupt(format!("claimed run {} has no lease owner", run.id)))?;
            claimed.push(Claimed { lease: Lease { run_id: run.id, owner, fence: run.fence }, run, charged: *charged });
        }
        claimed.sort_by_key(|c| c.run.id);
        Ok(deal(claims, claimed))
    }
}

/// Deals `claimed` (oldest run first) to `claims` in queue order: each
/// claim takes up to its `charged` of the runs leased to its owner that
/// counted an attempt, and up to the rest of its `max` of those that did
/// not.
fn deal(claims: &[Claim], claimed: Vec<Claimed>) -> Vec<Result<Vec<Claimed>, StoreError>> {
    let mut left: Vec<Option<Claimed>> = claimed.into_iter().map(Some).collect();
    claims
        .iter()
        .map(|want| {
            let mut take = |charged: bool, n: i64| -> Vec<Claimed> {
                left.iter_mut()
                    .filter(|c| c.as_ref().is_some_and(|c| c.lease.owner == want.owner && c.charged == charged))
                    .take(n as usize)
                    .filter_map(Option::take)
                    .collect()
            };
            let mut mine = take(true, want.charged);
            mine.extend(take(false, want.max - want.charged));
            mine.sort_by_key(|c| c.run.id);
            Ok(mine)
        })
        .collect()
}

/// Most claims written by one SQLite transaction.
pub(crate) const MAX_BATCH: usize = 64;

/// Batches in flight at once: one (SQLite has one writer).
pub(crate) const WRITERS: usize = 1;

/// One claim waiting to be group-committed (SQLite).
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    owner: String,
    ttl: Duration,
    max: i64,
    /// How many of `max` count an attempt (see [`Claimed::charged`]).
    charged: i64,
}

/// SQLite claims waiting to be group-committed.
pub(crate) type Queue = group::Queue<Claim, Vec<Claimed>>;

impl group::Batched for Claim {
    type Out = Vec<Claimed>;
    const WHAT: &'static str = "claims";

    fn queue(store: &Store) -> &std::sync::Arc<Queue> {
        &store.claims
    }

    /// One lease length per owner in a batch (a host's claims all share
    /// one): a claimed run then belongs to its owner's claims, whatever
    /// lease it got. A claim with another length waits for the next batch.
    fn take(store: &Store) -> Vec<(Claim, group::Reply<Vec<Claimed>>)> {
        let mut ttls: std::collections::HashMap<String, Duration> = Default::default();
        store.claims.take(MAX_BATCH, |c| *ttls.entry(c.owner.clone()).or_insert(c.ttl) == c.ttl)
    }

    async fn write(store: &Store, claims: &[Claim]) -> Result<Vec<Result<Vec<Claimed>, StoreError>>, StoreError> {
        store.claim_batch_sqlite(claims).await
    }

    fn written(store: &Store, n: usize) {
        store.claims.count(n);
    }

    fn answer(&self, store: &Store, reply: group::Reply<Vec<Claimed>>, result: Result<Vec<Claimed>, StoreError>) {
        if let Err(Ok(orphans)) = reply.send(result) {
            // Its caller stopped waiting: nobody here runs these runs, so
            // they go back unstarted.
            if !orphans.is_empty() {
                tracing::warn!(runs = orphans.len(), "a claimer stopped before taking its runs; giving them back");
                crate::store::orphans::give_back_orphans(store, orphans);
            }
        }
    }}

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
