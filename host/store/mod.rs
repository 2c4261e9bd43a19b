//! The run store: one connection pool, one protocol, two SQL dialects.
//!
//! The lease protocol, the ledger, the thread log and the reaper's
//! statements are written once against [`Store`], a file for what each
//! part owns. Only the pieces of SQL that really differ between
//! SQLite and PostgreSQL live in [`sqlite`] and [`postgres`]: the database
//! clock expression, the claim statement and the bench loader.
//!
//! Every timestamp is epoch milliseconds computed *by the database* (`{now}`
//! in a statement template); no statement takes a time from the worker.

mod budgets;
mod children;
mod claims;
mod columns;
pub mod contract;
pub mod concurrency;
pub(crate) mod closes;
mod emits;
pub mod faults;
pub(crate) mod group;
mod guard;
pub mod hub;
mod inbox;
mod kv_usage;
pub mod ledger;
pub(crate) mod ledger_writes;
mod local;
pub mod log;
mod migrations;
mod notify;
mod orphans;
mod pause;
mod plugins;
pub mod postgres;
pub mod priority;
pub mod rates;
mod reap;
mod rerun;
mod resolve;
mod retry;
pub mod rollup;
pub(crate) mod retention;
pub(crate) mod renewals;
mod runs;
pub mod schedules; pub mod segments;
pub mod search;
pub mod sqlite;
mod overview;
pub(crate) mod partial;
mod stats;
pub(crate) mod submits;
mod suspend;
pub mod ticks;
mod types;
mod upgrades;
mod upkeep;

use std::{str::FromStr, sync::OnceLock, time::Duration};

use sqlx::{AnyPool, Executor, any::{AnyConnectOptions, AnyPoolOptions}};

pub(crate) use closes::{max_batch as closes_max_batch, writers as close_writers};
pub use sqlite::SqliteSync;
pub use {children::{ChildEnd, ChildState, ChildWait, FOREVER, Spawn}, claims::{baseline_sql, claim_sql}};
pub use {budgets::{Budget, Hold, BudgetLimits, usd_to_nanos}, inbox::{Delivery, NamedWait, wait_result}, resolve::Resolution, retry::is_lock_timeout};
pub use ledger::{Completion, EffectCall, LedgerSummary, REQUEST_PREVIEW, Streamed, idempotency_key};
pub use {kv_usage::{KvQuota, KvRoom, KvUsage}, local::{HeldPut, LocalOp}, plugins::{ModelGrant, PluginInfo, PluginSettings, UpgradePolicy}};
pub use {reap::ReapReport, retention::Deleted, runs::RunFilter, submits::MAX_SUBMIT_BATCH, schedules::{Overlap, Schedule}, ticks::Tick};
pub use {overview::{FENCED_WINDOW, FencedRun, HeldRun, VersionInfo}, stats::Gauges};
pub use types::*;

/// Which database a [`Store`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    Sqlite = 0,
    Postgres = 1,
}

impl Backend {
    /// Picks the backend from a database URL (`sqlite:` or `postgres:`/`postgresql:`).
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Ok(Backend::Postgres)
        } else {
            Err(StoreError::Config(format!(
                "unsupported database URL {url:?}: expected sqlite://PATH or postgres://…"
            )))
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }

    fn dialect(self) -> &'static Dialect {
        match self {
            Backend::Sqlite => &sqlite::DIALECT,
            Backend::Postgres => &postgres::DIALECT,
        }
    }
}

/// The parts of SQL that differ per backend. Everything else is shared text.
pub struct Dialect {
    /// An expression for the database's current time in epoch milliseconds.
    pub now: &'static str,
    /// The same, read when the expression is evaluated rather than when
    /// the statement (PostgreSQL: the transaction) began: leases are given
    /// from it, so a statement that waited on a lock hands out the lease
    /// it says, not one shortened by the wait. Templates: `{clock}`.
    pub clock: &'static str,
    /// The run's streamed output not yet folded into `partial` (see
    /// [`partial`]), as one string: an expression over the row `runs`,
    /// cheap (no read) when nothing is unfolded. Templates: `{unfolded}`.
    pub unfolded: &'static str,
    /// Claims up to `$3` claimable runs for owner `$1` with a lease of `$2` ms.
    /// Template: `{now}` is replaced by [`Dialect::now`].
    pub claim: &'static str,
    /// The same for exactly one run (`$3` is 1), where a dialect has a
    /// cheaper form.
    pub claim_one: &'static str,
    /// Loads `$1` runs of plugin `$2` with status `$3` (bench and tests only).
    pub bulk_load: &'static str,
    /// The bench baseline: a plain `UPDATE … RETURNING` of up to `$1` queued
    /// runs that sets only the status (no fence, attempt or lease).
    pub baseline_claim: &'static str,
    /// The baseline for exactly one run, in the same form as `claim_one`.
    pub baseline_claim_one: &'static str,
}

