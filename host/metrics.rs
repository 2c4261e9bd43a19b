//! The process's counters and histograms: atomics in one process-wide
//! [`Metrics`], bumped by the store, the executor and the API, and written
//! out in Prometheus' text format. A leaf: it imports nothing of the crate.
//! The gauges read from the database (runs by status, ledger rows by
//! state) and the whole `/metrics` page are the API's (`api::metrics`).

use std::fmt::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;


/// Upper bounds of the latency buckets, in seconds.
const SECONDS: [f64; 14] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];
/// Upper bounds of the waiting buckets (a run's queue time), in seconds.
const WAITS: [f64; 14] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0];
/// Upper bounds of the batch size buckets.
const SIZES: [f64; 14] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0];

/// A Prometheus histogram of seconds (by default) or of sizes.
pub struct Histogram {
    bounds: &'static [f64; 14],
    counts: [AtomicU64; 14],
    count: AtomicU64,
    /// The sum, in millionths.
    sum_micros: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::with(&SECONDS)
    }
}

impl Histogram {
    fn with(bounds: &'static [f64; 14]) -> Histogram {
        Histogram { bounds, counts: Default::default(), count: AtomicU64::new(0), sum_micros: AtomicU64::new(0) }
    }

    pub fn observe(&self, d: Duration) {
        self.observe_value(d.as_secs_f64());
    }

