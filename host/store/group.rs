//! Group commit: the queue shared by submits ([`super::submits`]) and
//! closes ([`super::closes`]).
//!
//! Each write is a statement and a commit, and on a small machine the cost
//! of a statement (its round trip, executor start-up and commit) is most of
//! the cost of a small write. So a write made while enough others are in
//! flight waits in a queue, and the waiting ones go to the database
//! together. A write made while fewer than `max_writers` batches are in
//! flight goes at once, so an idle host adds no delay.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::store::{Backend, Store, StoreError};

/// How long a write waits for its answer before it starts another batch
/// writer for the writes queued behind a slow batch (see [`Queue::push`]).
/// Default: 200 ms, some 100 times a batch's usual time.
pub(crate) const STALLED: std::time::Duration = std::time::Duration::from_millis(200);

/// Most batch writers at once, counting those started for stalled writes.
pub(crate) const STALLED_WRITERS: usize = 8;

/// Where a write's result goes.
pub(crate) type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

/// Writes waiting for a batch, and the batch writers running.
#[derive(Debug)]
pub(crate) struct Queue<T, R> {
    state: Mutex<State<T, R>>,
    /// Writes written, and the commits that wrote them.
    written: AtomicU64,
    commits: AtomicU64,
    /// Writers started for writes left waiting behind a slow batch.
    stalls: AtomicU64,
    /// Batches the database rolled back, written again one by one.
    split: AtomicU64,
}

#[derive(Debug)]
struct State<T, R> {
    waiting: Vec<(T, Reply<R>)>,
    /// Tasks writing batches; each takes what is queued until nothing is.
    writers: usize,
}

impl<T, R> Default for Queue<T, R> {
    fn default() -> Self {
        Queue {
            state: Mutex::new(State { waiting: Vec::new(), writers: 0 }),
            written: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            split: AtomicU64::new(0),
        }
    }
}

impl<T, R> Queue<T, R> {
    /// Writes queued and not yet taken.
    fn waiting(&self) -> usize {
        self.state.lock().expect("group commit queue lock").waiting.len()
    }
}

impl<T: Send + 'static, R: Send + 'static> Queue<T, R> {
    /// Queues `item` and returns its result once its batch is written. When
    /// fewer than `max_writers` batch writers run, `spawn_writer` is called
    /// to start one (it must call [`Queue::take`] until that returns an
    /// empty batch).
    ///
    /// A write still unanswered after [`STALLED`] starts one more writer
    /// when writes are queued (up to [`STALLED_WRITERS`]): the batch in
    /// flight may be waiting on a row lock (another host's transaction, a
    /// stopped process), and the writes behind it must not all wait for it.
    pub(crate) async fn push(&self, item: T, max_writers: usize, spawn_writer: impl Fn()) -> Result<R, StoreError> {
        let (reply, mut result) = oneshot::channel();
        let start = {
            let mut state = self.state.lock().expect("group commit queue lock");
            state.waiting.push((item, reply));
            let start = state.writers < max_writers;
            if start {
                state.writers += 1;
            }
            start
        };
        if start {
            spawn_writer();
        }
        loop {
            tokio::select! {
                answer = &mut result => {
                    return answer.map_err(|_| StoreError::Unknown("the batch writer stopped before answering".into()))?;
                }
                _ = tokio::time::sleep(STALLED) => {
                    let start = {
                        let mut state = self.state.lock().expect("group commit queue lock");
                        let start = !state.waiting.is_empty() && state.writers < max_writers.max(STALLED_WRITERS);
                        if start {
                            state.writers += 1;
                        }
                        start
                    };
                    if start {
                        self.stalls.fetch_add(1, Relaxed);
                        tracing::debug!(writers = max_writers, "a batch is slow; starting another writer for the writes queued behind it");
                        spawn_writer();
                    }
                }
            }
        }
    }

    /// The next batch: at most `max` queued writes in order, skipping (and
    /// leaving queued) those `fits` refuses. `fits` sees the writes in
    /// queue order and is told of each one taken, so it can refuse what
    /// clashes with them. Empty means nothing is queued, and the caller is
    /// no longer a writer.
    pub(crate) fn take(&self, max: usize, mut fits: impl FnMut(&T) -> bool) -> Vec<(T, Reply<R>)> {
        let mut state = self.state.lock().expect("group commit queue lock");
        let mut batch = Vec::new();
        let mut kept = Vec::new();
        for (item, reply) in state.waiting.drain(..) {
            if batch.len() < max && fits(&item) {
                batch.push((item, reply));
            } else {
                kept.push((item, reply));
            }
        }
        state.waiting = kept;
        if batch.is_empty() {
            state.writers -= 1;
        }
        batch
    }

