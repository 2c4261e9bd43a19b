//! Group commit of closes, on both backends.
//!
//! A close is the one statement a short turn costs while there is a queue
//! (its tail, its puts, its final status and the next claim; see
//! [`Store::close_and_claim`]). On a small machine most of that
//! statement's cost is being a statement: the round trip, starting its
//! executor nodes, the commit. So a close made while [`writers`] batches
//! are in flight waits, and the waiting closes go together as one statement
//! ([`Store::close_batch`]) with one commit. A close on a quiet host goes
//! at once.
//!
//! Each close keeps its own (owner, fence) guard inside the batch: one
//! that fails it writes nothing and gets [`StoreError::LeaseLost`], and
//! the others are written. A batch's closes that claim a next run share
//! one owner and lease length (a host's workers all do). When a batch
//! fails as a whole, each of its closes is tried on its own, so every
//! caller gets its own result and its own error.
//!
//! PostgreSQL writes a batch as one data-modifying statement
//! ([`Store::close_batch`]); SQLite, which has one writer, as one
//! transaction of each close's statements ([`Store::close_batch_sqlite`]),
//! so that under `synchronous=FULL` a batch costs one fsync, not one per
//! close.

mod sqlite;

use std::time::Duration;

use sqlx::Row;

use crate::store::claims::claimed_rows;
use crate::store::guard::{ms, rejected};
use crate::store::group;
use crate::store::local::{HeldPut, held_put_json, pg_held_puts};
use crate::store::contract::Step;
use crate::store::log::message_payload;
use crate::store::{Backend, Claimed, Lease, Outcome, RunStatus, Store, StoreError, sql};

/// Most closes written by one statement: 64 on PostgreSQL, 128 on
/// SQLite. A batch is every close queued when a writer frees, so it grows
/// with the workers and the backlog and a lone close still goes at once.
///
/// `bench drain` (no-op turns, 64 workers), alternating: SQLite with 128
/// ran 3,870, 3,662, 4,026, 4,822 and 3,627 runs/s where 32 ran 3,211,
/// 3,249, 3,240, 3,482 and 3,249 (batches of 64 against 32; 64 workers
/// make at most 64 at once). PostgreSQL with 256: batches of 78–82
/// against 54–57 at 64, 6,625 runs/s on average against 6,477, within the
/// machine's noise, while beside a keyed backlog a small key's run
/// started later (`bench fairness` p99 40–57 ms against 28–38), so it
/// stays at 64.
pub(crate) fn max_batch(backend: Backend) -> usize {
    match backend {
        Backend::Postgres => 64,
        Backend::Sqlite => 128,
    }
}

/// Batches in flight at once: two on PostgreSQL, one on SQLite. Batches
/// grow with the load (up to [`max_batch`]), so few writers keep up with
/// many workers by writing more closes per statement.
///
/// PostgreSQL: with one batch in flight its statement was running in 86%
/// of 300 samples of `pg_stat_activity` during a 64-worker drain, while
/// the machine stood 40% idle: the drain waited on one backend's work, in
/// series with the round trip and the host's part of each batch. With two,
/// one batch executes while the other commits, travels or is being
/// answered. `bench drain` (no-op turns), two writers over one,
/// alternating: at 64 workers 1.35, 1.23, 1.16, 1.34, 0.96 (40,000 runs)
/// and 1.16, 1.04, 0.93 (20,000), where batches halve (about 17 closes
/// a commit, not 32); at 128 workers (claim batch 64, batches of at most
/// 64) 1.19, 1.15, 1.00. More workers in flight count for more: at 128
/// workers batches of at most 64 ran 9,320–11,965 runs/s where batches of
/// at most 32 ran 8,117–9,350 (40,000 runs).
///
/// Two batches lock what they share in one order (runs by id, threads by
/// id, kv keys by key; claims skip locked rows), as a stalled batch and
/// the writer started behind it always could. A batch
/// held up by a row lock no longer holds up every close behind it until
/// the stall rescue ([`group::STALLED`]).
///
/// SQLite has one writer connection: a second batch would only wait for it.
pub(crate) fn writers(backend: Backend) -> usize {
    match backend {
        Backend::Postgres => 2,
        Backend::Sqlite => 1,
    }
}

