//! Runs: submitting them (group-committed, see [`super::submits`]),
//! reading and listing them, and renewing their leases (statement 2).

use std::time::Duration;

use serde_json::json;
use sqlx::{AnyConnection, Row};

use crate::store::submits::Submit;
use crate::store::{Backend, Lease, NewRun, Run, RunStatus, Store, StoreError, dialect_sql, sql};

/// Most runs [`Store::create_runs`] writes in one commit.
pub const MAX_SUBMIT_BATCH: usize = 1000;

/// The `submitted` event's payload for `new`.
fn submitted_payload(new: &NewRun) -> String {
    submitted_payload_of(&new.plugin, &new.input)
}

/// Its fields in name order, as a `json!` object wrote them.
fn submitted_payload_of(plugin: &str, input: &str) -> String {
    #[derive(serde::Serialize)]
    struct Submitted<'a> {
        input: &'a str,
        plugin: &'a str,
    }
    serde_json::to_string(&Submitted { input, plugin }).expect("a submitted payload serializes")
}

/// A submit as PostgreSQL's insert reads it (`jsonb_to_recordset`),
/// serialized straight from the submit rather than through a `json!`
/// object per run.
#[derive(serde::Serialize)]
struct PgSubmit<'a> {
    i: usize,
    thread_id: &'a str,
    plugin: &'a str,
    digest: &'a str,
    input: &'a str,
    key: Option<&'a str>,
    max_attempts: i64,
    priority: i64,
    ckey: &'a str,
    payload: String,
    secret: &'a str,
    budget: Option<i64>,
    budget_usd: Option<i64>,
    trace: Option<&'a str>,
}

