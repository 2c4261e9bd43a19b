//! The durable thread event log: one gap-free sequence per thread. Every
//! event carries the run id and the fence of the segment that wrote it, and
//! is appended inside the same transaction as the run change it reports.

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use crate::store::{Backend, Event, RunStatus, Store, StoreError, sql};

/// Event kinds written by the host.
pub mod kind {
    /// A run was submitted; payload `{plugin, input}`.
    pub const SUBMITTED: &str = "submitted";
    /// A streamed output delta; payload `{pos, delta}`.
    pub const DELTA: &str = "delta";
    /// The run's final message; payload `{status, output, error}`.
    pub const MESSAGE: &str = "message";
    /// The run suspended; payload `{status, prompt?, not_before?}`.
    pub const SUSPENDED: &str = "suspended";
    /// Input was delivered; payload `{input}`.
    pub const INPUT: &str = "input";
    /// The run was cancelled.
    pub const CANCELLED: &str = "cancelled";
    /// Stream positions `from..to` of this run, written by a segment that
    /// died, are void; payload `{from, to}`. Readers drop those deltas.
    pub const RETRACT: &str = "retract";
    /// An operator resolved an effect by hand; payload `{seq, outcome, by,
    /// status}` (`store::resolve`).
    pub const RESOLVED: &str = "resolved";
    /// An operator paused the run; payload `{status}` (`store::pause`).
    pub const PAUSED: &str = "paused";
    /// An operator resumed the paused run; payload `{status}`.
    pub const RESUMED: &str = "resumed";
}

/// Applies a run's `delta` and `retract` events, in log order, as a reader
/// should: returns the deltas that stand, by position.
pub fn replay_stream<'a>(events: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let mut stream: Vec<String> = Vec::new();
    for (kind, payload) in events {
        let v: serde_json::Value = serde_json::from_str(payload).unwrap_or_default();
        match kind {
            kind::DELTA => {
                let pos = v["pos"].as_i64().unwrap_or(0).max(0) as usize;
                let delta = v["delta"].as_str().unwrap_or_default().to_string();
                stream.truncate(pos);
                stream.push(delta);
            }
            kind::RETRACT => stream.truncate(v["from"].as_i64().unwrap_or(0).max(0) as usize),
            _ => {}
        }
    }
    stream
}

/// Moves `thread_id`'s event counter on by `count` and returns its new
/// value: the events to append are numbered up to it. The write holds the
/// counter's lock until commit, so concurrent appends to one thread get
/// distinct, gap-free numbers.
///
/// A thread's counter is its `threads` row, or, for a thread made by a
/// run's submit while it has that run alone, the run's `thread_seq`
/// ([`Step::RunCounters`]). Anything but that run's own emits and close
/// moves such a count to a `threads` row here, clearing `thread_seq` for
/// good, so a thread with a `threads` row never has a run that holds its
/// counter and a lookup for one meets the thread's one run.
///
/// [`Step::RunCounters`]: crate::store::contract::Step::RunCounters
pub(crate) async fn bump(
    store: &Store,
    conn: &mut AnyConnection,
    thread_id: &str,
    count: i64,
) -> Result<i64, StoreError> {
    if store.backend() == Backend::Postgres {
        // One statement: the holding run, looked for only when the thread
        // has no row (a one-time filter), locked first (runs before
        // threads, as a close batch locks them) and read as its last
        // committed version, so an emit or close of it that was writing is
        // counted; a writer that took the count over first has cleared it.
        // No fence in `c`: it moves a count out of a row it has locked and
        // changes none of the run's state, lease or output; the holder's
        // own writes read `thread_seq` after the lock, so see it cleared.
        return Ok(sqlx::query_scalar(
            "WITH h AS (SELECT id, thread_seq FROM runs WHERE thread_id = $1 AND thread_seq IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM threads WHERE id = $1) ORDER BY id FOR NO KEY UPDATE), \
             c AS (UPDATE runs SET thread_seq = NULL FROM h WHERE runs.id = h.id) \
             INSERT INTO threads (id, last_seq) SELECT $1, COALESCE((SELECT MAX(thread_seq) FROM h), 0) + $2 \
             ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + $2 RETURNING last_seq",
        )
        .bind(thread_id)
        .bind(count)
        .fetch_one(&mut *conn)
        .await?);
    }
    // SQLite, the one writer: nothing moves between the statements. The
    // thread's row when it has one; without, one made from any count a run
    // of the thread held, which is then cleared.
    let bumped: Option<i64> =
        sqlx::query_scalar(sql!(store, "UPDATE threads SET last_seq = last_seq + $2 WHERE id = $1 RETURNING last_seq"))
            .bind(thread_id)
            .bind(count)
            .fetch_optional(&mut *conn)
            .await?;
    if let Some(last) = bumped {
        return Ok(last);
    }
    let last: i64 = sqlx::query_scalar(sql!(
        store,
        "INSERT INTO threads (id, last_seq) SELECT $1, COALESCE((SELECT MAX(thread_seq) FROM runs \
         WHERE thread_id = $1 AND thread_seq IS NOT NULL), 0) + $2 WHERE true \
         ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + $2 RETURNING last_seq"
    ))
    .bind(thread_id)
    .bind(count)
    .fetch_one(&mut *conn)
    .await?;
    // Unfenced as on PostgreSQL: only the count moves, under the one writer.
    sqlx::query(sql!(store, "UPDATE runs SET thread_seq = NULL WHERE thread_id = $1 AND thread_seq IS NOT NULL"))
        .bind(thread_id)
        .execute(&mut *conn)
        .await?;
    Ok(last)
}

