//! Token budgets shared by a run's tree (docs/concepts.md, "Budgets").
//!
//! A root run may carry a budget (`budget_tokens`); its children, theirs
//! and so on draw from it. What the tree has spent is never a counter: it
//! is the sum of `usage.total_tokens` over the tree's committed
//! `model.chat` rows, so a replayed call (its row already committed) costs
//! nothing and a resumed run is never granted a fresh budget. A call about
//! to go out first holds its estimate (the request's `max_tokens` and its
//! prompt, see `effects::rate::reserve`) in `budget_holds`, under the
//! root's row lock, so calls at once on several hosts cannot together go
//! past the budget; a hold counts while its call has no outcome and its
//! run is open. A call that would go past it is not made: the run waits
//! (`queued`, `waiting_for = 'budget'`) until the budget is raised.

use serde::Serialize;
use sqlx::Row;

use crate::store::guard::{guard, rejected};
use crate::store::log::{self, kind};
use crate::store::{Backend, FOREVER, Lease, RunStatus, Store, StoreError, sql};

/// A tree's budget as it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Budget {
    /// The tree's root, which carries the budget.
    pub root_id: i64,
    /// Tokens the tree may use; `None`: no budget.
    pub tokens: Option<i64>,
    /// Tokens its committed `model.chat` calls report having used.
    pub spent: i64,
    /// Tokens held by its calls in flight.
    pub held: i64,
}

/// What a hold found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// The tree has no budget: nothing held.
    Unlimited,
    /// Held (or held already, for a re-issued call).
    Held,
    /// The call would go past the budget: nothing held.
    Over { spent: i64, held: i64, limit: i64 },
}

/// The tree spend of root `$1`, per backend: usage over its committed
/// `model.chat` rows.
fn spent_sql(store: &Store) -> &'static str {
    match store.backend() {
        Backend::Sqlite => sql!(
            store,
            "SELECT COALESCE(SUM(json_extract(e.result, '$.usage.total_tokens')), 0) FROM effects e \
             WHERE e.run_id IN (SELECT id FROM runs WHERE id = $1 UNION ALL SELECT id FROM runs WHERE root_id = $1) \
             AND e.name = 'model.chat' AND e.state = 'committed'"
        ),
        Backend::Postgres => sql!(
            store,
            "SELECT COALESCE(SUM((e.result::jsonb -> 'usage' ->> 'total_tokens')::bigint), 0)::bigint FROM effects e \
             WHERE e.run_id IN (SELECT id FROM runs WHERE id = $1 UNION ALL SELECT id FROM runs WHERE root_id = $1) \
             AND e.name = 'model.chat' AND e.state = 'committed'"
        ),
    }
}

/// Tokens held for root `$1` by calls with no outcome yet, of open runs.
const HELD: &str = "SELECT CAST(COALESCE(SUM(h.tokens), 0) AS BIGINT) FROM budget_holds h JOIN runs r ON r.id = h.run_id \
     LEFT JOIN effects e ON e.run_id = h.run_id AND e.seq = h.seq \
     WHERE h.root_id = $1 AND r.status NOT IN ('completed','failed','aborted','cancelled') \
     AND (e.state IS NULL OR e.state IN ('started','in_doubt'))";

impl Store {
    async fn budget_on(&self, conn: &mut sqlx::AnyConnection, root: i64, tokens: Option<i64>) -> Result<Budget, StoreError> {
        let spent: i64 = sqlx::query_scalar(spent_sql(self)).bind(root).fetch_one(&mut *conn).await?;
        let held: i64 = sqlx::query_scalar(sql!(self, HELD)).bind(root).fetch_one(&mut *conn).await?;
        Ok(Budget { root_id: root, tokens, spent, held })
    }

    /// The budget of the tree run `run_id` belongs to.
    pub async fn budget(&self, run_id: i64) -> Result<Budget, StoreError> {
        let mut conn = self.pool().acquire().await?;
        let row = sqlx::query(sql!(
            self,
            "SELECT r.id, r.budget_tokens FROM runs r WHERE r.id = (SELECT COALESCE(root_id, id) FROM runs WHERE id = $1)"
        ))
        .bind(run_id)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or(StoreError::RunNotFound(run_id))?;
        self.budget_on(&mut *conn, row.try_get("id")?, row.try_get("budget_tokens")?).await
    }

