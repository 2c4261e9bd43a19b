//! Schedules' ticks (docs/operations.md, "Schedules"). A tick is one
//! scheduled time of one schedule, recorded once in `schedule_ticks`
//! (keyed by the two): the run it started, or why none (skipped), or that
//! it waits for the open run to end (buffered). A tick and its run are
//! written in one transaction, which first takes the schedule's row
//! (moving `next_at` on, compare-and-set on `version`, for a tick the
//! ticker found due), so that hosts ticking at once each find the time
//! taken or not, never half.

use serde::Serialize;
use serde_json::json;
use sqlx::{AnyConnection, Row};

use crate::store::log::{self, kind};
use crate::store::schedules::{Overlap, Schedule};
use crate::store::{Run, Store, StoreError, sql};

/// What became of a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Started,
    Skipped,
    Buffered,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Started => "started",
            Outcome::Skipped => "skipped",
            Outcome::Buffered => "buffered",
        }
    }

    fn parse(s: &str) -> Result<Outcome, StoreError> {
        match s {
            "started" => Ok(Outcome::Started),
            "skipped" => Ok(Outcome::Skipped),
            "buffered" => Ok(Outcome::Buffered),
            _ => Err(StoreError::Corrupt(format!("unknown tick outcome {s:?}"))),
        }
    }
}

/// A tick's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Tick {
    pub schedule_id: String,
    /// The time it was scheduled for (epoch ms), jitter not included.
    pub scheduled_at: i64,
    pub outcome: Outcome,
    /// The run it started.
    pub run_id: Option<i64>,
    /// That run's status now, where the read joined it.
    pub run_status: Option<String>,
    /// Why it was skipped (`overlap: …`, `missed: …`, `plugin: …`), or
    /// what its start did (`cancelled run 12`).
    pub reason: Option<String>,
    /// Made by a backfill, not by the clock.
    pub backfill: bool,
    /// When it was recorded (the database's clock).
    pub recorded_at: i64,
    /// A run of missed times recorded as one: the last of them (null: this
    /// record is `scheduled_at` alone).
    pub through_at: Option<i64>,
    /// How many times this record holds: 1, or a run of missed times'.
    pub times: i64,
}

impl Tick {
    fn from_row(row: &sqlx::any::AnyRow) -> Result<Tick, StoreError> {
        Ok(Tick {
            schedule_id: row.try_get("schedule_id")?,
            scheduled_at: row.try_get("scheduled_at")?,
            outcome: Outcome::parse(&row.try_get::<String, _>("outcome")?)?,
            run_id: row.try_get("run_id")?,
            run_status: row.try_get("run_status")?,
            reason: row.try_get("reason")?,
            backfill: row.try_get::<i64, _>("backfill")? != 0,
            recorded_at: row.try_get("recorded_at")?,
            through_at: row.try_get("through_at")?,
            times: row.try_get("times")?,
        })
    }
}

/// A scheduled time the ticker found due.
#[derive(Debug, Clone)]
pub struct Due {
    pub at: i64,
    /// Set when it is past the catch-up window: recorded as skipped with
    /// this reason, and starts nothing.
    pub missed: Option<String>,
    /// How long its run waits before it may be claimed (ms).
    pub jitter_ms: i64,
    /// A run of missed times recorded as one (`missed` set): the last of
    /// them, and how many. `None` and 1 for one time.
    pub through: Option<i64>,
    pub times: i64,
}

impl Due {
    /// Time `at`, alone.
    pub fn at(at: i64, missed: Option<String>, jitter_ms: i64) -> Due {
        Due { at, missed, jitter_ms, through: None, times: 1 }
    }
}

