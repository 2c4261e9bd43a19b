//! Test databases for both backends.
//!
//! PostgreSQL is found through `LEASEHOLD_TEST_DATABASE_URL`, then
//! `DATABASE_URL`, then `postgres://postgres@127.0.0.1:5432/postgres`. Each
//! test gets a fresh database, dropped when the test ends. If no server
//! answers, the PostgreSQL half of each test fails with a message saying so:
//! it is never skipped.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::runtime::Runtime;
use leasehold::store::{Backend, Store, StoreOptions};

mod server;
pub mod sse;
mod wait;

pub use server::Server;
pub use wait::{eventually, eventually_some, kill_when};

pub const TTL: Duration = Duration::from_secs(30);

/// A test host's settings: named `owner`, a 30 s lease with no renewal
/// loop, no model, nothing reserved (the defaults otherwise).
pub fn worker(owner: &str) -> ExecutorConfig {
    ExecutorConfig { owner: owner.into(), model: None, ..ExecutorConfig::default() }
}

/// A host named `owner` on `db` running `rt`'s plugins ([`worker`]).
pub fn executor(db: &TestDb, rt: &Arc<Runtime>, owner: &str) -> Executor {
    Executor::new(db.store.clone(), rt.clone(), worker(owner))
}

pub struct TestDb {
    pub store: Store,
    pub backend: Backend,
    url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    Sqlite(#[allow(dead_code)] tempfile::TempDir),
    Postgres { admin: Store, name: String },
}

pub fn admin_url() -> String {
    std::env::var("LEASEHOLD_TEST_DATABASE_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_string())
}

impl TestDb {
    pub async fn new(backend: Backend) -> Result<TestDb> {
        TestDb::create(backend, true).await
    }

    /// A database with no schema yet (its store applies no migrations):
    /// for a host of another release to create it.
    pub async fn empty(backend: Backend) -> Result<TestDb> {
        TestDb::create(backend, false).await
    }

    async fn create(backend: Backend, migrate: bool) -> Result<TestDb> {
        let options = || StoreOptions { migrate, ..Default::default() };
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir()?;
                let file = dir.path().join("test.db");
                if migrate {
                    // A copy of a migrated database, not 30 migrations under
                    // synchronous=FULL each test.
                    std::fs::copy(sqlite_template().await?, &file)?;
                }
                let url = format!("sqlite://{}", file.display());
                let store = Store::connect_with(&url, options()).await?;
                if migrate {
                    fresh_deployment(&store).await?;
                }
                Ok(TestDb { store, backend, url, cleanup: Cleanup::Sqlite(dir) })
            }
            Backend::Postgres => {
                let admin_url = admin_url();
                let admin = Store::connect_with(
                    &admin_url,
                    StoreOptions { migrate: false, max_connections: Some(2), ..Default::default() },
                )
                .await
                .with_context(|| {
                    format!(
                        "PostgreSQL tests need a server: could not connect to {admin_url}. \
                         Run ./scripts/test (it finds or starts one), or set LEASEHOLD_TEST_DATABASE_URL"
                    )
                })?;
                // The name is ours (not input); identifiers cannot be bound.
                let name = format!("leasehold_test_{}", uuid::Uuid::new_v4().simple());
                // A copy of a migrated template, not 35 migrations each test.
                let template = if migrate { format!(" TEMPLATE {}", pg_template(&admin).await?) } else { String::new() };
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}{template}")))
                    .execute(admin.pool())
                    .await?;
                let mut url = url::Url::parse(&admin_url)?;
                url.set_path(&name);
                let url = url.to_string();
                let store = Store::connect_with(&url, options()).await?;
                if migrate {
                    fresh_deployment(&store).await?;
                }
                Ok(TestDb { store, backend, url, cleanup: Cleanup::Postgres { admin, name } })
            }
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// A second, independent store (its own pool) on the same database: a
    /// separate worker process, as far as the database can tell.
    pub async fn another_store(&self, max_connections: u32) -> Result<Store> {
        Ok(Store::connect_with(
            &self.url,
            StoreOptions { max_connections: Some(max_connections), migrate: false, ..Default::default() },
        )
        .await?)
    }

    pub async fn cleanup(self) -> Result<()> {
        self.store.shutdown().await;
        if let Cleanup::Postgres { admin, name } = self.cleanup {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
                .execute(admin.pool())
                .await?;
            admin.shutdown().await;
        }
        Ok(())
    }

    /// Moves a run's lease expiry `ms` into the past, instead of waiting.
    pub async fn backdate_lease(&self, run_id: i64, ms: i64) -> Result<()> {
        sqlx::query("UPDATE runs SET lease_expires_at = lease_expires_at - $2 WHERE id = $1")
            .bind(run_id)
            .bind(ms)
            .execute(self.store.pool())
            .await?;
        Ok(())
    }

    /// Moves every deadline of every unfinished run `ms` into the past: the
    /// clock, as seen by the protocol, advances by `ms`.
    pub async fn advance_clock(&self, ms: i64) -> Result<()> {
        sqlx::query(
            "UPDATE runs SET lease_expires_at = lease_expires_at - $1, not_before = not_before - $1 \
             WHERE status NOT IN ('completed','failed','aborted','cancelled')",
        )
        .bind(ms)
        .execute(self.store.pool())
        .await?;
        Ok(())
    }
}

/// The idempotency key of run `run_id`'s call `seq` in `store`'s database.
pub async fn key(store: &Store, run_id: i64, seq: i64) -> Result<String> {
    Ok(leasehold::store::idempotency_key(&store.database_id().await?, run_id, seq))
}

/// With `LEASEHOLD_TEST_LOG` set (a filter such as `leasehold=debug`),
/// the host's logs go to the test's output: for a test that fails only
/// under load.
pub fn init_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // The process's TLS provider, which every HTTP client needs: under
    // nextest each test is a process of its own.
    leasehold::effects::http::install_tls();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("LEASEHOLD_TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
    });
}

