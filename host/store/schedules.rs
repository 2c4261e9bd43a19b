//! Schedules' rows (docs/operations.md, "Schedules"; migration 0025/0022).
//! What a schedule's times are is `schedules` (the host's module), which
//! computes `next_at`; this file stores it. Every change is a
//! compare-and-set on `version`, which every tick bumps too
//! (`store::ticks`), so a change and a tick made at once never mix.

use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::store::{Store, StoreError, sql};

/// What a tick does while the schedule's last run is still open (queued,
/// running or waiting), in the words Temporal's schedules use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Starts nothing; the tick is recorded as skipped. The default.
    #[default]
    Skip,
    /// Keeps the tick (one at most) and starts it when the open run ends;
    /// a tick while one is kept is skipped.
    BufferOne,
    /// Starts a run anyway.
    AllowAll,
    /// Cancels the open runs, then starts one.
    CancelOther,
}

impl Overlap {
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::BufferOne => "buffer_one",
            Overlap::AllowAll => "allow_all",
            Overlap::CancelOther => "cancel_other",
        }
    }

    pub fn parse(s: &str) -> Option<Overlap> {
        [Overlap::Skip, Overlap::BufferOne, Overlap::AllowAll, Overlap::CancelOther].into_iter().find(|o| o.as_str() == s)
    }
}

/// A schedule as stored. Times are epoch ms on the database's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Schedule {
    /// Its name: 1 to 128 of `A-Z a-z 0-9 . _ -`.
    pub id: String,
    pub plugin: String,
    /// The runs' input, JSON text.
    #[serde(skip)]
    pub input: String,
    /// A cron expression, or null for an interval.
    pub cron: Option<String>,
    /// An interval in ms, or null for a cron expression.
    pub interval_ms: Option<i64>,
    /// The IANA time zone its cron expression's wall-clock times are in.
    pub time_zone: String,
    pub overlap: Overlap,
    /// A tick found later than this (a downtime) is recorded as skipped
    /// (`missed`) and starts nothing.
    pub catchup_window_ms: i64,
    /// Each run waits a further 0 to this many ms before it may be
    /// claimed, the same for a given time on every host.
    pub jitter_ms: i64,
    pub priority: i64,
    pub concurrency_key: Option<String>,
    pub max_attempts: i64,
    pub budget_tokens: Option<i64>,
    pub budget_usd_nanos: Option<i64>,
    /// A paused schedule has no ticks; on resume it goes on from the next
    /// time after the resume.
    pub paused: bool,
    /// Why it was paused or changed, as its operator said.
    pub note: Option<String>,
    /// Its next scheduled time; null when its expression has none left.
    pub next_at: Option<i64>,
    /// Moves on with every tick and change.
    pub version: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

impl Schedule {
    pub(crate) fn from_row(row: &AnyRow) -> Result<Schedule, StoreError> {
        let overlap: String = row.try_get("overlap")?;
        Ok(Schedule {
            id: row.try_get("id")?,
            plugin: row.try_get("plugin")?,
            input: row.try_get("input")?,
            cron: row.try_get("cron")?,
            interval_ms: row.try_get("interval_ms")?,
            time_zone: row.try_get("time_zone")?,
            overlap: Overlap::parse(&overlap).ok_or_else(|| StoreError::Corrupt(format!("unknown overlap policy {overlap:?}")))?,
            catchup_window_ms: row.try_get("catchup_window_ms")?,
            jitter_ms: row.try_get("jitter_ms")?,
            priority: row.try_get("priority")?,
            concurrency_key: Some(row.try_get::<String, _>("concurrency_key")?).filter(|k| !k.is_empty()),
            max_attempts: row.try_get("max_attempts")?,
            budget_tokens: row.try_get("budget_tokens")?,
            budget_usd_nanos: row.try_get("budget_usd_nanos")?,
            paused: row.try_get::<i64, _>("paused")? != 0,
            note: row.try_get("note")?,
            next_at: row.try_get("next_at")?,
            version: row.try_get("version")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
        })
    }
}

/// The columns a statement reads a schedule from (a literal, for `concat!`).
macro_rules! columns {
    () => {
        "id, plugin, input, cron, interval_ms, time_zone, overlap, catchup_window_ms, jitter_ms, priority, concurrency_key, \
         max_attempts, budget_tokens, budget_usd_nanos, paused, note, next_at, version, created_at, updated_at"
    };
}
pub(crate) use columns;

