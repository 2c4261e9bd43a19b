//! Cron expressions: five fields (minute, hour, day of month, month, day
//! of week) or six with a leading seconds field, and the `@hourly`-style
//! shorthands. A field is `*`, a number, a range `a-b`, a step `*/n`,
//! `a-b/n` or `a/n`, or a comma-separated list of those; months and days
//! may be named (`JAN`, `MON`), Sunday is 0 or 7, and `?` means `*`. As in
//! Vixie cron, when both day fields are restricted a day matches either.
//!
//! An expression matches wall-clock times ([`Cron::next_civil`]); which
//! instant a wall-clock time is in a time zone is the caller's rule
//! (`schedules::Spec::next_after`).

use jiff::civil::{Date, DateTime};

/// A parsed cron expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    seconds: u64,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    /// Both day fields restricted: a day matches either (Vixie cron).
    either_day: bool,
}

/// The furthest [`Cron::next_civil`] looks: an expression with no match
/// in this many years (`0 0 30 2 *`) has none at all.
const HORIZON_YEARS: i16 = 30;

const MONTHS: [&str; 12] = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

impl Cron {
    /// Parses `text`, or says what is wrong with it.
    pub fn parse(text: &str) -> Result<Cron, String> {
        let text = text.trim();
        let expanded = match text.to_ascii_lowercase().as_str() {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            s if s.starts_with('@') => return Err(format!("unknown shorthand {text:?}: use @yearly, @monthly, @weekly, @daily or @hourly")),
            _ => text,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let (seconds, rest) = match fields.len() {
            5 => ("0", &fields[..]),
            6 => (fields[0], &fields[1..]),
            n => return Err(format!("a cron expression has 5 fields (minute hour day month weekday) or 6 (seconds first), not {n}")),
        };
        let restricted = |f: &str| !(f == "*" || f == "?" || f.starts_with("*/") || f.starts_with("?/"));
        Ok(Cron {
            seconds: field(seconds, "second", 0, 59, &[])?,
            minutes: field(rest[0], "minute", 0, 59, &[])?,
            hours: field(rest[1], "hour", 0, 23, &[])?,
            days: field(rest[2], "day of month", 1, 31, &[])?,
            months: field(rest[3], "month", 1, 12, &MONTHS)?,
            weekdays: {
                let w = field(rest[4], "day of week", 0, 7, &WEEKDAYS)?;
                // 7 is Sunday too.
                (w | (w >> 7)) & 0x7f
            },
            either_day: restricted(rest[2]) && restricted(rest[4]),
        })
    }

    fn day_matches(&self, d: Date) -> bool {
        let dom = bit(self.days, d.day() as u32);
        let dow = bit(self.weekdays, d.weekday().to_sunday_zero_offset() as u32);
        if self.either_day { dom || dow } else { dom && dow }
    }

    /// The first wall-clock time after `after` (whole seconds) that the
    /// expression matches; `None` if none within 30 years.
    pub fn next_civil(&self, after: DateTime) -> Option<DateTime> {
        let limit = after.year().saturating_add(HORIZON_YEARS);
        let mut date = after.date();
        // The first second after `after`, as (hour, minute, second).
        let mut from = (after.hour() as u32, after.minute() as u32, after.second() as u32 + 1);
        loop {
            if date.year() > limit {
                return None;
            }
            if !bit(self.months, date.month() as u32) {
                date = date.first_of_month().checked_add(jiff::Span::new().months(1)).ok()?;
                from = (0, 0, 0);
                continue;
            }
            if !self.day_matches(date) {
                date = date.tomorrow().ok()?;
                from = (0, 0, 0);
                continue;
            }
            if let Some((h, m, s)) = self.time_from(from) {
                return Some(date.at(h as i8, m as i8, s as i8, 0));
            }
            date = date.tomorrow().ok()?;
            from = (0, 0, 0);
        }
    }

    /// The first matching time of day at or after `(h, m, s)` (seconds may
    /// be 60: the next minute), if any that day.
    fn time_from(&self, (h0, m0, s0): (u32, u32, u32)) -> Option<(u32, u32, u32)> {
        for h in h0..24 {
            if !bit(self.hours, h) {
                continue;
            }
            let m_start = if h == h0 { m0 } else { 0 };
            for m in m_start..60 {
                if !bit(self.minutes, m) {
                    continue;
                }
                let s_start = if h == h0 && m == m0 { s0 } else { 0 };
                if let Some(s) = (s_start..60).find(|s| bit(self.seconds, *s)) {
                    return Some((h, m, s));
                }
            }
        }
        None
    }
}

fn bit(mask: u64, n: u32) -> bool {
    n < 64 && mask & (1 << n) != 0
}

/// One field as a bit mask of the values it allows.
fn field(text: &str, what: &str, min: u32, max: u32, names: &[&str]) -> Result<u64, String> {
    let value = |s: &str| -> Result<u32, String> {
        if let Some(i) = names.iter().position(|n| n.eq_ignore_ascii_case(s)) {
            // Months are 1-based, days of week 0-based.
            return Ok(i as u32 + min);
        }
        let n: u32 = s.parse().map_err(|_| format!("{what} field: {s:?} is not a number{}", if names.is_empty() { "" } else { " or a name" }))?;
        if !(min..=max).contains(&n) {
            return Err(format!("{what} field: {n} is out of range {min}-{max}"));
        }
        Ok(n)
    };
    let mut mask = 0u64;
    for item in text.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((r, s)) => {
                let step: u32 = s.parse().map_err(|_| format!("{what} field: step {s:?} is not a number"))?;
                if step == 0 || step > max {
                    return Err(format!("{what} field: step {step} must be 1 to {max}"));
                }
                (r, step)
            }
            None => (item, 1),
        };
        let (lo, hi) = match range {
            "*" | "?" => (min, max),
            r => match r.split_once('-') {
                Some((a, b)) => (value(a)?, value(b)?),
                // `a/n` runs from a to the end.
                None if item.contains('/') => (value(r)?, max),
                None => {
                    let v = value(r)?;
                    (v, v)
                }
            },
        };
        if lo > hi {
            return Err(format!("{what} field: range {range:?} runs backwards"));
        }
        for v in (lo..=hi).step_by(step as usize) {
            mask |= 1 << v;
        }
    }
    if text.is_empty() {
        return Err(format!("{what} field is empty"));
    }
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::date;

    fn next(expr: &str, after: DateTime) -> DateTime {
        Cron::parse(expr).unwrap().next_civil(after).unwrap()
    }

    #[test]
    fn fields_steps_ranges_and_names() {
        let t = date(2026, 12, 6).at(12, 0, 0, 0);
        assert_eq!(next("*/15 * * * *", t), date(2026, 12, 6).at(12, 15, 0, 0));
        assert_eq!(next("30 2 * * *", t), date(2026, 12, 7).at(2, 30, 0, 0));
        assert_eq!(next("* * * * * *", t), date(2026, 12, 6).at(12, 0, 1, 0));
        assert_eq!(next("0 9 * * MON-FRI", t), date(2026, 12, 7).at(9, 0, 0, 0), "the 6th is a Sunday");
        assert_eq!(next("0 0 1 jan *", t), date(2027, 1, 1).at(0, 0, 0, 0));
        assert_eq!(next("0 0 * * 7", t), date(2026, 12, 13).at(0, 0, 0, 0), "7 is Sunday");
        assert_eq!(next("@hourly", t), date(2026, 12, 6).at(13, 0, 0, 0));
        assert_eq!(next("0 0 29 2 *", t), date(2028, 2, 29).at(0, 0, 0, 0));
        // Both day fields restricted: either matches (the 13th, or a Friday).
        assert_eq!(next("0 0 13 * 5", t), date(2026, 12, 11).at(0, 0, 0, 0));
        assert_eq!(next("10/20 * * * * *", t), date(2026, 12, 6).at(12, 0, 10, 0));
        assert_eq!(Cron::parse("0 0 30 2 *").unwrap().next_civil(t), None);
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        for (expr, says) in [
            ("* * * *", "5 fields"),
            ("60 * * * *", "out of range 0-59"),
            ("* * * * FOO", "not a number or a name"),
            ("*/0 * * * *", "step 0"),
            ("5-1 * * * *", "backwards"),
            ("@reboot", "unknown shorthand"),
            ("1,,2 * * * *", "not a number"),
        ] {
            let e = Cron::parse(expr).unwrap_err();
            assert!(e.contains(says), "{expr}: {e}");
        }
    }
}
