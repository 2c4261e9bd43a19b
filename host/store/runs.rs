//! Runs: reading and listing them, and renewing their leases (statement
//! 2). Submitting them is [`super::submits`].

use std::time::Duration;

use sqlx::Row;

use crate::store::{Lease, Run, RunStatus, Store, StoreError, dialect_sql, sql};

impl Store {
    /// The run with `id`.
    pub async fn get_run(&self, id: i64) -> Result<Run, StoreError> {
        let row = sqlx::query(sql!(self, "SELECT {runs} FROM runs WHERE id = $1"))
            .bind(id)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::RunNotFound(id))?;
        let mut run = Run::from_row(&row)?;
        self.unfold(&mut run).await?;
        Ok(run)
    }

    /// Runs, newest first, optionally filtered; `before` is a cursor (an id).
    pub async fn list_runs(
        &self,
        status: Option<RunStatus>,
        plugin: Option<&str>,
        before: Option<i64>,
        limit: i64,
    ) -> Result<Vec<Run>, StoreError> {
        let filter = RunFilter { status, plugin: plugin.map(str::to_string), ..RunFilter::default() };
        Ok(self.runs_page(&filter, before, limit, i64::MAX).await?.0)
    }

    /// [`Store::list_runs`] with every [`RunFilter`], and no more than about
    /// `max_bytes` of inputs, outputs and partials (always at least one
    /// run). Also returns whether the page was cut short by its size.
    ///
    /// A fixed statement per index it can use, rather than one
    /// `($1 IS NULL OR status = $1)` for all: a thread's runs come from
    /// `runs_thread`, a status's from `runs_status`, the rest by id. The
    /// text search scans (newest first, until the page is full).
    pub async fn runs_page(
        &self,
        filter: &RunFilter,
        before: Option<i64>,
        limit: i64,
        max_bytes: i64,
    ) -> Result<(Vec<Run>, bool), StoreError> {
        self.runs_page_from(filter, before, 0, limit, max_bytes).await
    }

    /// [`Store::runs_page`] over the runs with ids of at least `from` only
    /// (a text search's window: [`super::search`]).
    pub(crate) async fn runs_page_from(
        &self,
        filter: &RunFilter,
        before: Option<i64>,
        from: i64,
        limit: i64,
        max_bytes: i64,
    ) -> Result<(Vec<Run>, bool), StoreError> {
        // `$4`: the text, as a LIKE pattern; `$5`, `$6`: status, plugin;
        // `$7`: the lowest id; `$8`: the thread.
        // The byte budget counts the stored partial; a running run's
        // unfolded deltas (`store::partial`) are not counted.
        macro_rules! page {
            ($filter:literal) => {
                concat!(
                    "SELECT * FROM (SELECT {runs@r}, SUM(LENGTH(r.input) + LENGTH(r.partial) + COALESCE(LENGTH(r.output), 0) \
                     + COALESCE(LENGTH(r.error), 0)) OVER (ORDER BY r.id DESC) AS running FROM runs r \
                     WHERE r.id < $1 AND r.id >= $7", $filter,
                     " AND ($4 IS NULL OR LOWER(r.input) LIKE $4 ESCAPE '!' OR LOWER(COALESCE(r.output, '')) LIKE $4 ESCAPE '!' \
                     OR LOWER(COALESCE(r.error, '')) LIKE $4 ESCAPE '!') \
                     ORDER BY r.id DESC LIMIT $2) AS p WHERE p.running - \
                     (LENGTH(p.input) + LENGTH(p.partial) + COALESCE(LENGTH(p.output), 0) + COALESCE(LENGTH(p.error), 0)) < $3 \
                     ORDER BY p.id DESC"
                )
            };
        }
        let before = before.unwrap_or(i64::MAX);
        let text = filter.text.as_deref().filter(|t| !t.is_empty()).map(like_pattern);
        let status = filter.status.map(|s| s.as_str());
        let query = match (&filter.thread, status, &filter.plugin) {
            // A run's children come from runs_spawn.
            _ if filter.parent.is_some() => sqlx::query(sql!(
                self,
                page!(
                    " AND r.parent_id = $9 AND ($8 IS NULL OR r.thread_id = $8) AND ($5 IS NULL OR r.status = $5) \
                     AND ($6 IS NULL OR r.plugin = $6)"
                )
            )),
            (Some(_), _, _) => sqlx::query(sql!(
                self,
                page!(" AND r.thread_id = $8 AND ($5 IS NULL OR r.status = $5) AND ($6 IS NULL OR r.plugin = $6)")
            )),
            (None, None, None) => sqlx::query(sql!(self, page!(" AND $5 IS NULL AND $6 IS NULL"))),
            (None, Some(_), None) => sqlx::query(sql!(self, page!(" AND r.status = $5 AND $6 IS NULL"))),
            (None, None, Some(_)) => sqlx::query(sql!(self, page!(" AND $5 IS NULL AND r.plugin = $6"))),
            (None, Some(_), Some(_)) => sqlx::query(sql!(self, page!(" AND r.status = $5 AND r.plugin = $6"))),
        };
        let mut query =
            query.bind(before).bind(limit).bind(max_bytes).bind(text).bind(status).bind(filter.plugin.clone()).bind(from);
        if let Some(parent) = filter.parent {
            query = query.bind(filter.thread.clone()).bind(parent);
        } else if let Some(thread) = &filter.thread {
            query = query.bind(thread.clone());
        }
        let rows = query.fetch_all(self.pool()).await?;
        let cut = match rows.last() {
            Some(last) => last.try_get::<i64, _>("running")? >= max_bytes,
            None => false,
        };
        let mut runs = rows.iter().map(Run::from_row).collect::<Result<Vec<_>, _>>()?;
        self.unfold_all(&mut runs).await?;
        Ok((runs, cut))
    }

    /// Statement 2: extends the lease to `ttl` from the database's now and
    /// returns the new expiry. `LeaseLost` means: stop the guest, write nothing.
    /// On PostgreSQL it gives up after the lock timeout rather than wait on
    /// a row another (frozen) session holds: the caller retries, and its
    /// lease deadline stops the guest if no renewal lands.
    pub async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<i64, StoreError> {
        Ok(crate::store::renewals::renew(self, crate::store::renewals::Renewal { lease: lease.clone(), ttl, charge: false }).await?.0)
    }

    /// [`Store::renew`] that also counts the attempt of a segment whose
    /// claim did not (a run claimed for a local queue, starting its guest:
    /// see [`crate::store::Claimed::charged`]).
    pub async fn renew_charging(&self, lease: &Lease, ttl: Duration) -> Result<i64, StoreError> {
        Ok(crate::store::renewals::renew(self, crate::store::renewals::Renewal { lease: lease.clone(), ttl, charge: true }).await?.0)
    }
}