    /// Holds `tokens` of its tree's budget for call `seq` of the run
    /// `lease` holds, under (owner, fence) and the root's row lock.
    pub async fn hold_budget(&self, lease: &Lease, seq: i64, tokens: i64) -> Result<Hold, StoreError> {
        self.retry(|| async {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let root: i64 = sqlx::query_scalar(sql!(self, "SELECT COALESCE(root_id, id) FROM runs WHERE id = $1"))
                .bind(lease.run_id)
                .fetch_one(&mut *tx)
                .await?;
            let locked = match self.backend() {
                Backend::Sqlite => sql!(self, "SELECT budget_tokens FROM runs WHERE id = $1"),
                Backend::Postgres => sql!(self, "SELECT budget_tokens FROM runs WHERE id = $1 FOR UPDATE"),
            };
            let limit: Option<i64> = sqlx::query_scalar(locked).bind(root).fetch_one(&mut *tx).await?;
            let Some(limit) = limit else { return Ok(Hold::Unlimited) };
            let already: Option<i64> = sqlx::query_scalar(sql!(self, "SELECT tokens FROM budget_holds WHERE run_id = $1 AND seq = $2"))
                .bind(lease.run_id)
                .bind(seq)
                .fetch_optional(&mut *tx)
                .await?;
            if already.is_some() {
                return Ok(Hold::Held);
            }
            let b = self.budget_on(&mut *tx, root, Some(limit)).await?;
            if b.spent + b.held + tokens > limit {
                return Ok(Hold::Over { spent: b.spent, held: b.held, limit });
            }
            sqlx::query(sql!(
                self,
                "INSERT INTO budget_holds (run_id, seq, root_id, tokens, created_at) VALUES ($1, $2, $3, $4, {now})"
            ))
            .bind(lease.run_id)
            .bind(seq)
            .bind(root)
            .bind(tokens)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(Hold::Held)
        })
        .await
    }

    /// After a held call's row settles: drops its hold (it no longer
    /// counts anyway) and makes the tree's runs waiting for budget due, so
    /// they look again at what the call left. Best effort.
    pub async fn release_budget(&self, run_id: i64, seq: i64) -> Result<(), StoreError> {
        let woken = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let root: Option<i64> =
                    sqlx::query_scalar(sql!(self, "DELETE FROM budget_holds WHERE run_id = $1 AND seq = $2 RETURNING root_id"))
                        .bind(run_id)
                        .bind(seq)
                        .fetch_optional(&mut *tx)
                        .await?;
                let woken = match root {
                    Some(root) => wake_waiting(self, &mut tx, root).await?,
                    None => 0,
                };
                tx.commit().await?;
                Ok(woken)
            })
            .await?;
        if woken > 0 {
            self.signal_work(true).await;
        }
        Ok(())
    }

    /// Statement 5 for a call that would overspend: the run waits for its
    /// tree's budget to be raised (`queued`, `waiting_for = 'budget'`).
    pub(crate) async fn suspend_for_budget(&self, lease: &Lease) -> Result<RunStatus, StoreError> {
        let thread = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let thread_id: String = sqlx::query_scalar(sql!(
                    self,
                    "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, not_before = $4, \
                     waiting_for = 'budget', attempt = 0, updated_at = {now} \
                     WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' RETURNING thread_id"
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(FOREVER)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or_else(|| rejected(lease))?;
                let payload = serde_json::json!({ "status": RunStatus::Queued, "waiting_for": "budget", "not_before": FOREVER });
                log::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::SUSPENDED, &payload).await?;
                tx.commit().await?;
                Ok(thread_id)
            })
            .await?;
        self.hub().wake(&thread);
        Ok(RunStatus::Queued)
    }

    /// Sets the budget of the tree run `run_id` belongs to (on its root;
    /// `None` removes it) and makes the tree's runs waiting for budget
    /// due, so each looks again. Returns the budget as it now stands.
    pub async fn set_budget(&self, run_id: i64, tokens: Option<i64>) -> Result<Budget, StoreError> {
        if tokens.is_some_and(|t| t < 0) {
            return Err(StoreError::Config("a budget is 0 tokens or more".into()));
        }
        let (budget, woken) = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let root: i64 = sqlx::query_scalar(sql!(
                    self,
                    "UPDATE runs SET budget_tokens = $2 WHERE id = (SELECT COALESCE(root_id, id) FROM runs WHERE id = $1) RETURNING id"
                ))
                .bind(run_id)
                .bind(tokens)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(StoreError::RunNotFound(run_id))?;
                let woken = wake_waiting(self, &mut tx, root).await?;
                let budget = self.budget_on(&mut *tx, root, tokens).await?;
                tx.commit().await?;
                Ok((budget, woken))
            })
            .await?;
        if woken > 0 {
            self.signal_work(true).await;
        }
        Ok(budget)
    }
}

/// Makes the runs of root `root`'s tree that wait for budget due.
async fn wake_waiting(store: &Store, conn: &mut sqlx::AnyConnection, root: i64) -> Result<u64, StoreError> {
    Ok(sqlx::query(sql!(
        store,
        "UPDATE runs SET not_before = {now}, waiting_for = NULL, updated_at = {now} \
         WHERE (id = $1 OR root_id = $1) AND status = 'queued' AND waiting_for = 'budget'"
    ))
    .bind(root)
    .execute(&mut *conn)
    .await?
    .rows_affected())
}