impl Store {
    /// Records `due` (in order) for schedule `s` as read at its version,
    /// and moves its `next_at` to `next_at`, in one transaction. `None`:
    /// the schedule moved on meanwhile (another host ticked it, or it was
    /// changed, paused or deleted) and nothing was written.
    pub async fn tick_schedule(&self, s: &Schedule, due: &[Due], next_at: Option<i64>) -> Result<Option<Vec<Tick>>, StoreError> {
        let ticks = self
            .retry(|| async move {
                let mut tx = self.writer().begin().await?;
                let moved = sqlx::query(sql!(
                    self,
                    "UPDATE schedules SET next_at = $1, version = version + 1, updated_at = {now} \
                     WHERE id = $2 AND version = $3 AND paused = 0"
                ))
                .bind(next_at)
                .bind(&s.id)
                .bind(s.version)
                .execute(&mut *tx)
                .await?;
                if moved.rows_affected() == 0 {
                    return Ok(None);
                }
                let (mut ticks, mut woken) = (Vec::with_capacity(due.len()), Vec::new());
                for d in due {
                    ticks.extend(self.fire(&mut tx, s, d, s.overlap, false, &mut woken).await?);
                }
                tx.commit().await?;
                self.wake_all(&woken);
                Ok(Some(ticks))
            })
            .await?;
        if ticks.as_ref().is_some_and(|t| t.iter().any(|t| t.outcome == Outcome::Started)) {
            self.signal_work(true).await;
        }
        Ok(ticks)
    }

    /// Records the ticks of `times` for schedule `s` as a backfill would:
    /// not past any catch-up window, under `overlap`. A time already
    /// recorded keeps its record, which is returned as it is.
    pub async fn backfill(&self, s: &Schedule, times: &[i64], overlap: Overlap) -> Result<Vec<Tick>, StoreError> {
        let ticks = self
            .retry(|| async move {
                let mut tx = self.writer().begin().await?;
                // The schedule's row, as a tick takes it: ticks of one
                // schedule are written one transaction at a time.
                let held = sqlx::query(sql!(self, "UPDATE schedules SET version = version + 1, updated_at = {now} WHERE id = $1"))
                    .bind(&s.id)
                    .execute(&mut *tx)
                    .await?;
                if held.rows_affected() == 0 {
                    return Err(StoreError::NotFound(format!("no schedule {:?}", s.id)));
                }
                let (mut ticks, mut woken) = (Vec::with_capacity(times.len()), Vec::new());
                for &at in times {
                    let d = Due::at(at, None, 0);
                    match self.fire(&mut tx, s, &d, overlap, true, &mut woken).await? {
                        Some(t) => ticks.push(t),
                        None => ticks.extend(self.tick_at(&mut tx, &s.id, at).await?),
                    }
                }
                // Times inside one run of missed times return its record once.
                ticks.dedup_by_key(|t| t.scheduled_at);
                tx.commit().await?;
                self.wake_all(&woken);
                Ok(ticks)
            })
            .await?;
        self.signal_work(true).await;
        Ok(ticks)
    }

    /// Starts the buffered tick of each schedule whose open runs have
    /// ended (at most `limit` schedules). Returns the ticks started.
    pub async fn release_buffered(&self, limit: i64) -> Result<Vec<Tick>, StoreError> {
        let waiting: Vec<(String, i64)> = sqlx::query_as(sql!(
            self,
            "SELECT t.schedule_id, t.scheduled_at FROM schedule_ticks t JOIN schedules s ON s.id = t.schedule_id \
             WHERE t.outcome = 'buffered' AND s.paused = 0 AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.schedule_id = t.schedule_id \
             AND r.schedule_id IS NOT NULL AND r.status NOT IN ('completed', 'failed', 'aborted', 'cancelled')) \
             ORDER BY t.scheduled_at LIMIT $1"
        ))
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        let mut started = Vec::new();
        for (id, at) in waiting {
            let tick = self
                .retry(|| async {
                    let mut tx = self.writer().begin().await?;
                    let s = sqlx::query(sql!(
                        self,
                        concat!(
                            "UPDATE schedules SET version = version + 1, updated_at = {now} WHERE id = $1 AND paused = 0 RETURNING ",
                            crate::store::schedules::columns!()
                        )
                    ))
                    .bind(&id)
                    .fetch_optional(&mut *tx)
                    .await?;
                    let Some(s) = s.as_ref().map(Schedule::from_row).transpose()? else { return Ok(None) };
                    // Still buffered, and nothing open (another host may
                    // have started it, or a backfill a run).
                    let still: Option<i64> = sqlx::query_scalar(sql!(
                        self,
                        "SELECT scheduled_at FROM schedule_ticks WHERE schedule_id = $1 AND scheduled_at = $2 AND outcome = 'buffered'"
                    ))
                    .bind(&id)
                    .bind(at)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if still.is_none() || !self.open_runs(&mut tx, &id).await?.is_empty() {
                        return Ok(None);
                    }
                    let tick = self.start_buffered(&mut tx, &s, at).await?;
                    tx.commit().await?;
                    Ok(Some(tick))
                })
                .await?;
            started.extend(tick);
        }
        if !started.is_empty() {
            self.signal_work(true).await;
        }
        Ok(started)
    }