/// One close: [`Store::close_and_claim`]'s arguments, owned.
#[derive(Debug, Clone)]
pub(crate) struct Close {
    pub lease: Lease,
    pub deltas: Vec<String>,
    pub puts: Vec<HeldPut>,
    pub outcome: Outcome,
    /// Owner and lease length of the next run to claim in the same
    /// statement; `None`: claim nothing.
    pub next: Option<(String, Duration)>,
    /// Counts the segment's attempt too: its claim did not, and nothing
    /// since has (see `executor::renewer::Charge`).
    pub charge: bool,
}

/// Closes waiting to be group-committed.
pub(crate) type Queue = group::Queue<Close, Option<Claimed>>;

/// Queues `close` and returns its result once its batch is written.
pub(crate) async fn close(store: &Store, close: Close) -> Result<Option<Claimed>, StoreError> {
    store
        .closes
        .push(close, writers(store.backend()), || {
            // Its own task: a caller that gives up must not stop the batch
            // that carries other callers' closes.
            tokio::spawn(group::write_batches::<Close>(store.clone()));
        })
        .await
}

/// The next batch: queued closes in order, leaving queued any that wants
/// its next run for another owner or lease length than the batch's, or
/// closes a run the batch already closes (a zombie's close and its
/// successor's: each gets its own answer from its own batch).
fn take(store: &Store) -> Vec<(Close, group::Reply<Option<Claimed>>)> {
    let mut next: Option<(String, Duration)> = None;
    let mut runs = std::collections::HashSet::new();
    store.closes.take(max_batch(store.backend()), |close| {
        if runs.contains(&close.lease.run_id) {
            return false;
        }
        let fits = match (&close.next, &next) {
            (None, _) => true,
            (Some(want), None) => {
                next = Some(want.clone());
                true
            }
            (Some(want), Some(taken)) => want == taken,
        };
        if fits {
            runs.insert(close.lease.run_id);
        }
        fits
    })
}

impl group::Batched for Close {
    type Out = Option<Claimed>;
    const WHAT: &'static str = "closes";

    fn queue(store: &Store) -> &std::sync::Arc<Queue> {
        &store.closes
    }

    fn take(store: &Store) -> Vec<(Close, group::Reply<Option<Claimed>>)> {
        take(store)
    }

    async fn write(store: &Store, closes: &[Close]) -> Result<Vec<Result<Option<Claimed>, StoreError>>, StoreError> {
        match store.backend() {
            Backend::Postgres => store.close_batch(closes).await,
            Backend::Sqlite => store.close_batch_sqlite(closes).await,
        }
    }

    fn written(store: &Store, n: usize) {
        store.closes.count(n);
        crate::metrics::global().close_batch.0.observe_value(n as f64);
    }

    fn answer(&self, store: &Store, reply: group::Reply<Option<Claimed>>, result: Result<Option<Claimed>, StoreError>) {
        if let Err(Ok(Some(orphan))) = reply.send(result) {
            // Its worker stopped waiting (its task was aborted): nobody here
            // runs the run claimed for it, so it goes back unstarted.
            tracing::warn!(closed = self.lease.run_id, run_id = orphan.run.id, "a worker stopped before taking the run claimed with its close; giving it back");
            crate::store::orphans::give_back_orphans(store, vec![orphan]);
        }
    }}

/// A close's final status, output and error, and, when its `message`
/// event is written as an `events` row (`derived` false: the step
/// [`Step::DerivedMessages`] not taken), that event's payload.
fn closing(outcome: &Outcome, derived: bool) -> (RunStatus, Option<&str>, Option<&str>, Option<String>) {
    let (status, output, error) = match outcome {
        Outcome::Completed { output } => (RunStatus::Completed, Some(output.as_str()), None),
        Outcome::Failed { error } => (RunStatus::Failed, None, Some(error.as_str())),
    };
    let payload = (!derived).then(|| message_payload(status, output, error));
    (status, output, error, payload)
}

/// A close as PostgreSQL's batch statement reads it (`jsonb_to_recordset`),
/// serialized straight from the close: building a `json!` object for each
/// (a map of owned keys and values) was a measurable part of the host's
/// CPU per run.
#[derive(serde::Serialize)]
struct PgClose<'a> {
    i: usize,
    id: i64,
    owner: &'a str,
    fence: i64,
    status: &'static str,
    output: Option<&'a str>,
    error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    deltas: &'a [String],
    n: usize,
    want: bool,
    charge: bool,
}

