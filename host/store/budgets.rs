//! Budgets shared by a run's tree, in tokens and in US dollars
//! (docs/concepts.md, "Budgets").
//!
//! A root run may carry a budget (`budget_tokens`, `budget_usd_nanos`); its
//! children, theirs and so on draw from it. A parent may give a child a
//! share (the child's own budget columns), which its subtree may not pass
//! either. What the tree has spent is never a counter: it is the sum of
//! `usage.total_tokens` and of `cost_usd_nanos` (recorded at the price of
//! the moment, `effects::prices`) over the tree's committed `model.chat`
//! rows, so a replayed call (its row already committed) costs nothing and a
//! resumed run is never granted a fresh budget. A call about to go out
//! first holds its estimate (the request's `max_tokens` and its prompt, see
//! `effects::rate::reserve`, and their price) in `budget_holds`, under the
//! root's row lock, so calls at once on several hosts cannot together go
//! past the budget; a hold counts while its call has no outcome and its run
//! is open. A call that would go past it is not made: the run waits
//! (`queued`, `waiting_for = 'budget'`) until the budget is raised. A call
//! to a model with no price, under a budget in dollars, is denied: its
//! cost could not be told.

use serde::Serialize;
use sqlx::Row;

use crate::store::guard::{guard, guarded, rejected};
use crate::store::log::{self, kind};
use crate::store::{Backend, FOREVER, Lease, RunStatus, Store, StoreError, sql};

/// Nano-dollars in a dollar.
const NANOS: f64 = 1e9;

/// A budget as it stands: a root's, for its whole tree, or the share a
/// parent gave a child, for the child's subtree.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Budget {
    /// The run that carries the budget (the tree's root, or a child given
    /// a share); it covers that run and every run below it.
    pub holder_id: i64,
    /// Tokens the subtree may use; `None`: no budget in tokens.
    pub tokens: Option<i64>,
    /// Tokens its committed `model.chat` calls report having used.
    pub spent: i64,
    /// Tokens held by its calls in flight.
    pub held: i64,
    /// US dollars the subtree may spend; `None`: no budget in dollars.
    pub usd: Option<f64>,
    /// Dollars its committed `model.chat` calls cost (priced calls only).
    pub spent_usd: f64,
    /// Dollars held by its calls in flight.
    pub held_usd: f64,
}

/// A budget's limits: either may be unset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BudgetLimits {
    pub tokens: Option<i64>,
    /// US dollars, in whole nano-dollars.
    pub usd_nanos: Option<i64>,
}

impl BudgetLimits {
    pub fn is_none(&self) -> bool {
        self.tokens.is_none() && self.usd_nanos.is_none()
    }
}

/// The most tokens one call may be charged: 2^53, so that sums stay exact.
pub const MAX_CALL_TOKENS: u64 = 1 << 53;

/// Checks a `model.chat` result written by hand (a resolve): its `usage`
/// counts, if given, are whole numbers from 0 to [`MAX_CALL_TOKENS`], and
/// its `cost_usd_nanos`, if given, one from 0 up. What a budget sums from
/// it must be; the host writes results that are (`effects::model`).
pub fn check_chat_result(result: &str) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_str(result).map_err(|e| format!("a model.chat result is a JSON object: {e}"))?;
    let count = |x: &serde_json::Value| x.as_u64().is_some_and(|n| n <= MAX_CALL_TOKENS);
    match &v["usage"] {
        serde_json::Value::Null => {}
        serde_json::Value::Object(usage) => {
            for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                if let Some(n) = usage.get(k)
                    && !count(n)
                {
                    return Err(format!("usage.{k} must be a whole number from 0 to {MAX_CALL_TOKENS}, not {n}"));
                }
            }
        }
        other => return Err(format!("usage must be an object, not {other}")),
    }
    match &v["cost_usd_nanos"] {
        serde_json::Value::Null => Ok(()),
        n if n.as_u64().is_some_and(|n| n <= i64::MAX as u64 / 2) => Ok(()),
        n => Err(format!("cost_usd_nanos must be a whole number from 0 up, not {n}")),
    }
}

/// Dollars as whole nano-dollars, for a budget of 0 to a million dollars.
pub fn usd_to_nanos(usd: f64) -> Option<i64> {
    (usd.is_finite() && (0.0..=1e6).contains(&usd)).then(|| (usd * NANOS).round() as i64)
}