    /// Schedule `id`'s ticks, newest first, before `before` (epoch ms), at
    /// most `limit`, each with its run's status now.
    pub async fn ticks(&self, id: &str, before: i64, limit: i64) -> Result<Vec<Tick>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT t.schedule_id, t.scheduled_at, t.outcome, t.run_id, r.status AS run_status, t.reason, t.backfill, t.recorded_at, t.through_at, t.times \
             FROM schedule_ticks t LEFT JOIN runs r ON r.id = t.run_id \
             WHERE t.schedule_id = $1 AND t.scheduled_at < $2 ORDER BY t.scheduled_at DESC LIMIT $3"
        ))
        .bind(id)
        .bind(before)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(Tick::from_row).collect()
    }

    /// Deletes up to `batch` tick records older than `keep_ms` (by when they
    /// were recorded), but never a buffered one. Returns how many.
    pub async fn forget_old_ticks(&self, keep_ms: i64, batch: i64) -> Result<u64, StoreError> {
        self.retry(|| async move {
            let done = sqlx::query(sql!(
                self,
                "DELETE FROM schedule_ticks WHERE (schedule_id, scheduled_at) IN (SELECT schedule_id, scheduled_at \
                 FROM schedule_ticks WHERE recorded_at < {now} - $1 AND outcome <> 'buffered' ORDER BY recorded_at LIMIT $2)"
            ))
            .bind(keep_ms)
            .bind(batch)
            .execute(self.writer())
            .await?;
            Ok(done.rows_affected())
        })
        .await
    }

    /// Records one tick under `overlap`, unless its time is recorded
    /// already (`None`). The schedule's row is held by the transaction.
    /// Threads whose runs it cancelled are added to `woken`, to be woken
    /// once the transaction commits.
    async fn fire(
        &self,
        tx: &mut AnyConnection,
        s: &Schedule,
        d: &Due,
        overlap: Overlap,
        backfill: bool,
        woken: &mut Vec<String>,
    ) -> Result<Option<Tick>, StoreError> {
        if self.tick_at(tx, &s.id, d.at).await?.is_some() {
            return Ok(None);
        }
        // A run that outlived its time's record (records go by age, runs
        // when their tree is done) is that time's run: recorded again, never
        // started twice.
        let kept: Option<(i64, String)> = sqlx::query_as(sql!(self, "SELECT id, status FROM runs WHERE schedule_id = $1 AND scheduled_at = $2"))
            .bind(&s.id)
            .bind(d.at)
            .fetch_optional(&mut *tx)
            .await?;
        if let Some((id, status)) = kept {
            let row = sqlx::query(sql!(
                self,
                "INSERT INTO schedule_ticks (schedule_id, scheduled_at, outcome, run_id, reason, backfill, recorded_at) \
                 VALUES ($1, $2, 'started', $3, $4, $5, {now}) \
                 RETURNING schedule_id, scheduled_at, outcome, run_id, NULL AS run_status, reason, backfill, recorded_at, through_at, times"
            ))
            .bind(&s.id)
            .bind(d.at)
            .bind(id)
            .bind(format!("its run {id} outlived its record"))
            .bind(i64::from(backfill))
            .fetch_one(&mut *tx)
            .await?;
            let mut tick = Tick::from_row(&row)?;
            tick.run_status = Some(status);
            return Ok(Some(tick));
        }
        let (outcome, run, reason) = match self.decide(tx, s, d, overlap, woken).await? {
            Decision::Skip(reason) => (Outcome::Skipped, None, Some(reason)),
            Decision::Buffer => (Outcome::Buffered, None, None),
            Decision::Start(note) => (Outcome::Started, Some(self.start(tx, s, d.at, d.jitter_ms).await?), note),
        };
        let row = sqlx::query(sql!(
            self,
            "INSERT INTO schedule_ticks (schedule_id, scheduled_at, outcome, run_id, reason, backfill, recorded_at, through_at, times) \
             VALUES ($1, $2, $3, $4, $5, $6, {now}, $7, $8) \
             RETURNING schedule_id, scheduled_at, outcome, run_id, NULL AS run_status, reason, backfill, recorded_at, through_at, times"
        ))
        .bind(&s.id)
        .bind(d.at)
        .bind(outcome.as_str())
        .bind(run.as_ref().map(|r| r.id))
        .bind(reason)
        .bind(i64::from(backfill))
        .bind(d.through)
        .bind(d.times)
        .fetch_one(&mut *tx)
        .await?;
        let mut tick = Tick::from_row(&row)?;
        tick.run_status = run.map(|r| r.status.as_str().to_string());
        Ok(Some(tick))
    }

    async fn decide(
        &self,
        tx: &mut AnyConnection,
        s: &Schedule,
        d: &Due,
        overlap: Overlap,
        woken: &mut Vec<String>,
    ) -> Result<Decision, StoreError> {
        if let Some(missed) = &d.missed {
            return Ok(Decision::Skip(format!("missed: {missed}")));
        }
        let plugin: Option<String> = sqlx::query_scalar(sql!(self, "SELECT name FROM plugins WHERE name = $1"))
            .bind(&s.plugin)
            .fetch_optional(&mut *tx)
            .await?;
        if plugin.is_none() {
            return Ok(Decision::Skip(format!("plugin: {:?} is not registered", s.plugin)));
        }
        let open = self.open_runs(tx, &s.id).await?;
        if overlap == Overlap::BufferOne {
            let buffered: Option<i64> = sqlx::query_scalar(sql!(
                self,
                "SELECT scheduled_at FROM schedule_ticks WHERE schedule_id = $1 AND outcome = 'buffered' LIMIT 1"
            ))
            .bind(&s.id)
            .fetch_optional(&mut *tx)
            .await?;
            return Ok(match (open.last(), buffered) {
                (Some(last), Some(_)) => Decision::Skip(format!("overlap: run {last} is still open and a tick is buffered already")),
                (Some(_), None) => Decision::Buffer,
                // The open run ended and no pass has started the buffered
                // tick yet: it goes first, this one waits for it.
                (None, Some(at)) => {
                    self.start_buffered(tx, s, at).await?;
                    Decision::Buffer
                }
                (None, None) => Decision::Start(None),
            });
        }
        let Some(last) = open.last() else { return Ok(Decision::Start(None)) };
        Ok(match overlap {
            Overlap::AllowAll | Overlap::BufferOne => Decision::Start(None),
            Overlap::Skip => Decision::Skip(format!("overlap: run {last} is still open")),
            Overlap::CancelOther => {
                for id in &open {
                    let cancelled = self.cancel_subtree(tx, *id).await?;
                    woken.extend(cancelled.into_iter().map(|r| r.thread_id));
                }
                let ids: Vec<String> = open.iter().map(|id| id.to_string()).collect();
                Decision::Start(Some(format!("cancelled run {}", ids.join(", "))))
            }
        })
    }

    /// Starts schedule `s`'s buffered tick of time `at`: its run, and its
    /// record marked started.
    async fn start_buffered(&self, tx: &mut AnyConnection, s: &Schedule, at: i64) -> Result<Tick, StoreError> {
        let run = self.start(tx, s, at, jitter(s, at)).await?;
        let row = sqlx::query(sql!(
            self,
            "UPDATE schedule_ticks SET outcome = 'started', run_id = $3 WHERE schedule_id = $1 AND scheduled_at = $2 \
             RETURNING schedule_id, scheduled_at, outcome, run_id, NULL AS run_status, reason, backfill, recorded_at, through_at, times"
        ))
        .bind(&s.id)
        .bind(at)
        .bind(run.id)
        .fetch_one(&mut *tx)
        .await?;
        Tick::from_row(&row)
    }

    /// The open runs schedule `id` started, oldest first.
    async fn open_runs(&self, tx: &mut AnyConnection, id: &str) -> Result<Vec<i64>, StoreError> {
        Ok(sqlx::query_scalar(sql!(
            self,
            "SELECT id FROM runs WHERE schedule_id = $1 AND schedule_id IS NOT NULL \
             AND status NOT IN ('completed', 'failed', 'aborted', 'cancelled') ORDER BY id"
        ))
        .bind(id)
        .fetch_all(&mut *tx)
        .await?)
    }

    /// The record that holds time `at` of schedule `id`: its own, or a run
    /// of missed times that covers it.
    async fn tick_at(&self, tx: &mut AnyConnection, id: &str, at: i64) -> Result<Option<Tick>, StoreError> {
        let row = sqlx::query(sql!(
            self,
            "SELECT t.schedule_id, t.scheduled_at, t.outcome, t.run_id, r.status AS run_status, t.reason, t.backfill, t.recorded_at, t.through_at, t.times \
             FROM schedule_ticks t LEFT JOIN runs r ON r.id = t.run_id WHERE t.schedule_id = $1 AND t.scheduled_at <= $2 \
             ORDER BY t.scheduled_at DESC LIMIT 1"
        ))
        .bind(id)
        .bind(at)
        .fetch_optional(&mut *tx)
        .await?;
        let tick = row.as_ref().map(Tick::from_row).transpose()?;
        Ok(tick.filter(|t| t.scheduled_at == at || t.through_at.is_some_and(|through| through >= at)))
    }

    /// Writes schedule `s`'s run for time `at` (on the plugin's current
    /// version, due `jitter_ms` from now) and its `submitted` event.
    async fn start(&self, tx: &mut AnyConnection, s: &Schedule, at: i64, jitter_ms: i64) -> Result<Run, StoreError> {
        let thread_id = uuid::Uuid::new_v4().to_string();
        let secret = format!("{:032x}", rand::random::<u128>());
        let row = sqlx::query(sql!(
            self,
            "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, created_at, updated_at, \
             secret, priority, concurrency_key, budget_tokens, budget_usd_nanos, schedule_id, scheduled_at) \
             SELECT $1, p.name, p.digest, $3, 'queued', $4, {now} + $5, {now}, {now}, $6, $7, $8, $9, $10, $11, $12 \
             FROM plugins p WHERE p.name = $2 RETURNING {runs}"
        ))
        .bind(&thread_id)
        .bind(&s.plugin)
        .bind(&s.input)
        .bind(s.max_attempts)
        .bind(jitter_ms)
        .bind(&secret)
        .bind(s.priority)
        .bind(s.concurrency_key.as_deref().unwrap_or(""))
        .bind(s.budget_tokens)
        .bind(s.budget_usd_nanos)
        .bind(&s.id)
        .bind(at)
        .fetch_one(&mut *tx)
        .await?;
        let run = Run::from_row(&row)?;
        if let Some(key) = &run.concurrency_key {
            crate::store::concurrency::activate(self, tx, key, &run.plugin).await?;
        }
        let payload = json!({ "plugin": run.plugin, "input": run.input, "schedule": s.id, "scheduled_at": at });
        log::append(self, tx, &run.thread_id, run.id, run.fence, kind::SUBMITTED, &payload).await?;
        Ok(run)
    }

    fn wake_all(&self, threads: &[String]) {
        for t in threads {
            self.hub().wake(t);
        }
    }
}

enum Decision {
    Skip(String),
    Buffer,
    /// With a note of what the start did.
    Start(Option<String>),
}

/// How long schedule `s`'s run for time `at` waits before it may be
/// claimed: 0 to `jitter_ms` ms, the same on every host (a hash of the two).
pub fn jitter(s: &Schedule, at: i64) -> i64 {
    if s.jitter_ms <= 0 {
        return 0;
    }
    use sha2::Digest;
    let hash = sha2::Sha256::new().chain_update(s.id.as_bytes()).chain_update(at.to_be_bytes()).finalize();
    let n = u64::from_be_bytes(hash[..8].try_into().expect("8 bytes"));
    (n % (s.jitter_ms as u64 + 1)) as i64
}
