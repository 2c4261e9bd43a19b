//! The host's maintenance services: the loops that keep the database and
//! the runs in it healthy beside the work itself, each with a tick-once
//! entry point and its time injectable, so tests drive them without
//! sleeping.
//!
//! * [`reaper`]: runs whose lease ran out, and runs past their attempts;
//! * [`cleaner`]: retention, spent holds and idle keys;
//! * [`vacuum`]: PostgreSQL's `runs` table, when autovacuum is off;
//! * [`rollup`]: the per-minute counts the dashboard draws;
//! * [`segment_log`]: each segment's record, written behind it.

pub mod cleaner;
pub mod reaper;
pub mod rollup;
pub mod segment_log;
pub mod vacuum;