/// SQLite: writes a batch of submits inside the caller's transaction, in
/// three statements however many: their runs (reading them from a JSON
/// list), one bump of their threads' counters, and their `submitted`
/// events. A digest of `'current'` ([`NewRun::CURRENT_VERSION`]) is the
/// plugin's current version, read by the insert. A submit whose
/// idempotency key is taken inserts nothing and
/// returns the run holding the key. Threads are distinct within a batch
/// ([`super::submits`]), so a thread names its run.
async fn insert_runs_sqlite(store: &Store, conn: &mut AnyConnection, submits: &[Submit]) -> Result<Vec<(Run, bool)>, StoreError> {
    let list: Vec<serde_json::Value> = submits
        .iter()
        .map(|s| {
            json!([
                s.thread_id,
                s.new.plugin,
                s.new.plugin_digest,
                s.new.input,
                s.new.idempotency_key,
                s.max_attempts,
                s.secret,
                s.new.priority,
                s.new.concurrency_key.as_deref().unwrap_or(""),
                s.new.budget_tokens,
                s.new.budget_usd_nanos,
                s.new.trace_parent
            ])
        })
        .collect();
    let rows = sqlx::query(sql!(
        store,
        "INSERT INTO runs (thread_id, plugin, plugin_digest, input, idempotency_key, status, \
         max_attempts, not_before, created_at, updated_at, secret, priority, concurrency_key, budget_tokens, budget_usd_nanos, \
         trace_parent) SELECT value ->> 0, value ->> 1, \
         CASE WHEN value ->> 2 = 'current' THEN (SELECT p.digest FROM plugins p WHERE p.name = value ->> 1) \
         ELSE value ->> 2 END, value ->> 3, value ->> 4, 'queued', value ->> 5, \
         {now}, {now}, {now}, value ->> 6, value ->> 7, value ->> 8, value ->> 9, value ->> 10, value ->> 11 FROM jsonb_each($1) WHERE true ORDER BY key \
         ON CONFLICT (idempotency_key) DO NOTHING RETURNING {runs}"
    ))
    .bind(serde_json::Value::Array(list).to_string())
    .fetch_all(&mut *conn)
    .await?;
    if submits.iter().any(|s| s.new.concurrency_key.is_some()) {
        // Their keys take turns from now (see `store::concurrency`).
        // With their plugins' default limit, for a key no operator set.
        let keys: std::collections::BTreeSet<(&str, &str)> =
            submits.iter().filter_map(|s| Some((s.new.concurrency_key.as_deref()?, s.new.plugin.as_str()))).collect();
        sqlx::query(sql!(
            store,
            concat!(
                "INSERT INTO concurrency_keys (key, active, concurrency) SELECT value ->> 0, true, MIN(p.key_concurrency) \
                 FROM json_each($1) LEFT JOIN plugins p ON p.name = value ->> 1 WHERE true GROUP BY value ->> 0 ",
                crate::key_default!()
            )
        ))
        .bind(json!(keys).to_string())
        .execute(&mut *conn)
        .await?;
    }
    let mut inserted = std::collections::HashMap::with_capacity(rows.len());
    for row in &rows {
        let run = Run::from_row(row)?;
        inserted.insert(run.thread_id.clone(), run);
    }
    if !inserted.is_empty() {
        let threads: Vec<&str> = submits.iter().map(|s| s.thread_id.as_str()).filter(|t| inserted.contains_key(*t)).collect();
        let bumped = sqlx::query(sql!(
            store,
            "INSERT INTO threads (id, last_seq) SELECT value, 1 FROM json_each($1) WHERE true \
             ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + 1 RETURNING id, last_seq"
        ))
        .bind(json!(threads).to_string())
        .fetch_all(&mut *conn)
        .await?;
        let mut events = Vec::with_capacity(bumped.len());
        for row in &bumped {
            let (thread, seq): (String, i64) = (row.try_get("id")?, row.try_get("last_seq")?);
            let run = inserted.get(&thread).ok_or_else(|| StoreError::Corrupt(format!("thread {thread} bumped without a run")))?;
            events.push(json!([thread, seq, run.id, run.fence, submitted_payload_of(&run.plugin, &run.input)]));
        }
        sqlx::query(sql!(
            store,
            "INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
             SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, 'submitted', value ->> 4, {now} FROM jsonb_each($1)"
        ))
        .bind(serde_json::Value::Array(events).to_string())
        .execute(&mut *conn)
        .await?;
    }
    let mut created = Vec::with_capacity(submits.len());
    for submit in submits {
        created.push(match inserted.remove(&submit.thread_id) {
            Some(run) => (run, true),
            None => {
                // Only a taken key gets here (a NULL key never conflicts).
                let row = sqlx::query(sql!(store, "SELECT {runs} FROM runs WHERE idempotency_key = $1"))
                    .bind(&submit.new.idempotency_key)
                    .fetch_one(&mut *conn)
                    .await?;
                (Run::from_row(&row)?, false)
            }
        });
    }
    Ok(created)
}

impl Store {
    /// Enqueues a run. With an `idempotency_key` that already exists, returns
    /// the existing run and `false`; nothing new is written.
    ///
    /// Submits made while another is being written are group-committed
    /// (see `store::submits`).
    pub async fn create_run(&self, new: &NewRun) -> Result<(Run, bool), StoreError> {
        let thread_id = new
            .thread_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let max_attempts = new.max_attempts.unwrap_or(NewRun::DEFAULT_MAX_ATTEMPTS);
        if max_attempts < 1 {
            return Err(StoreError::Config(format!(
                "max_attempts must be at least 1, got {max_attempts}"
            )));
        }
        crate::store::priority::check(new.priority).map_err(StoreError::Config)?;
        if let Some(key) = &new.concurrency_key {
            crate::store::concurrency::check_key(key).map_err(StoreError::Config)?;
        }
        let secret = format!("{:032x}", rand::random::<u128>());
        let submit = Submit { new: new.clone(), thread_id, max_attempts, secret };
        crate::store::submits::submit(self, submit).await
    }