    /// Counts a commit that wrote `items` writes.
    pub(crate) fn count(&self, items: usize) {
        self.written.fetch_add(items as u64, Relaxed);
        self.commits.fetch_add(1, Relaxed);
    }

    /// Writes written through this queue, and the commits that wrote them.
    pub(crate) fn written(&self) -> (u64, u64) {
        (self.written.load(Relaxed), self.commits.load(Relaxed))
    }

    /// Writers started because writes waited [`STALLED`] behind a batch.
    pub(crate) fn stalls(&self) -> u64 {
        self.stalls.load(Relaxed)
    }

    /// Batches the database rolled back and that were written again one
    /// write at a time.
    pub(crate) fn split(&self) -> u64 {
        self.split.load(Relaxed)
    }
}

/// A kind of write that is group-committed: how a writer takes, writes
/// and counts its batches ([`write_batches`]).
pub(crate) trait Batched: Sized + Send + Sync + 'static {
    type Out: Send + 'static;
    /// The writes' name, plural, for logs and errors.
    const WHAT: &'static str;
    fn queue(store: &Store) -> &Arc<Queue<Self, Self::Out>>;
    /// The next batch (see [`Queue::take`]).
    fn take(store: &Store) -> Vec<(Self, Reply<Self::Out>)>;
    /// Writes `items` with one commit; each one's result, in order. An
    /// error fails them all.
    fn write<'a>(
        store: &'a Store,
        items: &'a [Self],
    ) -> impl Future<Output = Result<Vec<Result<Self::Out, StoreError>>, StoreError>> + Send + 'a;
    /// Counts a commit that wrote `n` of them.
    fn written(store: &Store, n: usize);
    /// Called when a writer finds the queue empty, before it stops.
    fn idle(_store: &Store) {}
    /// Sends this write's result to its caller.
    fn answer(&self, _store: &Store, reply: Reply<Self::Out>, result: Result<Self::Out, StoreError>) {
        let _ = reply.send(result);
    }
}

/// A batch writer: writes batches of `B` until the queue is empty. A batch
/// the database rolled back is written again one write at a time, so each
/// caller gets its own result and its own error; a batch that may have
/// been written is not (see [`rolled_back`]).
pub(crate) async fn write_batches<B: Batched>(store: Store) {
    let mut writing = Writing::new(B::queue(&store).clone());
    loop {
        if store.backend() == Backend::Sqlite {
            gather(B::queue(&store)).await;
        }
        let batch = B::take(&store);
        if batch.is_empty() {
            writing.done();
            B::idle(&store);
            return;
        }
        tracing::trace!(writes = batch.len(), "writing a batch of {}", B::WHAT);
        let (items, replies): (Vec<B>, Vec<_>) = batch.into_iter().unzip();
        if items.len() > 1 {
            match B::write(&store, &items).await {
                Ok(results) => {
                    B::written(&store, items.len());
                    for ((item, reply), result) in items.iter().zip(replies).zip(results) {
                        item.answer(&store, reply, result);
                    }
                    continue;
                }
                Err(e) if rolled_back(&e) => {
                    B::queue(&store).split.fetch_add(1, Relaxed);
                    if crate::store::is_lock_timeout(&e) {
                        // One row another session holds: written one by one,
                        // only that write waits (and gives up) again.
                        crate::metrics::global().lock_timeouts.fetch_add(1, Relaxed);
                        tracing::warn!(writes = items.len(), "a batch of {} gave up waiting for a row lock; writing them one by one", B::WHAT);
                    } else {
                        tracing::debug!(error = %e, writes = items.len(), "a batch of {} failed; writing them one by one", B::WHAT);
                    }
                }
                Err(e) => {
                    unknown(replies, B::WHAT, &e);
                    continue;
                }
            }
        }
        for (item, reply) in items.iter().zip(replies) {
            let result = B::write(&store, std::slice::from_ref(item)).await;
            match &result {
                Ok(_) => B::written(&store, 1),
                Err(e) if crate::store::is_lock_timeout(e) => {
                    crate::metrics::global().lock_timeouts.fetch_add(1, Relaxed);
                }
                Err(_) => {}
            }
            let result = result.and_then(|mut r| {
                r.pop()
                    .unwrap_or_else(|| Err(StoreError::Config(format!("one of the {} was written without a result", B::WHAT))))
            });
            item.answer(&store, reply, result);
        }
    }
}