/// What a hold found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// The tree has no budget: nothing held.
    Unlimited,
    /// Held (or held already, for a re-issued call).
    Held,
    /// The call would go past the budget: nothing held. `unit` is
    /// `tokens` or `usd_nanos`.
    Over { holder: i64, unit: &'static str, spent: i64, held: i64, limit: i64 },
    /// A budget in dollars binds the run and its call's model has no
    /// price: nothing held.
    Unpriced { holder: i64 },
}

/// The runs of the subtree under `$1` (it included), as CTE `sub`.
macro_rules! subtree {
    () => {
        "WITH RECURSIVE sub(id) AS (SELECT CAST($1 AS BIGINT) UNION ALL SELECT r.id FROM runs r JOIN sub ON r.parent_id = sub.id) "
    };
}

/// The same for a root: its tree, through `runs_root`, with no walk.
macro_rules! tree {
    () => {
        "WITH sub(id) AS (SELECT CAST($1 AS BIGINT) UNION ALL SELECT id FROM runs WHERE root_id = $1) "
    };
}

/// What the subtree `sub` has spent (the usage, in tokens, and the cost,
/// in nano-dollars, over its committed `model.chat` rows, read through
/// `effects_chat`, not its whole ledger) and what its calls with no
/// outcome yet, of open runs, hold: one statement, so one snapshot. Read
/// in two, a sibling's call that settled between them was in neither (no
/// longer held, not yet spent).
macro_rules! spent_and_held {
    (sqlite, $sub:expr, $held:expr) => {
        concat!(
            $sub,
            "SELECT spent.t, spent.u, held.t, held.u FROM \
             (SELECT CAST(COALESCE(SUM(json_extract(e.result, '$.usage.total_tokens')), 0) AS INTEGER) AS t, \
             CAST(COALESCE(SUM(json_extract(e.result, '$.cost_usd_nanos')), 0) AS INTEGER) AS u FROM effects e INDEXED BY effects_chat \
             WHERE e.run_id IN (SELECT id FROM sub) AND e.name = 'model.chat' AND e.state = 'committed') AS spent, ",
            $held
        )
    };
    (postgres, $sub:expr, $held:expr) => {
        concat!(
            $sub,
            "SELECT spent.t, spent.u, held.t, held.u FROM \
             (SELECT COALESCE(SUM((e.result::jsonb -> 'usage' ->> 'total_tokens')::bigint), 0)::bigint AS t, \
             COALESCE(SUM((e.result::jsonb ->> 'cost_usd_nanos')::bigint), 0)::bigint AS u FROM effects e \
             WHERE e.run_id IN (SELECT id FROM sub) AND e.name = 'model.chat' AND e.state = 'committed') AS spent, ",
            $held
        )
    };
}

/// Tokens and nano-dollars held in `sub` by calls with no outcome yet, of
/// open runs; `tree`: a root's, through `budget_holds_root`.
macro_rules! held {
    (sub) => {
        concat!(
            "(SELECT CAST(COALESCE(SUM(h.tokens), 0) AS BIGINT) AS t, CAST(COALESCE(SUM(h.usd_nanos), 0) AS BIGINT) AS u \
             FROM budget_holds h JOIN sub ON sub.id = h.run_id ",
            held!(rest)
        )
    };
    (tree) => {
        concat!(
            "(SELECT CAST(COALESCE(SUM(h.tokens), 0) AS BIGINT) AS t, CAST(COALESCE(SUM(h.usd_nanos), 0) AS BIGINT) AS u \
             FROM budget_holds h ",
            held!(rest),
            " AND h.root_id = $1"
        )
    };
    (rest) => {
        "JOIN runs r ON r.id = h.run_id LEFT JOIN effects e ON e.run_id = h.run_id AND e.seq = h.seq \
         WHERE r.status NOT IN ('completed','failed','aborted','cancelled') \
         AND (e.state IS NULL OR e.state IN ('started','in_doubt'))"
    };
}

/// [`spent_and_held!`] for the subtree under `$1`: a root's tree (`root`),
/// or a child's subtree, walked.
fn sums_sql(store: &Store, root: bool) -> &'static str {
    match (store.backend(), root) {
        (Backend::Sqlite, true) => sql!(store, spent_and_held!(sqlite, tree!(), concat!(held!(tree), ") AS held"))),
        (Backend::Sqlite, false) => sql!(store, spent_and_held!(sqlite, subtree!(), concat!(held!(sub), ") AS held"))),
        (Backend::Postgres, true) => sql!(store, spent_and_held!(postgres, tree!(), concat!(held!(tree), ") AS held"))),
        (Backend::Postgres, false) => sql!(store, spent_and_held!(postgres, subtree!(), concat!(held!(sub), ") AS held"))),
    }
}