/// Serves `state`'s API on a free loopback port until `shutdown` turns
/// true; returns its base URL (`http://127.0.0.1:PORT`).
pub async fn serve_api(state: leasehold::api::AppState, shutdown: tokio::sync::watch::Receiver<bool>) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let mut stopped = shutdown;
    tokio::spawn(async move {
        let _ = axum::serve(listener, leasehold::api::router(state))
            .with_graceful_shutdown(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await;
    });
    Ok(base)
}

/// Waits (up to 30 s) until `count` (a PostgreSQL query returning one
/// `COUNT(*)`, e.g. of `pg_stat_activity`) is above zero; `what` names the
/// awaited state in the error.
pub async fn wait_for_count(db: &TestDb, count: &'static str, what: &str) -> Result<()> {
    eventually(what, async || Ok(sqlx::query_scalar::<_, i64>(count).fetch_one(db.store.pool()).await? > 0)).await
}

/// Waits (up to 30 s) until `count` sessions on `db` (PostgreSQL) wait on a
/// lock: a statement a test blocked is blocked, not merely sent.
pub async fn until_lock_waiter(db: &TestDb, count: i64) -> Result<()> {
    const WAITING: &str = "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let waiting = async || Ok(sqlx::query_scalar::<_, i64>(WAITING).fetch_one(db.store.pool()).await? >= count);
    eventually(&format!("{count} sessions never waited on a lock"), waiting).await
}

/// Waits (up to 30 s) until no statement of another session runs on `db`:
/// what a killed process had sent has landed or gone (PostgreSQL; on
/// SQLite a dead process writes nothing more).
pub async fn until_quiet(db: &TestDb) -> Result<()> {
    if db.backend == Backend::Sqlite {
        return Ok(());
    }
    const BUSY: &str =
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND state <> 'idle' AND pid <> pg_backend_pid()";
    eventually("other sessions stayed busy", async || Ok(sqlx::query_scalar::<_, i64>(BUSY).fetch_one(db.store.pool()).await? == 0)).await
}

async fn fresh_deployment(store: &Store) -> Result<()> {
    sqlx::query("UPDATE deployment SET id = $1").bind(uuid::Uuid::new_v4().simple().to_string()).execute(store.writer()).await?;
    Ok(())
}

/// A migrated SQLite database for this build's migrations, made once (by
/// whichever test process comes first) under `target/test-templates/`.
async fn sqlite_template() -> Result<std::path::PathBuf> {
    static MADE: tokio::sync::OnceCell<std::path::PathBuf> = tokio::sync::OnceCell::const_new();
    MADE.get_or_try_init(|| async {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-templates");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("sqlite-{}.db", Store::migrations_digest(Backend::Sqlite)));
        if !path.exists() {
            let scratch = tempfile::tempdir_in(&dir)?;
            let file = scratch.path().join("template.db");
            let store = Store::connect_with(&format!("sqlite://{}", file.display()), StoreOptions::default()).await?;
            sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)").execute(store.writer()).await?;
            store.shutdown().await;
            // Whole or not at all: another process may be making it too.
            std::fs::rename(&file, &path)?;
        }
        anyhow::Ok(path)
    })
    .await
    .cloned()
}