    /// Enqueues `news` in one commit (PostgreSQL: one statement), in order:
    /// each run and whether it is new, as [`Store::create_run`] returns. A
    /// batch names each thread and each idempotency key at most once, and
    /// holds at most [`MAX_SUBMIT_BATCH`] runs.
    pub async fn create_runs(&self, news: &[NewRun]) -> Result<Vec<(Run, bool)>, StoreError> {
        if news.len() > MAX_SUBMIT_BATCH {
            return Err(StoreError::Config(format!(
                "a batch holds at most {MAX_SUBMIT_BATCH} runs, not {}",
                news.len()
            )));
        }
        let (mut threads, mut keys) = (std::collections::HashSet::new(), std::collections::HashSet::new());
        let mut submits = Vec::with_capacity(news.len());
        for (i, new) in news.iter().enumerate() {
            let max_attempts = new.max_attempts.unwrap_or(NewRun::DEFAULT_MAX_ATTEMPTS);
            if max_attempts < 1 {
                return Err(StoreError::Config(format!("run {i}: max_attempts must be at least 1, got {max_attempts}")));
            }
            crate::store::priority::check(new.priority).map_err(|e| StoreError::Config(format!("run {i}: {e}")))?;
            if let Some(key) = &new.concurrency_key {
                crate::store::concurrency::check_key(key).map_err(|e| StoreError::Config(format!("run {i}: {e}")))?;
            }
            if let Some(key) = &new.idempotency_key
                && !keys.insert(key.as_str())
            {
                return Err(StoreError::Config(format!("run {i}: idempotency_key {key:?} is already used by this batch")));
            }
            let thread_id = new.thread_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            if !threads.insert(thread_id.clone()) {
                return Err(StoreError::Config(format!(
                    "run {i}: thread_id {thread_id:?} is already used by this batch (a batch names each thread once)"
                )));
            }
            let secret = format!("{:032x}", rand::random::<u128>());
            submits.push(Submit { new: new.clone(), thread_id, max_attempts, secret });
        }
        self.insert_runs(&submits).await
    }

    /// Writes `submits` (distinct threads, distinct idempotency keys) as one
    /// commit: each run and its `submitted` event. Returns, in order, each
    /// run and whether it is new (`false`: its key was taken; the run that
    /// holds it). Wakes workers for the new runs.
    pub(crate) async fn insert_runs(&self, submits: &[Submit]) -> Result<Vec<(Run, bool)>, StoreError> {
        let mut created = match (self.backend(), submits) {
            (_, []) => Vec::new(),
            (Backend::Postgres, _) => self.insert_runs_pg(submits).await?,
            (Backend::Sqlite, _) => {
                self.retry(|| async move {
                    let mut tx = self.writer().begin().await?;
                    let created = insert_runs_sqlite(self, &mut tx, submits).await?;
                    tx.commit().await?;
                    Ok(created)
                })
                .await?
            }
        };
        // Wakes this process's workers only: on PostgreSQL the statement
        // itself announced the runs to other hosts, or left the
        // announcement owed (see `carry_announcement`); SQLite hosts in
        // other processes poll.
        for (run, _) in created.iter().filter(|(_, new)| *new) {
            self.hub().wake(&run.thread_id);
            self.signal_work(false).await;
            if run.concurrency_key.is_some() || run.priority != 0 {
                self.ahead_signal().notify_one();
            }
        }
        // A taken key's run may be streaming. The batch is written: a
        // failed read leaves that run's partial short, never an error that
        // would have the batch submitted again.
        for (run, _) in created.iter_mut().filter(|(_, new)| !*new) {
            if let Err(e) = self.unfold(run).await {
                tracing::warn!(run = run.id, error = %e, "reading a run's streamed output failed");
            }
        }
        Ok(created)
    }

