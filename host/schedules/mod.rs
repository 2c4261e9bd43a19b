//! Schedules (docs/operations.md, "Schedules"): which times a schedule
//! has, and the ticker that every host runs to start their runs. The rows
//! are `store::schedules`; the ticks, each recorded once with its run in
//! one transaction, `store::ticks`.
//!
//! The daylight-saving rule. A cron expression names wall-clock times in
//! its time zone, and each of them that the clock shows is one tick:
//! - a time the clock skips (02:30 on a day it jumps from 02:00 to 03:00)
//!   is ticked once, as far past the jump as it was past 02:00 (03:30
//!   in the new offset; RFC 5545 and JavaScript's Temporal do the same),
//!   unless that instant is a tick already;
//! - a time the clock shows twice (02:30 on a day it goes back from 03:00
//!   to 02:00) is ticked once, the first time.
//!
//! So a daily 02:30 schedule runs once every day of the year, and a
//! schedule with a wildcard hour does not tick again in the repeated hour.
//! An interval is a steady period of real time, anchored at the Unix
//! epoch, which time zones do not touch.

pub mod cron;
pub mod ticker;

use jiff::Timestamp;
use jiff::tz::TimeZone;

use self::cron::Cron;

/// When a schedule's times are.
#[derive(Debug, Clone)]
pub enum Spec {
    /// Wall-clock times in a time zone.
    Cron { cron: Cron, tz: TimeZone },
    /// Every `ms` milliseconds since the Unix epoch.
    Every { ms: i64 },
}

/// The shortest interval: 1 s.
pub const MIN_INTERVAL_MS: i64 = 1000;

impl Spec {
    /// A cron expression in time zone `tz` (an IANA name, `UTC` by default).
    pub fn cron(expr: &str, tz: &str) -> Result<Spec, String> {
        let cron = Cron::parse(expr)?;
        let tz = TimeZone::get(tz).map_err(|_| format!("unknown time zone {tz:?}: give an IANA name such as UTC or Europe/Berlin"))?;
        Ok(Spec::Cron { cron, tz })
    }

    /// An interval of `ms` ms, at least [`MIN_INTERVAL_MS`].
    pub fn every(ms: i64) -> Result<Spec, String> {
        if ms < MIN_INTERVAL_MS {
            return Err(format!("an interval is at least 1s, not {ms} ms"));
        }
        Ok(Spec::Every { ms })
    }

    /// The spec of a stored schedule.
    pub fn of(s: &crate::store::Schedule) -> Result<Spec, String> {
        match (&s.cron, s.interval_ms) {
            (Some(expr), _) => Spec::cron(expr, &s.time_zone),
            (None, Some(ms)) => Spec::every(ms),
            (None, None) => Err(format!("schedule {:?} has neither a cron expression nor an interval", s.id)),
        }
    }

    /// The first scheduled time after `after` (epoch ms), by the rule in
    /// this module's doc. `None`: there is none (within 30 years).
    pub fn next_after(&self, after: i64) -> Option<i64> {
        match self {
            Spec::Every { ms } => after.div_euclid(*ms).checked_add(1)?.checked_mul(*ms),
            Spec::Cron { cron, tz } => {
                let after_ts = Timestamp::from_millisecond(after).ok()?;
                let mut civil = after_ts.to_zoned(tz.clone()).datetime();
                loop {
                    civil = cron.next_civil(civil)?;
                    // A skipped time lands past the jump; a repeated one is
                    // its first instant ("compatible", as RFC 5545).
                    let at = civil.to_zoned(tz.clone()).ok()?.timestamp().as_millisecond();
                    if at > after {
                        return Some(at);
                    }
                }
            }
        }
    }

    /// Up to `n` scheduled times after `after`.
    pub fn upcoming(&self, after: i64, n: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(n);
        let mut at = after;
        while out.len() < n {
            match self.next_after(at) {
                Some(next) => {
                    out.push(next);
                    at = next;
                }
                None => break,
            }
        }
        out
    }
}

