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

use crate::store::StoreError;

/// Where a write's result goes.
pub(crate) type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

/// Writes waiting for a batch, and the batch writers running.
#[derive(Debug)]
pub(crate) struct Queue<T, R> {
    state: Mutex<State<T, R>>,
    /// Writes written, and the commits that wrote them.
    written: AtomicU64,
    commits: AtomicU64,
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
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> Queue<T, R> {
    /// Queues `item` and returns its result once its batch is written. When
    /// fewer than `max_writers` batch writers run, `spawn_writer` is called
    /// to start one (it must call [`Queue::take`] until that returns an
    /// empty batch).
    pub(crate) async fn push(&self, item: T, max_writers: usize, spawn_writer: impl FnOnce()) -> Result<R, StoreError> {
        let (reply, result) = oneshot::channel();
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
        result
            .await
            .map_err(|_| StoreError::Config("the batch writer stopped before answering".into()))?
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
}

/// Held by a batch writer task. Should it panic, its callers get an error
/// (their reply senders are dropped) and the next write starts a new
/// writer, rather than every later write waiting for a writer that is gone.
pub(crate) struct Writing<T, R>(pub Arc<Queue<T, R>>);

impl<T, R> Drop for Writing<T, R> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
            state.writers -= 1;
            if state.writers == 0 {
                state.waiting.clear();
            }
        }
    }
}
