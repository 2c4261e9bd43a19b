//! Fault hooks: places in the store's write paths where a test makes a
//! write late, or its connection die at a chosen moment, to check what the
//! protocol does then. Unset (always, outside tests) each costs one atomic
//! load.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::store::{Store, StoreError};

/// The store's fault hooks, shared by its clones ([`crate::store::Store::faults`]).
/// Default: none set.
#[derive(Debug, Default)]
pub struct Faults {
    close_delay_ms: AtomicU64,
    guest_delay_ms: AtomicU64,
    give_back_delay_ms: AtomicU64,
    submit_read_kills: AtomicU32,
    claim_reply_losses: AtomicU32,
    spawn_rollbacks: AtomicU32,
    spawn_reply_losses: AtomicU32,
    /// 1: pause spawns before their commit; 2: after it (see
    /// [`Faults::pause_spawns`]).
    spawn_pause: AtomicU32,
    spawn_hold_ms: AtomicU64,
    /// Told each time a spawn is held ([`Faults::hold_spawn_commits`]).
    spawn_held: tokio::sync::Notify,
}

/// Where [`Faults::pause_spawns`] holds a spawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpawnPause {
    /// Inside its transaction, everything written but the commit.
    Before,
    /// Just after its commit, before the segment hears of it.
    After,
}

impl Faults {
    /// Holds every close (statement 4) this long before it is queued to be
    /// written, as a close stuck behind another session's lock would be.
    /// `Duration::ZERO` clears it.
    pub fn delay_closes(&self, by: Duration) {
        self.close_delay_ms.store(by.as_millis() as u64, Ordering::Relaxed);
    }

    /// Holds every segment this long before its guest starts, as a cold
    /// compile of a large component would. `Duration::ZERO` clears it.
    pub fn delay_guests(&self, by: Duration) {
        self.guest_delay_ms.store(by.as_millis() as u64, Ordering::Relaxed);
    }

    /// PostgreSQL: the next `n` reads a batch of submits makes after its
    /// statement has committed find their session killed: the session
    /// ends itself with `pg_terminate_backend`, as an operator or a server
    /// restart would end it, and the read gets the server's error.
    pub fn kill_submit_reads(&self, n: u32) {
        self.submit_read_kills.store(n, Ordering::Relaxed);
    }

    /// Before a submit batch's read after its commit: kills the session
    /// the read is about to use, if asked to ([`Faults::kill_submit_reads`]).
    pub(crate) async fn submit_read(&self, store: &Store) -> Result<(), StoreError> {
        let take = self.submit_read_kills.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if take.is_err() {
            return Ok(());
        }
        let mut conn = store.pool().acquire().await?;
        sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())").execute(&mut *conn).await?;
        // The signal may land after the statement that sent it.
        sqlx::query("SELECT pg_sleep(1)").execute(&mut *conn).await?;
        Err(StoreError::Config("a session that killed itself lived on".into()))
    }

    /// PostgreSQL: the next `n` claim statements (claims, and batches of
    /// closes that claim) lose their reply after the server committed
    /// them: the store gets a broken-connection error, as when the server
    /// restarts or the network cuts between its commit and its answer.
    pub fn lose_claim_replies(&self, n: u32) {
        self.claim_reply_losses.store(n, Ordering::Relaxed);
    }

    /// After a claim statement committed: its reply is lost, if asked to
    /// ([`Faults::lose_claim_replies`]).
    pub(crate) fn after_claim(&self) -> Result<(), StoreError> {
        let take = self.claim_reply_losses.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        match take {
            Err(_) => Ok(()),
            Ok(_) => Err(StoreError::Db(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "the claim's reply was lost (fault hook)",
            )))),
        }
    }

    /// The next `n` spawns (`store::children`) are rolled back just before
    /// their commit, as a host killed there leaves them: nothing of them
    /// exists, and the segment stops with a database error.
    pub fn roll_back_spawns(&self, n: u32) {
        self.spawn_rollbacks.store(n, Ordering::Relaxed);
    }

    /// The next `n` spawns commit and then lose their reply, as a host
    /// killed (or cut off) between the commit and its answer: the spawn is
    /// in the database, and the segment stops with a database error.
    pub fn lose_spawn_replies(&self, n: u32) {
        self.spawn_reply_losses.store(n, Ordering::Relaxed);
    }

    /// Holds every spawn for a minute at `at`, saying so in the log at
    /// `warn` (a test kills the host there: `serve --test-pause-spawns`).
    pub fn pause_spawns(&self, at: SpawnPause) {
        self.spawn_pause.store(if at == SpawnPause::Before { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Holds every spawn this long just before its commit, with the
    /// parent's row locked, telling [`Faults::spawn_held`] each time.
    /// `Duration::ZERO` clears it.
    pub fn hold_spawn_commits(&self, by: Duration) {
        self.spawn_hold_ms.store(by.as_millis() as u64, Ordering::Relaxed);
    }

    /// Returns once a spawn is being held ([`Faults::hold_spawn_commits`]).
    pub async fn spawn_held(&self) {
        self.spawn_held.notified().await;
    }

    /// The pause [`Faults::pause_spawns`] asked for at this point, if any.
    pub(crate) async fn spawn_pause(&self, at: SpawnPause) {
        let want = if at == SpawnPause::Before { 1 } else { 2 };
        let hold = self.spawn_hold_ms.load(Ordering::Relaxed);
        if at == SpawnPause::Before && hold > 0 {
            self.spawn_held.notify_one();
            tokio::time::sleep(Duration::from_millis(hold)).await;
        }
        if self.spawn_pause.load(Ordering::Relaxed) == want {
            tracing::warn!(?at, "test setting: pausing a spawn for a minute");
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    }

    /// Just before a spawn commits: `Err` rolls it back, if asked to
    /// ([`Faults::roll_back_spawns`]).
    pub(crate) fn before_spawn_commit(&self) -> Result<(), StoreError> {
        match self.spawn_rollbacks.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)) {
            Err(_) => Ok(()),
            Ok(_) => Err(StoreError::Unknown("the host stopped before its spawn committed (fault hook)".into())),
        }
    }

    /// After a spawn committed: its reply is lost, if asked to
    /// ([`Faults::lose_spawn_replies`]).
    pub(crate) fn after_spawn_commit(&self) -> Result<(), StoreError> {
        match self.spawn_reply_losses.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)) {
            Err(_) => Ok(()),
            Ok(_) => Err(StoreError::Db(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "the spawn's reply was lost (fault hook)",
            )))),
        }
    }

    /// Holds every give-back this long before it is written, as a database
    /// that does not answer would. `Duration::ZERO` clears it.
    pub fn delay_give_backs(&self, by: Duration) {
        self.give_back_delay_ms.store(by.as_millis() as u64, Ordering::Relaxed);
    }

    pub(crate) async fn before_give_back(&self) {
        delay(&self.give_back_delay_ms).await
    }

    pub(crate) async fn before_close(&self) {
        delay(&self.close_delay_ms).await
    }

    #[doc(hidden)]
    pub async fn before_guest(&self) {
        delay(&self.guest_delay_ms).await
    }
}

async fn delay(ms: &AtomicU64) {
    let ms = ms.load(Ordering::Relaxed);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}