/// Checks a schedule's name: 1 to 128 of `A-Z a-z 0-9 . _ -`.
pub fn check_id(id: &str) -> Result<(), String> {
    let ok = (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok { Ok(()) } else { Err(format!("a schedule id is 1 to 128 of A-Z a-z 0-9 . _ - (got {id:?})")) }
}

impl Store {
    /// Writes a new schedule (its `version`, `created_at` and `updated_at`
    /// are the store's). Refused when the id is taken.
    /// How many schedules there are.
    pub async fn count_schedules(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar("SELECT COUNT(*) FROM schedules").fetch_one(self.pool()).await?)
    }

    pub async fn create_schedule(&self, s: &Schedule) -> Result<Schedule, StoreError> {
        let row = self
            .retry(|| async move {
                let q = sqlx::query(sql!(
                    self,
                    concat!("INSERT INTO schedules (id, plugin, input, cron, interval_ms, time_zone, overlap, catchup_window_ms, jitter_ms, \
                     priority, concurrency_key, max_attempts, budget_tokens, budget_usd_nanos, paused, note, next_at, version, \
                     created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, 0, {now}, {now}) \
                     ON CONFLICT (id) DO NOTHING \
                     RETURNING ", columns!())
                ));
                Ok(bind_fields(q, s).fetch_optional(self.writer()).await?)
            })
            .await?;
        let row = row.ok_or_else(|| StoreError::Refused(format!("a schedule named {:?} exists already", s.id)))?;
        Schedule::from_row(&row)
    }

    /// Replaces schedule `s.id`'s fields with `s`'s if its version is
    /// still `s.version`. `None`: it moved on meanwhile (a tick or another
    /// change); read it again and redo the change.
    pub async fn update_schedule(&self, s: &Schedule) -> Result<Option<Schedule>, StoreError> {
        let row = self
            .retry(|| async move {
                let q = sqlx::query(sql!(
                    self,
                    concat!("UPDATE schedules SET id = $1, plugin = $2, input = $3, cron = $4, interval_ms = $5, time_zone = $6, \
                     overlap = $7, catchup_window_ms = $8, jitter_ms = $9, priority = $10, concurrency_key = $11, \
                     max_attempts = $12, budget_tokens = $13, budget_usd_nanos = $14, paused = $15, note = $16, next_at = $17, \
                     version = version + 1, updated_at = {now} WHERE id = $1 AND version = $18 \
                     RETURNING ", columns!())
                ));
                Ok(bind_fields(q, s).bind(s.version).fetch_optional(self.writer()).await?)
            })
            .await?;
        row.as_ref().map(Schedule::from_row).transpose()
    }

    /// Deletes a schedule and its tick records; the runs it started stay.
    /// `false`: there was none.
    pub async fn delete_schedule(&self, id: &str) -> Result<bool, StoreError> {
        self.retry(|| async move {
            let mut tx = self.writer().begin().await?;
            let gone = sqlx::query(sql!(self, "DELETE FROM schedules WHERE id = $1")).bind(id).execute(&mut *tx).await?;
            sqlx::query(sql!(self, "DELETE FROM schedule_ticks WHERE schedule_id = $1")).bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(gone.rows_affected() > 0)
        })
        .await
    }

    pub async fn schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError> {
        let q = sql!(self, concat!("SELECT ", columns!(), " FROM schedules WHERE id = $1"));
        let row = sqlx::query(q).bind(id).fetch_optional(self.pool()).await?;
        row.as_ref().map(Schedule::from_row).transpose()
    }

    /// Schedules by id, after `after`, at most `limit`.
    pub async fn schedules(&self, after: &str, limit: i64) -> Result<Vec<Schedule>, StoreError> {
        let q = sql!(self, concat!("SELECT ", columns!(), " FROM schedules WHERE id > $1 ORDER BY id LIMIT $2"));
        let rows = sqlx::query(q).bind(after).bind(limit).fetch_all(self.pool()).await?;
        rows.iter().map(Schedule::from_row).collect()
    }

    /// Unpaused schedules due at `now` (epoch ms), soonest first, at most
    /// `limit`; and the soonest `next_at` of the others (when the next is
    /// due), if any.
    pub async fn due_schedules(&self, now: i64, limit: i64) -> Result<(Vec<Schedule>, Option<i64>), StoreError> {
        let q = sql!(self, concat!("SELECT ", columns!(), " FROM schedules WHERE paused = 0 AND next_at <= $1 ORDER BY next_at LIMIT $2"));
        let rows = sqlx::query(q).bind(now).bind(limit).fetch_all(self.pool()).await?;
        let due = rows.iter().map(Schedule::from_row).collect::<Result<Vec<_>, _>>()?;
        let soonest: Option<i64> = sqlx::query_scalar(sql!(self, "SELECT MIN(next_at) FROM schedules WHERE paused = 0 AND next_at > $1"))
            .bind(now)
            .fetch_one(self.pool())
            .await?;
        Ok((due, soonest))
    }
}

/// Binds `s`'s fields as `$1`..`$17`, in the order of the columns less
/// the store's own (`version`, `created_at`, `updated_at`).
fn bind_fields<'q>(
    q: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>,
    s: &'q Schedule,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments> {
    q.bind(&s.id)
        .bind(&s.plugin)
        .bind(&s.input)
        .bind(&s.cron)
        .bind(s.interval_ms)
        .bind(&s.time_zone)
        .bind(s.overlap.as_str())
        .bind(s.catchup_window_ms)
        .bind(s.jitter_ms)
        .bind(s.priority)
        .bind(s.concurrency_key.as_deref().unwrap_or(""))
        .bind(s.max_attempts)
        .bind(s.budget_tokens)
        .bind(s.budget_usd_nanos)
        .bind(i64::from(s.paused))
        .bind(&s.note)
        .bind(s.next_at)
}