/// The owner and lease length the batch's closes that want a next run
/// share (a host's workers all do); closes wanting different ones never
/// share a batch ([`take`]).
fn wanted_next(closes: &[Close]) -> Result<Option<(&str, Duration)>, StoreError> {
    let mut next: Option<(&str, Duration)> = None;
    for (owner, ttl) in closes.iter().filter_map(|c| c.next.as_ref()) {
        match next {
            None => next = Some((owner, *ttl)),
            Some(n) if n == (owner.as_str(), *ttl) => {}
            Some(_) => return Err(StoreError::Config("the closes of a batch want leases for different owners".into())),
        }
    }
    Ok(next)
}

/// PostgreSQL's close batch: the closes (`b`, from `$1`) and their
/// deltas (`d`).
macro_rules! close_batch_input {
    () => {
        "WITH b AS (SELECT * FROM jsonb_to_recordset($1::text::jsonb) AS b(i bigint, id bigint, \
         owner text, fence bigint, status text, output text, error text, payload text, deltas jsonb, \
         n bigint, want boolean, charge boolean)), \
         d AS (SELECT b.i, x.delta, x.ord FROM b, \
         jsonb_array_elements_text(b.deltas) WITH ORDINALITY AS x(delta, ord)), "
    };
}

/// What a close sets on its run (`b`'s close), but its `message_seq`.
macro_rules! close_batch_set {
    () => {
        "status = b.status, output = b.output, error = b.error, \
         lease_owner = NULL, lease_expires_at = NULL, closed_by = b.owner, finished_at = {now}, updated_at = {now}, \
         attempt = runs.attempt + CASE WHEN b.charge THEN 1 ELSE 0 END, \
         partial = runs.partial || {unfolded} || COALESCE((SELECT string_agg(d.delta, '' ORDER BY d.ord) \
         FROM d WHERE d.i = b.i), ''), emit_pos = runs.emit_pos + b.n, partial_pos = runs.emit_pos + b.n"
    };
}

/// `t`: each thread's counter moved on once, by all the events of its
/// closes in `$held` (a row may be updated only once per statement), in
/// thread order, so two batches lock the threads they share in one order;
/// `s`: each close's first event number, the thread's new counter less the
/// events of its closes from this one on. A close whose run holds its
/// thread's counter (`held`, the count before the close; the thread's one
/// run, see `store::log::bump`) numbers from it and moves no `threads` row.
macro_rules! close_batch_numbering {
    ($held:literal) => {
        concat!(
            "t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, SUM(n + 1)::bigint FROM ", $held, " \
             WHERE held IS NULL GROUP BY thread_id ORDER BY thread_id \
             ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + excluded.last_seq \
             RETURNING id, last_seq), \
             s AS (SELECT h.*, COALESCE(h.held, t.last_seq - (SUM(h.n + 1) OVER (PARTITION BY h.thread_id ORDER BY h.i \
             ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING))::bigint) AS base FROM ", $held, " AS h \
             LEFT JOIN t ON t.id = h.thread_id), "
        )
    };
}

/// `e`: each close's `delta` events, numbered from its base, and `$more`.
macro_rules! close_batch_deltas {
    ($more:literal) => {
        concat!(
            "e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
             SELECT s.thread_id, s.base + d.ord, s.id, s.fence, 'delta', \
             jsonb_build_object('pos', s.first + d.ord - 1, 'delta', d.delta)::text, {now} \
             FROM s JOIN d ON d.i = s.i",
            $more,
            ")"
        )
    };
}

/// The held puts of the closes written (`r`), the next runs claimed (never
/// a run of this batch: a row updated twice in one statement keeps one
/// update, unpredictably), and the answer: the closes written and their
/// threads, then one row per run claimed.
macro_rules! close_batch_tail {
    () => {
        concat!(
            pg_held_puts!("$2", "l.i = r.i"),
            ", ",
            crate::store::postgres::claim_ctes!(
                "$3",
                "$4",
                "(SELECT COUNT(*) FROM r WHERE r.want)",
                "ARRAY(SELECT id FROM b)",
                "true",
                "$5"
            ),
            " SELECT (SELECT string_agg(i::text, ',') FROM r) AS closed, \
             (SELECT json_agg(DISTINCT thread_id)::text FROM r) AS closed_threads, n.* \
             FROM (SELECT 1) o LEFT JOIN n ON true"
        )
    };
}

