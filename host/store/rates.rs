//! Rate limits on effects (docs/flow-control.md). A limit is keyed by what
//! an effect reaches: `http:HOST:PORT` (host in lower case) or
//! `model:NAME`. It bounds the calls every run makes, across all hosts:
//! `per_minute` calls and, for models, `tokens_per_minute` tokens.
//!
//! Calls are spaced evenly, a generic cell rate: each call moves the key's
//! clock (`calls_at`) on by 60 s / `per_minute`, and a call goes out only
//! once that clock has come, so no minute holds more than `per_minute`
//! calls whichever hosts make them. Tokens keep a clock of their own,
//! moved on by the tokens a call reserves and moved back or on again when
//! its answer reports what it used. A provider's `Retry-After` holds every
//! call to the key until `held_until`. All three clocks are the database's.
//!
//! Admission reads the key's row and writes it back only if no other call
//! moved it in between (compare and set): two hosts never wait on a lock
//! for it. No row, no limit: a host knows which keys have rows from
//! [`Store::rate_keys`], read at most once a second, so calls to targets
//! without a limit cost the database nothing.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::Row;

use crate::store::{Store, StoreError, sql};

/// The longest rate key, in characters.
pub const MAX_KEY_CHARS: usize = 256;
/// The highest `per_minute`.
pub const MAX_PER_MINUTE: i64 = 6_000_000;
/// The highest `tokens_per_minute`.
pub const MAX_TOKENS_PER_MINUTE: i64 = 1_000_000_000;
/// The longest hold a provider's `Retry-After` can put on a key: a longer
/// one is cut to this, so a broken or hostile server cannot stop every
/// call to itself for days. Default: 10 minutes.
pub const MAX_HOLD: Duration = Duration::from_secs(600);
/// How stale a host's list of limited keys may be: every host sees a new
/// limit within this.
pub const KEYS_FRESH: Duration = Duration::from_secs(1);

const MINUTE_US: i64 = 60_000_000;

/// Whether `key` names a rate limit (`http:` or `model:`) rather than a
/// concurrency key.
pub fn is_rate_key(key: &str) -> bool {
    key.starts_with("http:") || key.starts_with("model:")
}

/// A rate key is `http:HOST:PORT` (the host in lower case as a URL names
/// it, an IPv6 address in brackets; the port a number) or `model:NAME`,
/// at most [`MAX_KEY_CHARS`] characters with no control characters.
pub fn check_rate_key(key: &str) -> Result<(), String> {
    let chars = key.chars().count();
    if chars > MAX_KEY_CHARS {
        return Err(format!("a rate key is at most {MAX_KEY_CHARS} characters, got {chars}"));
    }
    if key.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("a rate key may not hold spaces or control characters".into());
    }
    if let Some(rest) = key.strip_prefix("http:") {
        let bad = || format!("an http rate key is http:HOST:PORT, e.g. http:api.example.com:443; got {key:?}");
        // `http:HOST:PORT@PLUGIN`: one plugin's hold from a provider's
        // Retry-After (shown, and cleared by a delete, like any key).
        let rest = match rest.rsplit_once('@') {
            Some((target, plugin)) => {
                let named = (1..=64).contains(&plugin.len())
                    && plugin.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
                if !named {
                    return Err(format!("{key:?}: after @ comes a plugin's name (a-z, 0-9, '-', '_')"));
                }
                target
            }
            None => rest,
        };
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(bad());
        }
        if host.chars().any(|c| c.is_ascii_uppercase()) {
            return Err(format!("write the host of {key:?} in lower case, as URLs name it"));
        }
        return Ok(());
    }
    match key.strip_prefix("model:") {
        Some(name) if !name.is_empty() => Ok(()),
        Some(_) => Err("a model rate key is model:NAME, e.g. model:gpt-4o-mini".into()),
        None => Err(format!("a rate key starts with http: or model:, got {key:?}")),
    }
}