/// Renders a statement template for both backends once per call site and
/// returns the one for `$store`. Templates use `{now}` for the database clock.
///
/// The rendered strings are leaked once per call site (a few hundred bytes
/// each), so every query is a `&'static str` and can be prepared and cached.
macro_rules! sql {
    ($store:expr, $template:expr) => {{
        static RENDERED: ::std::sync::OnceLock<[&'static str; 2]> = ::std::sync::OnceLock::new();
        RENDERED.get_or_init(|| $crate::store::render_both($template))[$store.backend() as usize]
    }};
}
pub(crate) use sql;

/// Like [`sql!`], for a statement that is itself dialect-specific: a field of
/// [`Dialect`].
macro_rules! dialect_sql {
    ($store:expr, $field:ident) => {{
        static RENDERED: ::std::sync::OnceLock<[&'static str; 2]> = ::std::sync::OnceLock::new();
        RENDERED.get_or_init(|| $crate::store::render_dialects(|d| d.$field))
            [$store.backend() as usize]
    }};
}
pub(crate) use dialect_sql;

#[doc(hidden)]
pub fn render_dialects(field: impl Fn(&Dialect) -> &'static str) -> [&'static str; 2] {
    [Backend::Sqlite, Backend::Postgres].map(|b| render(b, field(b.dialect())))
}

#[doc(hidden)]
pub fn render_both(template: &str) -> [&'static str; 2] {
    [Backend::Sqlite, Backend::Postgres].map(|b| render(b, template))
}

fn render(backend: Backend, template: &str) -> &'static str {
    let sql = template
        .replace("{now}", backend.dialect().now)
        .replace("{clock}", backend.dialect().clock)
        .replace("{unfolded}", backend.dialect().unfolded);
    Box::leak(columns::spell_out(&sql).into_boxed_str())
}

/// How to connect. Every field documents its default.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Pool size. Default: 16 for PostgreSQL; 8 readers for SQLite (which
    /// also keeps one dedicated writer connection).
    pub max_connections: Option<u32>,
    /// SQLite only: `synchronous` mode. Default: `FULL` (see [`SqliteSync`]).
    pub sqlite_sync: SqliteSync,
    /// SQLite only: how long a writer waits for the lock before the store
    /// retries the whole operation. Default: 5 s.
    pub busy_timeout: Duration,
    /// How long to wait for a pool connection. Default: 30 s.
    pub acquire_timeout: Duration,
    /// Apply migrations at connect time. Default: true.
    pub migrate: bool,
    /// PostgreSQL only: the server ends a session left idle inside a
    /// transaction this long (`idle_in_transaction_session_timeout`),
    /// rolling it back. The host's transactions take milliseconds; one left
    /// open means the host stalled (a stopped process, a frozen VM), and its
    /// row locks would otherwise keep every other host from taking over its
    /// runs until it wakes. Default: 5 s.
    pub pg_idle_in_transaction_timeout: Duration,
    /// PostgreSQL only: how long any statement of the host waits for a row
    /// lock (`lock_timeout`) before it gives up (migrations excepted). A
    /// frozen host (a stopped process, a VM paused mid-statement) can hold
    /// its claim's row locks for as long as it is frozen; without this,
    /// every other host's reaper would wait on them, and a batch of closes
    /// or ledger rows with one such row would hold all of its runs. A batch
    /// that gives up is written again one write at a time, so only the
    /// stuck row's write waits again (`leasehold_lock_timeouts_total`).
    /// Default: 2 s.
    pub pg_lock_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_connections: None,
            sqlite_sync: SqliteSync::Full,
            busy_timeout: Duration::from_secs(5),
            acquire_timeout: Duration::from_secs(30),
            migrate: true,
            pg_idle_in_transaction_timeout: Duration::from_secs(5),
            pg_lock_timeout: Duration::from_secs(2),
        }
    }
}