    /// PostgreSQL: the submits' runs and `submitted` events in one
    /// statement (`'current'` as a digest: [`NewRun::CURRENT_VERSION`]),
    /// reading them from a JSON list (bind parameters are per
    /// statement, not per row), one submit or many. Other hosts hear of new
    /// runs by a `NOTIFY` that this statement carries, or that a later one
    /// (or one sent on its own) does (see [`Store::carry_announcement`]).
    /// Thread counters are locked in thread order, as a batch of closes
    /// locks them, so two batches sharing threads wait rather than
    /// deadlock.
    async fn insert_runs_pg(&self, submits: &[Submit]) -> Result<Vec<(Run, bool)>, StoreError> {
        let list: Vec<PgSubmit> = submits
            .iter()
            .enumerate()
            .map(|(i, s)| PgSubmit {
                i,
                thread_id: &s.thread_id,
                plugin: &s.new.plugin,
                digest: &s.new.plugin_digest,
                input: &s.new.input,
                key: s.new.idempotency_key.as_deref(),
                max_attempts: s.max_attempts,
                priority: s.new.priority,
                ckey: s.new.concurrency_key.as_deref().unwrap_or(""),
                payload: submitted_payload(&s.new),
                secret: &s.secret,
                budget: s.new.budget_tokens,
                budget_usd: s.new.budget_usd_nanos,
                trace: s.new.trace_parent.as_deref(),
            })
            .collect();
        let list = serde_json::to_string(&list).map_err(|e| StoreError::Corrupt(format!("a submit batch: {e}")))?;
        let list = list.as_str();
        let carry = self.carry_announcement();
        let rows = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    concat!("WITH l AS (SELECT * FROM jsonb_to_recordset($1::text::jsonb) AS l(i bigint, thread_id text, \
                     plugin text, digest text, input text, key text, max_attempts bigint, priority bigint, ckey text, payload text, \
                     secret text, budget bigint, budget_usd bigint, trace text)), \
                     k AS (INSERT INTO concurrency_keys (key, active, concurrency) SELECT ckey, true, MIN(p.key_concurrency) \
                     FROM l LEFT JOIN plugins p ON p.name = l.plugin WHERE ckey <> '' GROUP BY ckey ORDER BY 1 ", crate::key_default!(), "), \
                     r AS (INSERT INTO runs (thread_id, plugin, plugin_digest, input, idempotency_key, \
                     status, max_attempts, not_before, created_at, updated_at, secret, priority, concurrency_key, budget_tokens, budget_usd_nanos, \
                     trace_parent) SELECT thread_id, plugin, \
                     CASE WHEN digest = 'current' THEN (SELECT p.digest FROM plugins p WHERE p.name = l.plugin) ELSE digest END, \
                     input, key, 'queued', max_attempts, {now}, {now}, {now}, secret, priority, ckey, budget, budget_usd, trace \
                     FROM l ORDER BY i ON CONFLICT (idempotency_key) DO NOTHING RETURNING {runs}), \
                     t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, 1 FROM r ORDER BY thread_id \
                     ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + 1 RETURNING id, last_seq), \
                     e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
                     SELECT t.id, t.last_seq, r.id, r.fence, 'submitted', l.payload, {now} \
                     FROM t JOIN r ON r.thread_id = t.id JOIN l ON l.thread_id = t.id RETURNING seq), \
                     n AS MATERIALIZED (SELECT pg_notify($2, $3) WHERE $4 AND EXISTS (SELECT 1 FROM r)) \
                     SELECT {runs@r} FROM r LEFT JOIN n ON true")
                ))
                .bind(list)
                .bind(crate::store::WORK_CHANNEL)
                .bind(self.node())
                .bind(carry)
                .fetch_all(self.writer())
                .await?)
            })
            .await;
        self.announcement_carried(carry, rows.as_ref().is_ok_and(|r| !r.is_empty()), rows.is_err());
        let rows = match rows {
            Ok(rows) => rows,
            // The database refused the statement: rolled back.
            Err(e @ StoreError::Db(sqlx::Error::Database(_))) if !super::group::session_lost(&e) => return Err(e),
            // The session broke: the statement may have committed first.
            Err(e) => self.written_by(list, &e).await?,
        };
        // From here the batch is written: a failure is never reported as
        // one the database rolled back, which would have it written again.
        // Threads are distinct within a batch, so a thread names its run.
        let mut inserted = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let run = Run::from_row(row).map_err(|e| written_but(&e))?;
            inserted.insert(run.thread_id.clone(), run);
        }
        let mut created = Vec::with_capacity(submits.len());
        for submit in submits {
            created.push(match inserted.remove(&submit.thread_id) {
                Some(run) => (run, true),
                None => (self.run_with_key(submit).await.map_err(|e| written_but(&e))?, false),
            });
        }
        Ok(created)
    }

    /// PostgreSQL: the runs a submit statement whose session broke wrote,
    /// found by their threads and secrets (each run's secret is new and
    /// random, so a run with both is this batch's). None found: it did
    /// not commit, and never will (its session is gone), so the broken
    /// session's error stands; an error here leaves the outcome unknown.
    async fn written_by(&self, list: &str, broke: &StoreError) -> Result<Vec<sqlx::any::AnyRow>, StoreError> {
        let found = self
            .read_after_commit(|| async move {
                Ok(sqlx::query(
                    "SELECT {runs@runs} FROM runs JOIN jsonb_to_recordset($1::text::jsonb) AS l(thread_id text, secret text) \
                     ON runs.thread_id = l.thread_id AND runs.secret = l.secret",
                )
                .bind(list)
                .fetch_all(self.pool())
                .await?)
            })
            .await
            .map_err(|e| StoreError::Unknown(format!("a submit batch's session broke ({broke}), and finding out what it wrote failed: {e}")))?;
        if found.is_empty() {
            return Err(StoreError::Unknown(format!("a submit batch's session broke and it wrote nothing: {broke}")));
        }
        tracing::warn!(error = %broke, written = found.len(), "a submit batch's session broke after its commit; its runs were found");
        Ok(found)
    }

    /// A read right after a commit, tried again on a new session while
    /// sessions break (a server restart ends them all), for about 3 s.
    async fn read_after_commit<T, F, Fut>(&self, read: F) -> Result<T, StoreError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut delay = std::time::Duration::from_millis(20);
        for _ in 0..8 {
            match read().await {
                Err(e) if super::group::session_lost(&e) || matches!(e, StoreError::Db(sqlx::Error::PoolTimedOut)) => {
                    tracing::debug!(error = %e, "a read after a commit lost its session; reading again");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                other => return other,
            }
        }
        read().await
    }

    /// The run holding `submit`'s idempotency key, for a submit that was not
    /// inserted (read after the batch's commit). Only a taken key gets here (a NULL key never conflicts), and
    /// `ON CONFLICT` has waited for the other insert to commit.
    async fn run_with_key(&self, submit: &Submit) -> Result<Run, StoreError> {
        let Some(key) = &submit.new.idempotency_key else {
            return Err(StoreError::Config("a submit without an idempotency key was not inserted".into()));
        };
        let row = self
            .read_after_commit(|| async move {
                self.faults().submit_read(self).await?;
                Ok(sqlx::query(sql!(self, "SELECT {runs} FROM runs WHERE idempotency_key = $1"))
                    .bind(key)
                    .fetch_one(self.pool())
                    .await?)
            })
            .await?;
        Run::from_row(&row)
    }

    /// The run with `id`.
    pub async fn get_run(&self, id: i64) -> Result<Run, StoreError> {
        let row = sqlx::query(sql!(self, "SELECT {runs} FROM runs WHERE id = $1"))
            .bind(id)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::RunNotFound(id))?;
        let mut run = Run::from_row(&row)?;
        self.unfold(&mut run).await?;
        Ok(run)
    }

    /// Runs, newest first, optionally filtered; `before` is a cursor (an id).
    pub async fn list_runs(
        &self,
        status: Option<RunStatus>,
        plugin: Option<&str>,
        before: Option<i64>,
        limit: i64,
    ) -> Result<Vec<Run>, StoreError> {
        let filter = RunFilter { status, plugin: plugin.map(str::to_string), ..RunFilter::default() };
        Ok(self.runs_page(&filter, before, limit, i64::MAX).await?.0)
    }

    /// [`Store::list_runs`] with every [`RunFilter`], and no more than about
    /// `max_bytes` of inputs, outputs and partials (always at least one
    /// run). Also returns whether the page was cut short by its size.
    ///
    /// A fixed statement per index it can use, rather than one
    /// `($1 IS NULL OR status = $1)` for all: a thread's runs come from
    /// `runs_thread`, a status's from `runs_status`, the rest by id. The
    /// text search scans (newest first, until the page is full).
    pub async fn runs_page(
        &self,
        filter: &RunFilter,
        before: Option<i64>,
        limit: i64,
        max_bytes: i64,
    ) -> Result<(Vec<Run>, bool), StoreError> {
        self.runs_page_from(filter, before, 0, limit, max_bytes).await
    }

    /// [`Store::runs_page`] over the runs with ids of at least `from` only
    /// (a text search's window: [`super::search`]).
    pub(crate) async fn runs_page_from(
        &self,
        filter: &RunFilter,
        before: Option<i64>,
        from: i64,
        limit: i64,
        max_bytes: i64,
    ) -> Result<(Vec<Run>, bool), StoreError> {
        // `$4`: the text, as a LIKE pattern; `$5`, `$6`: status, plugin;
        // `$7`: the lowest id; `$8`: the thread.
        // The byte budget counts the stored partial; a running run's
        // unfolded deltas (`store::partial`) are not counted.
        macro_rules! page {
            ($filter:literal) => {
                concat!(
                    "SELECT * FROM (SELECT {runs@r}, SUM(LENGTH(r.input) + LENGTH(r.partial) + COALESCE(LENGTH(r.output), 0) \
                     + COALESCE(LENGTH(r.error), 0)) OVER (ORDER BY r.id DESC) AS running FROM runs r \
                     WHERE r.id < $1 AND r.id >= $7", $filter,
                     " AND ($4 IS NULL OR LOWER(r.input) LIKE $4 ESCAPE '!' OR LOWER(COALESCE(r.output, '')) LIKE $4 ESCAPE '!' \
                     OR LOWER(COALESCE(r.error, '')) LIKE $4 ESCAPE '!') \
                     ORDER BY r.id DESC LIMIT $2) AS p WHERE p.running - \
                     (LENGTH(p.input) + LENGTH(p.partial) + COALESCE(LENGTH(p.output), 0) + COALESCE(LENGTH(p.error), 0)) < $3 \
                     ORDER BY p.id DESC"
                )
            };
        }
        let before = before.unwrap_or(i64::MAX);
        let text = filter.text.as_deref().filter(|t| !t.is_empty()).map(like_pattern);
        let status = filter.status.map(|s| s.as_str());
        let query = match (&filter.thread, status, &filter.plugin) {
            // A run's children come from runs_spawn.
            _ if filter.parent.is_some() => sqlx::query(sql!(
                self,
                page!(
                    " AND r.parent_id = $9 AND ($8 IS NULL OR r.thread_id = $8) AND ($5 IS NULL OR r.status = $5) \
                     AND ($6 IS NULL OR r.plugin = $6)"
                )
            )),
            (Some(_), _, _) => sqlx::query(sql!(
                self,
                page!(" AND r.thread_id = $8 AND ($5 IS NULL OR r.status = $5) AND ($6 IS NULL OR r.plugin = $6)")
            )),
            (None, None, None) => sqlx::query(sql!(self, page!(" AND $5 IS NULL AND $6 IS NULL"))),
            (None, Some(_), None) => sqlx::query(sql!(self, page!(" AND r.status = $5 AND $6 IS NULL"))),
            (None, None, Some(_)) => sqlx::query(sql!(self, page!(" AND $5 IS NULL AND r.plugin = $6"))),
            (None, Some(_), Some(_)) => sqlx::query(sql!(self, page!(" AND r.status = $5 AND r.plugin = $6"))),
        };
        let mut query =
            query.bind(before).bind(limit).bind(max_bytes).bind(text).bind(status).bind(filter.plugin.clone()).bind(from);
        if let Some(parent) = filter.parent {
            query = query.bind(filter.thread.clone()).bind(parent);
        } else if let Some(thread) = &filter.thread {
            query = query.bind(thread.clone());
        }
        let rows = query.fetch_all(self.pool()).await?;
        let cut = match rows.last() {
            Some(last) => last.try_get::<i64, _>("running")? >= max_bytes,
            None => false,
        };
        let mut runs = rows.iter().map(Run::from_row).collect::<Result<Vec<_>, _>>()?;
        self.unfold_all(&mut runs).await?;
        Ok((runs, cut))
    }

    /// Statement 2: extends the lease to `ttl` from the database's now and
    /// returns the new expiry. `LeaseLost` means: stop the guest, write nothing.
    /// On PostgreSQL it gives up after the lock timeout rather than wait on
    /// a row another (frozen) session holds: the caller retries, and its
    /// lease deadline stops the guest if no renewal lands.
    pub async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<i64, StoreError> {
        Ok(crate::store::renewals::renew(self, crate::store::renewals::Renewal { lease: lease.clone(), ttl, charge: false }).await?.0)
    }

    /// [`Store::renew`] that also counts the attempt of a segment whose
    /// claim did not (a run claimed for a local queue, starting its guest:
    /// see [`crate::store::Claimed::charged`]).
    pub async fn renew_charging(&self, lease: &Lease, ttl: Duration) -> Result<i64, StoreError> {
        Ok(crate::store::renewals::renew(self, crate::store::renewals::Renewal { lease: lease.clone(), ttl, charge: true }).await?.0)
    }
}

