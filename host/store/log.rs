//! The durable thread event log: one gap-free sequence per thread. Every
//! event carries the run id and the fence of the segment that wrote it, and
//! is appended inside the same transaction as the run change it reports.

use sqlx::AnyConnection;

use crate::store::{Event, Store, StoreError, sql};

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
/// value: the events to append are numbered up to it. The upsert holds the
/// thread row's write lock until commit, so concurrent appends to one
/// thread get distinct, gap-free numbers.
pub(crate) async fn bump(
    store: &Store,
    conn: &mut AnyConnection,
    thread_id: &str,
    count: i64,
) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(sql!(
        store,
        "INSERT INTO threads (id, last_seq) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + $2 RETURNING last_seq"
    ))
    .bind(thread_id)
    .bind(count)
    .fetch_one(&mut *conn)
    .await?)
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

impl Store {
    /// Events of `thread_id` with `seq > after`, oldest first, at most `limit`.
    pub async fn events_after(
        &self,
        thread_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT {events} FROM events WHERE thread_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
        ))
        .bind(thread_id)
        .bind(after)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(Event::from_row).collect()
    }

    /// Events of `thread_id` with `seq > after`, oldest first: at most
    /// `limit`, and no more than about `max_bytes` of payload (always at
    /// least one, so a reader moves on past a large event). What an API page
    /// or an event stream reads at once.
    pub async fn events_page(&self, thread_id: &str, after: i64, limit: i64, max_bytes: i64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT * FROM (SELECT {events@e}, SUM(LENGTH(e.payload)) OVER (ORDER BY e.seq) AS running FROM events e \
             WHERE e.thread_id = $1 AND e.seq > $2 ORDER BY e.seq LIMIT $3) AS p \
             WHERE p.running - LENGTH(p.payload) < $4 ORDER BY p.seq"
        ))
        .bind(thread_id)
        .bind(after)
        .bind(limit)
        .bind(max_bytes)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(Event::from_row).collect()
    }

    /// The last event seq of each of `threads` that has events: one query
    /// for every stream a host has open, to find what other hosts wrote.
    pub async fn thread_heads(&self, threads: &[String]) -> Result<Vec<(String, i64)>, StoreError> {
        if threads.is_empty() {
            return Ok(Vec::new());
        }
        let list = serde_json::to_string(threads).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let statement = match self.backend() {
            crate::store::Backend::Sqlite => sql!(self, "SELECT id, last_seq FROM threads WHERE id IN (SELECT value FROM json_each($1))"),
            crate::store::Backend::Postgres => sql!(
                self,
                "SELECT id, last_seq FROM threads WHERE id IN (SELECT jsonb_array_elements_text($1::text::jsonb))"
            ),
        };
        Ok(sqlx::query_as(statement).bind(list).fetch_all(self.pool()).await?)
    }

    /// Every event a run wrote, in order.
    pub async fn run_events(&self, run_id: i64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT {events} FROM events WHERE run_id = $1 ORDER BY seq"
        ))
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(Event::from_row).collect()
    }
}
