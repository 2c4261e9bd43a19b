//! Runs taken by a claim whose reply was lost (PostgreSQL).
//!
//! A claim, or a close that claims the next run, is one statement that
//! commits on the server. When its session breaks after the commit (the
//! server restarted, the network cut, the backend killed), the host gets
//! an error, and the runs the statement leased to it belong to nobody here:
//! left alone they would wait out their leases (30 s by default) and then
//! cost each an attempt, so a run with `max_attempts: 1` would be aborted
//! without ever running. A close batch claims up to 64; the dispatcher's
//! claim for the local queue up to four times the workers.
//!
//! So every claim statement writes a token of its own on the runs it
//! leases (`claim_token`: the token where it counted an attempt, its
//! negation where the run was for a local queue and did not), and a claim
//! whose outcome is unknown hands back whatever carries its token, as
//! [`Store::give_back`] would: `waiting_takeover`, claimable by any host at
//! once, the attempt returned. When the statement never committed, nothing
//! carries the token and nothing changes. The hand-back is made again a
//! little later ([`AGAIN_AFTER`]): a statement whose connection broke while
//! it ran may still commit on the server after the host has looked.
//!
//! SQLite's claims run in-process and roll back when they fail: they need
//! none of this.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::store::{Backend, Claimed, Store, StoreError, sql};

/// How long after a lost claim its hand-back is made again: 5 s, longer
/// than a claim statement runs even behind `lock_timeout` (2 s).
pub(crate) const AGAIN_AFTER: Duration = Duration::from_secs(5);

/// A new claim statement's token: random and positive, so its negation
/// marks the runs it did not charge.
pub(crate) fn token() -> i64 {
    (rand::random::<u64>() >> 2) as i64 + 1
}

impl Store {
    /// After a claim statement of `owner` with `token` failed with its
    /// outcome unknown (`e`): hands back the runs it may have claimed, now
    /// and again after [`AGAIN_AFTER`], each attempt bounded by `ttl` (after
    /// which their leases have run out anyway). Never fails: what it could
    /// not do is logged, and those runs wait out their leases.
    pub(crate) async fn hand_back_lost_claims(&self, owner: &str, token: i64, ttl: Duration, e: &StoreError) {
        if self.backend() != Backend::Postgres || !crate::store::group::session_lost(e) {
            return;
        }
        tracing::warn!(error = %e, owner, "a claim's reply was lost; handing back the runs it may have taken");
        self.hand_back_claims_within(owner, token, ttl).await;
        let (store, owner) = (self.clone(), owner.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(AGAIN_AFTER).await;
            store.hand_back_claims_within(&owner, token, ttl).await;
        });
    }

    /// [`Store::hand_back_claims`], retried while the database is out of
    /// reach, for at most `ttl`.
    async fn hand_back_claims_within(&self, owner: &str, token: i64, ttl: Duration) {
        let deadline = tokio::time::Instant::now() + ttl;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.hand_back_claims(owner, token).await {
                Ok(_) => return,
                Err(e) if tokio::time::Instant::now() + pause < deadline => {
                    tracing::debug!(error = %e, "handing back a lost claim's runs failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    tracing::warn!(error = %e, owner, "could not hand back a lost claim's runs; they are claimable again when their leases expire");
                    return;
                }
            }
        }
    }

    /// Hands back the runs still leased to `owner` by the claim statement
    /// with `token`, returning the attempt it counted where it counted one.
    /// Reads only the in-flight part of the claim index (running runs whose
    /// lease has not run out). Returns how many it handed back.
    ///
    /// Guarded by (owner, token) rather than (owner, fence): the token is
    /// one statement's, so a run since claimed again (by this host or any
    /// other) or closed no longer carries it and is left alone.
    #[doc(hidden)]
    pub async fn hand_back_claims(&self, owner: &str, token: i64) -> Result<u64, StoreError> {
        let n = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    concat!(
                        "UPDATE runs SET status = 'waiting_takeover', lease_owner = NULL, lease_expires_at = NULL, \
                         attempt = CASE WHEN claim_token = $2 AND attempt > 0 THEN attempt - 1 ELSE attempt END, \
                         claim_token = NULL, updated_at = {now} \
                         WHERE ",
                        crate::claimable!(),
                        " AND ",
                        crate::eligible_at!(),
                        " > {now} AND status = 'running' AND lease_owner = $1 AND claim_token IN ($2, -$2::bigint)"
                    )
                ))
                .bind(owner)
                .bind(token)
                .execute(self.writer())
                .await?
                .rows_affected())
            })
            .await?;
        if n > 0 {
            crate::metrics::global().orphans_handed_back.fetch_add(n, Relaxed);
            tracing::warn!(runs = n, owner, "handed back the runs a claim with a lost reply had taken");
            self.signal_work(true).await;
        }
        Ok(n)
    }
}

/// Gives back, in a task of their own, runs claimed for a caller that
/// stopped waiting for them: claimable by any host at once, their attempt
/// returned. One that cannot be given back waits out its lease.
pub(crate) fn give_back_orphans(store: &Store, orphans: Vec<Claimed>) {
    let store = store.clone();
    tokio::spawn(async move {
        for c in orphans {
            if let Err(e) = store.give_back(&c.lease, c.charged).await {
                tracing::warn!(run_id = c.run.id, error = %e, "could not give back an orphaned claim; it is claimable again when its lease expires");
            }
        }
    });
}