/// Appends one event to `thread_id`'s log on `conn` (inside the caller's
/// transaction) and returns its sequence number.
///
/// The per-thread counter row is locked by the upsert, so concurrent runs of
/// one thread get distinct, gap-free sequence numbers.
pub(crate) async fn append(
    store: &Store,
    conn: &mut AnyConnection,
    thread_id: &str,
    run_id: i64,
    fence: i64,
    kind: &str,
    payload: &serde_json::Value,
) -> Result<i64, StoreError> {
    let seq = bump(store, conn, thread_id, 1).await?;
    sqlx::query(sql!(
        store,
        "INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, {now})"
    ))
    .bind(thread_id)
    .bind(seq)
    .bind(run_id)
    .bind(fence)
    .bind(kind)
    .bind(payload.to_string())
    .execute(&mut *conn)
    .await?;
    Ok(seq)
}

/// A thread's log as readers see it: its `events` rows and, once
/// [`contract::Step::DerivedMessages`] is taken, the `message` event of
/// each closed run that has a `message_seq`, read from the run row (its
/// payload made by [`message_payload`] as the row is decoded). `size` is
/// what a page counts of an event's bytes. `$1` is the thread, `$2` the
/// position read after, `$3` the most events read.
///
/// Each side is cut to `$3` in its own index's order first: PostgreSQL
/// does not merge the two index scans of a bare `UNION ALL`, and sorted
/// the whole rest of a long thread for each page (100 ms a page of a
/// 100,000-event thread, against 1 ms from the events alone).
///
/// [`contract::Step::DerivedMessages`]: crate::store::contract::Step::DerivedMessages
macro_rules! thread_log {
    () => {
        "SELECT * FROM (SELECT thread_id, seq, run_id, fence, kind, payload, created_at, CAST(NULL AS TEXT) AS status, \
         CAST(NULL AS TEXT) AS output, CAST(NULL AS TEXT) AS error, LENGTH(payload) AS size \
         FROM events WHERE thread_id = $1 AND seq > $2 ORDER BY seq LIMIT $3) AS written \
         UNION ALL SELECT * FROM (SELECT thread_id, message_seq, id, fence, 'message', NULL, finished_at, status, output, error, \
         LENGTH(COALESCE(output, '')) + LENGTH(COALESCE(error, '')) + 40 \
         FROM runs WHERE thread_id = $1 AND message_seq > $2 ORDER BY message_seq LIMIT $3) AS derived"
    };
}

/// A closed run's `message` event payload: `{error, output, status}`, in
/// name order (the order a `json!` object wrote them in, so payloads read
/// the same whether written or derived).
pub(crate) fn message_payload(status: RunStatus, output: Option<&str>, error: Option<&str>) -> String {
    #[derive(serde::Serialize)]
    struct Message<'a> {
        error: Option<&'a str>,
        output: Option<&'a str>,
        status: RunStatus,
    }
    serde_json::to_string(&Message { error, output, status }).expect("a message payload serializes")
}

/// The `message` payload a closed run's row says (its `status`, `output`
/// and `error` columns).
fn payload_of_run(row: &AnyRow) -> Result<String, StoreError> {
    let status: String = row.try_get("status")?;
    let (output, error): (Option<String>, Option<String>) = (row.try_get("output")?, row.try_get("error")?);
    Ok(message_payload(status.parse()?, output.as_deref(), error.as_deref()))
}

/// An event of [`thread_log!`]'s shape: a derived `message` has no
/// payload of its own and gets it from its run's columns.
fn logged(row: &AnyRow) -> Result<Event, StoreError> {
    let payload: Option<String> = row.try_get("payload")?;
    let payload = match payload {
        Some(payload) => payload,
        None => payload_of_run(row)?,
    };
    Ok(Event {
        thread_id: row.try_get("thread_id")?,
        seq: row.try_get("seq")?,
        run_id: row.try_get("run_id")?,
        fence: row.try_get("fence")?,
        kind: row.try_get("kind")?,
        payload,
        created_at: row.try_get("created_at")?,
    })
}

