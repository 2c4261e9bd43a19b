//! Run priorities: a run of higher priority is claimed first; within one
//! priority, runs go in the order they became eligible. The claim reads
//! one priority at a time, highest first (see `claims` and each dialect's
//! claim); this module holds the range a priority may take.

/// The priorities a run may have. Default 0.
pub const PRIORITIES: std::ops::RangeInclusive<i64> = -1000..=1000;

/// A priority outside [`PRIORITIES`] is refused, with why.
pub fn check(priority: i64) -> Result<i64, String> {
    if PRIORITIES.contains(&priority) {
        Ok(priority)
    } else {
        Err(format!("priority must be between {} and {}, got {priority}", PRIORITIES.start(), PRIORITIES.end()))
    }
}
