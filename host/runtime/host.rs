//! The host side of `leasehold:turn/host`: one [`SegmentState`] per segment,
//! holding the lease and a replay cursor over the run's ledger.
//!
//! Every call but `log` gets the next *seq*. If the ledger already has a row
//! at that seq, its recorded result is returned and nothing is performed (a
//! different name, request or stream position is non-determinism).
//! Otherwise the call is new ground: it is recorded and performed under the
//! segment's (owner, fence). A call that must stop the guest (suspension, a
//! lost lease, a limit) sets [`SegmentState::interrupt`] and traps; the
//! executor reads the reason.
//!
//! Everything the guest controls is capped before the host stores it (and
//! a host call carries at most [`Limits::max_hostcall_bytes`] at all): effect
//! names, requests, prompts, log lines, WASI random, resources, and the
//! run's whole ledger.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use sha2::{Digest, Sha256};
use wasmtime::component::{HasSelf, Linker, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::clocks::{self, GuestTime};
use super::replay::Recorded;
use super::stream::{Buffer, Stream};
use crate::effects::model::{DeltaSink, ModelConfig};
use crate::effects::{self, Effect, RemoteFailure};
use crate::executor::GuestErrorKind;
use crate::ledger::{Completion, EffectCall, HeldPut, LocalOp, Streamed};
use crate::runtime::Limits;
use crate::store::{EffectClass, EffectRow, EffectState, Lease, Store, StoreError};

pub use super::stream::EMIT_FLUSH;
pub(crate) use super::stream::Held;

wasmtime::component::bindgen!({
    path: "wit",
    world: "turn",
    imports: { default: async | trappable },
    exports: { default: async },
});

pub use self::leasehold::turn::host::EffectError;

/// Why the host stopped the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interrupt {
    /// `wait-input` with no input yet: suspend as `waiting_input`.
    WaitInput { prompt: String },
    /// `sleep`, or a WASI wait longer than the slice has left: suspend as
    /// `queued` until the timer is due.
    Sleep { delay_ms: i64 },
    /// The slice budget is used up: suspend as `waiting_takeover`.
    Slice,
    /// The host is shutting down: suspend as `waiting_takeover`.
    Shutdown,
    /// A guarded write failed: stop, write nothing else.
    LeaseLost,
    /// A recorded call differs from the one the turn now makes.
    NonDeterminism(String),
    /// A sandbox limit: host calls, emit bytes, sizes, the ledger.
    Limit { kind: GuestErrorKind, message: String },
    /// The database failed under the segment (not a lease loss). The run is
    /// left as it is; its lease expires and another segment resumes it.
    Store(String),
}

/// The error a guest trap carries; the reason is in `SegmentState::interrupt`.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by the host")]
pub struct Interrupted;

/// Linear-memory and table limits that also remember a refusal, so an
/// out-of-memory trap is classified as such. Memory is counted for the
/// instance as a whole: every memory of every core instance in it.
pub(crate) struct Limiter {
    pub max_memory: usize,
    /// Bytes of linear memory the instance holds now, all memories together.
    pub total: usize,
    pub memory_refused: bool,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false); // fails anyway; not counted
        }
        let total = self.total.saturating_sub(current).saturating_add(desired);
        if total > self.max_memory {
            self.memory_refused = true;
            // Trap rather than return -1: most guests abort on a failed grow
            // anyway, and a trap here names the cause precisely.
            return Err(wasmtime::Error::msg(format!(
                "memory limit: the instance asked for {total} bytes of linear memory in all, the limit is {}",
                self.max_memory
            )));
        }
        self.total = total;
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}

/// What a segment needs to know about the run it holds.
pub struct SegmentInit {
    pub db: Store,
    pub lease: Lease,
    pub namespace: String,
    pub limits: Limits,
    /// The host's `model.chat` endpoint, if any.
    pub model: Option<Arc<ModelConfig>>,
    /// The run's ledger so far.
    pub recorded: Recorded,
    pub pending_input: Option<String>,
    pub recorded_emit_pos: i64,
    /// The run's creation time (epoch ms): where the guest's wall clock starts.
    pub created_at_ms: i64,
    /// The run's secret, which seeds WASI random (`None`: the run id does).
    pub secret: Option<String>,
    /// Addresses `http` may never reach unless an allow-list entry names
    /// them with their port: the service's own API.
    pub reserved: Arc<[SocketAddr]>,
}