    /// Observes `v` (seconds, or a size).
    pub fn observe_value(&self, v: f64) {
        for (i, le) in self.bounds.iter().enumerate() {
            if v <= *le {
                self.counts[i].fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((v.max(0.0) * 1e6) as u64, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// Observations of at most `le`, one of the bucket bounds (`None`
    /// for another value).
    pub fn count_at_most(&self, le: f64) -> Option<u64> {
        self.bounds.iter().position(|b| *b == le).map(|i| self.counts[i].load(Relaxed))
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_series(out, name, "");
    }

    /// The series only, each with `labels` (`effect="http",`) first.
    fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        for (i, le) in self.bounds.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{le}\"}} {}", self.counts[i].load(Relaxed));
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {count}");
        let plain = labels.trim_end_matches(',');
        let braces = if plain.is_empty() { String::new() } else { format!("{{{plain}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum_micros.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braces} {count}");
    }
}

/// A histogram of waits: up to an hour.
pub struct Waits(pub Histogram);

impl Default for Waits {
    fn default() -> Self {
        Waits(Histogram::with(&WAITS))
    }
}

/// A histogram of batch sizes.
pub struct Sizes(pub Histogram);

impl Default for Sizes {
    fn default() -> Self {
        Sizes(Histogram::with(&SIZES))
    }
}

/// The process's counters and histograms.
#[derive(Default)]
pub struct Metrics {
    pub claims: AtomicU64,
    pub claim_latency: Histogram,
    /// Runs one claim statement took (non-empty claims only).
    pub claim_batch: Sizes,
    /// Closes one commit wrote (`store::closes`).
    pub close_batch: Sizes,
    /// From a run's submit to its first segment's start, on the
    /// database's clock.
    pub submit_to_start: Waits,
    /// How long a prefetched run waited in the pool's local queue.
    pub local_queue_wait: Histogram,
    /// Effects performed (not replayed), by name: from the call to its
    /// recorded result.
    effect_latency: std::sync::Mutex<std::collections::BTreeMap<String, Histogram>>,
    pub leases_lost: AtomicU64,
    /// Writes refused by the (owner, fence) guard: renewals, ledger rows,
    /// emits and closes from a segment that no longer holds its run.
    pub fenced_writes_rejected: AtomicU64,
    pub reaped_resumable: AtomicU64,
    pub reaped_aborted: AtomicU64,
    pub segments_completed: AtomicU64,
    pub segments_failed: AtomicU64,
    pub segments_suspended: AtomicU64,
    pub segments_abandoned: AtomicU64,
    pub segment_duration: Histogram,
    /// Runs failed by a guest error, by kind (`GuestErrorKind::as_str`).
    guest_errors: std::sync::Mutex<std::collections::HashMap<&'static str, u64>>,
    pub http_requests: AtomicU64,
    /// Submit attempts written (new runs and repeated idempotency keys).
    pub submits: AtomicU64,
    /// Commits that wrote them: under concurrent submits fewer than
    /// `submits` (group commit, see `store::submits`).
    pub submit_commits: AtomicU64,
    /// Guest `log` lines dropped over a segment's cap.
    pub guest_log_lines_dropped: AtomicU64,
    /// Effect calls that waited for their rate limit in place, and runs
    /// suspended because it had no room soon enough (`runtime::rates`).
    pub rate_waits: AtomicU64,
    pub rate_suspensions: AtomicU64,
    /// Providers' `Retry-After` answers that held a rate key.
    pub rate_holds: AtomicU64,
    /// Runs suspended because a `model.chat` would have spent past its
    /// tree's token budget (`runtime::budget`).
    pub budget_waits: AtomicU64,
    /// Runs claimed ahead of free workers and waiting in the pool's local
    /// queue now (a gauge; see `pool`).
    pub prefetched: AtomicU64,
    /// Runs the local queue gave back unstarted: at shutdown, or after
    /// waiting too long for a worker.
    pub prefetch_given_back: AtomicU64,
    /// Express claims: a keyed or prioritized submit's run claimed ahead of
    /// the local queue (see `pool::express`).
    pub express_claims: AtomicU64,
    /// Closes being written behind the workers that made them, which have
    /// gone on to queued runs (a gauge; see `pool`).
    pub closes_behind: AtomicU64,
    /// Vacuums of `runs` this host ran (PostgreSQL; see `vacuum`).
    pub runs_vacuums: AtomicU64,
    /// Rows the retention cleaner deleted (see `cleaner`).
    pub deleted_runs: AtomicU64,
    pub deleted_effects: AtomicU64,
    pub deleted_events: AtomicU64,
    /// Batched writes (closes, ledger rows, submits) that gave up waiting
    /// for a row lock another session held (PostgreSQL `lock_timeout`);
    /// a batch that did is written again without waiting on the others.
    pub lock_timeouts: AtomicU64,
    /// Runs taken by a claim (or a close that claims) whose reply was lost,
    /// found by the statement's token and handed back (`store::orphans`).
    pub orphans_handed_back: AtomicU64,
    /// Schedules' ticks this host recorded, by outcome (`schedules`).
    pub ticks_started: AtomicU64,
    pub ticks_skipped: AtomicU64,
    pub ticks_buffered: AtomicU64,
    /// Spans the OTLP collector accepted, and spans dropped: the export
    /// queue was full, or the collector refused or missed a batch (`traces`).
    pub trace_spans_exported: AtomicU64,
    pub trace_spans_dropped_full: AtomicU64,
    pub trace_spans_dropped_export: AtomicU64,
}



/// A listener for each run's wait from its submit to the first start of its
/// turn, in ms (`executor`'s `tap_first_start` says when): the `bench
/// harness-adapter`'s exact percentiles (the histograms here are
/// bucketed). Unset by default; set once.
static START_TAP: OnceLock<fn(i64)> = OnceLock::new();

/// Sets the start listener; false if one was set before.
pub fn set_start_tap(tap: fn(i64)) -> bool {
    START_TAP.set(tap).is_ok()
}

/// The start listener, if one is set.
pub fn start_tap() -> Option<fn(i64)> {
    START_TAP.get().copied()
}

/// The process-wide metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::default)
}

impl Metrics {
    /// Observes an effect `name` performed in `d`.
    pub fn effect(&self, name: &str, d: Duration) {
        let mut all = self.effect_latency.lock().expect("metrics lock");
        // No allocation but a name's first.
        if !all.contains_key(name) {
            all.insert(name.to_string(), Default::default());
        }
        all.get(name).expect("inserted above").observe(d);
    }

    /// Effects `name` observed so far.
    pub fn effects_observed(&self, name: &str) -> u64 {
        self.effect_latency.lock().expect("metrics lock").get(name).map_or(0, |h| h.count())
    }

    /// Counts a run failed by a guest error of `kind`.
    pub fn guest_error(&self, kind: &'static str) {
        *self.guest_errors.lock().expect("metrics lock").entry(kind).or_default() += 1;
    }

    /// Runs failed by a guest error of `kind` so far.
    pub fn guest_errors(&self, kind: &str) -> u64 {
        self.guest_errors.lock().expect("metrics lock").get(kind).copied().unwrap_or(0)
    }

    /// This process's counters and histograms.
    pub fn render_counters(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Relaxed));
        };
        counter(&mut out, "leasehold_claims_total", "Runs claimed by this host.", &self.claims);
        self.claim_latency.render(&mut out, "leasehold_claim_seconds", "Time of one claim statement.");
        self.claim_batch.0.render(&mut out, "leasehold_claim_batch_size", "Runs one claim statement took (claims that took any).");
        self.close_batch.0.render(&mut out, "leasehold_close_batch_size", "Closes one commit wrote.");
        self.submit_to_start.0.render(&mut out, "leasehold_submit_to_start_seconds", "From a run's submit to its first segment's start (the database's clock).");
        self.local_queue_wait.render(&mut out, "leasehold_local_queue_wait_seconds", "How long a prefetched run waited in this host's local queue.");
        let _ = writeln!(out, "# HELP leasehold_effect_seconds Effects performed (not replayed), by name.\n# TYPE leasehold_effect_seconds histogram");
        for (name, h) in self.effect_latency.lock().expect("metrics lock").iter() {
            h.render_series(&mut out, "leasehold_effect_seconds", &format!("effect=\"{name}\","));
        }
        counter(&mut out, "leasehold_leases_lost_total", "Segments stopped because their lease was lost.", &self.leases_lost);
        counter(
            &mut out,
            "leasehold_fenced_writes_rejected_total",
            "Writes refused by the (owner, fence) guard: a segment wrote after losing its lease.",
            &self.fenced_writes_rejected,
        );
        let _ = writeln!(
            out,
            "# HELP leasehold_schedule_ticks_total Schedules' ticks this host recorded.\n# TYPE leasehold_schedule_ticks_total counter\n\
             leasehold_schedule_ticks_total{{outcome=\"started\"}} {}\nleasehold_schedule_ticks_total{{outcome=\"skipped\"}} {}\n\
             leasehold_schedule_ticks_total{{outcome=\"buffered\"}} {}",
            self.ticks_started.load(Relaxed),
            self.ticks_skipped.load(Relaxed),
            self.ticks_buffered.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP leasehold_reaped_total Expired runs handled by this host's reaper.\n# TYPE leasehold_reaped_total counter\n\
             leasehold_reaped_total{{outcome=\"resumable\"}} {}\nleasehold_reaped_total{{outcome=\"aborted\"}} {}",
            self.reaped_resumable.load(Relaxed),
            self.reaped_aborted.load(Relaxed)
        );
        let _ = writeln!(out, "# HELP leasehold_segments_total Segments run by this host, by outcome.\n# TYPE leasehold_segments_total counter");
        for (outcome, v) in [
            ("completed", &self.segments_completed),
            ("failed", &self.segments_failed),
            ("suspended", &self.segments_suspended),
            ("lease_lost", &self.leases_lost),
            ("abandoned", &self.segments_abandoned),
        ] {
            let _ = writeln!(out, "leasehold_segments_total{{outcome=\"{outcome}\"}} {}", v.load(Relaxed));
        }
        self.segment_duration.render(&mut out, "leasehold_segment_seconds", "Duration of one segment.");
        counter(&mut out, "leasehold_http_requests_total", "API requests served by this host.", &self.http_requests);
        counter(&mut out, "leasehold_runs_vacuums_total", "Vacuums of the runs table this host ran (PostgreSQL).", &self.runs_vacuums);
        let _ = writeln!(
            out,
            "# HELP leasehold_retention_deleted_total Rows the retention cleaner on this host deleted, by table.\n\
             # TYPE leasehold_retention_deleted_total counter\n\
             leasehold_retention_deleted_total{{table=\"runs\"}} {}\n\
             leasehold_retention_deleted_total{{table=\"effects\"}} {}\n\
             leasehold_retention_deleted_total{{table=\"events\"}} {}",
            self.deleted_runs.load(Relaxed),
            self.deleted_effects.load(Relaxed),
            self.deleted_events.load(Relaxed)
        );
        counter(
            &mut out,
            "leasehold_guest_log_lines_dropped_total",
            "Guest log lines dropped over a segment's cap.",
            &self.guest_log_lines_dropped,
        );
        counter(&mut out, "leasehold_rate_waits_total", "Effect calls that waited in place for their rate limit.", &self.rate_waits);
        counter(
            &mut out,
            "leasehold_rate_suspensions_total",
            "Runs suspended because an effect's rate limit had no room within the wait allowed in place.",
            &self.rate_suspensions,
        );
        counter(&mut out, "leasehold_rate_holds_total", "Providers' Retry-After answers that held every call to their rate key.", &self.rate_holds);
        counter(&mut out, "leasehold_budget_waits_total", "Runs suspended because a model call would have spent past its tree's token budget.", &self.budget_waits);
        let _ = writeln!(
            out,
            "# HELP leasehold_prefetched_runs Runs claimed ahead of free workers, waiting in the local queue.\n\
             # TYPE leasehold_prefetched_runs gauge\nleasehold_prefetched_runs {}",
            self.prefetched.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP leasehold_closes_behind Closes being written behind workers that went on to queued runs.\n\
             # TYPE leasehold_closes_behind gauge\nleasehold_closes_behind {}",
            self.closes_behind.load(Relaxed)
        );
        counter(
            &mut out,
            "leasehold_prefetch_given_back_total",
            "Prefetched runs given back unstarted (shutdown, or waited too long for a worker).",
            &self.prefetch_given_back,
        );
        counter(
            &mut out,
            "leasehold_express_claims_total",
            "Claims made at once for a keyed or prioritized submit while the local queue was full.",
            &self.express_claims,
        );
        counter(
            &mut out,
            "leasehold_lock_timeouts_total",
            "Batched writes that gave up waiting for a row lock another session held (PostgreSQL).",
            &self.lock_timeouts,
        );
        counter(
            &mut out,
            "leasehold_orphaned_claims_handed_back_total",
            "Runs claimed by a statement whose reply was lost, found and handed back unstarted (PostgreSQL).",
            &self.orphans_handed_back,
        );
        counter(&mut out, "leasehold_trace_spans_exported_total", "Spans the OTLP collector accepted.", &self.trace_spans_exported);
        let _ = writeln!(
            out,
            "# HELP leasehold_trace_spans_dropped_total Spans dropped: the export queue was full, or the collector refused or missed their batch.\n\
             # TYPE leasehold_trace_spans_dropped_total counter\n\
             leasehold_trace_spans_dropped_total{{reason=\"queue_full\"}} {}\n\
             leasehold_trace_spans_dropped_total{{reason=\"export_failed\"}} {}",
            self.trace_spans_dropped_full.load(Relaxed),
            self.trace_spans_dropped_export.load(Relaxed)
        );
        counter(&mut out, "leasehold_submits_total", "Submits written by this host.", &self.submits);
        counter(
            &mut out,
            "leasehold_submit_commits_total",
            "Commits that wrote them (concurrent submits share one).",
            &self.submit_commits,
        );
        out
    }
}
