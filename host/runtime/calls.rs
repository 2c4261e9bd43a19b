//! The host functions of `leasehold:turn/host`, as the guest calls them.
//!
//! Every call but `log` gets the next *seq*. If the ledger already has a row
//! at that seq, its recorded result is returned and nothing is performed (a
//! different name, request or stream position is non-determinism).
//! Otherwise the call is new ground: it is recorded and performed under the
//! segment's (owner, fence).

use std::sync::atomic::Ordering;

use super::host::leasehold::turn::host::Host;
use super::host::{Interrupt, SegmentState, WitEffectError};
use super::phase::Phase;
use super::text::{effect_name, escape_log, storable, truncated};
use crate::effects::model::DeltaSink;
use crate::effects::{self, EffectError};
use crate::runtime::GuestErrorKind;
use crate::store::LocalOp;

impl From<EffectError> for WitEffectError {
    fn from(e: EffectError) -> WitEffectError {
        match e {
            EffectError::Failed(m) => WitEffectError::Failed(m),
            EffectError::InDoubt(m) => WitEffectError::InDoubt(m),
            EffectError::Denied(m) => WitEffectError::Denied(m),
        }
    }
}

impl From<EffectError> for super::host::v0_1::leasehold::turn::host::EffectError {
    fn from(e: EffectError) -> Self {
        use super::host::v0_1::leasehold::turn::host::EffectError as E;
        match e {
            EffectError::Failed(m) => E::Failed(m),
            EffectError::InDoubt(m) => E::InDoubt(m),
            EffectError::Denied(m) => E::Denied(m),
        }
    }
}

impl Host for SegmentState {
    async fn effect(&mut self, name: String, request: String) -> wasmtime::Result<Result<String, WitEffectError>> {
        Ok(self.effect_call(name, request).await?.map_err(WitEffectError::from))
    }

    async fn emit(&mut self, delta: String) -> wasmtime::Result<()> {
        self.emit_call(delta).await
    }

    async fn wait_input(&mut self, prompt: String) -> wasmtime::Result<String> {
        self.wait_input_call(prompt).await
    }

    async fn sleep(&mut self, ms: u64) -> wasmtime::Result<()> {
        self.sleep_call(ms).await
    }

    async fn log(&mut self, level: u8, message: String) -> wasmtime::Result<()> {
        self.log_call(level, message)
    }
}

/// `leasehold:turn/host@0.1.0`: the same calls.
impl super::host::v0_1::leasehold::turn::host::Host for SegmentState {
    async fn effect(
        &mut self,
        name: String,
        request: String,
    ) -> wasmtime::Result<Result<String, super::host::v0_1::leasehold::turn::host::EffectError>> {
        Ok(self.effect_call(name, request).await?.map_err(Into::into))
    }

    async fn emit(&mut self, delta: String) -> wasmtime::Result<()> {
        self.emit_call(delta).await
    }

    async fn wait_input(&mut self, prompt: String) -> wasmtime::Result<String> {
        self.wait_input_call(prompt).await
    }

    async fn sleep(&mut self, ms: u64) -> wasmtime::Result<()> {
        self.sleep_call(ms).await
    }

    async fn log(&mut self, level: u8, message: String) -> wasmtime::Result<()> {
        self.log_call(level, message)
    }
}

/// The host functions of `leasehold:turn/host`.
impl SegmentState {
    async fn effect_call(&mut self, name: String, request: String) -> wasmtime::Result<Result<String, EffectError>> {
        self.charge()?;
        // Checked before anything is hashed or stored: a refused name is
        // recorded under a short stand-in, and an oversized request by its
        // size only.
        let (name, bad_name) = effect_name(name);
        let oversized = request.len() > self.limits.max_effect_bytes;
        let call = if oversized {
            self.call(&name, &format!("<{} bytes>", request.len()))
        } else {
            self.call(&name, &request)
        };
        if let Some(row) = self.replayed(&call).await? {
            return self.replay_effect(row, call, &request).await;
        }
        if self.offline {
            return self.frontier(&call, "not recorded");
        }
        if let Some(error) = bad_name {
            return self.refuse(&call, error).await;
        }
        if oversized {
            let error = EffectError::Denied(format!(
                "{name}: a request of {} bytes is over the {}-byte cap",
                request.len(),
                self.limits.max_effect_bytes
            ));
            return self.refuse(&call, error).await;
        }
        match effects::resolve(&name, &request, &self.grants()) {
            Ok(effect) => self.perform_timed(call, effect, false).await,
            Err(error) => self.refuse(&call, error).await,
        }
    }