/// The store data of one segment.
pub struct SegmentState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limiter: Limiter,
    db: Store,
    lease: Lease,
    /// The plugin name: the kv namespace.
    namespace: String,
    limits: Limits,
    model: Option<Arc<ModelConfig>>,
    reserved: Arc<[SocketAddr]>,
    recorded: Recorded,
    next_seq: i64,
    /// Rows and bytes of the run's ledger, this segment's included.
    ledger_rows: i64,
    ledger_bytes: i64,
    /// Input delivered to the run and not yet consumed by a `wait-input`.
    pending_input: Option<String>,
    /// The turn's output stream (`emit` and `model.chat` deltas).
    stream: Stream,
    pub(crate) time: GuestTime,
    started: Instant,
    host_calls: u64,
    logs: u64,
    /// Calls this segment settled (recorded with an outcome): its progress.
    /// A call started and not finished is not progress: a replay would do
    /// it again.
    pub(crate) settled: u64,
    /// The remote call in flight, if any: `(seq, name, detail)`.
    pub(crate) in_flight: Option<(i64, String, Option<String>)>,
    /// What the segment is doing outside wasm (see [`Phase`]): the
    /// executor's slice timer lets a remote call finish within the grace,
    /// and never cuts a database write.
    pub(crate) phase: Phase,
    pub(crate) interrupt: Option<Interrupt>,
}

impl SegmentState {
    pub fn new(init: SegmentInit) -> SegmentState {
        let time = GuestTime::default();
        let mut wasi = WasiCtx::builder();
        // Replay-safe WASI: virtual clocks (see `clocks`) and random seeded
        // from the run's secret. No network, no filesystem, no environment,
        // no stdio.
        let (secure, insecure, seed) = seeded_random(init.secret.as_deref(), init.lease.run_id);
        wasi.wall_clock(time.wall_clock(init.created_at_ms))
            .monotonic_clock(time.monotonic_clock())
            .secure_random(secure)
            .insecure_random(insecure)
            .insecure_random_seed(seed)
            .max_random_size(init.limits.max_random_bytes);
        let mut table = ResourceTable::new();
        table.set_max_capacity(init.limits.max_resources);
        SegmentState {
            wasi: wasi.build(),
            table,
            limiter: Limiter { max_memory: init.limits.max_memory_bytes, total: 0, memory_refused: false },
            stream: Stream {
                db: init.db.clone(),
                lease: init.lease.clone(),
                pos: 0,
                recorded: init.recorded_emit_pos,
                bytes: 0,
                cap: init.limits.max_emit_bytes,
                stopped: None,
                buffer: Arc::new(tokio::sync::Mutex::new(Buffer::default())),
            },
            db: init.db,
            lease: init.lease,
            namespace: init.namespace,
            model: init.model,
            reserved: init.reserved,
            ledger_rows: init.recorded.rows,
            ledger_bytes: init.recorded.bytes,
            recorded: init.recorded,
            limits: init.limits,
            next_seq: 0,
            pending_input: init.pending_input,
            time,
            started: Instant::now(),
            host_calls: 0,
            logs: 0,
            settled: 0,
            in_flight: None,
            phase: Phase::default(),
            interrupt: None,
        }
    }

    /// Records why the guest must stop and returns the trap that stops it.
    fn stop<T>(&mut self, why: Interrupt) -> wasmtime::Result<T> {
        self.interrupt = Some(why);
        Err(wasmtime::Error::new(Interrupted))
    }

    fn limit<T>(&mut self, kind: GuestErrorKind, message: String) -> wasmtime::Result<T> {
        self.stop(Interrupt::Limit { kind, message })
    }

    /// Maps a store error to the interrupt it means.
    fn store_failed<T>(&mut self, e: StoreError) -> wasmtime::Result<T> {
        self.stop(interrupt_for(e))
    }