/// `per_minute` and `tokens_per_minute`: at least one, each in range;
/// tokens only for `model:` keys.
pub fn check_rates(key: &str, per_minute: Option<i64>, tokens_per_minute: Option<i64>) -> Result<(), String> {
    if per_minute.is_none() && tokens_per_minute.is_none() {
        return Err("a rate limit needs per_minute, tokens_per_minute or both".into());
    }
    if let Some(n) = per_minute.filter(|n| !(1..=MAX_PER_MINUTE).contains(n)) {
        return Err(format!("per_minute must be between 1 and {MAX_PER_MINUTE}, got {n}"));
    }
    if let Some(n) = tokens_per_minute.filter(|n| !(1..=MAX_TOKENS_PER_MINUTE).contains(n)) {
        return Err(format!("tokens_per_minute must be between 1 and {MAX_TOKENS_PER_MINUTE}, got {n}"));
    }
    if key.contains('@') {
        return Err(format!("{key:?} names one plugin's hold from a provider's Retry-After; it takes no limit"));
    }
    if tokens_per_minute.is_some() && !key.starts_with("model:") {
        return Err("tokens_per_minute is for model: keys only".into());
    }
    Ok(())
}

/// A rate limit and where its clocks stand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct RateLimit {
    pub key: String,
    /// Calls a minute, spaced evenly; null: calls are not limited.
    pub per_minute: Option<i64>,
    /// Tokens a minute (`model:` keys); null: tokens are not limited.
    pub tokens_per_minute: Option<i64>,
    /// How long a call made now would wait, in ms: 0 when there is room.
    pub wait_ms: i64,
    /// A provider's `Retry-After` in force: no call goes out before this
    /// (epoch ms). Null when none is.
    pub held_until: Option<i64>,
    /// When the limit was last set (epoch ms); 0 for a row that only
    /// carries a hold.
    pub updated_at: i64,
}

/// A key's clocks as admission reads them (µs, the database's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clocks {
    pub per_minute: Option<i64>,
    pub tokens_per_minute: Option<i64>,
    pub calls_at: i64,
    pub tokens_at: i64,
    /// In ms, as stored.
    pub held_until: i64,
}

/// What admission decided for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Charged: the call goes out after `wait_ms` (0: now).
    Go { wait_ms: i64 },
    /// Not charged: there is no room within the caller's window; try again
    /// in `wait_ms`.
    Later { wait_ms: i64 },
}

impl Clocks {
    /// When a call could go out (µs): once every clock has come.
    pub fn start(&self, now_us: i64) -> i64 {
        now_us.max(self.calls_at).max(self.tokens_at).max(self.held_until.saturating_mul(1000))
    }

    /// The rule: a call that could go out within `window_ms` is charged
    /// (`calls` calls and `tokens` tokens, from when it goes out) and told
    /// how long to wait; one that could not is told when to ask again.
    /// Returns the decision and, when charged, the clocks to write.
    pub fn decide(&self, now_us: i64, calls: i64, tokens: i64, window_ms: i64) -> (Admission, Option<(i64, i64)>) {
        let start = self.start(now_us);
        let wait_ms = (start - now_us + 999) / 1000;
        if wait_ms > window_ms {
            return (Admission::Later { wait_ms }, None);
        }
        // Nothing to charge (a re-issue, or a row that only holds): no write.
        let charged = (calls > 0 && self.per_minute.is_some()) || (tokens > 0 && self.tokens_per_minute.is_some());
        if !charged {
            return (Admission::Go { wait_ms }, None);
        }
        let step = |n: i64, rate: Option<i64>| rate.map_or(0, |r| n.saturating_mul(MINUTE_US) / r);
        let calls_at = start.saturating_add(step(calls, self.per_minute));
        let tokens_at = if self.tokens_per_minute.is_some() { start.saturating_add(step(tokens, self.tokens_per_minute)) } else { self.tokens_at };
        (Admission::Go { wait_ms }, Some((calls_at, tokens_at)))
    }
}

/// This host's list of keys with a row, read at most once per
/// [`KEYS_FRESH`] (and at once after this host writes one).
#[derive(Debug, Default)]
pub struct KeyCache(tokio::sync::Mutex<Option<(Instant, Arc<HashSet<String>>)>>);

impl KeyCache {
    async fn forget(&self) {
        *self.0.lock().await = None;
    }
}

fn rate_limit(row: &sqlx::any::AnyRow) -> Result<RateLimit, StoreError> {
    let now: i64 = row.try_get("now")?;
    let clocks = clocks(row)?;
    let held: i64 = row.try_get("held_until")?;
    Ok(RateLimit {
        key: row.try_get("key")?,
        per_minute: clocks.per_minute,
        tokens_per_minute: clocks.tokens_per_minute,
        wait_ms: ((clocks.start(now * 1000) - now * 1000) + 999) / 1000,
        held_until: (held > now).then_some(held),
        updated_at: row.try_get("updated_at")?,
    })
}

