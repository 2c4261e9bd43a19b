//! Group commit of submits.
//!
//! Each submit is a write and a commit, and a commit waits for the
//! database's log flush. Under many concurrent submits (an HTTP API with
//! many clients, the e2e bench's submitters) those flushes, not the
//! inserts, bound the submit rate. So submits made while another is in
//! flight wait in a queue and go to the database together: one statement
//! (PostgreSQL) or one transaction (SQLite) for the lot, one commit. A
//! submit made while fewer than [`writers`] batches are in flight goes at
//! once, so an idle host adds no delay.
//!
//! A batch never holds two submits to one thread or with one idempotency
//! key (the later waits for the next batch): a statement cannot bump one
//! thread's counter twice, and a repeated key must see the first submit
//! committed. When a batch fails as a whole, each of its submits is tried
//! on its own, so every caller gets its own result and its own error.

mod insert;

use std::collections::HashSet;

pub use insert::MAX_SUBMIT_BATCH;

use crate::store::group;
use crate::store::{NewRun, Run, Store, StoreError};

/// Most submits written by one batch.
pub(crate) const MAX_BATCH: usize = 64;

/// A submit, checked and with its thread id chosen.
#[derive(Debug, Clone)]
pub(crate) struct Submit {
    pub new: NewRun,
    pub thread_id: String,
    pub max_attempts: i64,
    /// The run's random secret, hex (see [`crate::store::Run::secret`]).
    pub secret: String,
    /// The run holds its new thread's event counter (`runs.thread_seq`):
    /// submitted without a thread, once [`Step::RunCounters`] is taken.
    ///
    /// [`Step::RunCounters`]: crate::store::contract::Step::RunCounters
    pub hold: bool,
}

/// Submits waiting to be group-committed.
pub(crate) type Queue = group::Queue<Submit, (Run, bool)>;

/// Queues `submit` and returns its result once its batch is written.
pub(crate) async fn submit(store: &Store, submit: Submit) -> Result<(Run, bool), StoreError> {
    store
        .submits
        .push(submit, writers(store), || {
            // Its own task: a caller that gives up (a dropped request) must
            // not stop the batch that carries other callers' submits.
            tokio::spawn(group::write_batches::<Submit>(store.clone()));
        })
        .await
}

fn count(store: &Store, submits: usize) {
    store.submits.count(submits);
    let metrics = crate::metrics::global();
    metrics.submits.fetch_add(submits as u64, std::sync::atomic::Ordering::Relaxed);
    metrics.submit_commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The next batch: queued submits in order, skipping (and leaving queued)
/// any whose thread or idempotency key is already in it. Empty means
/// nothing is queued, and the caller is no longer the writer.
fn take(store: &Store) -> Vec<(Submit, group::Reply<(Run, bool)>)> {
    let mut threads = HashSet::new();
    let mut keys = HashSet::new();
    store.submits.take(MAX_BATCH, |submit| {
        let clashes = threads.contains(&submit.thread_id)
            || submit.new.idempotency_key.as_ref().is_some_and(|k| keys.contains(k));
        if !clashes {
            threads.insert(submit.thread_id.clone());
            if let Some(k) = &submit.new.idempotency_key {
                keys.insert(k.clone());
            }
        }
        !clashes
    })
}

/// Batches in flight at once. SQLite: 1 (it has one writer). PostgreSQL:
/// 2, so that a couple of submits at once each go straight to the
/// database and only submits beyond those wait to be batched. Measured
/// with `bench e2e` on 2 cores: 4 submitters ran faster with 4 in flight
/// than with 1 (one batch at a time made every submit wait for the one in
/// flight). Once closes were group-committed too, 8 submitters wrote
/// about 1.5 submits per commit with 4 in flight (844 and 902 runs/s), 2.5
/// with 2 (998 and 1098), 4 with 1 (1008–1219).
fn writers(store: &Store) -> usize {
    match store.backend() {
        crate::store::Backend::Sqlite => 1,
        crate::store::Backend::Postgres => 2,
    }
}

impl group::Batched for Submit {
    type Out = (Run, bool);
    const WHAT: &'static str = "submits";

    fn queue(store: &Store) -> &std::sync::Arc<Queue> {
        &store.submits
    }

    fn take(store: &Store) -> Vec<(Submit, group::Reply<(Run, bool)>)> {
        take(store)
    }

    async fn write(store: &Store, submits: &[Submit]) -> Result<Vec<Result<(Run, bool), StoreError>>, StoreError> {
        Ok(store.insert_runs(submits).await?.into_iter().map(Ok).collect())
    }

    fn written(store: &Store, n: usize) {
        count(store, n);
    }

    /// New runs whose announcement no submit statement carried.
    fn idle(store: &Store) {
        store.flush_announcements();
    }
}