    /// Counts a host call against the segment's budget.
    fn charge(&mut self) -> wasmtime::Result<()> {
        self.host_calls += 1;
        if self.host_calls > self.limits.max_host_calls {
            let message = format!("more than {} host calls in one segment", self.limits.max_host_calls);
            return self.limit(GuestErrorKind::HostCalls, message);
        }
        Ok(())
    }

    fn call(&mut self, name: &str, request: &str) -> EffectCall {
        let seq = self.next_seq;
        self.next_seq += 1;
        EffectCall { seq, name: name.to_string(), request_hash: request_hash(name, request), emit_pos: self.stream.pos }
    }

    /// Checks that the run's ledger may take one more row of `bytes`.
    fn room(&mut self, bytes: usize) -> wasmtime::Result<()> {
        let (rows, max_rows) = (self.ledger_rows + 1, self.limits.max_ledger_rows as i64);
        let (total, max_bytes) = (self.ledger_bytes.saturating_add(bytes as i64), self.limits.max_ledger_bytes as i64);
        if rows > max_rows {
            let message = format!("the run's ledger would hold {rows} rows; the cap is {max_rows}");
            return self.limit(GuestErrorKind::LedgerTooLarge, message);
        }
        if total > max_bytes {
            let message = format!("the run's ledger would hold {total} bytes; the cap is {max_bytes}");
            return self.limit(GuestErrorKind::LedgerTooLarge, message);
        }
        Ok(())
    }

    /// Counts a row this segment wrote.
    fn wrote(&mut self, call: &EffectCall, result: usize) {
        self.ledger_rows += 1;
        self.ledger_bytes += (call.name.len() + result) as i64;
    }

    /// The recorded row at `call.seq`, checked against the call; `Err` is a
    /// non-determinism stop.
    async fn replayed(&mut self, call: &EffectCall) -> wasmtime::Result<Option<EffectRow>> {
        let _db = self.phase.enter(Phase::DATABASE);
        let row = match self.recorded.get(call.seq).await {
            Ok(row) => row,
            Err(e) => return self.store_failed(e),
        };
        let Some(row) = row else { return Ok(None) };
        let message = if row.name != call.name {
            format!("call {} was recorded as {:?} but the turn now makes {:?}", call.seq, row.name, call.name)
        } else if row.request_hash != call.request_hash {
            format!("call {} ({:?}) was recorded with a different request", call.seq, row.name)
        } else if row.emit_pos != call.emit_pos {
            format!(
                "call {} ({:?}) was recorded after {} emits but the turn now makes it after {}",
                call.seq, row.name, row.emit_pos, call.emit_pos
            )
        } else {
            return Ok(Some(row));
        };
        self.stop(Interrupt::NonDeterminism(message))
    }

    /// Records a refusal at `call` (so replay returns it again) and returns it.
    async fn refuse(&mut self, call: &EffectCall, error: EffectError) -> wasmtime::Result<Result<String, EffectError>> {
        let _db = self.phase.enter(Phase::DATABASE);
        let failed = encode_error(&error);
        self.room(failed.len())?;
        self.flush_stream().await?;
        let (db, lease, c, f) = (self.db.clone(), self.lease.clone(), call.clone(), failed.clone());
        match detached(async move { db.record_refusal(&lease, &c, &f).await }).await {
            Ok(_) => {
                self.settled += 1;
                self.wrote(call, failed.len());
                Ok(Err(error))
            }
            Err(e) => self.store_failed(e),
        }
    }

    /// A recorded call in doubt whose re-issue today's grants refuse: the
    /// refusal is recorded on its row (now `failed`) before the guest sees
    /// it, so no other host re-issues it later and takes another path.
    async fn refuse_reissue(&mut self, call: &EffectCall, error: EffectError) -> wasmtime::Result<Result<String, EffectError>> {
        let _db = self.phase.enter(Phase::DATABASE);
        self.flush_stream().await?;
        let (db, lease, seq, failed) = (self.db.clone(), self.lease.clone(), call.seq, Completion::Failed(encode_error(&error)));
        match detached(async move { db.complete_effect(&lease, seq, &failed).await }).await {
            Ok(_) => {
                self.settled += 1;
                Ok(Err(error))
            }
            Err(e) => self.store_failed(e),
        }
    }