impl Store {
    /// Statement 4: finishes the turn. Sets the final status and output (or
    /// error), appends the final `message` event and clears the lease, in one
    /// transaction.
    pub async fn close(&self, lease: &Lease, outcome: &Outcome) -> Result<(), StoreError> {
        self.close_with_deltas(lease, &[], outcome).await
    }

    /// Statement 4 preceded by statement 3 for `deltas` (the segment's
    /// last buffered deltas), in one transaction: the stream's tail and the
    /// final message are written together.
    pub async fn close_with_deltas(&self, lease: &Lease, deltas: &[&str], outcome: &Outcome) -> Result<(), StoreError> {
        self.close_and_claim(lease, deltas, &[], outcome, None).await.map(drop)
    }

    /// [`Store::close_with_deltas`] with the segment's held puts (see
    /// [`HeldPut`]), then, when `next` names an owner and a
    /// lease length, statement 1 for one run in the same transaction: the
    /// worker that finishes a turn takes the next claimable run without a
    /// claim round trip of its own. Nothing is claimed when the close is
    /// rejected. Returns the run claimed, if any; its lease is running.
    pub async fn close_and_claim(
        &self,
        lease: &Lease,
        deltas: &[&str],
        puts: &[HeldPut],
        outcome: &Outcome,
        next: Option<(&str, Duration)>,
    ) -> Result<Option<Claimed>, StoreError> {
        self.close_charging(lease, deltas, puts, outcome, next, false).await
    }

    /// [`Store::close_and_claim`]; with `charge`, the close also counts the
    /// segment's attempt (`attempt + 1`), which its claim did not.
    pub async fn close_charging(
        &self,
        lease: &Lease,
        deltas: &[&str],
        puts: &[HeldPut],
        outcome: &Outcome,
        next: Option<(&str, Duration)>,
        charge: bool,
    ) -> Result<Option<Claimed>, StoreError> {
        let close = Close {
            lease: lease.clone(),
            deltas: deltas.iter().map(|d| d.to_string()).collect(),
            puts: puts.to_vec(),
            outcome: outcome.clone(),
            next: next.map(|(owner, ttl)| (owner.to_string(), ttl)),
            charge,
        };
        self.faults().before_close().await;
        crate::store::closes::close(self, close).await
    }

