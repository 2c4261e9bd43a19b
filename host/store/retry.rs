//! Retrying an operation the database refused for transient contention
//! (SQLite `BUSY`/`LOCKED`, PostgreSQL serialization failures and
//! deadlocks), and telling a lock timeout apart.

use std::time::Duration;

use crate::store::{Store, StoreError};

impl Store {
    /// Runs `op`, retrying it when the database reports transient lock
    /// contention (SQLite `BUSY`/`LOCKED`, PostgreSQL serialization failure
    /// or deadlock). Every retried operation is one transaction that was
    /// rolled back, so retrying is safe. Callers never see these errors
    /// unless contention lasts for all attempts.
    #[doc(hidden)]
    pub async fn retry<T, F, Fut>(&self, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        const ATTEMPTS: u32 = 50;
        let mut delay = Duration::from_millis(1);
        let mut n = 0;
        loop {
            match op().await {
                Err(StoreError::Db(e)) if n + 1 < ATTEMPTS && is_transient(&e) => {
                    n += 1;
                    tracing::debug!(attempt = n, error = %e, "transient database contention, retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }
}
/// True when a statement gave up waiting for a row lock (PostgreSQL
/// `lock_not_available`, raised by `lock_timeout`).
pub fn is_lock_timeout(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
}

/// True for errors that mean "try the same transaction again".
fn is_transient(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    let Some(code) = db.code() else { return false };
    match code.as_ref() {
        // PostgreSQL: serialization_failure, deadlock_detected.
        "40001" | "40P01" => true,
        // SQLite: primary result codes BUSY (5) and LOCKED (6), including
        // their extended forms (e.g. BUSY_SNAPSHOT = 517).
        c => c
            .parse::<i32>()
            .map(|c| matches!(c & 0xff, 5 | 6))
            .unwrap_or(false),
    }
}