    /// What replay returns for a recorded effect.
    async fn replay_effect(
        &mut self,
        row: EffectRow,
        call: EffectCall,
        request: &str,
    ) -> wasmtime::Result<Result<String, EffectError>> {
        match (row.state, row.class) {
            (EffectState::Committed, _) => {
                // Its deltas are already in the stream: move past them.
                self.stream.skip(row.deltas, row.delta_bytes);
                Ok(Ok(row.result.unwrap_or_default()))
            }
            (EffectState::Failed, _) => {
                self.stream.skip(row.deltas, row.delta_bytes);
                Ok(Err(decode_error(row.result.as_deref().unwrap_or(""))))
            }
            // Re-issued with the same idempotency key: the remote side
            // deduplicates.
            (EffectState::InDoubt | EffectState::Started, EffectClass::Keyed) => {
                match effects::resolve(&call.name, request, &self.grants()) {
                    Ok(effect) => self.perform(call, effect, true).await,
                    Err(error) => self.refuse_reissue(&call, error).await,
                }
            }
            (EffectState::InDoubt | EffectState::Started, _) => Ok(Err(EffectError::InDoubt(format!(
                "{} (call {}) was started by a segment that died; it may or may not have happened",
                call.name, call.seq
            )))),
        }
    }

    async fn perform(&mut self, call: EffectCall, effect: Effect, reissue: bool) -> wasmtime::Result<Result<String, EffectError>> {
        let _db = self.phase.enter(Phase::DATABASE);
        if !reissue {
            self.room(0)?;
        }
        // A put is held for the segment's next write (see `EMIT_FLUSH`), so
        // a turn's puts and deltas cost one write together. Other runs see
        // it at most `EMIT_FLUSH` later; everything this segment does that
        // others can observe (a remote call, any other write, its end)
        // writes it first, and `kv.get` too, so a turn reads its own puts.
        let effect = match effect {
            Effect::Local(LocalOp::KvPut { namespace, key, value }) => {
                let put = HeldPut { call: call.clone(), namespace, key, value };
                return match self.stream.hold(put).await {
                    Ok(()) => {
                        self.settled += 1;
                        self.wrote(&call, 4);
                        Ok(Ok("null".to_string()))
                    }
                    Err(why) => self.stop(why),
                };
            }
            other => other,
        };
        self.flush_stream().await?;
        let remote = match effect {
            Effect::Local(op) => {
                return match self.local(&call, op).await {
                    Ok(row) => {
                        self.settled += 1;
                        let result = row.result.unwrap_or_default();
                        self.wrote(&call, result.len());
                        Ok(Ok(result))
                    }
                    Err(e) => self.store_failed(e),
                };
            }
            Effect::Remote(remote) => remote,
        };
        let class = remote.class();
        let (db, lease, c) = (self.db.clone(), self.lease.clone(), call.clone());
        let started = detached(async move {
            if reissue { db.reissue_effect(&lease, c.seq).await } else { db.begin_effect(&lease, &c, class).await }
        })
        .await;
        if let Err(e) = started {
            return self.store_failed(e);
        }
        if !reissue {
            self.wrote(&call, 0);
        }
        let ctx = effects::RemoteCtx {
            run_id: self.lease.run_id,
            seq: call.seq,
            fence: self.lease.fence,
            max_result_bytes: self.limits.max_effect_bytes,
            idempotency_key: crate::ledger::idempotency_key(&self.database_id().await?, self.lease.run_id, call.seq),
            reissue,
        };
        self.in_flight = Some((call.seq, call.name.clone(), None));
        let bytes_before = self.stream.bytes;
        let outcome = {
            let _remote = self.phase.enter(Phase::REMOTE);
            self.remote_until_answered(remote, &ctx).await
        };
        let outcome = outcome?;
        if let Some(why) = self.stream.stopped.take() {
            // The lease is lost or the emit cap is reached mid-call: stop
            // without recording an outcome. The `started` row stays, so a
            // keyed call is re-issued on resume.
            return self.stop(why);
        }
        let streamed = Streamed {
            deltas: self.stream.pos - call.emit_pos,
            bytes: (self.stream.bytes - bytes_before) as i64,
        };
        let completion = match &outcome {
            Ok(result) => Completion::Committed(result.clone()),
            Err(error) => Completion::Failed(encode_error(error)),
        };
        // The call's streamed deltas first (`model.chat`), so a recorded
        // row's deltas are always in the stream.
        self.flush_stream().await?;
        let (db, lease, seq) = (self.db.clone(), self.lease.clone(), call.seq);
        let result_len = match &completion {
            Completion::Committed(r) | Completion::Failed(r) => r.len(),
        };
        if let Err(e) = detached(async move { db.complete_streamed(&lease, seq, &completion, streamed).await }).await {
            return self.store_failed(e);
        }
        self.in_flight = None;
        self.settled += 1;
        self.ledger_bytes += result_len as i64;
        Ok(outcome)
    }

