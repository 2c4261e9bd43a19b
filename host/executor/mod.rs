//! The executor: runs one *segment* of a run (docs/concepts.md).
//!
//! claim → reconcile the ledger → instantiate → call `run(input)` → close or
//! suspend. From the claim until its last write returns a renewal task keeps
//! the lease (`renewer::Cover`); if a renewal
//! is refused, or the lease would expire before a renewal lands, the guest is
//! interrupted at its next epoch tick, the in-flight call (and any effect
//! future in it) is dropped, and nothing more is written. The guest's
//! deadline is the earlier of its slice budget and its lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::runtime::host::{Held, SegmentInit};
use crate::runtime::replay::Recorded;
pub use crate::runtime::GuestErrorKind;
use crate::runtime::Runtime;
use crate::store::{Claimed, EffectClass, EffectState, Outcome, RunStatus, Store, StoreError};
use crate::store::segments::SegmentRecord;
use crate::traces::SegmentTrace;

mod config;
mod guest;
mod renewer;
mod settle;
mod upgrade;

pub use config::ExecutorConfig;
use renewer::Cover;

/// What one segment did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentOutcome {
    Completed,
    Failed(GuestErrorKind),
    Suspended(RunStatus),
    /// The lease was lost; the segment wrote nothing after that.
    LeaseLost,
    /// The database failed under the segment; the run was left as it was and
    /// will be resumed when its lease expires.
    Abandoned(String),
}

pub struct Executor {
    store: Store,
    runtime: Arc<Runtime>,
    config: ExecutorConfig,
    /// `config.reserved`, shared with each segment.
    reserved: Arc<[std::net::SocketAddr]>,
    stop: Arc<StopSignal>,
    /// Each segment's record, written behind it (`store::segments`).
    segment_log: crate::maintenance::segment_log::SegmentLog,
}

