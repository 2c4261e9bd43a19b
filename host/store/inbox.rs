//! Named waits (docs/concepts.md, "Named waits"): a run's inbox of input
//! delivered under a name, the wait that takes it, and one-use answer
//! links that deliver without the API token.
//!
//! A delivery lands in `inbox` whether or not the run waits yet; the wait
//! takes it (deleting it) in the transaction that records it in the
//! ledger, so input is taken exactly once and never lost to a race with
//! the wait. One pending delivery per (run, name): a second is refused
//! until the first is taken. A run waiting on a name is `queued` with
//! `waiting_for = 'input:<name>'` and `not_before` at its deadline (or
//! [`FOREVER`]); a delivery makes it due.

use serde_json::json;
use sqlx::Row;

use crate::store::guard::{guard, rejected};
use crate::store::ledger::{EffectCall, insert_row};
use crate::store::log::{self, kind};
use crate::store::{EffectClass, EffectRow, EffectState, FOREVER, Lease, Run, RunStatus, Store, StoreError, sql};

/// A named wait, as a segment suspends for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedWait {
    pub name: String,
    pub prompt: String,
    /// Epoch ms of the database's clock; `None`: no deadline.
    pub deadline: Option<i64>,
}

/// `waiting_for` of a run waiting on `name`.
fn waiting_for(name: &str) -> String {
    format!("input:{name}")
}

/// How a wait ended, as its ledger row records it: `{"input": …}` or
/// `{"timeout": true}`.
pub fn wait_result(input: Option<&str>) -> String {
    match input {
        Some(input) => json!({ "input": input }).to_string(),
        None => json!({ "timeout": true }).to_string(),
    }
}

impl Store {
    /// The end of a named wait, if it has one now, recorded as `call`'s
    /// ledger row under (owner, fence): the input delivered to `name`
    /// (taken from the inbox), or, when `timed_out`, the timeout. Either
    /// way the wait's answer links stop working. `None`: nothing to take
    /// and no timeout; nothing is written.
    pub async fn end_wait(&self, lease: &Lease, call: &EffectCall, name: &str, timed_out: bool) -> Result<Option<EffectRow>, StoreError> {
        self.retry(|| async {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            let input: Option<String> =
                sqlx::query_scalar(sql!(self, "DELETE FROM inbox WHERE run_id = $1 AND name = $2 RETURNING input"))
                    .bind(lease.run_id)
                    .bind(name)
                    .fetch_optional(&mut *tx)
                    .await?;
            if input.is_none() && !timed_out {
                return Ok(None);
            }
            sqlx::query(sql!(self, "DELETE FROM answer_links WHERE run_id = $1 AND name = $2"))
                .bind(lease.run_id)
                .bind(name)
                .execute(&mut *tx)
                .await?;
            let result = wait_result(input.as_deref());
            let row = insert_row(self, &mut tx, lease, call, EffectClass::Local, EffectState::Committed, Some(&result)).await?;
            tx.commit().await?;
            Ok(Some(row))
        })
        .await
    }

    /// Statement 5 for a named wait: suspends the run `lease` holds as
    /// `queued`, waiting on `wait.name` until its deadline. A delivery
    /// that landed meanwhile (after the turn looked) leaves it due at once.
    pub(crate) async fn suspend_named(&self, lease: &Lease, wait: &NamedWait, progressed: bool) -> Result<RunStatus, StoreError> {
        let waiting = waiting_for(&wait.name);
        let thread = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                // The run's row first (a delivery's update waits for it),
                // then the inbox: a delivery is either seen here or sees
                // the run waiting.
                let row = sqlx::query(sql!(
                    self,
                    "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, \
                     not_before = $4, waiting_for = $5, attempt = CASE WHEN $6 THEN 0 WHEN attempt > 0 THEN attempt - 1 ELSE 0 END, \
                     updated_at = {now} \
                     WHERE id = $1 AND lease_owner = $2 AND fence = $3 AND status = 'running' AND lease_expires_at >= {clock} \
                     RETURNING thread_id"
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(wait.deadline.unwrap_or(FOREVER))
                .bind(&waiting)
                .bind(progressed)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or_else(|| rejected(lease))?;
                let thread_id: String = row.try_get("thread_id")?;
                let not_before: i64 = sqlx::query_scalar(sql!(
                    self,
                    "UPDATE runs SET not_before = CASE WHEN EXISTS (SELECT 1 FROM inbox WHERE run_id = $1 AND name = $2) \
                     THEN {now} ELSE not_before END, \
                     waiting_for = CASE WHEN EXISTS (SELECT 1 FROM inbox WHERE run_id = $1 AND name = $2) \
                     THEN NULL ELSE waiting_for END \
                     WHERE id = $1 RETURNING not_before"
                ))
                .bind(lease.run_id)
                .bind(&wait.name)
                .fetch_one(&mut *tx)
                .await?;
                let payload = json!({
                    "status": RunStatus::Queued, "prompt": wait.prompt, "not_before": not_before, "waiting_for": waiting,
                });
                log::append(self, &mut tx, &thread_id, lease.run_id, lease.fence, kind::SUSPENDED, &payload).await?;
                tx.commit().await?;
                Ok(thread_id)
            })
            .await?;
        self.hub().wake(&thread);
        Ok(RunStatus::Queued)
    }