/// A handle to the run store. Cheap to clone: one reference count, as
/// every segment, request and batch writer holds a clone (cloning and
/// dropping each pool, queue and a copy of the URL one by one took about 4% of
/// the host's samples in a `perf` profile of `bench submit`).
#[derive(Clone, Debug)]
pub struct Store(std::sync::Arc<StoreShared>);

impl std::ops::Deref for Store {
    type Target = StoreShared;

    fn deref(&self) -> &StoreShared {
        &self.0
    }
}

/// What the clones of a [`Store`] share.
#[doc(hidden)]
#[derive(Debug)]
pub struct StoreShared {
    /// Reads (and, on PostgreSQL, everything).
    pool: AnyPool,
    /// Writes. On SQLite a one-connection pool: SQLite has one writer at a
    /// time anyway, and writers queued on this pool's fair semaphore wait far
    /// less than connections contending for the file lock, whose busy
    /// handler sleeps in 1–100 ms steps. On PostgreSQL the same pool as
    /// `pool`.
    writer: AnyPool,
    /// Renewals and the reaper. On PostgreSQL a small pool of its own whose
    /// sessions have a `lock_timeout` (see [`StoreOptions::pg_lock_timeout`])
    /// and are pinged before each use; on SQLite the writer.
    maint: AnyPool,
    backend: Backend,
    /// This database's random id (table `deployment`), read once: the first
    /// part of every idempotency key.
    database_id: std::sync::Arc<tokio::sync::OnceCell<std::sync::Arc<str>>>,
    /// Wakes this process's idle workers when work arrives (a submit, a
    /// delivered input, a suspended run). Other hosts on PostgreSQL hear of
    /// it through `NOTIFY` (see [`WORK_CHANNEL`]).
    work: std::sync::Arc<tokio::sync::Notify>,
    /// Holds the password, if the URL has one: never logged or printed.
    url: crate::redact::Secret,
    /// A random id for this store handle (and its clones), sent as the
    /// `NOTIFY` payload so this process's listener can skip its own
    /// announcements: its workers were already woken in process.
    node: std::sync::Arc<str>,
    /// Coalesces `NOTIFY`s (see [`Store::signal_work`]).
    announce: std::sync::Arc<notify::Announce>,
    /// Submits waiting to be group-committed (see [`submits`]).
    pub(crate) submits: std::sync::Arc<submits::Queue>,
    /// PostgreSQL closes waiting to be group-committed (see [`closes`]).
    pub(crate) closes: std::sync::Arc<closes::Queue>,
    /// Renewals waiting to be group-committed (see [`renewals`]).
    pub(crate) renewals: std::sync::Arc<renewals::Queue>,
    /// SQLite claims waiting to be group-committed (see [`claims`]).
    pub(crate) claims: std::sync::Arc<claims::Queue>,
    /// Ledger writes waiting to be group-committed (see [`ledger_writes`]).
    pub(crate) ledger_writes: std::sync::Arc<ledger_writes::Queue>,
    /// Fault hooks for tests (see [`faults`]).
    faults: faults::Faults,
    /// The event streams of this process, woken by its writes (see [`hub`]).
    hub: std::sync::Arc<hub::Hub>,
    /// Plugin names this process has seen registered (see
    /// [`Store::plugin_exists`]).
    known_plugins: std::sync::Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    /// The rate keys this process last read (see [`rates`]).
    rate_keys: std::sync::Arc<rates::KeyCache>,
    /// The kv usage this process last read (see [`kv_usage`]).
    kv_seen: std::sync::Arc<kv_usage::Seen>,
    /// Where the reaper's sweeps go on from ([`reap::Sweeps`]).
    pub(crate) sweeps: std::sync::Arc<reap::Sweeps>,
    /// The contract steps this process last read (see [`contract`]).
    pub(crate) contract: contract::Seen,
}

