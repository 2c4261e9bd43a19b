//! The host's own wall clock, used only where protocol time is not needed:
//! log timestamps. Every lease, fence, timer and reaper decision reads the
//! database's clock (`{now}` in the SQL) and never this one, so hosts on
//! machines whose clocks disagree neither steal nor keep each other's
//! leases.
//!
//! `leasehold serve --test-clock-skew-ms N` shifts this clock by `N` ms, as
//! if the host ran on a machine whose clock was off. The fault-injection
//! suite starts hosts skewed both ways and checks that leases do not care.
//! Code that wants the wall time calls [`wall`] (clippy's
//! `disallowed-methods` refuses `SystemTime::now` in the host), so it
//! honours the skew and the suite would catch a protocol decision made on
//! the worker's clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

static SKEW_MS: AtomicI64 = AtomicI64::new(0);

/// Shifts this process's wall clock by `ms` (test-only). Default: 0.
pub fn set_skew_ms(ms: i64) {
    SKEW_MS.store(ms, Ordering::Relaxed);
}

pub fn skew_ms() -> i64 {
    SKEW_MS.load(Ordering::Relaxed)
}

/// The wall clock of this host, skew included.
pub fn wall() -> SystemTime {
    #[allow(clippy::disallowed_methods)] // the one allowed reading
    let now = SystemTime::now();
    let skew = skew_ms();
    let shift = Duration::from_millis(skew.unsigned_abs());
    if skew >= 0 { now + shift } else { now.checked_sub(shift).unwrap_or(SystemTime::UNIX_EPOCH) }
}

/// The monotonic clock a segment measures its own lease and budget on
/// (never a protocol decision: the database decides who holds a lease). A
/// test moves it forward with [`Monotonic::advance`], as if the process had
/// been paused. Cheap to clone; clones share the offset. Default: no offset.
#[derive(Debug, Clone, Default)]
pub struct Monotonic {
    offset_ns: Arc<AtomicU64>,
}

impl Monotonic {
    pub fn now(&self) -> Instant {
        Instant::now() + Duration::from_nanos(self.offset_ns.load(Ordering::Relaxed))
    }

    /// Time since `earlier`, a reading of this clock.
    pub fn since(&self, earlier: Instant) -> Duration {
        self.now().saturating_duration_since(earlier)
    }

    /// Moves this clock (and its clones) forward by `by` (tests).
    pub fn advance(&self, by: Duration) {
        self.offset_ns.fetch_add(by.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Log timestamps from [`wall`], as RFC 3339 UTC with microseconds.
pub struct LogTime;

impl tracing_subscriber::fmt::time::FormatTime for LogTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let d = wall().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        write!(w, "{}", rfc3339(d))
    }
}

/// `d` after the Unix epoch as `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`.
pub fn rfc3339(d: Duration) -> String {
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(Duration::ZERO), "1970-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(Duration::from_millis(951_782_400_123)), "2000-02-29T00:00:00.123000Z");
        assert_eq!(rfc3339(Duration::from_secs(1_796_083_199)), "2026-11-30T23:59:59.000000Z");
    }

    #[test]
    fn skew_shifts_the_wall_clock_both_ways() {
        set_skew_ms(3_600_000);
        #[allow(clippy::disallowed_methods)]
        let ahead = wall().duration_since(SystemTime::now()).unwrap();
        assert!(ahead > Duration::from_secs(3_590), "{ahead:?}");
        set_skew_ms(-3_600_000);
        #[allow(clippy::disallowed_methods)]
        let behind = SystemTime::now().duration_since(wall()).unwrap();
        assert!(behind > Duration::from_secs(3_590), "{behind:?}");
        set_skew_ms(0);
    }
}