    /// Performs a remote effect. A re-issue answered "in progress" (the
    /// dead segment's own request may still be running) is not a result:
    /// it is tried again under the same key, backing off, while the slice
    /// has time; then the segment ends with the call still in doubt.
    async fn remote_until_answered(
        &mut self,
        remote: effects::Remote,
        ctx: &effects::RemoteCtx,
    ) -> wasmtime::Result<Result<String, EffectError>> {
        let mut backoff = Duration::from_millis(100);
        let mut remote = Some(remote);
        loop {
            let Some(this) = remote.take() else { unreachable!("a remote effect is performed once per round") };
            let again = this.again();
            let answer = effects::perform_remote(this, ctx, self.model.as_deref(), &mut self.stream).await;
            match answer {
                Ok(result) => return Ok(Ok(result)),
                Err(RemoteFailure::Effect(error)) => return Ok(Err(error)),
                Err(RemoteFailure::InProgress(answer)) => {
                    let left = self.limits.segment_budget.saturating_sub(self.started.elapsed());
                    if let Some((_, _, detail)) = &mut self.in_flight {
                        *detail = Some(format!(
                            "it was re-issued under its idempotency key and the remote side still answered {answer}"
                        ));
                    }
                    if backoff >= left {
                        return self.stop(Interrupt::Slice);
                    }
                    tracing::debug!(run_id = ctx.run_id, seq = ctx.seq, %answer, ?backoff, "re-issue in progress elsewhere; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    remote = Some(again);
                }
            }
        }
    }

    async fn database_id(&mut self) -> wasmtime::Result<Arc<str>> {
        let _db = self.phase.enter(Phase::DATABASE);
        let db = self.db.clone();
        match detached(async move { db.database_id().await }).await {
            Ok(id) => Ok(id),
            Err(e) => self.store_failed(e),
        }
    }

    fn grants(&self) -> effects::Grants<'_> {
        effects::Grants {
            namespace: &self.namespace,
            http_allow: &self.limits.http_allow,
            reserved: &self.reserved,
            model: self.model.as_deref(),
            max_kv_value_bytes: self.limits.max_kv_value_bytes,
        }
    }

