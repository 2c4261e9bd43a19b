//! Concurrency keys (docs/flow-control.md). A run may carry a key (a
//! tenant, a user, a document); a key may have a limit, the most of its
//! runs that hold a slot at once, and may be paused.
//!
//! A slot is held only by a `running` run whose lease is live, and every
//! claim counts a key's slots afresh from that (under the key's row lock
//! on PostgreSQL; SQLite has one writer): nothing keeps a count that a
//! crash could leak, so a run that sleeps, waits for input, dies or is
//! cancelled gives its slot back by that fact alone.
//!
//! Each key's claimable runs are a lane of their own in the claim index
//! (`runs_claim` leads with the key; `''` is the lane of runs without
//! one). Keys take turns, least recently served first
//! (`concurrency_keys.turn`), and within a claim every lane it takes,
//! the keyless one too, gets at most a fair share of the batch; a key
//! at its limit is passed over whatever its queue. The claim itself is
//! `leasehold_claimable` on PostgreSQL (migrations 0013 and 0016) and
//! [`claim_lanes_sqlite`] on SQLite; the two follow one rule, but for the
//! share: on PostgreSQL a key's turn takes at least 4 runs (when it has
//! them and the room), since each key served costs it statements of their
//! own; on SQLite every key's share is one statement, where a larger share
//! only read more rows (measured slower: docs/benchmarks.md).

use serde::Serialize;
use sqlx::{AnyConnection, Row};

use crate::store::{Store, StoreError, sql};

/// The longest key, in characters.
pub const MAX_KEY_CHARS: usize = 256;

/// The highest limit a key may have.
pub const MAX_CONCURRENCY: i64 = 1_000_000;

/// Key prefixes kept for the rate limits of effects.
const RESERVED: [&str; 2] = ["http:", "model:"];

/// A key is 1 to [`MAX_KEY_CHARS`] characters, none of them a control
/// character, and does not start with `http:` or `model:`.
pub fn check_key(key: &str) -> Result<(), String> {
    let chars = key.chars().count();
    if chars == 0 || chars > MAX_KEY_CHARS {
        return Err(format!("a concurrency key is 1 to {MAX_KEY_CHARS} characters, got {chars}"));
    }
    if key.chars().any(char::is_control) {
        return Err("a concurrency key may not hold control characters".into());
    }
    if let Some(p) = RESERVED.iter().find(|p| key.starts_with(**p)) {
        return Err(format!("concurrency keys starting with {p:?} are kept for the rate limits of effects"));
    }
    Ok(())
}

/// A limit is 1 to [`MAX_CONCURRENCY`] runs at once.
pub fn check_concurrency(n: i64) -> Result<(), String> {
    if (1..=MAX_CONCURRENCY).contains(&n) {
        Ok(())
    } else {
        Err(format!("concurrency must be between 1 and {MAX_CONCURRENCY}, got {n}"))
    }
}

/// A key: its limit, whether it is paused, and its runs now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct KeyLimit {
    pub key: String,
    /// The most of its runs that run at once; null: no limit.
    pub concurrency: Option<i64>,
    /// Its runs are not claimed while it is.
    pub paused: bool,
    /// Its runs waiting to run (`queued` or `waiting_takeover`, asleep or not).
    pub queued: i64,
    /// Its runs holding a slot: `running` with a live lease.
    pub running: i64,
    /// When its limit was last set (epoch ms); 0 if it never was.
    pub updated_at: i64,
}

/// A boolean column: PostgreSQL's `boolean`, SQLite's integer.
fn flag(row: &sqlx::any::AnyRow, column: &str) -> Result<bool, StoreError> {
    match row.try_get::<bool, _>(column) {
        Ok(b) => Ok(b),
        Err(_) => Ok(row.try_get::<i64, _>(column)? != 0),
    }
}

/// The conflict clause of a submit's key upsert (`excluded.concurrency`:
/// the least default limit of the plugins of the batch's runs with that
/// key): the key takes turns from now (a dormant one wakes) and, if no
/// operator ever set its limit (`updated_at` 0; `set_limit` and
/// `remove_limit` set it), takes that default. Writes nothing for a key
/// already active and awake with nothing to change, the usual case.
#[macro_export]
#[doc(hidden)]
macro_rules! key_default {
    () => {
        "ON CONFLICT (key) DO UPDATE SET active = true, due_at = NULL, \
         concurrency = COALESCE(concurrency_keys.concurrency, CASE WHEN concurrency_keys.updated_at = 0 THEN excluded.concurrency END) \
         WHERE NOT concurrency_keys.active OR concurrency_keys.due_at IS NOT NULL \
         OR (concurrency_keys.concurrency IS NULL AND concurrency_keys.updated_at = 0 AND excluded.concurrency IS NOT NULL)"
    };
}