/// SQLite: before a batch is taken, lets the tasks that are about to
/// queue a write (turns ending together) run and queue it, by yielding to
/// the runtime while the queue grows, up to [`GATHER_YIELDS`] times. A
/// SQLite batch costs mostly per batch (its statements' hand-offs to the
/// connection's thread, and the fsync), so fuller batches cost less per
/// write; on a quiet host the queue does not grow and one yield is all it
/// costs. Measured with `bench drain` (20,000 no-op runs, 16 workers,
/// `synchronous=full`, the same build with and without it, alternating):
/// faster in 7 of 8 pairs, by about a half at the median, with a quarter
/// less CPU per run. PostgreSQL, whose batch goes to another process, ran
/// 2–10% slower with it, so it does not gather.
async fn gather<T, R>(queue: &Queue<T, R>) {
    let mut queued = queue.waiting();
    for _ in 0..GATHER_YIELDS {
        tokio::task::yield_now().await;
        let now = queue.waiting();
        if now == queued {
            return;
        }
        queued = now;
    }
}

/// Most yields [`gather`] makes before a batch: 8.
const GATHER_YIELDS: usize = 8;

/// True when `e`, a batch's error, means the database rolled the batch
/// back (it reported an error for the statement or transaction): its
/// writes can then be tried one by one. Any other error (a broken
/// connection, a result that could not be read) may come after the commit,
/// and written again, a close would fail its guard and report a lost
/// lease, a submit without an idempotency key would make a second run.
fn rolled_back(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(sqlx::Error::Database(_))) && !session_lost(e)
}

/// True when `e` says the session itself broke: an I/O or protocol error,
/// or the server ending it (PostgreSQL `admin_shutdown`, `crash_shutdown`,
/// `cannot_connect_now`, and the connection exceptions, class 08). A
/// statement in flight then may have committed before its reply was lost.
pub(crate) fn session_lost(e: &StoreError) -> bool {
    match e {
        StoreError::Db(sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed) => true,
        StoreError::Db(sqlx::Error::Database(db)) => {
            db.code().is_some_and(|c| matches!(c.as_ref(), "57P01" | "57P02" | "57P03") || c.starts_with("08"))
        }
        _ => false,
    }
}

/// Tells each caller of a batch that failed in a way that does not say
/// whether it was written (see [`rolled_back`]).
fn unknown<R>(replies: Vec<Reply<R>>, what: &str, e: &StoreError) {
    let n = replies.len();
    tracing::warn!(error = %e, writes = n, "a batch of {what} failed; whether it was written is unknown");
    for reply in replies {
        let _ = reply.send(Err(StoreError::Unknown(format!("a batch of {n} {what} failed: {e}"))));
    }
}

/// Held by a batch writer task until [`Writing::done`]. Should the task
/// end before that (it panicked, or it was dropped while awaiting the
/// database), its count is released: its callers get an error (their reply
/// senders are dropped) when no writer is left, and the next write starts
/// a new writer, rather than every later write waiting for a writer that
/// is gone.
pub(crate) struct Writing<T, R> {
    queue: Arc<Queue<T, R>>,
    done: bool,
}

impl<T, R> Writing<T, R> {
    pub(crate) fn new(queue: Arc<Queue<T, R>>) -> Self {
        Writing { queue, done: false }
    }

    /// The writer found the queue empty ([`Queue::take`] released its
    /// count).
    pub(crate) fn done(&mut self) {
        self.done = true;
    }
}