    /// A local effect, run detached. Not an `async fn`: the future must not
    /// borrow `self`, which is not `Sync`.
    fn local(&self, call: &EffectCall, op: LocalOp) -> impl std::future::Future<Output = Result<EffectRow, StoreError>> + Send + 'static {
        let (db, lease, call) = (self.db.clone(), self.lease.clone(), call.clone());
        detached(async move { db.local_effect(&lease, &call, &op).await })
    }

    /// The database's clock, read detached.
    async fn db_now(&mut self) -> wasmtime::Result<i64> {
        let _db = self.phase.enter(Phase::DATABASE);
        let db = self.db.clone();
        match detached(async move { db.now_ms().await }).await {
            Ok(now) => Ok(now),
            Err(e) => self.store_failed(e),
        }
    }

    /// A durable timer at `call`: on replay, returns once its recorded wake
    /// time has come (and suspends again until then); on new ground,
    /// records the wake time and suspends. `Ok` means the timer is done.
    async fn timer(&mut self, call: EffectCall, ms: i64) -> wasmtime::Result<()> {
        let _db = self.phase.enter(Phase::DATABASE);
        if let Some(row) = self.replayed(&call).await? {
            let wake_at: i64 = row.result.as_deref().and_then(|r| r.parse().ok()).unwrap_or(0);
            let now = self.db_now().await?;
            if now >= wake_at {
                return Ok(());
            }
            return self.stop(Interrupt::Sleep { delay_ms: wake_at - now });
        }
        self.room(20)?;
        // Record the wake time first, so a segment that dies here still
        // wakes on time rather than sleeping again from scratch.
        let now = self.db_now().await?;
        let op = LocalOp::Record { value: now.saturating_add(ms).to_string() };
        self.flush_stream().await?;
        if let Err(e) = self.local(&call, op).await {
            return self.store_failed(e);
        }
        self.settled += 1;
        self.wrote(&call, 20);
        self.stop(Interrupt::Sleep { delay_ms: ms })
    }

    /// Writes buffered deltas before another write; a failure stops the
    /// guest like a failed write of its own.
    async fn flush_stream(&mut self) -> wasmtime::Result<()> {
        let _db = self.phase.enter(Phase::DATABASE);
        match self.stream.flush().await {
            Ok(()) => Ok(()),
            Err(why) => self.stop(why),
        }
    }

    /// Takes the deltas still buffered for the segment's last write (its
    /// close or suspension), waiting for a timed flush in flight. `Err`: a
    /// timed flush failed, so the stored stream lacks deltas; the segment
    /// must not close the run over that gap.
    /// Not an `async fn`: the future must not borrow `self`, which is not
    /// `Sync`.
    pub(crate) fn take_stream_tail(&self) -> impl std::future::Future<Output = Result<Held, Interrupt>> + Send + 'static {
        let buffer = self.stream.buffer.clone();
        async move {
            let mut buf = buffer.lock().await;
            buf.closed = true;
            if let Some(why) = buf.failed.take() {
                return Err(why);
            }
            Ok(Held { deltas: std::mem::take(&mut buf.deltas), puts: std::mem::take(&mut buf.puts) })
        }
    }
}

impl leasehold::turn::host::Host for SegmentState {
    async fn effect(&mut self, name: String, request: String) -> wasmtime::Result<Result<String, EffectError>> {
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
            Ok(effect) => self.perform(call, effect, false).await,
            Err(error) => self.refuse(&call, error).await,
        }
    }

    async fn emit(&mut self, delta: String) -> wasmtime::Result<()> {
        self.charge()?;
        if self.stream.delta(delta).await.is_err() {
            let why = self.stream.stopped.take().unwrap_or(Interrupt::LeaseLost);
            return self.stop(why);
        }
        Ok(())
    }

    async fn wait_input(&mut self, prompt: String) -> wasmtime::Result<String> {
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

    async fn sleep(&mut self, ms: u64) -> wasmtime::Result<()> {
        self.charge()?;
        let ms = i64::try_from(ms).unwrap_or(i64::MAX / 4);
        let call = self.call("sleep", &ms.to_string());
        self.timer(call, ms).await?;
        // The guest's clocks move on by the time it slept.
        self.time.advance_ms(ms);
        Ok(())
    }

    async fn log(&mut self, level: u8, message: String) -> wasmtime::Result<()> {
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
        match level {
            0 => tracing::trace!(run_id, "{message}"),
            1 => tracing::debug!(run_id, "{message}"),
            2 => tracing::info!(run_id, "{message}"),
            3 => tracing::warn!(run_id, "{message}"),
            _ => tracing::error!(run_id, "{message}"),
        }
        Ok(())
    }
}

/// What a segment is doing outside wasm, shared with the executor's slice
/// timer: a guest blocked in a remote call gets the grace past its budget;
/// one in a database write is never cut (the write is the protocol's, and
/// the lease deadline bounds it); anything else is stopped at the budget.
#[derive(Clone, Default)]
pub(crate) struct Phase(Arc<AtomicU8>);

/// Phase 0 (the default) is the guest's own: wasm or a WASI call.
impl Phase {
    pub(crate) const REMOTE: u8 = 1;
    pub(crate) const DATABASE: u8 = 2;

