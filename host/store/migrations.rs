//! The schema: each backend's embedded migrations, applied forward-only.

use sqlx::any::AnyPoolOptions;

use crate::store::{Backend, Store, StoreError};

fn migrator(backend: Backend) -> sqlx::migrate::Migrator {
    match backend {
        Backend::Sqlite => sqlx::migrate!("migrations/sqlite"),
        Backend::Postgres => sqlx::migrate!("migrations/postgres"),
    }
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
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut migrator = migrator(self.backend);
        migrator.set_ignore_missing(true);
        let known = migrator.iter().map(|m| m.version).max().unwrap_or(0);
        match self.backend {
            Backend::Sqlite => migrator.run(&self.writer).await?,
            Backend::Postgres => {
                let pool = AnyPoolOptions::new().max_connections(1).connect(self.url()).await?;
                let migrated = migrator.run(&pool).await;
                pool.close().await;
                migrated?;
            }
        }
        // The writer: an in-memory SQLite database (offline replay) is the
        // writer's connection alone.
        let applied: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(&self.writer).await?;
        if let Some(applied) = applied.filter(|v| *v > known) {
            tracing::warn!(
                applied,
                known,
                "the database was migrated by a newer release; this host runs as a previous release until it is upgraded"
            );
        }
        Ok(())
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