    /// Delivers `input` to run `run_id` under `name`: kept in its inbox
    /// until a wait on `name` takes it, and the run made due if it waits
    /// on `name` now. A `Conflict` if the run has finished, or if input
    /// delivered to `name` has not been taken yet.
    pub async fn deliver_named(&self, run_id: i64, name: &str, input: &str) -> Result<Run, StoreError> {
        let run = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let run = deliver_in(self, &mut tx, run_id, name, input).await?;
                tx.commit().await?;
                Ok(run)
            })
            .await?;
        self.input_delivered(run).await
    }

    /// [`Store::deliver_named`] once per `key` (or, without a `name`,
    /// [`Store::deliver_input`]): the first delivery with a key is recorded
    /// with it in the same transaction; a later one with the same key
    /// delivers nothing and returns the run as it stands
    /// ([`Delivery::Repeat`], or [`Delivery::Mismatch`] if its name or
    /// input differ from the first's), even after a wait took the first
    /// or the run finished.
    pub async fn deliver_once(&self, run_id: i64, name: Option<&str>, input: &str, key: &str) -> Result<(Run, Delivery), StoreError> {
        use sha2::Digest;
        let hash = hex::encode(sha2::Sha256::digest(input.as_bytes()));
        let (run, delivery) = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let first = sqlx::query(sql!(
                    self,
                    "INSERT INTO input_deliveries (run_id, idempotency_key, name, input_sha256, created_at) \
                     SELECT id, $2, $3, $4, {now} FROM runs WHERE id = $1 \
                     ON CONFLICT (run_id, idempotency_key) DO NOTHING RETURNING run_id"
                ))
                .bind(run_id)
                .bind(key)
                .bind(name.unwrap_or(""))
                .bind(&hash)
                .fetch_optional(&mut *tx)
                .await?;
                if first.is_some() {
                    let run = match name {
                        Some(name) => deliver_in(self, &mut tx, run_id, name, input).await?,
                        None => crate::store::suspend::deliver_unnamed_in(self, &mut tx, run_id, input).await?,
                    };
                    tx.commit().await?;
                    return Ok((run, Delivery::New));
                }
                let seen: Option<(String, String)> =
                    sqlx::query_as(sql!(self, "SELECT name, input_sha256 FROM input_deliveries WHERE run_id = $1 AND idempotency_key = $2"))
                        .bind(run_id)
                        .bind(key)
                        .fetch_optional(&mut *tx)
                        .await?;
                drop(tx);
                let Some((seen_name, seen_hash)) = seen else { return Err(StoreError::RunNotFound(run_id)) };
                let run = self.get_run(run_id).await?;
                let same = seen_name == name.unwrap_or("") && seen_hash == hash;
                Ok((run, if same { Delivery::Repeat } else { Delivery::Mismatch }))
            })
            .await?;
        match delivery {
            Delivery::New => Ok((self.input_delivered(run).await?, delivery)),
            _ => Ok((run, delivery)),
        }
    }

    /// Records a one-use answer link to the wait on `name` of the run
    /// `lease` holds (its token's SHA-256, `token_hash`), as `call`'s
    /// ledger row, under (owner, fence).
    pub async fn add_answer_link(&self, lease: &Lease, call: &EffectCall, name: &str, token_hash: &str) -> Result<EffectRow, StoreError> {
        self.retry(|| async {
            let mut tx = self.writer().begin().await?;
            guard(self, &mut tx, lease).await?;
            sqlx::query(sql!(
                self,
                "INSERT INTO answer_links (token_hash, run_id, name, created_at) VALUES ($1, $2, $3, {now}) \
                 ON CONFLICT (token_hash) DO NOTHING"
            ))
            .bind(token_hash)
            .bind(lease.run_id)
            .bind(name)
            .execute(&mut *tx)
            .await?;
            let row = insert_row(self, &mut tx, lease, call, EffectClass::Local, EffectState::Committed, Some("")).await?;
            tx.commit().await?;
            Ok(row)
        })
        .await
    }

    /// Delivers `input` through the answer link whose token hashes to
    /// `token_hash`, and ends the link, in one transaction. `Gone`: no such
    /// link (used, ended with its wait, or never made). Returns the run
    /// and the name delivered to.
    pub async fn answer(&self, token_hash: &str, input: &str) -> Result<(Run, String), StoreError> {
        // A read first: a made-up token (anyone may send one) never takes
        // the writer, SQLite's only one.
        let known: Option<i64> = sqlx::query_scalar(sql!(self, "SELECT run_id FROM answer_links WHERE token_hash = $1"))
            .bind(token_hash)
            .fetch_optional(self.pool())
            .await?;
        if known.is_none() {
            return Err(StoreError::Gone("this answer link was used, its wait has ended, or it never existed".into()));
        }
        let (run, name) = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let link = sqlx::query(sql!(self, "DELETE FROM answer_links WHERE token_hash = $1 RETURNING run_id, name"))
                    .bind(token_hash)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(link) = link else {
                    return Err(StoreError::Gone("this answer link was used, its wait has ended, or it never existed".into()));
                };
                let (run_id, name): (i64, String) = (link.try_get("run_id")?, link.try_get("name")?);
                let run = match deliver_in(self, &mut tx, run_id, &name, input).await {
                    Err(StoreError::Conflict { .. }) | Err(StoreError::RunNotFound(_)) => {
                        return Err(StoreError::Gone("this answer link's run has finished or already has this input".into()));
                    }
                    other => other?,
                };
                tx.commit().await?;
                Ok((run, name))
            })
            .await?;
        Ok((self.input_delivered(run).await?, name))
    }

    /// The plugin and prompt of the wait the answer link `token_hash` was
    /// made for, while the run still waits on it (the run's last
    /// suspension began that wait and said a prompt); `None` otherwise.
    /// A link is made by the running turn and ended when any wait on its
    /// name ends, so a link that exists while the run waits on its name
    /// belongs to that very wait. Reads only: opening a link uses nothing.
    pub async fn answer_prompt(&self, token_hash: &str) -> Result<Option<(String, String)>, StoreError> {
        let row = sqlx::query(sql!(
            self,
            "SELECT r.plugin, r.status, r.waiting_for, l.name, \
             (SELECT payload FROM events WHERE run_id = r.id AND kind = 'suspended' ORDER BY seq DESC LIMIT 1) AS last \
             FROM answer_links l JOIN runs r ON r.id = l.run_id WHERE l.token_hash = $1"
        ))
        .bind(token_hash)
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = row else { return Ok(None) };
        let (plugin, status, waiting, name): (String, String, Option<String>, String) =
            (row.try_get("plugin")?, row.try_get("status")?, row.try_get("waiting_for")?, row.try_get("name")?);
        let want = waiting_for(&name);
        if status != RunStatus::Queued.as_str() || waiting.as_deref() != Some(want.as_str()) {
            return Ok(None);
        }
        let last: Option<String> = row.try_get("last")?;
        let prompt = last
            .and_then(|p| serde_json::from_str::<serde_json::Value>(&p).ok())
            .filter(|p| p["waiting_for"].as_str() == Some(want.as_str()))
            .and_then(|p| p["prompt"].as_str().map(str::to_string))
            .filter(|p| !p.is_empty());
        Ok(prompt.map(|p| (plugin, p)))
    }
}

