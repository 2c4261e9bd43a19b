//! Contract steps: schema changes a previous release's host would not
//! understand, switched on for the whole database once none runs.
//!
//! A schema change is expand, then contract (docs/operations.md,
//! "Upgrades"). A migration only expands: the previous release's hosts
//! keep working on it during a rolling upgrade. A change in what the hosts
//! *write* that those hosts could not read waits for its contract step:
//! this release's hosts write the old way until an operator, with every
//! host upgraded, runs `leasehold schema contract`, which records the step
//! in `contract_steps`. Hosts see it within [`RECHECK`]; until they do they
//! write the old way, which this release reads as well.
//!
//! A database this release creates starts with every step taken: no host
//! of an older release has ever run on it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::store::{Store, StoreError, sql};

/// A contract step this release knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A close writes its run's `message` event as the run row's
    /// `message_seq`, not as an `events` row: the event is read from the
    /// run (its status, output and error). A previous release's host reads
    /// a thread's messages from `events` alone.
    DerivedMessages,
    /// A run submitted without a thread holds its new thread's event
    /// counter in its own row (`thread_seq`): no `threads` row at its
    /// submit, and its emits and close move no second row. A previous
    /// release's host would number such a thread from `threads` alone.
    /// This release's hosts honour a counter held by a run whether or not
    /// they have seen the step (store::log::bump), so only submits wait
    /// for it.
    RunCounters,
}

impl Step {
    /// Every step, in the order they were added.
    pub const ALL: [Step; 2] = [Step::DerivedMessages, Step::RunCounters];

    /// The step's name in `contract_steps`.
    pub fn name(self) -> &'static str {
        match self {
            Step::DerivedMessages => "derived_messages",
            Step::RunCounters => "run_counters",
        }
    }

    fn bit(self) -> u32 {
        1 << self as u32
    }
}

/// How long a host goes on with the steps it last read before it reads
/// them again: 5 s. An operator's `contract` reaches every host within it.
pub const RECHECK: Duration = Duration::from_secs(5);

/// The steps this process last read, and when.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    steps: AtomicU32,
    at: Mutex<Option<Instant>>,
}

impl Store {
    /// Whether `step` is taken on this database, as last read (at most
    /// [`RECHECK`] ago; read again now if older).
    pub async fn contracted(&self, step: Step) -> Result<bool, StoreError> {
        let stale = self.contract.at.lock().expect("contract lock").is_none_or(|at| at.elapsed() >= RECHECK);
        if stale {
            self.read_contract_steps().await?;
        }
        Ok(self.contract.steps.load(Ordering::Relaxed) & step.bit() != 0)
    }

    /// Reads the steps taken now, whatever was read before. On the writer:
    /// an in-memory SQLite database (offline replay) is its connection's
    /// alone.
    pub async fn read_contract_steps(&self) -> Result<Vec<Step>, StoreError> {
        let names: Vec<String> = sqlx::query_scalar("SELECT name FROM contract_steps").fetch_all(self.writer()).await?;
        let taken: Vec<Step> = Step::ALL.into_iter().filter(|s| names.iter().any(|n| n == s.name())).collect();
        let bits = taken.iter().fold(0, |bits, s| bits | s.bit());
        let before = self.contract.steps.swap(bits, Ordering::Relaxed);
        let first = self.contract.at.lock().expect("contract lock").is_none();
        for step in &taken {
            if !first && before & step.bit() == 0 {
                tracing::info!(step = step.name(), "a contract step was taken: this host now writes what only this release reads");
            }
        }
        *self.contract.at.lock().expect("contract lock") = Some(Instant::now());
        Ok(taken)
    }

    /// Takes every step this release knows (those already taken stay as
    /// they were) and returns the steps taken by this call. Only once no
    /// host of a previous release runs on the database: their reads would
    /// miss what this release's hosts then write.
    pub async fn contract(&self) -> Result<Vec<Step>, StoreError> {
        let mut tx = self.writer().begin().await?;
        let mut taken = Vec::new();
        for step in Step::ALL {
            let row: Option<String> = sqlx::query_scalar(sql!(
                self,
                "INSERT INTO contract_steps (name, done_at) VALUES ($1, {now}) ON CONFLICT (name) DO NOTHING RETURNING name"
            ))
            .bind(step.name())
            .fetch_optional(&mut *tx)
            .await?;
            if row.is_some() {
                taken.push(step);
            }
        }
        tx.commit().await?;
        self.read_contract_steps().await?;
        Ok(taken)
    }

    /// Forgets every step taken: the database as a rolling upgrade from
    /// the previous release leaves it, for the tests of the old way.
    #[doc(hidden)]
    pub async fn expand_only(&self) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM contract_steps").execute(self.writer()).await?;
        self.read_contract_steps().await?;
        Ok(())
    }
}