/// Writes run `run_id`'s derived `message` event, if it has one, as an
/// `events` row and clears its `message_seq`, on `conn` (inside the
/// caller's transaction): before a change to the run's status, output or
/// error that would change what the derived event says (a failed run
/// queued again, `store::resolve`). Returns whether there was one.
pub(crate) async fn keep_message(store: &Store, conn: &mut AnyConnection, run_id: i64) -> Result<bool, StoreError> {
    let row = sqlx::query(sql!(
        store,
        "SELECT thread_id, message_seq, fence, status, output, error, finished_at FROM runs WHERE id = $1 AND message_seq IS NOT NULL"
    ))
    .bind(run_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(false) };
    let payload = payload_of_run(&row)?;
    let fence: i64 = row.try_get("fence")?;
    sqlx::query(sql!(
        store,
        "INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at) VALUES ($1, $2, $3, $4, 'message', $5, $6)"
    ))
    .bind(row.try_get::<String, _>("thread_id")?)
    .bind(row.try_get::<i64, _>("message_seq")?)
    .bind(run_id)
    .bind(fence)
    .bind(payload)
    .bind(row.try_get::<i64, _>("finished_at")?)
    .execute(&mut *conn)
    .await?;
    // The fence read above: the caller holds the run (resolve's lock).
    sqlx::query(sql!(store, "UPDATE runs SET message_seq = NULL WHERE id = $1 AND fence = $2"))
        .bind(run_id)
        .bind(fence)
        .execute(&mut *conn)
        .await?;
    Ok(true)
}

/// [`Store::events_page`]'s statement: `$1` the thread, `$2` the position
/// read after, `$3` the most events, `$4` about the most bytes. For the
/// tests of its plan.
#[doc(hidden)]
pub fn events_page_sql(store: &Store) -> &'static str {
    sql!(
        store,
        concat!(
            "SELECT * FROM (SELECT l.*, SUM(l.size) OVER (ORDER BY l.seq) AS running FROM (",
            thread_log!(),
            ") AS l ORDER BY l.seq LIMIT $3) AS p WHERE p.running - p.size < $4 ORDER BY p.seq"
        )
    )
}

impl Store {
    /// Events of `thread_id` with `seq > after`, oldest first, at most `limit`.
    pub async fn events_after(
        &self,
        thread_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(sql!(self, concat!("SELECT * FROM (", thread_log!(), ") AS l ORDER BY seq LIMIT $3")))
            .bind(thread_id)
            .bind(after)
            .bind(limit)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(logged).collect()
    }

    /// Events of `thread_id` with `seq > after`, oldest first: at most
    /// `limit`, and no more than about `max_bytes` of payload (always at
    /// least one, so a reader moves on past a large event). What an API page
    /// or an event stream reads at once.
    pub async fn events_page(&self, thread_id: &str, after: i64, limit: i64, max_bytes: i64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(events_page_sql(self))
        .bind(thread_id)
        .bind(after)
        .bind(limit)
        .bind(max_bytes)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(logged).collect()
    }

    /// The last event seq of each of `threads` that has events: one query
    /// for every stream a host has open, to find what other hosts wrote.
    /// A thread's counter is its `threads` row or, without one, the count
    /// its one run holds (see [`bump`]).
    pub async fn thread_heads(&self, threads: &[String]) -> Result<Vec<(String, i64)>, StoreError> {
        if threads.is_empty() {
            return Ok(Vec::new());
        }
        let list = serde_json::to_string(threads).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let statement = match self.backend() {
            crate::store::Backend::Sqlite => sql!(
                self,
                "WITH w AS (SELECT value AS id FROM json_each($1)) \
                 SELECT threads.id, last_seq FROM threads JOIN w ON w.id = threads.id \
                 UNION ALL SELECT thread_id, thread_seq FROM runs JOIN w ON runs.thread_id = w.id \
                 WHERE thread_seq IS NOT NULL AND NOT EXISTS (SELECT 1 FROM threads WHERE threads.id = w.id)"
            ),
            crate::store::Backend::Postgres => sql!(
                self,
                "WITH w AS (SELECT jsonb_array_elements_text($1::text::jsonb) AS id) \
                 SELECT threads.id, last_seq FROM threads JOIN w ON w.id = threads.id \
                 UNION ALL SELECT thread_id, thread_seq FROM runs JOIN w ON runs.thread_id = w.id \
                 WHERE thread_seq IS NOT NULL AND NOT EXISTS (SELECT 1 FROM threads WHERE threads.id = w.id)"
            ),
        };
        Ok(sqlx::query_as(statement).bind(list).fetch_all(self.pool()).await?)
    }

    /// Every event a run wrote, in order.
    pub async fn run_events(&self, run_id: i64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT * FROM (SELECT thread_id, seq, run_id, fence, kind, payload, created_at, CAST(NULL AS TEXT) AS status, \
             CAST(NULL AS TEXT) AS output, CAST(NULL AS TEXT) AS error FROM events WHERE run_id = $1 \
             UNION ALL SELECT thread_id, message_seq, id, fence, 'message', NULL, finished_at, status, output, error \
             FROM runs WHERE id = $1 AND message_seq IS NOT NULL) AS l ORDER BY seq"
        ))
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(logged).collect()
    }
}