    pub(crate) fn get(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }

    /// Enters phase `p` until the guard is dropped (then the phase before).
    fn enter(&self, p: u8) -> PhaseGuard {
        PhaseGuard { phase: self.0.clone(), before: self.0.swap(p, Ordering::SeqCst) }
    }
}

struct PhaseGuard {
    phase: Arc<AtomicU8>,
    before: u8,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        self.phase.store(self.before, Ordering::SeqCst);
    }
}

/// How close to the end of its slice a WASI wait may end and still just
/// wait: a wait that would end later is made durable instead. 20 ms.
const WAIT_MARGIN: Duration = Duration::from_millis(20);

impl clocks::Waits for SegmentState {
    fn time(&mut self) -> (&mut GuestTime, &mut ResourceTable) {
        (&mut self.time, &mut self.table)
    }

    async fn wait_until(&mut self, target: u64) -> wasmtime::Result<()> {
        let ns = target.saturating_sub(self.time.peek());
        let ms = i64::try_from(ns.div_ceil(1_000_000)).unwrap_or(i64::MAX / 4);
        let wait = self.time.waits;
        self.time.waits += 1;
        let request = json!({ "wait": wait, "ms": ms }).to_string();
        if self.recorded.replaying(self.next_seq) {
            let recorded = match self.recorded.get(self.next_seq).await {
                Ok(row) => row,
                Err(e) => return self.store_failed(e),
            };
            let ours = recorded.is_some_and(|r| r.name == "wasi.sleep" && r.request_hash == request_hash("wasi.sleep", &request));
            if ours {
                let call = self.call("wasi.sleep", &request);
                self.timer(call, ms).await?;
            }
            // Otherwise it just waited when it was first made: its replay
            // does not wait again.
            self.time.advance_to(target);
            return Ok(());
        }
        let left = self.limits.segment_budget.saturating_sub(self.started.elapsed());
        if Duration::from_nanos(ns) + WAIT_MARGIN < left {
            tokio::time::sleep(Duration::from_nanos(ns)).await;
            self.time.advance_to(target);
            return Ok(());
        }
        // Longer than the slice has left: a durable sleep.
        let call = self.call("wasi.sleep", &request);
        self.timer(call, ms).await?;
        self.time.advance_to(target);
        Ok(())
    }
}

impl WasiView for SegmentState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// `text` as the store keeps it: each NUL replaced by U+FFFD. PostgreSQL
/// cannot store NUL in text (SQLite can), so without this a guest that
/// wrote one would fail differently on each backend, and on PostgreSQL only
/// after its segments had been abandoned until the reaper gave up.
pub(crate) fn storable(text: String) -> String {
    if text.contains('\0') { text.replace('\0', "\u{FFFD}") } else { text }
}

/// Longest effect name.
pub const MAX_EFFECT_NAME: usize = 128;

/// An effect name as it is recorded, and the refusal if it is not a valid
/// name (1 to 128 bytes of `a-z`, `0-9`, `.`, `_` and `-`). An invalid
/// name is recorded as `invalid:` and its first 32 characters, made safe,
/// and its refusal says only its size.
fn effect_name(name: String) -> (String, Option<EffectError>) {
    let valid = (1..=MAX_EFFECT_NAME).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        return (name, None);
    }
    let shown: String = name
        .chars()
        .take(32)
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '?' })
        .collect();
    let error = EffectError::Denied(format!(
        "effect names are 1 to {MAX_EFFECT_NAME} bytes of a-z, 0-9, '.', '_' and '-'; this one is {} bytes ({shown:?}…)",
        name.len()
    ));
    (format!("invalid:{shown}"), Some(error))
}

