//! Child runs (docs/concepts.md, "Child runs"): a turn's spawn, written in
//! one transaction with its ledger row; a parent's wait for its children;
//! the cancel of a whole subtree; and the sweep that applies a finished
//! parent's policy to its children still open.
//!
//! A parent waiting for children is `queued` with `waiting_for =
//! 'children'` and `not_before` at its deadline ([`FOREVER`] without
//! one): claimable when due like a sleeping run, so the claim does not
//! change. The child whose end completes the wait sets the parent's
//! `not_before` to now in the transaction that records that end, through
//! a trigger (migration 0018 on PostgreSQL, 0015 on SQLite), whichever
//! statement writes it: a close, a batch of closes, a cancel, an abort.

use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::Row;

use crate::store::guard::{guard, rejected};
use crate::store::ledger::{EffectCall, insert_row};
use crate::store::log::{self, kind};
use crate::store::{Backend, EffectClass, EffectRow, EffectState, Lease, Run, RunStatus, Store, StoreError, sql};

/// `not_before` of a parent that waits with no deadline: the last
/// millisecond of year 9999, so every reader can still show it as a date.
pub const FOREVER: i64 = 253_402_300_799_999;

/// What a turn asks for when it spawns a child, checked by the runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spawn {
    /// A registered plugin: the child runs its current version.
    pub plugin: String,
    /// JSON text.
    pub input: String,
    /// The child's priority: its parent's if `None`; one higher than its
    /// parent's is lowered to the parent's.
    pub priority: Option<i64>,
    /// The child's concurrency key: its parent's if `None` (none if the
    /// parent has none); another is refused unless `key_grants` covers it.
    pub concurrency_key: Option<String>,
    /// Prefixes of the keys a child may name other than its parent's (`*`:
    /// any), from the spawning plugin's `spawn_allow` entries `key:PREFIX`.
    pub key_grants: Vec<String>,
    /// Most runs a tree may have spawned, its root not counted.
    pub max_tree_runs: i64,
    /// Most spawned runs of a tree open at once.
    pub max_tree_open: i64,
    pub max_attempts: i64,
    /// Left open when the parent fails or is aborted (default: cancelled).
    pub detached: bool,
    /// A share of the tree's token budget that the child's subtree may not
    /// pass (`store::budgets`). Default: none (it draws on its root's).
    pub budget_tokens: Option<i64>,
    /// A share of the tree's budget in dollars (whole nano-dollars), as
    /// `budget_tokens`. Default: none.
    pub budget_usd_nanos: Option<i64>,
    /// The `traceparent` the child starts under: its spawn call's span
    /// (`traces`). Default: none.
    pub trace_parent: Option<String>,
}

/// How one child stands, as a waiting parent is told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ChildEnd {
    Completed { output: String },
    Failed { error: String },
    Aborted { error: String },
    Cancelled,
    /// Not finished yet.
    Pending,
}

impl ChildEnd {
    pub fn is_done(&self) -> bool {
        !matches!(self, ChildEnd::Pending)
    }
}

/// A child, by id, with how it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildState {
    pub id: i64,
    #[serde(flatten)]
    pub end: ChildEnd,
}

/// What a parent waits for: its children `ids`, all of them or (`any`)
/// the first, until `deadline` (epoch ms of the database's clock) if any.
/// `seq` is the ledger position of the call that waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildWait {
    pub seq: i64,
    pub ids: Vec<i64>,
    pub any: bool,
    pub deadline: Option<i64>,
}

/// The ids of `$2` (a JSON array of integers) in SQL, per backend.
macro_rules! with_ids {
    ($store:expr, $before:literal, $after:literal) => {
        match $store.backend() {
            Backend::Sqlite => sql!($store, concat!($before, "(SELECT value FROM json_each($2))", $after)),
            Backend::Postgres => {
                sql!($store, concat!($before, "(SELECT jsonb_array_elements_text($2::text::jsonb)::bigint)", $after))
            }
        }
    };
}

/// How often the orphan sweep reads every open child, not only those of
/// parents that ended lately: 10 minutes.
pub const ORPHAN_SWEEP_EVERY_MS: i64 = 600_000;