/// A key's row with its counts (`$1` the key, or `k.key` in a list).
macro_rules! key_view {
    ($key:literal) => {
        concat!(
            "SELECT k.key, k.concurrency, k.paused, k.updated_at, ",
            "(SELECT COUNT(*) FROM runs WHERE ", crate::claimable!(), " AND concurrency_key = ", $key,
            " AND status IN ('queued', 'waiting_takeover')) AS queued, ",
            "(SELECT COUNT(*) FROM runs WHERE status = 'running' AND concurrency_key <> '' AND concurrency_key = ", $key,
            " AND lease_expires_at >= {now}) AS running FROM concurrency_keys k"
        )
    };
}

fn key_limit(row: &sqlx::any::AnyRow) -> Result<KeyLimit, StoreError> {
    Ok(KeyLimit {
        key: row.try_get("key")?,
        concurrency: row.try_get("concurrency")?,
        paused: flag(row, "paused")?,
        queued: row.try_get("queued")?,
        running: row.try_get("running")?,
        updated_at: row.try_get("updated_at")?,
    })
}

impl Store {
    /// Sets `key`'s limit (`None`: none) and whether it is paused; every
    /// host's next claims follow it. Returns the key as it now stands.
    pub async fn set_limit(&self, key: &str, concurrency: Option<i64>, paused: bool) -> Result<KeyLimit, StoreError> {
        check_key(key).map_err(StoreError::Config)?;
        if let Some(n) = concurrency {
            check_concurrency(n).map_err(StoreError::Config)?;
        }
        self.retry(|| async move {
            sqlx::query(sql!(
                self,
                "INSERT INTO concurrency_keys (key, concurrency, paused, updated_at) VALUES ($1, $2, $3, {now}) \
                 ON CONFLICT (key) DO UPDATE SET concurrency = excluded.concurrency, paused = excluded.paused, \
                 updated_at = excluded.updated_at"
            ))
            .bind(key)
            .bind(concurrency)
            .bind(paused)
            .execute(self.writer())
            .await?;
            Ok(())
        })
        .await?;
        self.signal_work(true).await;
        self.key_row(key).await?.ok_or_else(|| StoreError::Corrupt(format!("key {key:?} vanished as it was set")))
    }

    /// Pauses or resumes `key`, leaving its limit as it is: an operator's,
    /// or none yet, so its runs' plugin's default limit still applies.
    /// Returns the key as it now stands.
    pub async fn set_paused(&self, key: &str, paused: bool) -> Result<KeyLimit, StoreError> {
        check_key(key).map_err(StoreError::Config)?;
        self.retry(|| async move {
            sqlx::query(sql!(
                self,
                "INSERT INTO concurrency_keys (key, paused) VALUES ($1, $2) \
                 ON CONFLICT (key) DO UPDATE SET paused = excluded.paused"
            ))
            .bind(key)
            .bind(paused)
            .execute(self.writer())
            .await?;
            Ok(())
        })
        .await?;
        self.signal_work(true).await;
        self.key_row(key).await?.ok_or_else(|| StoreError::Corrupt(format!("key {key:?} vanished as it was set")))
    }

    /// `key` with its limit and its runs now; `None` if it has no limit,
    /// is not paused and has no run queued or running.
    pub async fn limit(&self, key: &str) -> Result<Option<KeyLimit>, StoreError> {
        Ok(self.key_row(key).await?.filter(|k| k.concurrency.is_some() || k.paused || k.queued > 0 || k.running > 0))
    }

    /// `key`'s row with its counts, whatever it holds.
    async fn key_row(&self, key: &str) -> Result<Option<KeyLimit>, StoreError> {
        let row = sqlx::query(sql!(self, concat!(key_view!("$1"), " WHERE k.key = $1")))
            .bind(key)
            .fetch_optional(self.pool())
            .await?;
        row.as_ref().map(key_limit).transpose()
    }