fn clocks(row: &sqlx::any::AnyRow) -> Result<Clocks, StoreError> {
    Ok(Clocks {
        per_minute: row.try_get("per_minute")?,
        tokens_per_minute: row.try_get("tokens_per_minute")?,
        calls_at: row.try_get("calls_at")?,
        tokens_at: row.try_get("tokens_at")?,
        held_until: row.try_get("held_until")?,
    })
}

/// A rate key's row with the database's now (ms).
macro_rules! view {
    () => {
        "SELECT key, per_minute, tokens_per_minute, calls_at, tokens_at, held_until, updated_at, {clock} AS now FROM rate_limits"
    };
}

impl Store {
    /// Sets `key`'s rates (its clocks and any hold stay as they are);
    /// every host follows within [`KEYS_FRESH`].
    pub async fn set_rate(&self, key: &str, per_minute: Option<i64>, tokens_per_minute: Option<i64>) -> Result<RateLimit, StoreError> {
        check_rate_key(key).map_err(StoreError::Config)?;
        check_rates(key, per_minute, tokens_per_minute).map_err(StoreError::Config)?;
        self.retry(|| async move {
            sqlx::query(sql!(
                self,
                "INSERT INTO rate_limits (key, per_minute, tokens_per_minute, updated_at) VALUES ($1, $2, $3, {now}) \
                 ON CONFLICT (key) DO UPDATE SET per_minute = excluded.per_minute, \
                 tokens_per_minute = excluded.tokens_per_minute, updated_at = excluded.updated_at"
            ))
            .bind(key)
            .bind(per_minute)
            .bind(tokens_per_minute)
            .execute(self.writer())
            .await?;
            Ok(())
        })
        .await?;
        self.rate_keys.forget().await;
        self.rate(key).await?.ok_or_else(|| StoreError::Corrupt(format!("rate key {key:?} vanished as it was set")))
    }

    /// `key`'s limit and clocks; `None` if it has neither a limit nor a hold.
    pub async fn rate(&self, key: &str) -> Result<Option<RateLimit>, StoreError> {
        let row = sqlx::query(sql!(self, concat!(view!(), " WHERE key = $1")))
            .bind(key)
            .fetch_optional(self.pool())
            .await?;
        row.as_ref().map(rate_limit).transpose()
    }

    /// Up to `limit` rate keys after `after`, by key.
    pub async fn rates(&self, after: &str, limit: i64) -> Result<Vec<RateLimit>, StoreError> {
        let rows = sqlx::query(sql!(self, concat!(view!(), " WHERE key > $1 ORDER BY key LIMIT $2")))
            .bind(after)
            .bind(limit)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(rate_limit).collect()
    }

    /// Removes `key`'s limit and any hold on it. False if it had neither.
    pub async fn remove_rate(&self, key: &str) -> Result<bool, StoreError> {
        let n = self
            .retry(|| async move {
                Ok(sqlx::query("DELETE FROM rate_limits WHERE key = $1").bind(key).execute(self.writer()).await?.rows_affected())
            })
            .await?;
        self.rate_keys.forget().await;
        Ok(n > 0)
    }

    /// The keys with a row (a limit or a hold), as this host last read
    /// them: at most [`KEYS_FRESH`] old.
    pub async fn rate_keys(&self) -> Result<Arc<HashSet<String>>, StoreError> {
        let mut cached = self.rate_keys.0.lock().await;
        if let Some((_, keys)) = cached.as_ref().filter(|(at, _)| at.elapsed() < KEYS_FRESH) {
            return Ok(keys.clone());
        }
        let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM rate_limits").fetch_all(self.pool()).await?;
        let keys = Arc::new(keys.into_iter().collect::<HashSet<_>>());
        *cached = Some((Instant::now(), keys.clone()));
        Ok(keys)
    }