/// A length of time: whole numbers with units, `ms`, `s`, `m`, `h`, `d`,
/// one after another (`90s`, `1h30m`, `500ms`); `0` is zero. In ms.
pub fn parse_span(text: &str) -> Result<i64, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(0);
    }
    let bad = || format!("{text:?}: give whole numbers with units ms, s, m, h or d, e.g. 30s, 5m, 1h30m");
    let mut rest = text;
    let mut total: i64 = 0;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let n: i64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let ms = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total = n.checked_mul(ms).and_then(|v| total.checked_add(v)).ok_or_else(|| format!("{text:?} is too long"))?;
    }
    Ok(total)
}

/// `ms` as a short span (`1h30m`, `5s`, `250ms`), the inverse of
/// [`parse_span`].
pub fn format_span(ms: i64) -> String {
    if ms == 0 {
        return "0".into();
    }
    let mut out = String::new();
    let mut rest = ms;
    for (unit, size) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)] {
        if rest >= size {
            out.push_str(&format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> i64 {
        text.parse::<Timestamp>().unwrap().as_millisecond()
    }

    #[test]
    fn spans_parse_and_print() {
        assert_eq!(parse_span("90s"), Ok(90_000));
        assert_eq!(parse_span("1h30m"), Ok(5_400_000));
        assert_eq!(parse_span("250ms"), Ok(250));
        assert_eq!(format_span(5_400_000), "1h30m");
        for bad in ["", "5", "5x", "m5", "1.5s"] {
            assert!(parse_span(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn intervals_are_anchored_at_the_epoch() {
        let s = Spec::every(60_000).unwrap();
        assert_eq!(s.next_after(ms("2026-12-06T12:00:30Z")), Some(ms("2026-12-06T12:01:00Z")));
        assert_eq!(s.next_after(ms("2026-12-06T12:01:00Z")), Some(ms("2026-12-06T12:02:00Z")));
        assert!(Spec::every(999).is_err());
    }

    #[test]
    fn a_daily_0230_runs_once_on_both_daylight_saving_days() {
        // Europe/Berlin: 2026-03-29 jumps 02:00 -> 03:00 (02:30 does not
        // exist); 2026-10-25 goes back 03:00 -> 02:00 (02:30 happens twice).
        let s = Spec::cron("30 2 * * *", "Europe/Berlin").unwrap();
        let spring = s.upcoming(ms("2026-03-27T12:00:00Z"), 4);
        assert_eq!(spring, vec![
            ms("2026-03-28T02:30:00+01:00"),
            ms("2026-03-29T03:30:00+02:00"),
            ms("2026-03-30T02:30:00+02:00"),
            ms("2026-03-31T02:30:00+02:00"),
        ]);
        let autumn = s.upcoming(ms("2026-10-23T12:00:00Z"), 4);
        assert_eq!(autumn, vec![
            ms("2026-10-24T02:30:00+02:00"),
            ms("2026-10-25T02:30:00+02:00"),
            ms("2026-10-26T02:30:00+01:00"),
            ms("2026-10-27T02:30:00+01:00"),
        ]);
        // From inside the repeated hour, the repeat is not ticked.
        assert_eq!(s.next_after(ms("2026-10-25T02:10:00+01:00")), Some(ms("2026-10-26T02:30:00+01:00")));
    }

    #[test]
    fn a_half_hourly_schedule_keeps_one_tick_per_instant_across_the_jump() {
        let s = Spec::cron("*/30 * * * *", "Europe/Berlin").unwrap();
        let ticks = s.upcoming(ms("2026-03-29T01:00:00+01:00"), 4);
        assert_eq!(ticks, vec![
            ms("2026-03-29T01:30:00+01:00"),
            ms("2026-03-29T03:00:00+02:00"),
            ms("2026-03-29T03:30:00+02:00"),
            ms("2026-03-29T04:00:00+02:00"),
        ]);
    }

    #[test]
    fn unknown_zones_are_refused() {
        assert!(Spec::cron("* * * * *", "Mars/Olympus").unwrap_err().contains("unknown time zone"));
    }
}