    /// PostgreSQL: statement 4 for a batch of closes (see
    /// [`crate::store::closes`]), each with its tail's deltas and held
    /// puts, and statement 1 for as many runs as closes that held and want
    /// a next run, in one statement. Returns each close's result in order:
    /// the run it claimed, if any, or [`StoreError::LeaseLost`].
    ///
    /// Each close is guarded by its own (owner, fence); a close that fails
    /// its guard writes nothing and does not stop the others. Closes on
    /// one thread may share a batch: the thread's counter moves on once by
    /// all of their events, and each close's events are numbered in batch
    /// order. The wanting closes of a batch share one owner and lease
    /// length.
    pub(crate) async fn close_batch(&self, closes: &[Close]) -> Result<Vec<Result<Option<Claimed>, StoreError>>, StoreError> {
        let database = self.database_id().await?;
        let next = wanted_next(closes)?;
        let derived = self.contracted(Step::DerivedMessages).await?;
        let (mut list, mut held) = (Vec::with_capacity(closes.len()), Vec::new());
        for (i, c) in closes.iter().enumerate() {
            let (status, output, error, payload) = closing(&c.outcome, derived);
            list.push(PgClose {
                i,
                id: c.lease.run_id,
                owner: &c.lease.owner,
                fence: c.lease.fence,
                status: status.as_str(),
                output,
                error,
                payload,
                deltas: &c.deltas,
                n: c.deltas.len(),
                want: c.next.is_some(),
                charge: c.charge,
            });
            held.extend(c.puts.iter().map(|p| held_put_json(i, &database, c.lease.run_id, p)));
        }
        // In run order (each close keeps its place `i`): PostgreSQL locks
        // the rows as it meets them, so batches that share runs (a
        // zombie's and its successor's, renewals) lock them in one order.
        list.sort_by_key(|c| c.id);
        let list = serde_json::to_string(&list).map_err(|e| StoreError::Corrupt(format!("a close batch: {e}")))?;
        let held = serde_json::Value::Array(held).to_string();
        let (list, held) = (list.as_str(), held.as_str());
        let (next_owner, next_ttl) = next.map_or(("", 0), |(o, t)| (o, ms(t)));
        let token = crate::store::orphans::token();
        let statement = if derived {
            sql!(
                self,
                concat!(
                    close_batch_input!(),
                    // Lock the closes' runs that hold, in run order, first:
                    // a close's `message_seq` comes from its thread's
                    // counter, moved on below, and goes in the same update.
                    "g AS (SELECT runs.id, runs.fence, runs.thread_id, runs.emit_pos AS first, runs.thread_seq AS held, b.i, b.n, b.want \
                     FROM b JOIN runs ON runs.id = b.id AND runs.lease_owner = b.owner AND runs.fence = b.fence \
                     AND runs.status = 'running' AND runs.lease_expires_at >= {clock} ORDER BY runs.id FOR UPDATE OF runs), ",
                    close_batch_numbering!("g"),
                    // Locked above: the guard held, and nobody else can
                    // have moved the run since.
                    "r AS (UPDATE runs SET ", close_batch_set!(), ", message_seq = s.base + s.n + 1, thread_seq = s.held + s.n + 1 \
                     FROM b JOIN s ON s.i = b.i WHERE runs.id = s.id \
                     RETURNING runs.id, runs.fence, runs.thread_id, s.i, s.want), ",
                    close_batch_deltas!(""),
                    close_batch_tail!()
                )
            )
        } else {
            sql!(
                self,
                concat!(
                    close_batch_input!(),
                    "r AS (UPDATE runs SET ", close_batch_set!(), ", thread_seq = runs.thread_seq + b.n + 1 \
                     FROM b WHERE runs.id = b.id AND runs.lease_owner = b.owner AND runs.fence = b.fence \
                     AND runs.status = 'running' AND runs.lease_expires_at >= {clock} \
                     RETURNING runs.id, runs.fence, runs.thread_id, runs.emit_pos - b.n AS first, \
                     runs.thread_seq - b.n - 1 AS held, b.i, b.n, \
                     b.payload, b.want), ",
                    close_batch_numbering!("r"),
                    close_batch_deltas!(
                        " UNION ALL SELECT s.thread_id, s.base + s.n + 1, s.id, s.fence, 'message', s.payload, {now} FROM s"
                    ),
                    close_batch_tail!()
                )
            )
        };
        let rows = self
            .retry(|| async move {
                sqlx::query(statement)
                .bind(list)
                .bind(held)
                .bind(next_owner)
                .bind(next_ttl)
                .bind(token)
                .fetch_all(self.writer())
                .await
                .map_err(StoreError::from)
                .and_then(|rows| if next.is_some() { self.faults().after_claim().map(|()| rows) } else { Ok(rows) })
            })
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                if let Some((owner, ttl)) = next {
                    self.hand_back_lost_claims(owner, token, ttl, &e).await;
                }
                return Err(e);
            }
        };
        if let Some(row) = rows.first() {
            let threads: Option<String> = row.try_get("closed_threads")?;
            for thread in serde_json::from_str::<Vec<String>>(threads.as_deref().unwrap_or("[]")).unwrap_or_default() {
                self.hub().wake(&thread);
            }
        }
        let closed: std::collections::HashSet<usize> = match rows.first() {
            Some(row) => row
                .try_get::<Option<String>, _>("closed")?
                .unwrap_or_default()
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().map_err(|_| StoreError::Corrupt(format!("closed: {s:?}"))))
                .collect::<Result<_, _>>()?,
            None => Default::default(),
        };
        let mut claimed = Vec::new();
        for row in &rows {
            if row.try_get::<Option<i64>, _>("id")?.is_some() {
                claimed.extend(claimed_rows(std::slice::from_ref(row), next_owner)?);
            }
        }
        // The runs claimed go to the closes that held and wanted one, in
        // batch order; there are never more of them than such closes.
        let mut claimed = claimed.into_iter();
        Ok(closes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if !closed.contains(&i) {
                    return Err(rejected(&c.lease));
                }
                Ok(if c.next.is_some() { claimed.next() } else { None })
            })
            .collect())
    }
}