/// `text` cut to at most `max` bytes, at a character boundary, with `…`.
fn truncated(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// A guest's log line made safe for the host's log: control characters
/// (newlines, escape sequences, NUL) are written as escapes, so a guest
/// cannot forge log lines or drive the operator's terminal.
pub fn escape_log(text: String) -> String {
    if !text.chars().any(char::is_control) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

pub(crate) fn interrupt_for(e: StoreError) -> Interrupt {
    match e {
        StoreError::LeaseLost(_) => Interrupt::LeaseLost,
        other => Interrupt::Store(other.to_string()),
    }
}

pub(crate) fn add_to_linker(linker: &mut Linker<SegmentState>) -> wasmtime::Result<()> {
    Turn::add_to_linker::<_, HasSelf<_>>(linker, |s| s)?;
    clocks::add_to_linker(linker)
}

/// Runs a store operation in its own task and waits for it. If the guest
/// call awaiting it is dropped (a lost lease drops the call mid-flight), the
/// operation still runs to completion: cancelling a database future half-way
/// can leave its pooled connection inside an unfinished transaction that the
/// connection's next user inherits. A write that lands late is harmless: it
/// is fenced.
pub(crate) async fn detached<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    match tokio::spawn(op).await {
        Ok(r) => r,
        Err(e) => Err(StoreError::Config(format!("store task failed: {e}"))),
    }
}

/// `sha256(name NUL request)`, hex.
pub fn request_hash(name: &str, request: &str) -> String {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update([0]);
    h.update(request.as_bytes());
    hex::encode(h.finalize())
}

/// How a failed effect is stored in the ledger's `result`.
fn encode_error(e: &EffectError) -> String {
    let (kind, message) = match e {
        EffectError::Failed(m) => ("failed", m),
        EffectError::InDoubt(m) => ("in-doubt", m),
        EffectError::Denied(m) => ("denied", m),
    };
    json!({ "kind": kind, "message": message }).to_string()
}

fn decode_error(stored: &str) -> EffectError {
    let v: serde_json::Value = serde_json::from_str(stored).unwrap_or_default();
    let message = v["message"].as_str().unwrap_or(stored).to_string();
    match v["kind"].as_str() {
        Some("denied") => EffectError::Denied(message),
        Some("in-doubt") => EffectError::InDoubt(message),
        _ => EffectError::Failed(message),
    }
}

/// The guest's WASI random: secure and insecure generators and the
/// insecure seed, all from the run's secret (the same on every replay, and
/// unknown outside the database). A run from before secrets existed keeps
/// the seed it started with: its run id.
fn seeded_random(secret: Option<&str>, run_id: i64) -> (rand010::rngs::StdRng, rand010::rngs::StdRng, u128) {
    use rand010::SeedableRng;
    let seed = |stream: u8| -> [u8; 32] {
        match secret {
            Some(secret) => {
                let mut h = Sha256::new();
                h.update(secret.as_bytes());
                h.update([stream]);
                h.finalize().into()
            }
            None => {
                let mut bytes = [0u8; 32];
                let v = (run_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(stream);
                bytes[..8].copy_from_slice(&v.to_le_bytes());
                bytes
            }
        }
    };
    let insecure_seed = u128::from_le_bytes(seed(3)[..16].try_into().unwrap_or([0; 16]));
    let legacy = |stream: u64| rand010::rngs::StdRng::seed_from_u64((run_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream);
    match secret {
        Some(_) => (rand010::rngs::StdRng::from_seed(seed(1)), rand010::rngs::StdRng::from_seed(seed(2)), insecure_seed),
        None => (legacy(1), legacy(2), run_id as u128),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_have_their_control_characters_escaped() {
        assert_eq!(escape_log("a\nb\u{1b}[31m\r\u{0}".into()), "a\\nb\\u{1b}[31m\\r\\u{0}");
        assert_eq!(escape_log("plain é".into()), "plain é");
        assert_eq!(truncated("ééé", 3), "é…");
    }

    #[test]
    fn effect_names_are_checked_and_a_refused_one_is_recorded_short() {
        assert!(effect_name("kv.get".into()).1.is_none());
        assert!(effect_name("model.chat".into()).1.is_none());
        let (stored, refused) = effect_name("a".repeat(300));
        assert!(refused.is_some() && stored.len() <= 8 + 32, "{stored}");
        let (stored, refused) = effect_name("Bad Name!".into());
        assert!(refused.is_some() && stored == "invalid:Bad?Name?", "{stored}");
        assert!(effect_name(String::new()).1.is_some());
    }
}