/// The orphan sweep's reads: every open child of a parent that failed,
/// was aborted or was cancelled (`$1`: at most); and those whose parent
/// ended since `$1` (`$2`: at most), through `runs_ended`.
fn orphans_sql(store: &Store) -> [&'static str; 2] {
    const ALL: &str = "SELECT c.id FROM runs c JOIN runs p ON p.id = c.parent_id \
         WHERE c.parent_id IS NOT NULL AND c.status NOT IN ('completed','failed','aborted','cancelled') \
         AND (p.status = 'cancelled' OR (p.status IN ('failed','aborted') AND c.detached = 0)) \
         ORDER BY c.id LIMIT $1";
    match store.backend() {
        Backend::Sqlite => [
            ALL,
            "SELECT c.id FROM runs p INDEXED BY runs_ended JOIN runs c ON c.parent_id = p.id \
             WHERE p.status IN ('cancelled','failed','aborted') AND p.finished_at >= $1 \
             AND c.parent_id IS NOT NULL AND c.status NOT IN ('completed','failed','aborted','cancelled') \
             AND (p.status = 'cancelled' OR c.detached = 0) ORDER BY c.id LIMIT $2",
        ],
        Backend::Postgres => [
            ALL,
            "SELECT c.id FROM runs p JOIN runs c ON c.parent_id = p.id \
             WHERE p.status IN ('cancelled','failed','aborted') AND p.finished_at >= $1 \
             AND c.parent_id IS NOT NULL AND c.status NOT IN ('completed','failed','aborted','cancelled') \
             AND (p.status = 'cancelled' OR c.detached = 0) ORDER BY c.id LIMIT $2",
        ],
    }
}

impl Store {
    /// See [`orphans_sql`] (for the suite's plan checks).
    #[doc(hidden)]
    pub fn orphans_sql(&self) -> [&'static str; 2] {
        orphans_sql(self)
    }