    /// Up to `limit` keys after `after`, by key: those with a limit, paused,
    /// or with claimable runs.
    pub async fn limits(&self, after: &str, limit: i64) -> Result<Vec<KeyLimit>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            concat!(
                key_view!("k.key"),
                " WHERE k.key > $1 AND (k.concurrency IS NOT NULL OR k.paused OR k.active) ORDER BY k.key LIMIT $2"
            )
        ))
        .bind(after)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(key_limit).collect()
    }

    /// Clears `key`'s limit and pause: its runs are claimed as any key's,
    /// and a key with no runs to claim is forgotten at once. False if it
    /// had neither.
    pub async fn remove_limit(&self, key: &str) -> Result<bool, StoreError> {
        let n = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    "UPDATE concurrency_keys SET concurrency = NULL, paused = false, updated_at = {now} \
                     WHERE key = $1 AND (concurrency IS NOT NULL OR paused)"
                ))
                .bind(key)
                .execute(self.writer())
                .await?
                .rows_affected())
            })
            .await?;
        if n > 0 {
            self.signal_work(true).await;
        }
        Ok(n > 0)
    }

    /// Forgets up to `batch` keys that have no limit, are not paused and
    /// have no run to claim: a submit, or a run of the key that becomes
    /// claimable again, writes the key anew. Returns how many.
    pub async fn forget_idle_keys(&self, batch: i64) -> Result<u64, StoreError> {
        // None, the usual case: one read, and no write transaction.
        let any: Option<String> = sqlx::query_scalar(sql!(
            self,
            "SELECT key FROM concurrency_keys WHERE NOT active AND concurrency IS NULL AND NOT paused LIMIT 1"
        ))
        .fetch_optional(self.pool())
        .await?;
        if any.is_none() {
            return Ok(0);
        }
        self.retry(|| async move {
            Ok(sqlx::query(sql!(
                self,
                "DELETE FROM concurrency_keys WHERE key IN (SELECT key FROM concurrency_keys \
                 WHERE NOT active AND concurrency IS NULL AND NOT paused LIMIT $1) \
                 AND NOT active AND concurrency IS NULL AND NOT paused"
            ))
            .bind(batch)
            .execute(self.writer())
            .await?
            .rows_affected())
        })
        .await
    }
}

/// SQLite: chooses up to `want` runs for a claim inside `conn`'s
/// transaction, by the rule of migration 0013's `leasehold_claimable`,
/// and moves the keys it served to the back of the turn order. `None`
/// when no key is active and unpaused: the caller claims the keyless lane
/// with its one statement, as before keys. Its first statement writes,
/// so the transaction holds the write lock from the start.
pub(crate) async fn claim_lanes_sqlite(store: &Store, conn: &mut AnyConnection, want: i64) -> Result<Option<Vec<i64>>, StoreError> {
    // Dormant keys whose time has come take turns again.
    sqlx::query(sql!(
        store,
        "UPDATE concurrency_keys SET due_at = NULL WHERE key IN (SELECT key FROM concurrency_keys \
         INDEXED BY concurrency_keys_due WHERE active AND NOT paused AND due_at IS NOT NULL AND due_at <= {now} LIMIT $1)"
    ))
    .bind(want)
    .execute(&mut *conn)
    .await?;
    let keys = sqlx::query(sql!(
        store,
        "UPDATE concurrency_keys SET turn = {now} WHERE key IN (SELECT key FROM concurrency_keys \
         INDEXED BY concurrency_keys_ready WHERE active AND NOT paused AND due_at IS NULL ORDER BY turn, key LIMIT $1) \
         RETURNING key, concurrency"
    ))
    .bind(want)
    .fetch_all(&mut *conn)
    .await?;
    if keys.is_empty() {
        return Ok(None);
    }
    let keys = keys
        .iter()
        .map(|r| Ok((r.try_get::<String, _>("key")?, r.try_get::<Option<i64>, _>("concurrency")?)))
        .collect::<Result<Vec<_>, StoreError>>()?;
    let n = keys.len();
    let share = (want / (n as i64 + 1)).max(1);
    // Every key's share in one statement (a statement per key cost the
    // single writer more than the runs): its room, and up to its take of
    // runs in lane order.
    let rows = sqlx::query(sql!(store, super::sqlite::KEYS_ROUND))
        .bind(serde_json::json!(keys).to_string())
        .bind(share)
        .fetch_all(&mut *conn)
        .await?;
    let mut chosen: std::collections::BTreeMap<String, (i64, i64, Vec<i64>)> = Default::default();
    for row in &rows {
        let key: String = row.try_get("key")?;
        let entry = chosen.entry(key).or_insert((row.try_get("room")?, row.try_get("take")?, Vec::new()));
        if let Some(id) = row.try_get::<Option<i64>, _>("id")? {
            entry.2.push(id);
        }
    }
    let plain_at = rand::random_range(0..=n);
    let mut ids: Vec<i64> = Vec::with_capacity(want as usize);
    // Per lane: its room left and whether it filled its share (so may
    // have more); the keyless lane is the last.
    let mut lanes: Vec<(i64, bool)> = vec![(0, false); n + 1];
    for slot in 0..=n {
        let wanted = want - ids.len() as i64;
        if wanted <= 0 {
            break;
        }
        if slot == plain_at {
            let take = share.min(wanted);
            let got = lane_ids(store, conn, "", take, &ids).await?;
            lanes[n] = (want, got.len() as i64 == take);
            ids.extend(got);
            continue;
        }
        let i = if slot < plain_at { slot } else { slot - 1 };
        let key = keys[i].0.as_str();
        let Some((room, take, got)) = chosen.remove(key) else { continue };
        let got: Vec<i64> = got.into_iter().take(wanted as usize).collect();
        lanes[i] = (room - got.len() as i64, got.len() as i64 == take && room > got.len() as i64);
        if got.is_empty() && take > 0 {
            put_to_sleep(store, conn, key).await?;
        }
        ids.extend(got);
    }
    // The lanes that filled their share take more while the batch has
    // room: the keyless one first, as PostgreSQL's claim does.
    for i in std::iter::once(n).chain(0..n) {
        let wanted = want - ids.len() as i64;
        if wanted <= 0 {
            break;
        }
        let (room, more) = lanes[i];
        if !more {
            continue;
        }
        let lane = if i == n { "" } else { keys[i].0.as_str() };
        let got = lane_ids(store, conn, lane, room.min(wanted), &ids).await?;
        ids.extend(got);
    }
    Ok(Some(ids))
}