/// What a delivery with an idempotency key did
/// ([`Store::deliver_once`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Delivered now.
    New,
    /// Delivered before with this key, name and input: nothing done.
    Repeat,
    /// The key was used before for another name or input: nothing done.
    Mismatch,
}

/// A delivery's statements on `conn` (see [`Store::deliver_named`]).
async fn deliver_in(store: &Store, conn: &mut sqlx::AnyConnection, run_id: i64, name: &str, input: &str) -> Result<Run, StoreError> {
    let status: Option<String> = sqlx::query_scalar(sql!(store, "SELECT status FROM runs WHERE id = $1"))
        .bind(run_id)
        .fetch_optional(&mut *conn)
        .await?;
    let status: RunStatus = status.ok_or(StoreError::RunNotFound(run_id))?.parse()?;
    if status.is_terminal() {
        return Err(StoreError::Conflict { run_id, status, message: "run is already finished" });
    }
    let landed = sqlx::query(sql!(
        store,
        "INSERT INTO inbox (run_id, name, input, created_at) VALUES ($1, $2, $3, {now}) \
         ON CONFLICT (run_id, name) DO NOTHING RETURNING run_id"
    ))
    .bind(run_id)
    .bind(name)
    .bind(input)
    .fetch_optional(&mut *conn)
    .await?;
    if landed.is_none() {
        return Err(StoreError::Conflict { run_id, status, message: "input delivered to this name has not been taken yet" });
    }
    // Unconditional (the CASE decides): on PostgreSQL the update then waits
    // for a suspend in flight (which holds the row) and sees it waiting; a
    // WHERE on the status would skip the row by its snapshot instead.
    let row = sqlx::query(sql!(
        store,
        "UPDATE runs SET not_before = CASE WHEN status = 'queued' AND waiting_for = $2 THEN {now} ELSE not_before END, \
         waiting_for = CASE WHEN status = 'queued' AND waiting_for = $2 THEN NULL ELSE waiting_for END, \
         updated_at = {now} WHERE id = $1 RETURNING {runs}"
    ))
    .bind(run_id)
    .bind(waiting_for(name))
    .fetch_one(&mut *conn)
    .await?;
    let run = Run::from_row(&row)?;
    log::append(store, conn, &run.thread_id, run.id, run.fence, kind::INPUT, &json!({ "name": name, "input": input })).await?;
    Ok(run)
}
