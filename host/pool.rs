//! The worker pool: `workers` tasks, each claiming one run at a time and
//! running a segment of it. Idle workers sleep until work is signalled (in
//! process, and on PostgreSQL by `LISTEN`), with a slow poll as the fallback
//! that also picks up sleep timers and expired leases.
//!
//! Shutdown: [`WorkerPool::shutdown`] stops claiming, lets running segments
//! finish for the grace period, then stops the rest, which suspend their
//! runs as `waiting_takeover` and so release their leases. Segment futures
//! are awaited, never cancelled: a store future dropped half-way could leave
//! its pooled connection inside an open transaction.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::executor::Executor;
use crate::store::{Backend, Store, WORK_CHANNEL};

/// Pool settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Concurrent segments. Default: 4.
    pub workers: usize,
    /// How often an idle worker looks for work without being woken (sleep
    /// timers, expired leases of dead hosts, missed notifications).
    /// Default: 1 s.
    pub poll: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { workers: 4, poll: Duration::from_secs(1) }
    }
}

pub struct WorkerPool {
    executor: Arc<Executor>,
    stop_claiming: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl WorkerPool {
    pub fn start(store: Store, executor: Arc<Executor>, config: PoolConfig) -> WorkerPool {
        let (stop_claiming, stopping) = watch::channel(false);
        let mut tasks = JoinSet::new();
        if store.backend() == Backend::Postgres {
            tasks.spawn(listen(store.clone(), stopping.clone()));
        }
        for n in 0..config.workers.max(1) {
            tasks.spawn(worker(n, store.clone(), executor.clone(), config.poll, stopping.clone()));
        }
        WorkerPool { executor, stop_claiming, tasks }
    }

    /// Stops claiming, waits up to `grace` for running segments, then stops
    /// the rest (they suspend as `waiting_takeover`) and waits for them.
    pub async fn shutdown(mut self, grace: Duration) {
        let _ = self.stop_claiming.send(true);
        let drained = tokio::time::timeout(grace, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(?grace, "grace period over; suspending the segments still running");
            self.executor.stop_guests();
            while self.tasks.join_next().await.is_some() {}
        }
    }
}

async fn worker(n: usize, store: Store, exec: Arc<Executor>, poll: Duration, mut stopping: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(100);
    while !*stopping.borrow() {
        // Registered before looking, so a signal sent while this worker
        // looks is not missed.
        let notified = store.work_signal().notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match exec.run_once().await {
            Ok(Some((run_id, outcome))) => {
                tracing::debug!(worker = n, run_id, ?outcome, "segment done");
                backoff = Duration::from_millis(100);
                continue;
            }
            Ok(None) => {
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep(poll) => {}
                    _ = stopping.changed() => {}
                }
            }
            Err(e) => {
                // The database is unreachable or failing: keep the host up
                // and try again, backing off to 5 s.
                tracing::warn!(worker = n, error = %e, ?backoff, "claiming failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// PostgreSQL: relays `NOTIFY leasehold_work` from other hosts to this
/// process's idle workers. Reconnects with backoff; workers poll meanwhile.
async fn listen(store: Store, mut stopping: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(200);
    while !*stopping.borrow() {
        let mut listener = match sqlx::postgres::PgListener::connect(store.url()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; polling meanwhile");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        if let Err(e) = listener.listen(WORK_CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; polling meanwhile");
            continue;
        }
        backoff = Duration::from_millis(200);
        loop {
            tokio::select! {
                msg = listener.recv() => match msg {
                    Ok(_) => store.work_signal().notify_waiters(),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                        break;
                    }
                },
                _ = stopping.changed() => return,
            }
        }
    }
}