/// Tells running guests to stop at once (shutdown after the grace period).
#[derive(Default)]
struct StopSignal {
    stopped: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Executor {
    pub fn new(store: Store, runtime: Arc<Runtime>, config: ExecutorConfig) -> Executor {
        let reserved = config.reserved.clone().into();
        let segment_log = crate::maintenance::segment_log::SegmentLog::new(store.clone(), config.segment_log_every);
        Executor { store, runtime, config, reserved, stop: Arc::default(), segment_log }
    }

    /// Stops every running segment of this executor at once: each suspends
    /// its run as `waiting_takeover` (releasing the lease) so another worker
    /// resumes it by replay. An effect in flight is dropped: its ledger row
    /// stays `started`, as after a crash. Used at shutdown, after the grace
    /// period. Segments started afterwards stop at their first check.
    pub fn stop_guests(&self) {
        self.stop.stopped.store(true, Ordering::SeqCst);
        self.stop.notify.notify_waiters();
    }

    pub fn config(&self) -> &ExecutorConfig {
        &self.config
    }

    /// The runtime this executor runs its guests in.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// Claims one run and runs one segment of it. `None`: nothing to claim.
    pub async fn run_once(&self) -> Result<Option<(i64, SegmentOutcome)>, StoreError> {
        let Some(claimed) = self.claim(1).await?.pop() else {
            return Ok(None);
        };
        let id = claimed.run.id;
        Ok(Some((id, self.run_claimed(claimed).await?)))
    }

    /// Claims up to `max` runs for this worker (statement 1), counted in the
    /// claim metrics. The caller runs a segment of each at once: their
    /// leases are already running.
    pub async fn claim(&self, max: usize) -> Result<Vec<Claimed>, StoreError> {
        self.claim_charging(max, max).await
    }

    /// [`Executor::claim`], counting an attempt for at most `charged` of
    /// the runs: those for free workers. The others are for the pool's
    /// local queue, and count theirs when their segments start.
    pub async fn claim_charging(&self, max: usize, charged: usize) -> Result<Vec<Claimed>, StoreError> {
        let metrics = crate::metrics::global();
        let asked = Instant::now();
        let claimed = self
            .store
            .claim_batch_charging(&self.config.owner, self.config.lease_ttl, max.max(1) as i64, charged as i64)
            .await?;
        metrics.claim_latency.observe(asked.elapsed());
        metrics.claims.fetch_add(claimed.len() as u64, Ordering::Relaxed);
        if !claimed.is_empty() {
            metrics.claim_batch.0.observe_value(claimed.len() as f64);
        }
        Ok(claimed)
    }

    /// Runs one segment of a claimed run, counted in the segment metrics.
    pub async fn run_claimed(&self, claimed: Claimed) -> Result<SegmentOutcome, StoreError> {
        self.run_claimed_then(claimed, false).await.map(|(outcome, _)| outcome)
    }

    /// [`Executor::run_claimed`]; with `take_next`, a segment that finishes
    /// its turn claims the next claimable run in the same statement as its
    /// close (see [`Store::close_and_claim`]) and returns it: the caller
    /// runs it in the same slot, one claim round trip saved per run while
    /// there is a queue.
    pub async fn run_claimed_then(
        &self,
        claimed: Claimed,
        take_next: bool,
    ) -> Result<(SegmentOutcome, Option<Claimed>), StoreError> {
        self.run_claimed_signalling(claimed, take_next, None).await
    }

    /// [`Executor::run_claimed_then`], sending `guest_done` once the guest
    /// has returned and its instance is gone, before the segment's last
    /// write: from then on the segment holds no Wasm instance, only its
    /// close in flight, so the worker pool may start another guest while
    /// it is written. Dropped unsent when no guest ran (an unknown plugin,
    /// a lost lease before the call).
    pub async fn run_claimed_signalling(
        &self,
        claimed: Claimed,
        take_next: bool,
        guest_done: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Result<(SegmentOutcome, Option<Claimed>), StoreError> {
        let metrics = crate::metrics::global();
        let started = Instant::now();
        let mut next = Handoff { want: take_next, got: None, guest_done, charge: false };
        let (run_id, fence) = (claimed.run.id, claimed.lease.fence);
        let first = claimed.run.fence == first_fence(&claimed.run);
        observe_first_start(&self.store, &claimed.run);
        tap_first_start(&claimed);
        let database = self.store.database_id().await?;
        let (parent, http_header) = (claimed.run.trace_parent.as_deref(), self.config.http_traceparent);
        let trace = Arc::new(SegmentTrace::new(self.config.tracer.clone(), database, run_id, fence, parent, http_header));
        let described = trace.exporting().then(|| crate::traces::segment::describe(&claimed, &self.config.owner));
        let claimed_at = claimed.run.heartbeat_at.unwrap_or_default();
        // No `tracing` span: entering and leaving one at each of the
        // segment's polls, and formatting its fields, cost the host about
        // 4% of its CPU a no-op run (docs/benchmarks.md). The segment's own
        // lines (the guest's, a failed run, a lost lease) name its run,
        // fence and trace instead.
        let outcome = self.segment(claimed, &mut next, &trace).await;
        // A run's first segment that completes it is read from the run row
        // (`store::segments`): most runs then cost the log nothing, and,
        // with no exporter, the outcome is not even put in words.
        let logged = !(first && matches!(outcome, Ok(SegmentOutcome::Completed)));
        if described.is_some() || logged {
            let (outcome_said, error) = said(&outcome);
            if let Some(described) = described {
                let suspended = match &outcome {
                    Ok(SegmentOutcome::Suspended(status)) => Some(status.as_str()),
                    _ => None,
                };
                crate::traces::segment::finish(&trace, described, suspended, &outcome_said, error.as_deref());
            }
            if logged {
                let (owner, ended_at) = (self.config.owner.clone(), claimed_at + started.elapsed().as_millis() as i64);
                self.segment_log.record(SegmentRecord { run_id, fence, owner, started_at: claimed_at, ended_at, outcome: outcome_said });
            }
        }
        if let Ok(SegmentOutcome::LeaseLost) = &outcome {
            // An operator sees which runs a paused or partitioned host gave up.
            tracing::info!(run_id, fence, trace_id = %trace.trace(), "segment stopped: its lease was lost, and it wrote nothing more");
        }
        metrics.segment_duration.observe(started.elapsed());
        let counter = match &outcome {
            Ok(SegmentOutcome::Completed) => &metrics.segments_completed,
            Ok(SegmentOutcome::Failed(_)) => &metrics.segments_failed,
            Ok(SegmentOutcome::Suspended(_)) => &metrics.segments_suspended,
            Ok(SegmentOutcome::LeaseLost) => &metrics.leases_lost,
            Ok(SegmentOutcome::Abandoned(_)) | Err(_) => &metrics.segments_abandoned,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if next.got.is_some() {
            metrics.claims.fetch_add(1, Ordering::Relaxed);
        }
        outcome.map(|o| (o, next.got))
    }

    /// Writes the segment log's held records now (else within `segment_log::EVERY`).
    pub async fn flush_segment_log(&self) {
        self.segment_log.flush().await;
    }

    /// Runs segments until nothing is claimable; returns what each did.
    pub async fn drain(&self) -> Result<Vec<(i64, SegmentOutcome)>, StoreError> {
        let mut done = Vec::new();
        while let Some(outcome) = self.run_once().await? {
            done.push(outcome);
        }
        Ok(done)
    }

    /// Runs one segment of a run this worker has claimed.
    pub async fn run_segment(&self, claimed: Claimed) -> Result<SegmentOutcome, StoreError> {
        let database = self.store.database_id().await?;
        let (run, fence) = (claimed.run.id, claimed.lease.fence);
        let trace = Arc::new(SegmentTrace::new(None, database, run, fence, claimed.run.trace_parent.as_deref(), self.config.http_traceparent));
        self.segment(claimed, &mut Handoff { want: false, got: None, guest_done: None, charge: false }, &trace).await
    }

    async fn segment(&self, claimed: Claimed, next: &mut Handoff, trace: &Arc<SegmentTrace>) -> Result<SegmentOutcome, StoreError> {
        let (run_id, fence) = (claimed.run.id, claimed.lease.fence);
        let outcome = self.segment_of(claimed, next, trace).await;
        if let Ok(SegmentOutcome::Failed(kind)) = &outcome {
            tracing::warn!(run_id, fence, trace_id = %trace.trace(), kind = kind.as_str(), "run failed");
        }
        outcome
    }

    async fn segment_of(&self, claimed: Claimed, next: &mut Handoff, trace: &Arc<SegmentTrace>) -> Result<SegmentOutcome, StoreError> {
        let Claimed { run, lease, charged } = claimed;
        if let Some(given_back) = self.give_back_if_paused(&run, &lease, charged).await? {
            return Ok(given_back);
        }
        // The lease is renewed from here, measured from the claim (a run
        // that waited in the local queue has less left), until the
        // segment's last write returns.
        let lease_expires_at = run.lease_expires_at.unwrap_or(0);
        let claimed_at = run.heartbeat_at.unwrap_or(lease_expires_at);
        let lease_left = Duration::from_millis((lease_expires_at - claimed_at).max(0) as u64);
        // Dropped when the segment returns, after its last write.
        let cover = Cover::start(&self.store, &lease, self.config.lease_ttl, self.renew_every(), lease_left, self.config.clock.clone());
        let watch = &cover.watch;
        // A pause made on this host reaches the guest at once (store::pause).
        let _here = self.store.hub().running(run.id, watch.paused.clone());
        let plugin = match crate::plugins::resolve(&self.store, &self.runtime, &run.plugin, &run.plugin_digest).await {
            Ok(Some(plugin)) => plugin,
            Ok(None) => {
                let error = format!("unknown-plugin: no plugin named {:?} is registered", run.plugin);
                return self.finish(&lease, Outcome::Failed { error }, GuestErrorKind::UnknownPlugin, &Held::default(), next).await;
            }
            Err(crate::plugins::RegisterError::Store(e)) => return Err(e),
            Err(e) => {
                let error = format!("unknown-plugin: plugin {:?} could not be loaded: {e}", run.plugin);
                return self.finish(&lease, Outcome::Failed { error }, GuestErrorKind::UnknownPlugin, &Held::default(), next).await;
            }
        };
        let plugin = match self.upgrade(&run, &lease, plugin).await {
            Ok(plugin) => plugin,
            Err(StoreError::LeaseLost(_)) => return Ok(SegmentOutcome::LeaseLost),
            Err(e) => return Err(e),
        };
        // Fence 1 is a run's first segment: no segment held it before, so it
        // has no ledger to reconcile or replay (two round trips saved on the
        // common path).
        let (recorded, mut emit_pos) = (Recorded::empty(), run.emit_pos);
        let recorded = if lease.fence == 1 {
            recorded
        } else {
            match self.store.reconcile(&lease).await {
                Ok(_) => {}
                Err(StoreError::LeaseLost(_)) => return Ok(SegmentOutcome::LeaseLost),
                Err(e) => return Err(e),
            }
            let summary = self.store.ledger_summary(run.id).await?;
            // The segment whose call the ledger ends with: the one this resumes.
            if let Some(last) = summary.last.as_ref().filter(|r| r.fence_started < lease.fence) {
                trace.resumes(last.fence_started);
            }
            // After a death, the stream is cut back to where the dead
            // segment's own unsettled call began: past it the re-issued
            // call streams another answer. That call is the ledger's last
            // row, keyed and unsettled: a segment that replayed past it
            // would have re-issued and settled it. Decided from the row
            // alone, never from the fence before this one: claims that
            // never started a guest (a queued run given back, an orphaned
            // claim, a host that died before reconciling) leave gaps in the
            // fences. An unkeyed row is never re-issued and streams nothing,
            // so what follows it was streamed after a replay handed the turn
            // `in-doubt`, and replays as it was. Nothing below a settled
            // call is cut (its deltas replay as recorded).
            let cut = summary
                .last
                .as_ref()
                .filter(|r| matches!(r.state, EffectState::Started | EffectState::InDoubt))
                .filter(|r| r.class == EffectClass::Keyed)
                .map(|r| r.emit_pos);
            if let Some(cut) = cut.filter(|cut| *cut < emit_pos) {
                emit_pos = match self.store.retract(&lease, cut).await {
                    Ok(pos) => pos,
                    Err(StoreError::LeaseLost(_)) => return Ok(SegmentOutcome::LeaseLost),
                    Err(e) => return Err(e),
                };
            }
            Recorded::paged(self.store.clone(), run.id, &summary)
        };
        let init = SegmentInit {
            db: self.store.clone(),
            lease: lease.clone(),
            namespace: plugin.name.clone(),
            limits: plugin.limits.clone(),
            model: self.config.model.clone(),
            recorded,
            pending_input: run.pending_input.clone(),
            recorded_emit_pos: emit_pos,
            created_at_ms: run.created_at,
            secret: run.secret.clone(),
            reserved: self.reserved.clone(),
            egress: self.config.egress.clone(),
            answer_base: self.config.answer_base.clone(),
            offline: false,
            trace: Some(trace.clone()),
            lease_live: Some(watch.live()),
        };
        self.store.faults().before_guest().await;
        // Claimed for a local queue: the segment counts its attempt once its
        // guest has run for `CHARGE_AFTER`, in a renewal it does not wait
        // for (the worker never waits on the database between short turns);
        // a guest that returns first has its last write count it. Either
        // way a finished run has counted it.
        let mut charge = (!charged).then(renewer::Charge::default);
        let result = self.guest_call(&plugin, init, &run.input, watch, charge.as_mut()).await;
        // The deltas and puts still held go with the segment's last write:
        // taken now, or a timed flush fired while the charge below (or a
        // busy host) held the close back wrote them in a statement of their
        // own, one more commit a run.
        let tail = result.1.take_stream_tail().await;
        trace.guest_returned();
        if let Some(done) = next.guest_done.take() {
            let _ = done.send(());
        }
        let uncharged = match charge {
            None => false,
            Some(charge) => match charge.settle().await {
                renewer::Charged::Not => true,
                renewer::Charged::Sent(Err(StoreError::LeaseLost(_))) => return Ok(SegmentOutcome::LeaseLost),
                renewer::Charged::Sent(_) => false,
            },
        };
        // Renewed until the close returns: the store bounds how long a
        // write waits (a lock timeout, the batch's own retries).
        watch.renew_for(Duration::MAX);
        watch.closing.store(true, Ordering::Relaxed);
        // The puts the last write holds: reported once it is written.
        let tail_puts: Vec<i64> = match &tail {
            Ok(held) if trace.exporting() => held.puts.iter().map(|p| p.call.seq).collect(),
            _ => Vec::new(),
        };
        let settled = self.settle(&plugin, &lease, result, tail, next, uncharged).await;
        if matches!(settled, Ok(SegmentOutcome::Completed | SegmentOutcome::Failed(_) | SegmentOutcome::Suspended(_))) {
            trace.puts_written(trace.guest_returned_at(), tail_puts);
        }
        if run.parent_id.is_some() && matches!(settled, Ok(SegmentOutcome::Completed | SegmentOutcome::Failed(_))) {
            // Its end may have woken its parent (store::children): any
            // host's idle worker takes the parent now, not at its poll.
            self.store.signal_work(true).await;
        }
        settled
    }

    fn renew_every(&self) -> Duration {
        self.config.renew_every.unwrap_or(self.config.lease_ttl / 3)
    }
}

/// Whether a closing segment should claim the next run in its close, the
/// run it claimed, and who to tell when its guest has returned.
struct Handoff {
    want: bool,
    got: Option<Claimed>,
    guest_done: Option<tokio::sync::oneshot::Sender<()>>,
    /// The segment's attempt is not counted yet: its close counts it.
    charge: bool,
}

/// The fence of a run's first claim: 1, or 2 for a rerun, whose fence
/// starts at 1.
fn first_fence(run: &crate::store::Run) -> i64 {
    if run.rerun_of.is_some() { 2 } else { 1 }
}

/// Counts a run's wait from its submit to its first claim (`started_at`,
/// both on the database's clock) when this segment is that claim's.
fn observe_first_start(store: &Store, run: &crate::store::Run) {
    if let (true, Some(started)) = (run.fence == first_fence(run), run.started_at) {
        let wait = (started - run.created_at).max(0);
        crate::metrics::global().submit_to_start.0.observe_value(wait as f64 / 1000.0);
        crate::maintenance::rollup::observe_wait(store, started, wait);
    }
}

/// Tells the start listener ([`crate::metrics::start_tap`], a bench's) a
/// run's wait from its submit to now, when this segment is the first to
/// start its turn: no attempt counted before this claim. So a run claimed
/// by a host that died before starting it counts here, when a worker does,
/// and a prefetched run's wait in the local queue is part of its wait.
/// (The submit is on the database's clock, now on this host's: a tap is
/// for a bench on one machine.)
fn tap_first_start(claimed: &Claimed) {
    if let Some(tap) = crate::metrics::start_tap()
        && claimed.run.attempt - i64::from(claimed.charged) == 0
    {
        let now = crate::clock::wall().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        tap((now - claimed.run.created_at).max(0));
    }
}

/// The outcome as the segment's span and its log record say it, and the
/// error the span's status carries, if any.
fn said(outcome: &Result<SegmentOutcome, StoreError>) -> (String, Option<String>) {
    match outcome {
        Ok(SegmentOutcome::Completed) => ("completed".to_string(), None),
        Ok(SegmentOutcome::Failed(kind)) => (format!("failed: {}", kind.as_str()), Some(format!("the turn failed: {}", kind.as_str()))),
        Ok(SegmentOutcome::Suspended(status)) => (format!("suspended: {}", status.as_str()), None),
        Ok(SegmentOutcome::LeaseLost) => ("lease_lost".to_string(), Some("the lease was lost".to_string())),
        Ok(SegmentOutcome::Abandoned(why)) => ("abandoned".to_string(), Some(format!("abandoned: {why}"))),
        Err(e) => ("abandoned".to_string(), Some(format!("abandoned: {e}"))),
    }
}