/// The URL to connect to: SQLite's with `mode=rwc`, its file created first
/// for this user only (the first connection, a probe's too, would create
/// it readable by all).
fn connect_url(backend: Backend, url: &str) -> Result<String, StoreError> {
    let url = match backend {
        Backend::Sqlite => sqlite::normalize_url(url),
        Backend::Postgres => return Ok(url.to_string()),
    };
    if let Some(file) = sqlite::file_of(&url) {
        sqlite::private_file(&file).map_err(|e| StoreError::Config(format!("cannot create the database file {}: {e}", file.display())))?;
    }
    Ok(url)
}

/// The PostgreSQL `LISTEN`/`NOTIFY` channel announcing new work.
pub const WORK_CHANNEL: &str = "leasehold_work";

static DRIVERS: OnceLock<()> = OnceLock::new();

impl Store {
    /// Connects to `url` with default options and applies migrations.
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        Store::connect_with(url, StoreOptions::default()).await
    }

    /// Connects to `url` (`sqlite://PATH`, created if missing, or
    /// `postgres://…`) and, unless disabled, applies migrations under the
    /// migrator's lock.
    pub async fn connect_with(url: &str, opts: StoreOptions) -> Result<Store, StoreError> {
        DRIVERS.get_or_init(sqlx::any::install_default_drivers);
        let backend = Backend::from_url(url)?;
        let url = connect_url(backend, url)?;
        let connect = AnyConnectOptions::from_str(&url)?;
        let max = opts.max_connections.unwrap_or(match backend {
            Backend::Sqlite => 8,
            Backend::Postgres => 16,
        });
        let pool_options = |max: u32, writer: bool| {
            let mut pool = AnyPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(opts.acquire_timeout)
                // The default pings every connection before each use: one
                // extra round trip per statement. A dead connection fails the
                // statement instead, which every caller already handles.
                .test_before_acquire(false);
            if backend == Backend::Sqlite {
                let pragmas = sqlite::pragmas(opts.sqlite_sync, opts.busy_timeout);
                pool = pool.after_connect(move |conn, _| {
                    Box::pin(async move {
                        if writer {
                            let tables: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master").fetch_one(&mut *conn).await?;
                            if tables == 0 {
                                conn.execute(sqlite::NEW_DATABASE).await?;
                            }
                        }
                        conn.execute(pragmas).await?;
                        conn.execute(sqlite::memory_pragmas(writer)).await?;
                        Ok(())
                    })
                });
            }
            pool
        };
        // PostgreSQL sessions: the idle-in-transaction timeout and the lock
        // timeout on every one.
        let pg_session = |pool: AnyPoolOptions| {
            let idle_ms = opts.pg_idle_in_transaction_timeout.as_millis().to_string();
            let lock_ms = opts.pg_lock_timeout.as_millis().max(1).to_string();
            pool.after_connect(move |conn, _| {
                let (idle_ms, lock_ms) = (idle_ms.clone(), lock_ms.clone());
                Box::pin(async move {
                    sqlx::query(
                        "SELECT set_config('idle_in_transaction_session_timeout', $1, false), \
                         set_config('lock_timeout', $2, false)",
                    )
                    .bind(idle_ms)
                    .bind(lock_ms)
                    .execute(&mut *conn)
                    .await?;
                    Ok(())
                })
            })
        };
        let (pool, writer, maint) = match backend {
            Backend::Sqlite => {
                // The writer first: it creates the file and switches it to WAL.
                let writer = pool_options(1, true).connect_with(connect.clone()).await?;
                (pool_options(max, false).connect_with(connect).await?, writer.clone(), writer)
            }
            Backend::Postgres => {
                let pool = pg_session(pool_options(max, false)).connect_with(connect.clone()).await?;
                // Renewals and the reaper do test each session first: they
                // are few, and a segment's last renewal before it gives its
                // run up must not fail on a session a restart left dead.
                let maint = pg_session(pool_options(4, false).test_before_acquire(true))
                    .connect_with(connect)
                    .await?;
                (pool.clone(), pool, maint)
            }
        };
        let store = Store(std::sync::Arc::new(StoreShared {
            pool,
            writer,
            maint,
            database_id: Default::default(),
            backend,
            work: Default::default(),
            url: url.as_str().into(),
            node: uuid::Uuid::new_v4().to_string().into(),
            announce: Default::default(),
            submits: Default::default(),
            closes: Default::default(),
            renewals: Default::default(),
            claims: Default::default(),
            ledger_writes: Default::default(),
            faults: Default::default(),
            hub: Default::default(),
            known_plugins: Default::default(),
            rate_keys: Default::default(),
            kv_seen: Default::default(),
            sweeps: Default::default(),
            contract: Default::default(),
        }));
        if opts.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Opens one connection to `url` and closes it: says at once whether
    /// the database can be reached, and why not (a pool's connect waits
    /// for its acquire timeout first). Gives up after `timeout`.
    pub async fn probe(url: &str, timeout: Duration) -> Result<(), StoreError> {
        DRIVERS.get_or_init(sqlx::any::install_default_drivers);
        let url = connect_url(Backend::from_url(url)?, url)?;
        let options = AnyConnectOptions::from_str(&url)?;
        let connect = sqlx::ConnectOptions::connect(&options);
        match tokio::time::timeout(timeout, connect).await {
            Ok(conn) => {
                let _ = sqlx::Connection::close(conn?).await;
                Ok(())
            }
            Err(_) => Err(StoreError::Unknown(format!("no answer within {timeout:?}"))),
        }
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// This store's fault hooks (tests).
    pub fn faults(&self) -> &faults::Faults {
        &self.faults
    }

    /// The read pool, for tests, benches and operator tooling.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// The pool every protocol write goes through (see [`Store`]).
    pub fn writer(&self) -> &AnyPool {
        &self.writer
    }

    /// The pool of renewals and the reaper (see [`Store`]).
    pub(crate) fn maint(&self) -> &AnyPool {
        &self.maint
    }

    /// This database's random id, created once by a migration: the first
    /// part of every idempotency key, so that keys never repeat across
    /// deployments or after a reset.
    pub async fn database_id(&self) -> Result<std::sync::Arc<str>, StoreError> {
        let id = self
            .database_id
            .get_or_try_init(|| async {
                let id: String = sqlx::query_scalar("SELECT id FROM deployment").fetch_one(&self.pool).await?;
                Ok::<_, StoreError>(std::sync::Arc::<str>::from(id))
            })
            .await?;
        Ok(id.clone())
    }

    /// The URL this store was opened with, password included: for
    /// connecting, never for logs (see [`Store::url_redacted`]).
    pub fn url(&self) -> &str {
        self.url.expose()
    }

    /// The URL without its password, for logs and messages.
    pub fn url_redacted(&self) -> String {
        crate::redact::url(self.url.expose())
    }

    /// The event streams watching threads in this process (see [`hub`]).
    pub fn hub(&self) -> &hub::Hub {
        &self.hub
    }

    /// Notified when work arrives in this process (see [`Store::signal_work`]).
    pub fn work_signal(&self) -> &tokio::sync::Notify {
        &self.work
    }

    /// Submits this store (and its clones) has written, and the commits
    /// that wrote them: fewer commits when concurrent submits were
    /// group-committed (see `submits`).
    pub fn submits_written(&self) -> (u64, u64) {
        self.submits.written()
    }

    /// Closes this store (and its clones) has written, and the commits
    /// that wrote them (see `closes`).
    pub fn closes_written(&self) -> (u64, u64) {
        self.closes.written()
    }

    /// Close batch writers this store started because closes waited
    /// behind a slow batch (one held up by a row lock, say) for 200 ms.
    pub fn closes_stalled(&self) -> u64 {
        self.closes.stalls()
    }

    /// Close batches the database rolled back (one close it refused, a
    /// lock wait given up) and that were written again one by one.
    pub fn closes_split(&self) -> u64 {
        self.closes.split()
    }

    /// Renewals this store has written, and the statements that wrote
    /// them: fewer statements when concurrent renewals were batched (see
    /// `renewals`).
    pub fn renewals_written(&self) -> (u64, u64) {
        self.renewals.written()
    }

    /// This handle's `NOTIFY` payload (see the `node` field).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The database's clock, in epoch milliseconds.
    pub async fn now_ms(&self) -> Result<i64, StoreError> {
        let q = sql!(self, "SELECT {now} AS now");
        let now: i64 = sqlx::query_scalar(q).fetch_one(&self.pool).await?;
        Ok(now)
    }

    /// Closes the pools, waiting for connections to be returned.
    pub async fn shutdown(&self) {
        self.maint.close().await;
        self.writer.close().await;
        self.pool.close().await;
    }
}