    /// Spawns a child of the run `lease` holds, as the committed ledger
    /// row of `call` (its result is the child's id), guarded by (owner,
    /// fence): the child and the row are written together or not at all,
    /// so a replay finds the row and never spawns again. `None`: the
    /// plugin is not registered (nothing is written).
    pub async fn spawn_child(&self, lease: &Lease, call: &EffectCall, spawn: &Spawn) -> Result<Option<(EffectRow, Run)>, StoreError> {
        let thread_id = uuid::Uuid::new_v4().to_string();
        let secret = format!("{:032x}", rand::random::<u128>());
        let written = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                guard(self, &mut tx, lease).await?;
                let (priority, key) = self.tree_room(&mut tx, lease.run_id, spawn).await?;
                let row = sqlx::query(sql!(
                    self,
                    "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, \
                     created_at, updated_at, secret, priority, concurrency_key, parent_id, root_id, spawn_seq, detached, budget_tokens, budget_usd_nanos, trace_parent) \
                     SELECT $1, p.name, p.digest, $2, 'queued', $3, {now}, {now}, {now}, $4, $5, $6, $7, \
                     (SELECT COALESCE(r.root_id, r.id) FROM runs r WHERE r.id = $7), $8, $9, $11, $12, $13 \
                     FROM plugins p WHERE p.name = $10 RETURNING {runs}"
                ))
                .bind(&thread_id)
                .bind(&spawn.input)
                .bind(spawn.max_attempts)
                .bind(&secret)
                .bind(priority)
                .bind(&key)
                .bind(lease.run_id)
                .bind(call.seq)
                .bind(i64::from(spawn.detached))
                .bind(&spawn.plugin)
                .bind(spawn.budget_tokens)
                .bind(spawn.budget_usd_nanos)
                .bind(spawn.trace_parent.as_deref())
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else { return Ok(None) };
                let child = Run::from_row(&row)?;
                if let Some(key) = &child.concurrency_key {
                    crate::store::concurrency::activate(self, &mut tx, key, &child.plugin).await?;
                }
                let payload = json!({ "input": child.input, "plugin": child.plugin, "parent_id": lease.run_id });
                log::append(self, &mut tx, &child.thread_id, child.id, child.fence, kind::SUBMITTED, &payload).await?;
                let result = child.id.to_string();
                let ledger = insert_row(self, &mut tx, lease, call, EffectClass::Local, EffectState::Committed, Some(&result)).await?;
                self.faults().before_spawn_commit()?;
                self.faults().spawn_pause(crate::store::faults::SpawnPause::Before).await;
                tx.commit().await?;
                self.faults().spawn_pause(crate::store::faults::SpawnPause::After).await;
                self.faults().after_spawn_commit()?;
                Ok(Some((ledger, child)))
            })
            .await?;
        if let Some((_, child)) = &written {
            self.hub().wake(&child.thread_id);
            // Other hosts too: an idle one starts the child at once.
            self.signal_work(true).await;
            if child.concurrency_key.is_some() || child.priority != 0 {
                self.ahead_signal().notify_one();
            }
        }
        Ok(written)
    }

    /// How many runs are above `run_id` in its tree (0 for a root). A
    /// run's ancestors never change, so this needs no lock.
    /// Inside a spawn's transaction, after its guard: refuses the spawn
    /// ([`StoreError::Refused`]) if the parent's tree has spawned
    /// `max_tree_runs` runs, or has `max_tree_open` of them open, or if
    /// the child names a key that is neither its parent's nor granted;
    /// else returns the child's priority and key (`''`: none). On
    /// PostgreSQL the tree's spawns count one at a time (an advisory lock
    /// on the root, not its row: a cascade cancel locks the root, then its
    /// children).
    async fn tree_room(&self, conn: &mut sqlx::AnyConnection, parent: i64, spawn: &Spawn) -> Result<(i64, String), StoreError> {
        let row = sqlx::query(sql!(self, "SELECT COALESCE(root_id, id) AS root, priority, concurrency_key FROM runs WHERE id = $1"))
            .bind(parent)
            .fetch_one(&mut *conn)
            .await?;
        let root: i64 = row.try_get("root")?;
        let (parent_priority, parent_key): (i64, String) = (row.try_get("priority")?, row.try_get("concurrency_key")?);
        if self.backend() == crate::store::Backend::Postgres {
            sqlx::query("SELECT pg_advisory_xact_lock(CAST(1818 AS INTEGER), CAST($1 % 2147483647 AS INTEGER))")
                .bind(root)
                .execute(&mut *conn)
                .await?;
        }
        let counts = sqlx::query(sql!(
            self,
            "SELECT CAST(COUNT(*) AS BIGINT) AS runs, \
             CAST(COALESCE(SUM(CASE WHEN finished_at IS NULL THEN 1 ELSE 0 END), 0) AS BIGINT) AS open \
             FROM runs WHERE root_id = $1"
        ))
        .bind(root)
        .fetch_one(&mut *conn)
        .await?;
        let (runs, open): (i64, i64) = (counts.try_get("runs")?, counts.try_get("open")?);
        if runs >= spawn.max_tree_runs {
            return Err(StoreError::Refused(format!(
                "run {root}'s tree has spawned {runs} runs, at most {} (--tree-max-runs)",
                spawn.max_tree_runs
            )));
        }
        if open >= spawn.max_tree_open {
            return Err(StoreError::Refused(format!(
                "run {root}'s tree has {open} spawned runs open, at most {} at once (--tree-max-open): wait for some to finish",
                spawn.max_tree_open
            )));
        }
        let priority = spawn.priority.map_or(parent_priority, |p| p.min(parent_priority));
        let key = match spawn.concurrency_key.as_deref() {
            None => parent_key,
            Some(k) if k == parent_key || spawn.key_grants.iter().any(|g| g == "*" || k.starts_with(g.as_str())) => k.to_string(),
            Some(k) => {
                return Err(StoreError::Refused(format!(
                    "concurrency key {k:?} is not this run's ({parent_key:?}), and this plugin's spawn_allow grants no key:PREFIX for it"
                )));
            }
        };
        Ok((priority, key))
    }

    pub async fn depth(&self, run_id: i64) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(sql!(
            self,
            "WITH RECURSIVE up(parent_id, d) AS (SELECT parent_id, CAST(0 AS BIGINT) FROM runs WHERE id = $1 \
             UNION ALL SELECT r.parent_id, up.d + 1 FROM runs r JOIN up ON r.id = up.parent_id) \
             SELECT CAST(COALESCE(MAX(d), 0) AS BIGINT) FROM up"
        ))
        .bind(run_id)
        .fetch_one(self.pool())
        .await?)
    }

    /// How each of `ids` stands, in the order given; `None` for an id that
    /// is not a child of `parent`.
    pub async fn child_states(&self, parent: i64, ids: &[i64]) -> Result<Vec<Option<ChildEnd>>, StoreError> {
        let list = json!(ids).to_string();
        let rows = sqlx::query(with_ids!(
            self,
            "SELECT id, status, CASE WHEN status IN ('completed','failed','aborted') THEN output END AS output, \
             CASE WHEN status IN ('completed','failed','aborted') THEN error END AS error \
             FROM runs WHERE parent_id = $1 AND id IN ",
            ""
        ))
        .bind(parent)
        .bind(&list)
        .fetch_all(self.pool())
        .await?;
        let mut found = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let status: RunStatus = row.try_get::<String, _>("status")?.parse()?;
            let (output, error): (Option<String>, Option<String>) = (row.try_get("output")?, row.try_get("error")?);
            let end = match status {
                RunStatus::Completed => ChildEnd::Completed { output: output.unwrap_or_default() },
                RunStatus::Failed => ChildEnd::Failed { error: error.unwrap_or_default() },
                RunStatus::Aborted => ChildEnd::Aborted { error: error.unwrap_or_default() },
                RunStatus::Cancelled => ChildEnd::Cancelled,
                _ => ChildEnd::Pending,
            };
            found.insert(row.try_get::<i64, _>("id")?, end);
        }
        Ok(ids.iter().map(|id| found.get(id).cloned()).collect())
    }

    /// Statement 5 for a wait on children: suspends the run `lease` holds
    /// as `queued`, waiting for `wait` (see the module doc). Each child
    /// still open is marked with the wait's position, so that its end
    /// counts toward it. If the wait is already met (a child ended after
    /// the turn looked), the run is left due at once instead.
    ///
    /// PostgreSQL: the children are locked first (`FOR SHARE`), then the
    /// parent, the order in which a child's end reaches its parent, so the
    /// two never wait on each other; a child ending meanwhile is waited
    /// for and then seen ended.
    pub async fn suspend_for_children(&self, lease: &Lease, wait: &ChildWait, progressed: bool) -> Result<RunStatus, StoreError> {
        let list = json!(wait.ids).to_string();
        let thread = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let locked = match self.backend() {
                    Backend::Sqlite => with_ids!(self, "SELECT id, status FROM runs WHERE parent_id = $1 AND id IN ", ""),
                    Backend::Postgres => {
                        with_ids!(self, "SELECT id, status FROM runs WHERE parent_id = $1 AND id IN ", " ORDER BY id FOR SHARE")
                    }
                };
                let rows = sqlx::query(locked).bind(lease.run_id).bind(&list).fetch_all(&mut *tx).await?;
                let mut open = Vec::new();
                for row in &rows {
                    let status: RunStatus = row.try_get::<String, _>("status")?.parse()?;
                    if !status.is_terminal() {
                        open.push(row.try_get::<i64, _>("id")?);
                    }
                }
                let ended = rows.len() - open.len();
                let met = open.is_empty() || (wait.any && ended > 0);
                let (left, waiting, not_before) = if met {
                    (None, None, None)
                } else {
                    let left = if wait.any { 1 } else { open.len() as i64 };
                    (Some(left), Some("children"), Some(wait.deadline.unwrap_or(FOREVER)))
                };
                if !met {
                    sqlx::query(with_ids!(self, "UPDATE runs SET awaited_at = $1 WHERE id IN ", ""))
                        .bind(wait.seq)
                        .bind(json!(open).to_string())
                        .execute(&mut *tx)
                        .await?;
                }
                let row = sqlx::query(sql!(
                    self,
                    "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, \
                     not_before = COALESCE($4, {now}), waiting_for = $5, await_seq = $6, await_left = $7, \
                     attempt = CASE WHEN $8 THEN 0 WHEN attempt > 0 THEN attempt - 1 ELSE 0 END, updated_at = {now} \
                     WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' AND lease_expires_at >= {clock} \
                     RETURNING thread_id, not_before"
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(not_before)
                .bind(waiting)
                .bind(wait.seq)
                .bind(left)
                .bind(progressed)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or_else(|| rejected(lease))?;
                let thread_id: String = row.try_get("thread_id")?;
                let not_before: i64 = row.try_get("not_before")?;
                let payload = json!({
                    "status": RunStatus::Queued, "prompt": null, "not_before": not_before,
                    "waiting_for": waiting, "children": open,
                });
                log::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::SUSPENDED, &payload).await?;
                tx.commit().await?;
                Ok((thread_id, met))
            })
            .await?;
        let (thread, met) = thread;
        self.hub().wake(&thread);
        if met {
            self.signal_work(true).await;
        }
        Ok(RunStatus::Queued)
    }

    /// Statement 6 for a subtree: cancels `run_id` and every run below it
    /// that is not finished, in one statement, each with its fence bumped
    /// (so every later write of a segment still running on any host fails
    /// its guard) and a `cancelled` event. Returns the runs cancelled,
    /// `run_id` first if it was open.
    ///
    /// On PostgreSQL the statement is made again until it cancels
    /// nothing: its snapshot predates the lock waits, so a child whose
    /// spawn held a parent's row and committed while the statement waited
    /// for it was not in that statement's tree; the next one sees it. A run
    /// cancelled stays locked until commit, so it spawns nothing more.
    pub(crate) async fn cancel_subtree(&self, conn: &mut sqlx::AnyConnection, run_id: i64) -> Result<Vec<Run>, StoreError> {
        let mut runs = Vec::new();
        loop {
            let pass = self.cancel_subtree_once(conn, run_id).await?;
            let done = pass.is_empty() || self.backend() == crate::store::Backend::Sqlite;
            runs.extend(pass);
            if done {
                break;
            }
        }
        runs.sort_by_key(|r| (r.id != run_id, r.id));
        for run in &runs {
            log::append(self, conn, &run.thread_id, run.id, run.fence, kind::CANCELLED, &json!({})).await?;
        }
        Ok(runs)
    }

    async fn cancel_subtree_once(&self, conn: &mut sqlx::AnyConnection, run_id: i64) -> Result<Vec<Run>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "WITH RECURSIVE sub(id) AS (SELECT CAST($1 AS BIGINT) UNION ALL \
             SELECT r.id FROM runs r JOIN sub ON r.parent_id = sub.id) \
             UPDATE runs SET status = 'cancelled', fence = fence + 1, lease_owner = NULL, \
             lease_expires_at = NULL, finished_at = {now}, updated_at = {now}, \
             partial = runs.partial || {unfolded}, partial_pos = emit_pos \
             WHERE id IN (SELECT id FROM sub) AND status NOT IN ('completed','failed','aborted','cancelled') \
             RETURNING {runs}"
        ))
        .bind(run_id)
        .fetch_all(&mut *conn)
        .await?;
        Ok(rows.iter().map(Run::from_row).collect::<Result<Vec<_>, _>>()?)
    }

    /// Applies finished parents' policy: cancels (with their subtrees) up
    /// to `limit` open children of parents that failed or were aborted,
    /// unless spawned detached, and of parents that were cancelled. A
    /// parent's close does not do this in its own statement; this sweep
    /// (the reaper's, each tick) does, so it holds across any host's
    /// death. Returns how many runs it cancelled.
    ///
    /// Each pass reads the children of parents that ended since a minute
    /// before the last pass that found them all (`runs_ended`), so a tick
    /// costs what ended lately, not every open child; the first pass, and
    /// one every [`ORPHAN_SWEEP_EVERY`], read them all (a parent's end that
    /// committed late, from a frozen host, is found there).
    pub async fn cancel_orphans(&self, limit: i64) -> Result<usize, StoreError> {
        use std::sync::atomic::Ordering;
        let now = self.now_ms().await?;
        let (since, full_at) = (self.sweeps.orphans_since.load(Ordering::Relaxed), self.sweeps.orphans_all_at.load(Ordering::Relaxed));
        let full = since == 0 || now - full_at >= ORPHAN_SWEEP_EVERY_MS;
        let [all, recent] = self.orphans_sql();
        let ids: Vec<i64> = if full {
            sqlx::query_scalar(all).bind(limit).fetch_all(self.pool()).await?
        } else {
            sqlx::query_scalar(recent).bind(since).bind(limit).fetch_all(self.pool()).await?
        };
        if (ids.len() as i64) < limit {
            // Found every orphan of parents ended before `now`: later passes
            // read from a minute before, for closes stamped but not yet seen.
            self.sweeps.orphans_since.store(now - 60_000, Ordering::Relaxed);
            if full {
                self.sweeps.orphans_all_at.store(now, Ordering::Relaxed);
            }
        }
        let mut cancelled = 0;
        for id in ids {
            let runs = self
                .retry(|| async move {
                    let mut tx = self.writer().begin().await?;
                    let runs = self.cancel_subtree(&mut tx, id).await?;
                    tx.commit().await?;
                    Ok(runs)
                })
                .await?;
            for run in &runs {
                self.hub().wake(&run.thread_id);
            }
            cancelled += runs.len();
        }
        Ok(cancelled)
    }
}
