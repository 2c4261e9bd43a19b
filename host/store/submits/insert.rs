//! Writing submits: each batch's runs, their threads' counters and their
//! `submitted` events, in one statement (PostgreSQL) or one transaction
//! (SQLite); the group commit that forms the batches is [`super`].

use serde_json::json;
use sqlx::{AnyConnection, Row};

use crate::store::contract::Step;
use crate::store::submits::Submit;
use crate::store::{Backend, NewRun, Run, Store, StoreError, sql};

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
    hold: bool,
}

/// SQLite: writes a batch of submits inside the caller's transaction, in
/// a few statements however many: their runs (reading them from a JSON
/// list), one bump of the counters of their threads that have or get a
/// `threads` row (taking over a count a thread's run held, see
/// `store::log::bump`; a run that holds its new thread's counter needs
/// none), and their `submitted` events. A digest of `'current'` ([`NewRun::CURRENT_VERSION`]) is the
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
                s.new.trace_parent,
                s.hold
            ])
        })
        .collect();
    let rows = sqlx::query(sql!(
        store,
        "INSERT INTO runs (thread_id, plugin, plugin_digest, input, idempotency_key, status, \
         max_attempts, not_before, created_at, updated_at, secret, priority, concurrency_key, budget_tokens, budget_usd_nanos, \
         trace_parent, thread_seq) SELECT value ->> 0, value ->> 1, \
         CASE WHEN value ->> 2 = 'current' THEN (SELECT p.digest FROM plugins p WHERE p.name = value ->> 1) \
         ELSE value ->> 2 END, value ->> 3, value ->> 4, 'queued', value ->> 5, \
         {now}, {now}, {now}, value ->> 6, value ->> 7, value ->> 8, value ->> 9, value ->> 10, value ->> 11, \
         CASE WHEN value ->> 12 THEN 1 END FROM jsonb_each($1) WHERE true ORDER BY key \
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
        // A run that holds its new thread's counter numbers its event 1;
        // the others bump their threads' counters, each taking over the
        // count a run of its thread held (see `log::bump`).
        let mut events = Vec::with_capacity(inserted.len());
        let mut threads = Vec::with_capacity(inserted.len());
        for s in submits {
            match inserted.get(&s.thread_id) {
                Some(run) if s.hold => events.push(json!([s.thread_id, 1, run.id, run.fence, submitted_payload_of(&run.plugin, &run.input)])),
                Some(_) => threads.push(s.thread_id.as_str()),
                None => {}
            }
        }
        if !threads.is_empty() {
            let threads = json!(threads).to_string();
            let bumped = sqlx::query(sql!(
                store,
                "INSERT INTO threads (id, last_seq) SELECT value, 1 + CASE WHEN EXISTS (SELECT 1 FROM threads WHERE id = value) \
                 THEN 0 ELSE COALESCE((SELECT MAX(thread_seq) FROM runs WHERE thread_id = value AND thread_seq IS NOT NULL), 0) END \
                 FROM json_each($1) WHERE true \
                 ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + 1 RETURNING id, last_seq"
            ))
            .bind(&threads)
            .fetch_all(&mut *conn)
            .await?;
            sqlx::query(sql!(
                store,
                "UPDATE runs SET thread_seq = NULL WHERE thread_id IN (SELECT value FROM json_each($1)) AND thread_seq IS NOT NULL"
            ))
            .bind(&threads)
            .execute(&mut *conn)
            .await?;
            for row in &bumped {
                let (thread, seq): (String, i64) = (row.try_get("id")?, row.try_get("last_seq")?);
                let run = inserted.get(&thread).ok_or_else(|| StoreError::Corrupt(format!("thread {thread} bumped without a run")))?;
                events.push(json!([thread, seq, run.id, run.fence, submitted_payload_of(&run.plugin, &run.input)]));
            }
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
        let hold = new.thread_id.is_none() && self.contracted(Step::RunCounters).await?;
        let submit = Submit { new: new.clone(), thread_id, max_attempts, secret, hold };
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
        let counters = self.contracted(Step::RunCounters).await?;
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
            submits.push(Submit { new: new.clone(), thread_id, max_attempts, secret, hold: counters && new.thread_id.is_none() });
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
    /// Runs that hold a named thread's counter are locked first, in run
    /// order, then thread counters in thread order, as a batch of closes
    /// locks them, so two batches sharing threads wait rather than
    /// deadlock. A run submitted without a thread, once
    /// [`Step::RunCounters`] is taken, holds its new thread's counter and
    /// moves none.
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
                hold: s.hold,
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
                     secret text, budget bigint, budget_usd bigint, trace text, hold boolean)), \
                     k AS (INSERT INTO concurrency_keys (key, active, concurrency) SELECT ckey, true, MIN(p.key_concurrency) \
                     FROM l LEFT JOIN plugins p ON p.name = l.plugin WHERE ckey <> '' GROUP BY ckey ORDER BY 1 ", crate::key_default!(), "), \
                     r AS (INSERT INTO runs (thread_id, plugin, plugin_digest, input, idempotency_key, \
                     status, max_attempts, not_before, created_at, updated_at, secret, priority, concurrency_key, budget_tokens, budget_usd_nanos, \
                     trace_parent, thread_seq) SELECT thread_id, plugin, \
                     CASE WHEN digest = 'current' THEN (SELECT p.digest FROM plugins p WHERE p.name = l.plugin) ELSE digest END, \
                     input, key, 'queued', max_attempts, {now}, {now}, {now}, secret, priority, ckey, budget, budget_usd, trace, \
                     CASE WHEN hold THEN 1 END \
                     FROM l ORDER BY i ON CONFLICT (idempotency_key) DO NOTHING RETURNING {runs}, thread_seq), \
                     h AS (SELECT runs.id, runs.thread_id, runs.thread_seq FROM l JOIN runs ON runs.thread_id = l.thread_id \
                     WHERE NOT l.hold AND NOT EXISTS (SELECT 1 FROM threads WHERE threads.id = l.thread_id) \
                     AND runs.thread_seq IS NOT NULL ORDER BY runs.id FOR NO KEY UPDATE OF runs), \
                     c AS (UPDATE runs SET thread_seq = NULL FROM h WHERE runs.id = h.id), \
                     t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, SUM(k)::bigint FROM \
                     (SELECT thread_id, 1 AS k FROM r WHERE r.thread_seq IS NULL UNION ALL SELECT thread_id, thread_seq FROM h) AS x \
                     GROUP BY thread_id ORDER BY thread_id \
                     ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + 1 RETURNING id, last_seq), \
                     e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
                     SELECT r.thread_id, COALESCE(r.thread_seq, t.last_seq), r.id, r.fence, 'submitted', l.payload, {now} \
                     FROM r JOIN l ON l.thread_id = r.thread_id LEFT JOIN t ON t.id = r.thread_id RETURNING seq), \
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

}

/// A failure after a submit batch committed: never one the group writer
/// takes for a rollback (and writes again, one by one).
fn written_but(e: &StoreError) -> StoreError {
    StoreError::Unknown(format!("the submit batch was written, but reading its runs back failed: {e}"))
}