impl<T, R> Drop for Writing<T, R> {
    fn drop(&mut self) {
        if !self.done {
            let mut state = self.queue.state.lock().unwrap_or_else(|p| p.into_inner());
            state.writers -= 1;
            if state.writers == 0 {
                state.waiting.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A writer that answers every write with its value times ten.
    fn answering_writer(q: Arc<Queue<u32, u32>>) {
        tokio::spawn(async move {
            let mut writing = Writing::new(q.clone());
            loop {
                let batch = q.take(8, |_| true);
                if batch.is_empty() {
                    writing.done();
                    return;
                }
                for (v, reply) in batch {
                    let _ = reply.send(Ok(v * 10));
                }
            }
        });
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_gathered_batch_holds_the_writes_of_tasks_ready_to_queue_them() {
        let q: Arc<Queue<u32, u32>> = Arc::default();
        let push = |v: u32| {
            let q = q.clone();
            // No writer is started: the test takes the batch itself.
            tokio::spawn(async move { q.push(v, 0, || {}).await })
        };
        let first = push(0);
        tokio::task::yield_now().await;
        assert_eq!(q.waiting(), 1);
        // Turns that have ended and are about to queue their writes.
        let rest: Vec<_> = (1..8).map(push).collect();
        gather(&q).await;
        let batch = q.take(64, |_| true);
        assert_eq!(batch.len(), 8, "the batch waited for the writes ready to be queued");
        for (v, reply) in batch {
            let _ = reply.send(Ok(v));
        }
        for task in std::iter::once(first).chain(rest) {
            task.await.expect("joined").expect("answered");
        }
    }

    #[tokio::test]
    async fn writes_behind_a_stuck_batch_get_another_writer() {
        let q: Arc<Queue<u32, u32>> = Arc::default();
        let (taken_tx, taken_rx) = oneshot::channel();
        let taken_tx = Arc::new(Mutex::new(Some(taken_tx)));
        let q2 = q.clone();
        // The first writer takes its batch and never answers (its statement
        // waits on a lock); later writers answer.
        let writers = Arc::new(AtomicU64::new(0));
        let spawn = {
            let writers = writers.clone();
            move || {
                if writers.fetch_add(1, Relaxed) == 0 {
                    let q = q2.clone();
                    let tx = taken_tx.lock().unwrap().take();
                    tokio::spawn(async move {
                        let _writing = Writing::new(q.clone());
                        let _batch = q.take(8, |_| true);
                        if let Some(tx) = tx {
                            let _ = tx.send(());
                        }
                        std::future::pending::<()>().await;
                    });
                } else {
                    answering_writer(q2.clone());
                }
            }
        };
        let stuck = {
            let (q, spawn) = (q.clone(), spawn.clone());
            tokio::spawn(async move { q.push(1, 1, spawn).await })
        };
        taken_rx.await.expect("the first writer took its batch");
        let behind = tokio::time::timeout(Duration::from_secs(5), q.push(2, 1, spawn)).await;
        assert_eq!(behind.expect("answered by another writer").expect("written"), 20);
        assert!(!stuck.is_finished());
        stuck.abort();
    }

    #[tokio::test]
    async fn a_writer_dropped_mid_batch_fails_its_callers_and_the_next_write_starts_another() {
        let q: Arc<Queue<u32, u32>> = Arc::default();
        let (taken_tx, taken_rx) = oneshot::channel();
        let (writer_tx, writer_rx) = oneshot::channel();
        let (taken_tx, writer_tx) = (Mutex::new(Some(taken_tx)), Mutex::new(Some(writer_tx)));
        let first = {
            let q = q.clone();
            tokio::spawn(async move {
                let q2 = q.clone();
                q.push(1, 1, move || {
                    // A writer stuck on the database, then dropped (its task
                    // aborted, as at runtime shutdown).
                    let q2 = q2.clone();
                    let taken_tx = taken_tx.lock().unwrap().take();
                    let task = tokio::spawn(async move {
                        let _writing = Writing::new(q2.clone());
                        let _batch = q2.take(8, |_| true);
                        if let Some(tx) = taken_tx {
                            let _ = tx.send(());
                        }
                        std::future::pending::<()>().await;
                    });
                    if let Some(tx) = writer_tx.lock().unwrap().take() {
                        let _ = tx.send(task);
                    }
                })
                .await
            })
        };
        taken_rx.await.expect("the writer took the batch");
        writer_rx.await.expect("a writer was started").abort();
        let got = tokio::time::timeout(Duration::from_secs(5), first).await.expect("the caller was answered");
        assert!(matches!(got.expect("joined"), Err(StoreError::Unknown(_))));
        let q2 = q.clone();
        let second = q.push(2, 1, move || answering_writer(q2.clone()));
        let got = tokio::time::timeout(Duration::from_secs(5), second).await.expect("a new writer answered");
        assert_eq!(got.expect("written"), 20);
    }
}