/// The name of a migrated PostgreSQL database for this build's
/// migrations, made once on the server (whichever test process comes
/// first, under an advisory lock) and kept for later runs; each test's
/// database is a copy (`CREATE DATABASE … TEMPLATE`).
async fn pg_template(admin: &Store) -> Result<String> {
    let name = format!("leasehold_tpl_{}", Store::migrations_digest(Backend::Postgres));
    let mut conn = admin.pool().acquire().await?;
    sqlx::query("SELECT pg_advisory_lock(7411)").execute(&mut *conn).await?;
    let made = async {
        let exists: Option<i32> = sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1").bind(&name).fetch_optional(&mut *conn).await?;
        if exists.is_none() {
            let scratch = format!("leasehold_tplnew_{}", uuid::Uuid::new_v4().simple());
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {scratch}"))).execute(&mut *conn).await?;
            let mut url = url::Url::parse(&admin_url())?;
            url.set_path(&scratch);
            let store = Store::connect_with(url.as_str(), StoreOptions { max_connections: Some(2), ..Default::default() }).await?;
            store.shutdown().await;
            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER DATABASE {scratch} RENAME TO {name}"))).execute(&mut *conn).await?;
        }
        anyhow::Ok(())
    }
    .await;
    sqlx::query("SELECT pg_advisory_unlock(7411)").execute(&mut *conn).await?;
    made?;
    Ok(name)
}

/// Runs `body` against a fresh database of `backend`, then drops it.
pub async fn run_on(backend: Backend, body: impl AsyncFnOnce(&TestDb) -> Result<()>) -> Result<()> {
    init_logs();
    let db = TestDb::new(backend).await?;
    let result = body(&db).await;
    db.cleanup().await?;
    result
}

/// Declares store tests that run one body on both backends:
/// `both! { async fn name(db) { … } }` becomes `name::sqlite` and
/// `name::postgres`.
macro_rules! both {
    ($( $(#[$meta:meta])* async fn $name:ident($db:ident) $body:block )*) => {$(
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            async fn body($db: &$crate::harness::TestDb) -> ::anyhow::Result<()> $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() -> ::anyhow::Result<()> {
                $crate::harness::run_on(::leasehold::Backend::Sqlite, body).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() -> ::anyhow::Result<()> {
                $crate::harness::run_on(::leasehold::Backend::Postgres, body).await
            }
        }
    )*};
}
pub(crate) use both;

/// A test of one backend's behaviour alone (`postgres` or `sqlite`): the
/// report names only the backend it tests.
macro_rules! only {
    ($backend:ident: $( $(#[$meta:meta])* async fn $name:ident($db:ident) $body:block )*) => {$(
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            async fn body($db: &$crate::harness::TestDb) -> ::anyhow::Result<()> $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $backend() -> ::anyhow::Result<()> {
                $crate::harness::run_on($crate::harness::only!(@backend $backend), body).await
            }
        }
    )*};
    (@backend postgres) => { ::leasehold::Backend::Postgres };
    (@backend sqlite) => { ::leasehold::Backend::Sqlite };
}
pub(crate) use only;

/// What is wrong with the threads' logs in `store`, as lines (none: all
/// well). Each event number is taken once in its thread, counting the
/// messages derived from runs beside the `events` rows; a thread's counter
/// (its `threads` row, or the one run that holds it) is at or past its
/// last event; and no thread has both, or two runs holding one. Numbers
/// may have gaps where retention deleted a finished run's events. Each
/// check is one statement, so it holds while hosts write.
pub async fn thread_log_faults(store: &leasehold::store::Store) -> Result<Vec<String>> {
    macro_rules! log {
        () => {
            "(SELECT thread_id, seq FROM events UNION ALL SELECT thread_id, message_seq FROM runs WHERE message_seq IS NOT NULL)"
        };
    }
    let twice: Vec<(String, i64, i64)> =
        sqlx::query_as(concat!("SELECT thread_id, seq, COUNT(*) FROM ", log!(), " AS l GROUP BY thread_id, seq HAVING COUNT(*) > 1 LIMIT 5"))
    .fetch_all(store.pool())
    .await?;
    let behind: Vec<(String, i64, Option<i64>)> = sqlx::query_as(concat!(
        "SELECT thread_id, last, head FROM (SELECT l.thread_id, MAX(l.seq) AS last, \
         COALESCE((SELECT last_seq FROM threads WHERE id = l.thread_id), \
         (SELECT MAX(thread_seq) FROM runs WHERE thread_id = l.thread_id)) AS head FROM ",
        log!(),
        " AS l GROUP BY l.thread_id) AS h WHERE COALESCE(head, 0) < last LIMIT 5"
    ))
    .fetch_all(store.pool())
    .await?;
    let doubled: Vec<(String, i64)> = sqlx::query_as(
        "SELECT thread_id, COUNT(*) FROM runs WHERE thread_seq IS NOT NULL GROUP BY thread_id \
         HAVING COUNT(*) > 1 OR EXISTS (SELECT 1 FROM threads WHERE id = runs.thread_id) LIMIT 5",
    )
    .fetch_all(store.pool())
    .await?;
    let mut faults = Vec::new();
    faults.extend(twice.iter().map(|(t, s, n)| format!("thread {t}: event {s} numbered {n} times")));
    faults.extend(behind.iter().map(|(t, s, c)| format!("thread {t}: last event {s}, counter at {c:?}")));
    faults.extend(doubled.iter().map(|(t, n)| format!("thread {t}: {n} runs hold its counter, or one does beside its threads row")));
    Ok(faults)
}
