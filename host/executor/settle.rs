//! How a segment ends: the guest's result, or the reason the host stopped
//! it, becomes the run's close, failure or suspension (with the segment's
//! last held deltas and puts, and the next claim when the close takes one).

use super::{Executor, Handoff, SegmentOutcome};
use crate::runtime::GuestErrorKind;
use crate::runtime::host::{Held, Interrupt, SegmentState, storable};
use crate::runtime::Plugin;
use crate::store::{Lease, Outcome, RunStatus, StoreError, Suspend};

impl Executor {
    /// Turns the guest's result into the run's next state.
    pub(super) async fn settle(
        &self,
        plugin: &Plugin,
        lease: &Lease,
        (result, state): (wasmtime::Result<Result<String, String>>, SegmentState),
        tail: Result<Held, Interrupt>,
        next: &mut Handoff,
        uncharged: bool,
    ) -> Result<SegmentOutcome, StoreError> {
        let result = result.map(|r| r.map(storable).map_err(storable));
        // Deltas and puts still held (`tail`, taken as the guest returned)
        // are written with the segment's last write. A timed flush that
        // failed left a gap in the stored stream: then nothing more is
        // written, and the run is resumed by replay.
        let tail = match tail {
            Ok(tail) => tail,
            Err(Interrupt::LeaseLost) => return Ok(SegmentOutcome::LeaseLost),
            Err(Interrupt::Store(e)) => return Ok(SegmentOutcome::Abandoned(e)),
            Err(other) => return Ok(SegmentOutcome::Abandoned(format!("{other:?}"))),
        };
        // The segment's attempt, not counted yet: its close counts it, and
        // a suspension first counts it in a renewal ([`Executor::suspend`]).
        // A segment that writes nothing more (a lost lease, a failed store)
        // leaves it to the next claim.
        next.charge = uncharged;
        let limits = &plugin.limits;
        let too_large = |len: usize| Outcome::Failed {
            error: format!(
                "output-too-large: the turn returned {len} bytes, the cap is {}",
                limits.max_output_bytes
            ),
        };
        // Whether the segment got anywhere: a settled call or a held put.
        let progressed = state.settled > 0 || !tail.puts.is_empty();
        match (result, state.interrupt.clone()) {
            (Ok(Ok(output)), _) if output.len() > limits.max_output_bytes => {
                self.finish(lease, too_large(output.len()), GuestErrorKind::OutputTooLarge, &tail, next).await
            }
            (Ok(Ok(output)), _) => {
                self.close(lease, Outcome::Completed { output }, SegmentOutcome::Completed, &tail, next).await
            }
            (Ok(Err(error)), _) if error.len() > limits.max_output_bytes => {
                self.finish(lease, too_large(error.len()), GuestErrorKind::OutputTooLarge, &tail, next).await
            }
            (Ok(Err(error)), _) => {
                let error = format!("turn-error: {error}");
                self.finish(lease, Outcome::Failed { error }, GuestErrorKind::TurnError, &tail, next).await
            }
            (Err(_), Some(Interrupt::WaitInput { prompt })) => self.suspend(lease, Suspend::WaitInput { prompt }, &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::Sleep { delay_ms })) => self.suspend(lease, Suspend::Sleep { delay_ms }, &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::Rate { key, delay_ms })) => self.suspend(lease, Suspend::Rate { delay_ms, key }, &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::AwaitChildren(wait))) => self.suspend(lease, Suspend::Children(wait), &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::WaitNamed(wait))) => self.suspend(lease, Suspend::Named(wait), &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::Budget { tokens, usd_nanos })) => self.suspend(lease, Suspend::Budget { tokens, usd_nanos }, &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::Slice)) => {
                if state.settled > 0 || !tail.puts.is_empty() {
                    self.suspend(lease, Suspend::Takeover, &tail, true, uncharged).await
                } else {
                    // Replay is deterministic: a slice that settled nothing
                    // would do exactly the same next time.
                    let error = match &state.in_flight {
                        Some((seq, name, detail)) => format!(
                            "timeout: {name} (call {seq}) was still running at the end of the segment budget \
                             ({:?}) and its grace ({:?}){}; raise the plugin's budget for calls this long",
                            limits.segment_budget,
                            limits.slice_grace,
                            detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default()
                        ),
                        None => format!("timeout: ran for {:?} without recording any progress", limits.segment_budget),
                    };
                    self.finish(lease, Outcome::Failed { error }, GuestErrorKind::Timeout, &tail, next).await
                }
            }
            (Err(_), Some(Interrupt::Shutdown | Interrupt::Pause)) => self.suspend(lease, Suspend::Takeover, &tail, progressed, uncharged).await,
            (Err(_), Some(Interrupt::LeaseLost)) => Ok(SegmentOutcome::LeaseLost),
            (Err(_), Some(Interrupt::Store(e))) => Ok(SegmentOutcome::Abandoned(e)),
            // Only offline replay stops at the frontier; a live segment
            // never sets it. Left for another segment rather than guessed at.
            (Err(_), Some(Interrupt::Frontier(next))) => Ok(SegmentOutcome::Abandoned(format!("replay frontier at call {}", next.seq))),
            (Err(_), Some(Interrupt::NonDeterminism(m))) => {
                let error = format!("non-determinism: {m}");
                self.finish(lease, Outcome::Failed { error }, GuestErrorKind::NonDeterminism, &tail, next).await
            }
            (Err(_), Some(Interrupt::Limit { kind, message })) => {
                let error = format!("{}: {message}", kind.as_str());
                self.finish(lease, Outcome::Failed { error }, kind, &tail, next).await
            }
            (Err(trap), None) => {
                let (kind, detail) = if state.limiter.memory_refused {
                    (GuestErrorKind::OutOfMemory, format!("{trap:#}"))
                } else if let Some(limit) = crate::runtime::limit_trap(&trap) {
                    (GuestErrorKind::Limit, limit)
                } else {
                    (GuestErrorKind::Trap, trap_detail(&trap))
                };
                let mut error = format!("{}: {detail}", kind.as_str());
                // What the guest printed before it died: a panic message, a traceback.
                if let Some(output) = state.output.tail() {
                    error = format!("{error}\nguest output (last {} bytes at most):\n{output}", crate::runtime::OUTPUT_TAIL);
                }
                self.finish(lease, Outcome::Failed { error }, kind, &tail, next).await
            }
        }
    }

    pub(super) async fn finish(
        &self,
        lease: &Lease,
        outcome: Outcome,
        kind: GuestErrorKind,
        tail: &Held,
        next: &mut Handoff,
    ) -> Result<SegmentOutcome, StoreError> {
        crate::metrics::global().guest_error(kind.as_str());
        self.close(lease, outcome, SegmentOutcome::Failed(kind), tail, next).await
    }

    /// Closes the run, writing `tail` (its last held deltas and puts) in
    /// the same transaction, and claims the next run with it if `next` wants.
    pub(super) async fn close(
        &self,
        lease: &Lease,
        outcome: Outcome,
        done: SegmentOutcome,
        tail: &Held,
        next: &mut Handoff,
    ) -> Result<SegmentOutcome, StoreError> {
        let deltas: Vec<&str> = tail.deltas.iter().map(String::as_str).collect();
        let claim = next.want.then_some((self.config.owner.as_str(), self.config.lease_ttl));
        match self.store.close_charging(lease, &deltas, &tail.puts, &outcome, claim, next.charge).await {
            Ok(got) => {
                next.got = got;
                Ok(done)
            }
            Err(StoreError::LeaseLost(_)) => Ok(SegmentOutcome::LeaseLost),
            Err(e) => Err(e),
        }
    }

    /// Suspends the run after writing `tail` (its last held deltas and puts);
    /// `uncharged`, after counting the segment's attempt in a renewal: what
    /// a suspension gives back assumes it was counted.
    pub(super) async fn suspend(&self, lease: &Lease, how: Suspend, tail: &Held, progressed: bool, uncharged: bool) -> Result<SegmentOutcome, StoreError> {
        if uncharged {
            match self.store.renew_charging(lease, self.config.lease_ttl).await {
                Ok(_) => {}
                Err(StoreError::LeaseLost(_)) => return Ok(SegmentOutcome::LeaseLost),
                Err(e) => return Err(e),
            }
        }
        if !tail.deltas.is_empty() || !tail.puts.is_empty() {
            let deltas: Vec<&str> = tail.deltas.iter().map(String::as_str).collect();
            match self.store.write_held(lease, &deltas, &tail.puts).await {
                Ok(()) => {}
                Err(StoreError::LeaseLost(_)) => return Ok(SegmentOutcome::LeaseLost),
                Err(e) => return Err(e),
            }
        }
        match self.store.suspend_after(lease, &how, progressed).await {
            Ok(status) => Ok(SegmentOutcome::Suspended(status)),
            Err(StoreError::LeaseLost(_)) => Ok(SegmentOutcome::LeaseLost),
            Err(e) => Err(e),
        }
    }
}