impl Store {
    /// Inserts `n` queued runs of `plugin` in one statement. For benches and
    /// tests that need a large queue quickly.
    pub async fn bulk_load_queued(&self, n: i64, plugin: &str) -> Result<u64, StoreError> {
        self.bulk_load(n, plugin, RunStatus::Queued).await
    }

    /// Inserts `n` runs of `plugin` with `status` in one statement (bench
    /// and tests: e.g. a million finished runs under the claim path).
    pub async fn bulk_load(&self, n: i64, plugin: &str, status: RunStatus) -> Result<u64, StoreError> {
        let done = sqlx::query(dialect_sql!(self, bulk_load))
            .bind(n)
            .bind(plugin)
            .bind(status.as_str())
            .execute(self.writer())
            .await?;
        Ok(done.rows_affected())
    }
}

/// Which runs [`Store::runs_page`] lists. Every field is optional; all
/// that are set must hold.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub status: Option<RunStatus>,
    pub plugin: Option<String>,
    pub thread: Option<String>,
    /// Only the children of this run (runs its turn spawned).
    pub parent: Option<i64>,
    /// Text the run's input, output or error holds, case-insensitively
    /// (ASCII).
    pub text: Option<String>,
}

/// `text` as a LIKE pattern that matches it anywhere, lower-cased, with
/// `!` escaping LIKE's wildcards in it.
fn like_pattern(text: &str) -> String {
    let mut pattern = String::with_capacity(text.len() + 2);
    pattern.push('%');
    for c in text.to_lowercase().chars() {
        if matches!(c, '%' | '_' | '!') {
            pattern.push('!');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}