/// SQLite's read of one lane (`$1` the key, `$2` how many), for plan
/// tests.
#[doc(hidden)]
pub fn lane_sql() -> &'static str {
    crate::store::render_both(super::sqlite::LANE)[crate::store::Backend::Sqlite as usize]
}

/// Up to `n` claimable runs of `lane` that `taken` does not hold, in claim
/// order. Nothing is written between a claim's reads, so a lane read
/// again yields the runs it gave before first; they are stepped over.
async fn lane_ids(store: &Store, conn: &mut AnyConnection, lane: &str, n: i64, taken: &[i64]) -> Result<Vec<i64>, StoreError> {
    let before = taken.len() as i64;
    let rows: Vec<i64> = sqlx::query_scalar(sql!(store, super::sqlite::LANE))
        .bind(lane)
        .bind(n + before)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.into_iter().filter(|id| !taken.contains(id)).take(n as usize).collect())
}

/// Makes `key` take turns again, after a run with it became claimable
/// outside a submit (a spawn, a resolved run queued again, a rerun): as a
/// submit's upsert does, with `plugin`'s default limit for a key no
/// operator set.
pub(crate) async fn activate(store: &Store, conn: &mut AnyConnection, key: &str, plugin: &str) -> Result<(), StoreError> {
    sqlx::query(sql!(
        store,
        concat!(
            "INSERT INTO concurrency_keys (key, active, concurrency) SELECT $1, true, p.key_concurrency FROM plugins p WHERE p.name = $2 ",
            crate::key_default!()
        )
    ))
    .bind(key)
    .bind(plugin)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// SQLite: `key`, served and found with nothing to take now, leaves the
/// turns until its earliest claimable run is due (at most [`DORMANT_MS`]
/// on), or for good (`active` false) if it has none: claims stop visiting
/// it meanwhile (migration 0030 / 0033; PostgreSQL's claim does the same).
async fn put_to_sleep(store: &Store, conn: &mut AnyConnection, key: &str) -> Result<(), StoreError> {
    sqlx::query(sql!(
        store,
        concat!(
            "UPDATE concurrency_keys SET active = (x.m IS NOT NULL), \
             due_at = CASE WHEN x.m > {now} THEN MIN(x.m, {now} + 30000) END \
             FROM (SELECT MIN(",
            crate::eligible_at!(),
            ") AS m FROM runs INDEXED BY runs_claim WHERE concurrency_key = $1 AND ",
            crate::claimable!(),
            ") AS x WHERE key = $1"
        )
    ))
    .bind(key)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Longest a dormant key sleeps before a claim looks at it again: 30 s. A
/// wake it missed (a submit by a host of the previous release) costs that
/// much at worst.
pub const DORMANT_MS: i64 = 30_000;