    /// [`SegmentState::perform`], its time counted by effect name
    /// (`leasehold_effect_seconds`) and its span reported (`traces`): only
    /// effects performed, never one replayed.
    pub(super) async fn perform_timed(&mut self, call: crate::store::EffectCall, effect: effects::Effect, reissue: bool) -> wasmtime::Result<Result<String, EffectError>> {
        let (name, seq, started) = (call.name.clone(), call.seq, std::time::Instant::now());
        let span = self.trace.as_ref().filter(|t| t.exporting()).and_then(|_| crate::traces::call::Begun::of(&effect, reissue));
        let result = self.perform(call, effect, reissue).await;
        crate::metrics::global().effect(&name, started.elapsed());
        // A call stopped mid-way (a lost lease, a suspension) reports
        // nothing: the segment that finishes it does.
        if let (Some(span), Some(trace), Ok(outcome)) = (span, &self.trace, &result) {
            span.report(trace, seq, &name, outcome);
        }
        result
    }

    async fn emit_call(&mut self, delta: String) -> wasmtime::Result<()> {
        self.charge()?;
        if self.stream.delta(delta).await.is_err() {
            let why = self.stream.stopped.take().unwrap_or(Interrupt::LeaseLost);
            return self.stop(why);
        }
        Ok(())
    }

    async fn wait_input_call(&mut self, prompt: String) -> wasmtime::Result<String> {
        self.charge()?;
        if prompt.len() > self.limits.max_prompt_bytes {
            let message = format!(
                "a wait-input prompt of {} bytes is over the {}-byte cap",
                prompt.len(),
                self.limits.max_prompt_bytes
            );
            return self.limit(GuestErrorKind::Limit, message);
        }
        let prompt = storable(prompt);
        let call = self.call("wait-input", &prompt);
        if let Some(row) = self.replayed(&call).await? {
            return Ok(row.result.unwrap_or_default());
        }
        if self.offline {
            return self.frontier(&call, "not recorded: the turn waits for input here");
        }
        let Some(input) = self.pending_input.take() else {
            return self.stop(Interrupt::WaitInput { prompt });
        };
        self.room(input.len())?;
        let _db = self.phase.enter(Phase::DATABASE);
        self.flush_stream().await?;
        match self.local(&call, LocalOp::TakeInput { value: input }).await {
            Ok(row) => {
                self.settled += 1;
                let result = row.result.unwrap_or_default();
                self.wrote(&call, result.len());
                Ok(result)
            }
            Err(e) => self.store_failed(e),
        }
    }

    async fn sleep_call(&mut self, ms: u64) -> wasmtime::Result<()> {
        self.charge()?;
        let ms = i64::try_from(ms).unwrap_or(i64::MAX / 4);
        let call = self.call("sleep", &ms.to_string());
        self.timer(call, ms).await?;
        // The guest's clocks move on by the time it slept.
        self.time.advance_ms(ms);
        Ok(())
    }

    fn log_call(&mut self, level: u8, message: String) -> wasmtime::Result<()> {
        self.charge()?;
        self.logs += 1;
        let run_id = self.lease.run_id;
        if self.logs > self.limits.max_log_lines {
            crate::metrics::global().guest_log_lines_dropped.fetch_add(1, Ordering::Relaxed);
            if self.logs == self.limits.max_log_lines + 1 {
                tracing::warn!(run_id, cap = self.limits.max_log_lines, "the guest logged more lines than its cap in this segment; dropping the rest");
            }
            return Ok(());
        }
        let message = escape_log(truncated(&message, self.limits.max_log_bytes));
        // The segment's place: its run, fence and trace (offline replay has no trace).
        let fence = self.lease.fence;
        let trace_id = self.trace.as_ref().map(|t| tracing::field::display(t.trace()));
        match level {
            0 => tracing::trace!(run_id, fence, trace_id, "{message}"),
            1 => tracing::debug!(run_id, fence, trace_id, "{message}"),
            2 => tracing::info!(run_id, fence, trace_id, "{message}"),
            3 => tracing::warn!(run_id, fence, trace_id, "{message}"),
            _ => tracing::error!(run_id, fence, trace_id, "{message}"),
        }
        Ok(())
    }
}