impl Executor {
    /// Paused (store::pause): a lease taken over, or a run paused before
    /// or while it sat in a local queue, is given back before its guest
    /// starts. `None`: not paused (or resumed since): run it.
    pub(super) async fn give_back_if_paused(&self, run: &crate::store::Run, lease: &Lease, charged: bool) -> Result<Option<SegmentOutcome>, StoreError> {
        if run.paused_at.is_none() && !self.store.hub().was_paused(run.id) {
            return Ok(None);
        }
        let first = run.fence == if run.rerun_of.is_some() { 2 } else { 1 };
        match self.store.give_back_paused(lease, charged, first).await {
            Ok(true) => Ok(Some(SegmentOutcome::Suspended(if first { RunStatus::Queued } else { RunStatus::WaitingTakeover }))),
            Ok(false) if run.paused_at.is_none() => Ok(None),
            Ok(false) | Err(StoreError::LeaseLost(_)) => Ok(Some(SegmentOutcome::LeaseLost)),
            Err(e) => Err(e),
        }
    }
}

/// The first line of a trap with its wasm backtrace, for the run's error.
fn trap_detail(trap: &wasmtime::Error) -> String {
    match trap.downcast_ref::<wasmtime::Trap>() {
        Some(t) => format!("{t}"),
        None => format!("{trap:#}"),
    }
}