impl Store {
    /// Inserts `n` queued runs of `plugin` in one statement. For benches and
    /// tests that need a large queue quickly.
    pub async fn bulk_load_queued(&self, n: i64, plugin: &str) -> Result<u64, StoreError> {
        self.bulk_load(n, plugin, RunStatus::Queued).await
    }

    /// Inserts `n` runs of `plugin` with `status` in one statement (bench
    /// and tests: e.g. a million finished runs under the claim path).
    pub async fn bulk_load(&self, n: i64, plugin: &str, status: RunStatus) -> Result<u64, StoreError> {
        let done = sqlx::query(dialect_sql!(self, bulk_load))
            .bind(n)
            .bind(plugin)
            .bind(status.as_str())
            .execute(self.writer())
            .await?;
        Ok(done.rows_affected())
    }
}

/// Which runs [`Store::runs_page`] lists. Every field is optional; all
/// that are set must hold.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub status: Option<RunStatus>,
    pub plugin: Option<String>,
    pub thread: Option<String>,
    /// Only the children of this run (runs its turn spawned).
    pub parent: Option<i64>,
    /// Text the run's input, output or error holds, case-insensitively
    /// (ASCII).
    pub text: Option<String>,
}

/// `text` as a LIKE pattern that matches it anywhere, lower-cased, with
/// `!` escaping LIKE's wildcards in it.
fn like_pattern(text: &str) -> String {
    let mut pattern = String::with_capacity(text.len() + 2);
    pattern.push('%');
    for c in text.to_lowercase().chars() {
        if matches!(c, '%' | '_' | '!') {
            pattern.push('!');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}

/// A failure after a submit batch committed: never one the group writer
/// takes for a rollback (and writes again, one by one).
fn written_but(e: &StoreError) -> StoreError {
    StoreError::Unknown(format!("the submit batch was written, but reading its runs back failed: {e}"))
}