/// The runs from `$1` up to its root that carry a budget, root first.
const HOLDERS: &str = "WITH RECURSIVE up(id, parent_id, budget_tokens, budget_usd_nanos) AS \
     (SELECT id, parent_id, budget_tokens, budget_usd_nanos FROM runs WHERE id = $1 \
     UNION ALL SELECT r.id, r.parent_id, r.budget_tokens, r.budget_usd_nanos FROM runs r JOIN up ON r.id = up.parent_id) \
     SELECT id, parent_id, budget_tokens, budget_usd_nanos FROM up \
     WHERE budget_tokens IS NOT NULL OR budget_usd_nanos IS NOT NULL ORDER BY id";

/// Spent or held, in both units.
#[derive(Debug, Clone, Copy)]
struct Sums {
    tokens: i64,
    usd_nanos: i64,
}

impl Store {
    /// [`sums_sql`] for a root (for the suite's plan checks).
    #[doc(hidden)]
    pub fn spend_sql(&self) -> &'static str {
        sums_sql(self, true)
    }

    /// What `holder`'s subtree has spent and holds; `root`: it is a root,
    /// so its tree is read through `runs_root` with no walk.
    async fn sums(&self, conn: &mut sqlx::AnyConnection, holder: i64, root: bool) -> Result<(Sums, Sums), StoreError> {
        let r = sqlx::query(sums_sql(self, root)).bind(holder).fetch_one(&mut *conn).await?;
        Ok((Sums { tokens: r.try_get(0)?, usd_nanos: r.try_get(1)? }, Sums { tokens: r.try_get(2)?, usd_nanos: r.try_get(3)? }))
    }

    /// Whether a call of `tokens` and `usd_nanos` (`None`: its model has no
    /// price) fits every budget over run `run_id`, each read under its
    /// holder's row lock (PostgreSQL), root first: [`Hold::Held`] if it
    /// fits (nothing is held here), else why not.
    async fn fits(&self, conn: &mut sqlx::AnyConnection, run_id: i64, tokens: i64, usd_nanos: Option<i64>, lock: bool) -> Result<Hold, StoreError> {
        let holders = sqlx::query(sql!(self, HOLDERS)).bind(run_id).fetch_all(&mut *conn).await?;
        if holders.is_empty() {
            return Ok(Hold::Unlimited);
        }
        for h in &holders {
            let holder: i64 = h.try_get("id")?;
            let root = h.try_get::<Option<i64>, _>("parent_id")?.is_none();
            let read = match (self.backend(), lock) {
                (Backend::Postgres, true) => sql!(self, "SELECT budget_tokens, budget_usd_nanos FROM runs WHERE id = $1 FOR UPDATE"),
                _ => sql!(self, "SELECT budget_tokens, budget_usd_nanos FROM runs WHERE id = $1"),
            };
            let limits = limits_of(&sqlx::query(read).bind(holder).fetch_one(&mut *conn).await?)?;
            if limits.is_none() {
                continue;
            }
            let (spent, held) = self.sums(&mut *conn, holder, root).await?;
            // Checked: an overflow is over any budget.
            let over = |spent: i64, held: i64, more: i64, limit: i64| spent.checked_add(held).and_then(|s| s.checked_add(more)).is_none_or(|s| s > limit);
            if let Some(limit) = limits.tokens
                && over(spent.tokens, held.tokens, tokens, limit)
            {
                return Ok(Hold::Over { holder, unit: "tokens", spent: spent.tokens, held: held.tokens, limit });
            }
            if let Some(limit) = limits.usd_nanos {
                let Some(usd) = usd_nanos else { return Ok(Hold::Unpriced { holder }) };
                if over(spent.usd_nanos, held.usd_nanos, usd, limit) {
                    return Ok(Hold::Over { holder, unit: "usd_nanos", spent: spent.usd_nanos, held: held.usd_nanos, limit });
                }
            }
        }
        Ok(Hold::Held)
    }

    async fn budget_on(&self, conn: &mut sqlx::AnyConnection, holder: i64, limits: BudgetLimits) -> Result<Budget, StoreError> {
        let (spent, held) = self.sums(&mut *conn, holder, false).await?;
        Ok(Budget {
            holder_id: holder,
            tokens: limits.tokens,
            spent: spent.tokens,
            held: held.tokens,
            usd: limits.usd_nanos.map(|n| n as f64 / NANOS),
            spent_usd: spent.usd_nanos as f64 / NANOS,
            held_usd: held.usd_nanos as f64 / NANOS,
        })
    }

    /// The budget that binds run `run_id` most closely: its own share, its
    /// nearest ancestor's, or its root's (with no limits if the root has
    /// none either).
    async fn nearest(&self, conn: &mut sqlx::AnyConnection, run_id: i64) -> Result<(i64, BudgetLimits), StoreError> {
        let holders = sqlx::query(sql!(self, HOLDERS)).bind(run_id).fetch_all(&mut *conn).await?;
        if let Some(last) = holders.last() {
            return Ok((last.try_get("id")?, limits_of(last)?));
        }
        let root: Option<i64> = sqlx::query_scalar(sql!(self, "SELECT COALESCE(root_id, id) FROM runs WHERE id = $1"))
            .bind(run_id)
            .fetch_optional(&mut *conn)
            .await?;
        Ok((root.ok_or(StoreError::RunNotFound(run_id))?, BudgetLimits::default()))
    }

    /// Whether any budget binds run `run_id` (its own, or an ancestor's).
    pub(crate) async fn budgeted(&self, run_id: i64) -> Result<bool, StoreError> {
        let holders = sqlx::query(sql!(self, HOLDERS)).bind(run_id).fetch_all(self.pool()).await?;
        Ok(!holders.is_empty())
    }

    /// The budget that binds run `run_id` most closely (see
    /// [`Store::set_budget`]).
    pub async fn budget(&self, run_id: i64) -> Result<Budget, StoreError> {
        let mut conn = self.pool().acquire().await?;
        let (holder, limits) = self.nearest(&mut *conn, run_id).await?;
        self.budget_on(&mut *conn, holder, limits).await
    }

    /// Holds `tokens` and `usd_nanos` (`None`: the call's model has no
    /// price) for call `seq` of the run `lease` holds, under (owner,
    /// fence), against every budget over it (its root's and any share on
    /// the way), each under its holder's row lock, root first.
    pub async fn hold_budget(&self, lease: &Lease, seq: i64, tokens: i64, usd_nanos: Option<i64>) -> Result<Hold, StoreError> {
        self.retry(|| async {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let already: Option<i64> = sqlx::query_scalar(sql!(self, "SELECT tokens FROM budget_holds WHERE run_id = $1 AND seq = $2"))
                .bind(lease.run_id)
                .bind(seq)
                .fetch_optional(&mut *tx)
                .await?;
            if already.is_some() {
                return Ok(Hold::Held);
            }
            match self.fits(&mut tx, lease.run_id, tokens, usd_nanos, true).await? {
                Hold::Held => {}
                other => return Ok(other),
            }
            sqlx::query(sql!(
                self,
                "INSERT INTO budget_holds (run_id, seq, root_id, tokens, usd_nanos, created_at) \
                 SELECT id, $2, COALESCE(root_id, id), $3, $4, {now} FROM runs WHERE id = $1"
            ))
            .bind(lease.run_id)
            .bind(seq)
            .bind(tokens)
            .bind(usd_nanos.unwrap_or(0))
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

    /// Statement 5 for a call of `tokens` and `usd_nanos` that would
    /// overspend: the run waits for room in its tree's budget (`queued`,
    /// `waiting_for = 'budget'`), recording what the call needs. Looked at
    /// again first, under the same locks as a hold: a hold that ended
    /// since the call was refused woke nobody (this run was not waiting
    /// yet), so if the call fits now the run is due at once instead.
    pub(crate) async fn suspend_for_budget(&self, lease: &Lease, tokens: i64, usd_nanos: Option<i64>, progressed: bool) -> Result<RunStatus, StoreError> {
        let thread = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                guard(self, &mut tx, lease).await?;
                let waits = matches!(self.fits(&mut tx, lease.run_id, tokens, usd_nanos, true).await?, Hold::Over { .. });
                let row = sqlx::query(sql!(
                    self,
                    concat!(
                        "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, \
                         not_before = CASE WHEN $4 THEN $5 ELSE {now} END, waiting_for = CASE WHEN $4 THEN 'budget' END, \
                         wait_tokens = $6, wait_usd_nanos = $7, \
                         attempt = CASE WHEN $8 THEN 0 WHEN attempt > 0 THEN attempt - 1 ELSE 0 END, updated_at = {now} WHERE ",
                        guarded!(),
                        " RETURNING thread_id, not_before, waiting_for"
                    )
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(waits)
                .bind(FOREVER)
                .bind(tokens)
                .bind(usd_nanos)
                .bind(progressed)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or_else(|| rejected(lease))?;
                let thread_id: String = row.try_get("thread_id")?;
                let not_before: i64 = row.try_get("not_before")?;
                let waiting_for: Option<String> = row.try_get("waiting_for")?;
                let payload = serde_json::json!({ "status": RunStatus::Queued, "waiting_for": waiting_for, "not_before": not_before });
                log::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::SUSPENDED, &payload).await?;
                tx.commit().await?;
                Ok((thread_id, waits))
            })
            .await?;
        let (thread, waits) = thread;
        self.hub().wake(&thread);
        if !waits {
            self.signal_work(true).await;
        }
        Ok(RunStatus::Queued)
    }

    /// The reaper's sweep: wakes up to `limit` runs waiting for budget
    /// whose call now fits, going on each pass from where the last one
    /// stopped. Whatever ends a hold wakes its tree's waiters itself (a
    /// settle, the trigger on a run's end, a raise); this catches a wake
    /// that found nobody because the waiter had not committed its wait
    /// yet (PostgreSQL reads each statement's snapshot), so a waiter with
    /// room never waits longer than a reaper tick. Returns how many woke.
    pub async fn wake_budget_waiters(&self, limit: i64) -> Result<usize, StoreError> {
        use std::sync::atomic::Ordering;
        let after = self.sweeps.budget_after.load(Ordering::Relaxed);
        let waiters: Vec<(i64, Option<i64>, Option<i64>)> = sqlx::query_as(sql!(
            self,
            "SELECT id, wait_tokens, wait_usd_nanos FROM runs WHERE waiting_for = 'budget' AND status = 'queued' \
             AND id > $1 ORDER BY id LIMIT $2"
        ))
        .bind(after)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        let next = if (waiters.len() as i64) < limit { 0 } else { waiters.last().map_or(0, |w| w.0) };
        self.sweeps.budget_after.store(next, Ordering::Relaxed);
        let mut woken = 0;
        for (id, tokens, usd) in waiters {
            // Read without locks: a wake that turns out early costs the
            // run a replay to the call and a wait again, nothing more.
            let mut conn = self.pool().acquire().await?;
            // A waiter of the previous release recorded no need: any room.
            let fits = self.fits(&mut conn, id, tokens.unwrap_or(1), usd.or(Some(0)), false).await?;
            drop(conn);
            if matches!(fits, Hold::Over { .. }) {
                continue;
            }
            let n = self
                .retry(|| async move {
                    Ok(sqlx::query(sql!(
                        self,
                        "UPDATE runs SET not_before = {now}, waiting_for = NULL, updated_at = {now} \
                         WHERE id = $1 AND status = 'queued' AND waiting_for = 'budget'"
                    ))
                    .bind(id)
                    .execute(self.writer())
                    .await?
                    .rows_affected())
                })
                .await?;
            if n > 0 {
                tracing::info!(run_id = id, "a run waiting for budget has room now; woken by the sweep");
                woken += 1;
            }
        }
        if woken > 0 {
            self.signal_work(true).await;
        }
        Ok(woken)
    }

    /// Sets the budget that binds run `run_id` most closely (a share
    /// given to it or an ancestor, else its root's): each limit given
    /// replaces that unit's, one not given stays as it is. The tree's runs
    /// waiting for budget are made due, so each looks again. Returns the
    /// budget as it now stands.
    pub async fn set_budget(&self, run_id: i64, limits: BudgetLimits) -> Result<Budget, StoreError> {
        if limits.tokens.is_some_and(|t| t < 0) || limits.usd_nanos.is_some_and(|t| t < 0) {
            return Err(StoreError::Config("a budget is 0 or more".into()));
        }
        let (budget, woken) = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let (holder, _) = self.nearest(&mut *tx, run_id).await?;
                let row = sqlx::query(sql!(
                    self,
                    "UPDATE runs SET budget_tokens = COALESCE($2, budget_tokens), budget_usd_nanos = COALESCE($3, budget_usd_nanos) \
                     WHERE id = $1 RETURNING COALESCE(root_id, id) AS root, budget_tokens, budget_usd_nanos"
                ))
                .bind(holder)
                .bind(limits.tokens)
                .bind(limits.usd_nanos)
                .fetch_one(&mut *tx)
                .await?;
                let root: i64 = row.try_get("root")?;
                let now = limits_of(&row)?;
                let woken = wake_waiting(self, &mut tx, root).await?;
                let budget = self.budget_on(&mut *tx, holder, now).await?;
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

/// The limits a row of `runs` carries (`budget_tokens`, `budget_usd_nanos`).
fn limits_of(row: &sqlx::any::AnyRow) -> Result<BudgetLimits, sqlx::Error> {
    Ok(BudgetLimits { tokens: row.try_get("budget_tokens")?, usd_nanos: row.try_get("budget_usd_nanos")? })
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