    /// Admits one call to `key` worth `calls` calls and `tokens` tokens,
    /// if it can go out within `window_ms` (see [`Clocks::decide`]). A
    /// key without a row admits at once.
    pub async fn admit(&self, key: &str, calls: i64, tokens: i64, window_ms: i64) -> Result<Admission, StoreError> {
        self.retry(|| async move {
            for _ in 0..50 {
                let row = sqlx::query(sql!(self, concat!(view!(), " WHERE key = $1")))
                    .bind(key)
                    .fetch_optional(self.pool())
                    .await?;
                let Some(row) = row else { return Ok(Admission::Go { wait_ms: 0 }) };
                let (was, now): (Clocks, i64) = (clocks(&row)?, row.try_get("now")?);
                let (admission, write) = was.decide(now * 1000, calls, tokens, window_ms);
                let Some((calls_at, tokens_at)) = write else { return Ok(admission) };
                // Only if no other call moved the clocks since the read.
                let moved = sqlx::query(
                    "UPDATE rate_limits SET calls_at = $2, tokens_at = $3 \
                     WHERE key = $1 AND calls_at = $4 AND tokens_at = $5 AND held_until = $6",
                )
                .bind(key)
                .bind(calls_at)
                .bind(tokens_at)
                .bind(was.calls_at)
                .bind(was.tokens_at)
                .bind(was.held_until)
                .execute(self.writer())
                .await?
                .rows_affected();
                if moved == 1 {
                    return Ok(admission);
                }
            }
            // Fifty calls moved the key under this one: busy enough to wait.
            Ok(Admission::Later { wait_ms: 100 })
        })
        .await
    }

    /// Settles a call's tokens: `used - reserved` more (or, when negative,
    /// fewer) on `key`'s token clock.
    pub async fn settle_tokens(&self, key: &str, delta: i64) -> Result<(), StoreError> {
        if delta == 0 {
            return Ok(());
        }
        self.retry(|| async move {
            sqlx::query(
                "UPDATE rate_limits SET tokens_at = tokens_at + ($2 * 60000000 / tokens_per_minute) \
                 WHERE key = $1 AND tokens_per_minute IS NOT NULL",
            )
            .bind(key)
            .bind(delta)
            .execute(self.writer())
            .await?;
            Ok(())
        })
        .await
    }

    /// Holds every call to `key` for `hold` (cut to [`MAX_HOLD`]) from the
    /// database's now, or longer if a hold already reaches further: a
    /// provider's `Retry-After`. A key without a limit gets a row that
    /// only carries the hold, which the cleaner forgets once it is over.
    pub async fn hold(&self, key: &str, hold: Duration) -> Result<(), StoreError> {
        let ms = i64::try_from(hold.min(MAX_HOLD).as_millis()).unwrap_or(0);
        self.retry(|| async move {
            sqlx::query(sql!(
                self,
                "INSERT INTO rate_limits (key, held_until) VALUES ($1, {now} + $2) \
                 ON CONFLICT (key) DO UPDATE SET held_until = CASE WHEN excluded.held_until > rate_limits.held_until \
                 THEN excluded.held_until ELSE rate_limits.held_until END"
            ))
            .bind(key)
            .bind(ms)
            .execute(self.writer())
            .await?;
            Ok(())
        })
        .await?;
        self.rate_keys.forget().await;
        Ok(())
    }

    /// Forgets rows that only carried a hold that is over. Returns how many.
    pub async fn forget_spent_holds(&self) -> Result<u64, StoreError> {
        self.retry(|| async move {
            Ok(sqlx::query(sql!(
                self,
                "DELETE FROM rate_limits WHERE per_minute IS NULL AND tokens_per_minute IS NULL AND held_until < {now}"
            ))
            .execute(self.writer())
            .await?
            .rows_affected())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::{Admission, Clocks};

    const NOW: i64 = 1_000_000_000;

    fn clocks(per_minute: Option<i64>, tokens_per_minute: Option<i64>) -> Clocks {
        Clocks { per_minute, tokens_per_minute, calls_at: 0, tokens_at: 0, held_until: 0 }
    }

    #[test]
    fn a_call_moves_the_clock_by_its_rate_and_waits_for_it() {
        let (go, write) = clocks(Some(600), None).decide(NOW, 1, 0, 1000);
        assert_eq!((go, write), (Admission::Go { wait_ms: 0 }, Some((NOW + 100_000, 0))));
        let ahead = Clocks { calls_at: NOW + 1_500_000, ..clocks(Some(600), None) };
        assert_eq!(ahead.decide(NOW, 1, 0, 1000), (Admission::Later { wait_ms: 1500 }, None));
    }

    #[test]
    fn nothing_to_charge_writes_nothing() {
        // A row that only holds, once the hold is over; and a re-issue.
        assert_eq!(clocks(None, None).decide(NOW, 1, 0, 1000), (Admission::Go { wait_ms: 0 }, None));
        assert_eq!(clocks(Some(60), None).decide(NOW, 0, 0, 1000), (Admission::Go { wait_ms: 0 }, None));
        let held = Clocks { held_until: NOW / 1000 + 2, ..clocks(None, None) };
        assert_eq!(held.decide(NOW, 1, 0, 1000), (Admission::Go { wait_ms: 2 }, None));
    }
}
