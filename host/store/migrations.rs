//! The schema: each backend's embedded migrations, applied forward-only.

use sqlx::any::AnyPoolOptions;

use crate::store::{Backend, Store, StoreError};

fn migrator(backend: Backend) -> sqlx::migrate::Migrator {
    match backend {
        Backend::Sqlite => sqlx::migrate!("migrations/sqlite"),
        Backend::Postgres => sqlx::migrate!("migrations/postgres"),
    }
}

/// How many times a PostgreSQL migration that lost a deadlock is tried.
const MIGRATION_TRIES: u32 = 5;

/// A deadlock (40P01) or a lock timeout (55P03): the migration's
/// transaction was rolled back and may simply be run again.
fn lost_to_a_lock(e: &sqlx::migrate::MigrateError) -> bool {
    use sqlx::migrate::MigrateError;
    let (MigrateError::Execute(sqlx::Error::Database(d)) | MigrateError::ExecuteMigration(sqlx::Error::Database(d), _)) = e else {
        return false;
    };
    matches!(d.code().as_deref(), Some("40P01" | "55P03"))
}

impl Store {
    /// Applies the embedded migrations for this backend (forward-only). On
    /// PostgreSQL on a connection of its own, without the lock timeout of
    /// the host's sessions: the migrator waits for another host's
    /// migration to finish (an advisory lock).
    ///
    /// A database that a newer release has migrated further is accepted:
    /// its migrations keep this release working (expand, then contract a
    /// release later), so a host of this release may still start during
    /// a rolling upgrade. It says so in its log.
    ///
    /// A migration that deadlocks with the statements of hosts still
    /// running (a previous release's claim holds `runs` and wants a table
    /// the migration altered) is rolled back whole by PostgreSQL and tried
    /// again, up to 5 times.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.migrate_to(i64::MAX).await
    }

    /// [`Store::migrate`] up to and including migration `target`: a
    /// database as an older release left it, for the upgrade tests.
    #[doc(hidden)]
    pub async fn migrate_to(&self, target: i64) -> Result<(), StoreError> {
        let mut migrator = migrator(self.backend);
        migrator.set_ignore_missing(true);
        let known = migrator.iter().map(|m| m.version).max().unwrap_or(0);
        let fresh = self.never_migrated().await?;
        match self.backend {
            Backend::Sqlite => migrator.run_to(target, &self.writer).await?,
            Backend::Postgres => {
                let mut tries = 0;
                loop {
                    tries += 1;
                    let pool = AnyPoolOptions::new().max_connections(1).connect(self.url()).await?;
                    let migrated = migrator.run_to(target, &pool).await;
                    pool.close().await;
                    match migrated {
                        Err(e) if tries < MIGRATION_TRIES && lost_to_a_lock(&e) => {
                            tracing::warn!(tries, error = %e, "a migration lost a lock conflict with running hosts; it was rolled back and is tried again");
                            tokio::time::sleep(std::time::Duration::from_millis(200 * tries as u64)).await;
                        }
                        other => break other?,
                    }
                }
            }
        }
        // The writer: an in-memory SQLite database (offline replay) is the
        // writer's connection alone.
        let applied: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(&self.writer).await?;
        if fresh && target >= known {
            // No host of an older release has run on a database made now:
            // it starts contracted (see `store::contract`).
            let taken = self.contract().await?;
            tracing::debug!(steps = taken.len(), "a new database: every contract step taken");
        }
        if let Some(applied) = applied.filter(|v| *v > known) {
            tracing::warn!(
                applied,
                known,
                "the database was migrated by a newer release; this host runs as a previous release until it is upgraded"
            );
        }
        Ok(())
    }

    /// Whether no migration was ever applied here (no `_sqlx_migrations`
    /// rows, or no such table).
    async fn never_migrated(&self) -> Result<bool, StoreError> {
        let table = match self.backend {
            Backend::Sqlite => "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
            Backend::Postgres => "SELECT COUNT(*) FROM pg_catalog.pg_tables WHERE tablename = '_sqlx_migrations' AND schemaname = current_schema()",
        };
        let tables: i64 = sqlx::query_scalar(table).fetch_one(&self.writer).await?;
        if tables == 0 {
            return Ok(true);
        }
        let applied: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations").fetch_one(&self.writer).await?;
        Ok(applied == 0)
    }

    /// A digest of `backend`'s embedded migrations (their versions and
    /// checksums): a database migrated by one build matches another's with
    /// the same digest (the suite's template databases).
    #[doc(hidden)]
    pub fn migrations_digest(backend: Backend) -> String {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for m in migrator(backend).iter() {
            h.update(m.version.to_le_bytes());
            h.update(&m.checksum);
        }
        hex::encode(&h.finalize()[..8])
    }
}
