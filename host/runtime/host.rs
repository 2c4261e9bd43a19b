//! The host side of `leasehold:turn/host`: one [`SegmentState`] per segment,
//! holding the lease and a replay cursor over the run's ledger.
//!
//! Every call but `log` gets the next *seq*. If the ledger already has a row
//! at that seq, its recorded result is returned and nothing is performed (a
//! different name or request is non-determinism). Otherwise the call is new
//! ground: it is recorded and performed under the segment's (owner, fence).
//! A call that must stop the guest (suspension, a lost lease, a limit) sets
//! [`SegmentState::interrupt`] and traps; the executor reads the reason.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{HasSelf, Linker, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::effects::model::{DeltaSink, ModelConfig};
use crate::effects::{self, Effect};
use crate::executor::GuestErrorKind;
use crate::ledger::{Completion, EffectCall, HeldPut, LocalOp};
use crate::runtime::Limits;
use crate::store::{EffectClass, EffectRow, EffectState, Lease, Store, StoreError};

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
    /// `sleep`: suspend as `queued` until the timer is due.
    Sleep { delay_ms: i64 },
    /// The slice budget is used up: suspend as `waiting_takeover`.
    Slice,
    /// The host is shutting down: suspend as `waiting_takeover`.
    Shutdown,
    /// A guarded write failed: stop, write nothing else.
    LeaseLost,
    /// A recorded call differs from the one the turn now makes.
    NonDeterminism(String),
    /// A sandbox limit: host calls, emit bytes.
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
/// out-of-memory trap is classified as such.
pub(crate) struct Limiter {
    pub max_memory: usize,
    pub memory_refused: bool,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.max_memory {
            self.memory_refused = true;
            // Trap rather than return -1: most guests abort on a failed grow
            // anyway, and a trap here names the cause precisely.
            return Err(wasmtime::Error::msg(format!(
                "memory limit: the guest asked for {desired} bytes, the limit is {}",
                self.max_memory
            )));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
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
    /// Ledger rows recorded before this segment, by seq.
    recorded: HashMap<i64, EffectRow>,
    next_seq: i64,
    /// Input delivered to the run and not yet consumed by a `wait-input`.
    pending_input: Option<String>,
    /// The turn's output stream (`emit` and `model.chat` deltas).
    stream: Stream,
    host_calls: u64,
    /// Ledger rows this segment wrote (progress).
    pub(crate) new_rows: u64,
    pub(crate) interrupt: Option<Interrupt>,
}

/// What a segment needs to know about the run it holds.
pub struct SegmentInit {
    pub db: Store,
    pub lease: Lease,
    pub namespace: String,
    pub limits: Limits,
    /// The host's `model.chat` endpoint, if any.
    pub model: Option<Arc<ModelConfig>>,
    pub recorded: Vec<EffectRow>,
    pub pending_input: Option<String>,
    pub recorded_emit_pos: i64,
    /// The run's creation time (epoch ms): the guest's wall clock.
    pub created_at_ms: i64,
}

impl SegmentState {
    pub fn new(init: SegmentInit) -> SegmentState {
        let mut wasi = WasiCtx::builder();
        // Replay-safe WASI: a frozen wall clock, a stepping monotonic clock
        // and random seeded from the run id. No network, no filesystem, no
        // environment, no stdio.
        wasi.wall_clock(FrozenWallClock(Duration::from_millis(init.created_at_ms.max(0) as u64)))
            .monotonic_clock(SteppingClock::default())
            .secure_random(seeded_rng(init.lease.run_id, 1))
            .insecure_random(seeded_rng(init.lease.run_id, 2))
            .insecure_random_seed(init.lease.run_id as u128);
        SegmentState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limiter: Limiter {
                max_memory: init.limits.max_memory_bytes,
                memory_refused: false,
            },
            stream: Stream {
                db: init.db.clone(),
                lease: init.lease.clone(),
                pos: 0,
                recorded: init.recorded_emit_pos,
                bytes: 0,
                cap: init.limits.max_emit_bytes,
                stopped: None,
                buffer: Arc::default(),
            },
            db: init.db,
            lease: init.lease,
            namespace: init.namespace,
            limits: init.limits,
            model: init.model,
            recorded: init.recorded.into_iter().map(|r| (r.seq, r)).collect(),
            next_seq: 0,
            pending_input: init.pending_input,
            host_calls: 0,
            new_rows: 0,
            interrupt: None,
        }
    }

    /// Records why the guest must stop and returns the trap that stops it.
    fn stop<T>(&mut self, why: Interrupt) -> wasmtime::Result<T> {
        self.interrupt = Some(why);
        Err(wasmtime::Error::new(Interrupted))
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
            return self.stop(Interrupt::Limit { kind: GuestErrorKind::HostCalls, message });
        }
        Ok(())
    }

    fn call(&mut self, name: &str, request: &str) -> EffectCall {
        let seq = self.next_seq;
        self.next_seq += 1;
        EffectCall {
            seq,
            name: name.to_string(),
            request_hash: request_hash(name, request),
            emit_pos: self.stream.pos,
        }
    }

    /// The recorded row at `call.seq`, checked against the call; `Err` is a
    /// non-determinism stop.
    fn replayed(&mut self, call: &EffectCall) -> wasmtime::Result<Option<EffectRow>> {
        let Some(row) = self.recorded.get(&call.seq).cloned() else {
            return Ok(None);
        };
        if row.name != call.name || row.request_hash != call.request_hash {
            let message = format!(
                "call {} was recorded as {:?} but the turn now makes {:?}{}",
                call.seq,
                row.name,
                call.name,
                if row.name == call.name { " with a different request" } else { "" }
            );
            return self.stop(Interrupt::NonDeterminism(message));
        }
        Ok(Some(row))
    }

    /// Records a refusal at `call` (so replay returns it again) and returns it.
    async fn refuse(&mut self, call: &EffectCall, error: EffectError) -> wasmtime::Result<Result<String, EffectError>> {
        self.flush_stream().await?;
        let (db, lease, call, failed) = (self.db.clone(), self.lease.clone(), call.clone(), encode_error(&error));
        let done = detached(async move { db.record_refusal(&lease, &call, &failed).await }).await;
        match done {
            Ok(_) => {
                self.new_rows += 1;
                Ok(Err(error))
            }
            Err(e) => self.store_failed(e),
        }
    }

    async fn perform(&mut self, call: EffectCall, effect: Effect, reissue: bool) -> wasmtime::Result<Result<String, EffectError>> {
        // A put is held for the segment's next write (see `EMIT_FLUSH`), so
        // a turn's puts and deltas cost one write together. Other runs see
        // it at most `EMIT_FLUSH` later; everything this segment does that
        // others can observe (a remote call, any other write, its end)
        // writes it first, and `kv.get` too, so a turn reads its own puts.
        let effect = match effect {
            Effect::Local(LocalOp::KvPut { namespace, key, value }) => {
                return match self.stream.hold(HeldPut { call, namespace, key, value }).await {
                    Ok(()) => {
                        self.new_rows += 1;
                        Ok(Ok("null".to_string()))
                    }
                    Err(why) => self.stop(why),
                };
            }
            other => other,
        };
        self.flush_stream().await?;
        match effect {
            Effect::Local(op) => match self.local(&call, op).await {
                Ok(row) => {
                    self.new_rows += 1;
                    Ok(Ok(row.result.unwrap_or_default()))
                }
                Err(e) => self.store_failed(e),
            },
            Effect::Remote(remote) => {
                let class = remote.class();
                let (db, lease, c) = (self.db.clone(), self.lease.clone(), call.clone());
                let started = detached(async move {
                    if reissue {
                        db.reissue_effect(&lease, c.seq).await
                    } else {
                        db.begin_effect(&lease, &c, class).await
                    }
                })
                .await;
                if let Err(e) = started {
                    return self.store_failed(e);
                }
                self.new_rows += 1;
                let ctx = effects::RemoteCtx {
                    run_id: self.lease.run_id,
                    seq: call.seq,
                    fence: self.lease.fence,
                    max_result_bytes: self.limits.max_effect_bytes,
                };
                let outcome =
                    effects::perform_remote(remote, &ctx, self.model.as_deref(), &mut self.stream).await;
                if let Some(why) = self.stream.stopped.take() {
                    // The lease is lost or the emit cap is reached mid-call:
                    // stop without recording an outcome. The `started` row
                    // stays, so a keyed call is re-issued on resume.
                    return self.stop(why);
                }
                let completion = match &outcome {
                    Ok(result) => Completion::Committed(result.clone()),
                    Err(error) => Completion::Failed(encode_error(error)),
                };
                // The call's streamed deltas first (`model.chat`), so a
                // committed row's deltas are always in the stream.
                self.flush_stream().await?;
                let (db, lease, seq) = (self.db.clone(), self.lease.clone(), call.seq);
                if let Err(e) = detached(async move { db.complete_effect(&lease, seq, &completion).await }).await {
                    return self.store_failed(e);
                }
                Ok(outcome)
            }
        }
    }
}

impl SegmentState {
    fn grants(&self) -> effects::Grants<'_> {
        effects::Grants {
            namespace: &self.namespace,
            http_allow: &self.limits.http_allow,
            model: self.model.as_deref(),
        }
    }

    /// A local effect, run detached. Not an `async fn`: the future must not
    /// borrow `self`, which is not `Sync`.
    fn local(
        &self,
        call: &EffectCall,
        op: LocalOp,
    ) -> impl std::future::Future<Output = Result<EffectRow, StoreError>> + Send + 'static {
        let (db, lease, call) = (self.db.clone(), self.lease.clone(), call.clone());
        detached(async move { db.local_effect(&lease, &call, &op).await })
    }
}

impl leasehold::turn::host::Host for SegmentState {
    async fn effect(&mut self, name: String, request: String) -> wasmtime::Result<Result<String, EffectError>> {
        self.charge()?;
        // The name is stored in the ledger (the request only as its hash).
        let name = storable(name);
        let call = self.call(&name, &request);
        if let Some(row) = self.replayed(&call)? {
            return match (row.state, row.class) {
                (EffectState::Committed, _) => {
                    let result = row.result.unwrap_or_default();
                    if name == "model.chat" {
                        // Its deltas are already in the stream: move the
                        // position past them.
                        let (deltas, bytes) = effects::model::recorded_deltas(&result);
                        self.stream.pos += deltas;
                        self.stream.bytes += bytes;
                    }
                    Ok(Ok(result))
                }
                (EffectState::Failed, _) => Ok(Err(decode_error(row.result.as_deref().unwrap_or("")))),
                (EffectState::InDoubt | EffectState::Started, EffectClass::Keyed) => {
                    // Re-issued with the same idempotency key: the remote
                    // side deduplicates.
                    let effect = match effects::resolve(&name, &request, &self.grants()) {
                        Ok(e) => e,
                        Err(error) => return Ok(Err(error)),
                    };
                    self.perform(call, effect, true).await
                }
                (EffectState::InDoubt | EffectState::Started, _) => Ok(Err(EffectError::InDoubt(format!(
                    "{name} (call {}) was started by a segment that died; it may or may not have happened",
                    call.seq
                )))),
            };
        }
        if request.len() > self.limits.max_effect_bytes {
            let error = EffectError::Denied(format!(
                "request of {} bytes is over the {}-byte cap",
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
        let prompt = storable(prompt);
        let call = self.call("wait-input", &prompt);
        if let Some(row) = self.replayed(&call)? {
            return Ok(row.result.unwrap_or_default());
        }
        let Some(input) = self.pending_input.take() else {
            return self.stop(Interrupt::WaitInput { prompt });
        };
        self.flush_stream().await?;
        match self.local(&call, LocalOp::TakeInput { value: input }).await {
            Ok(row) => {
                self.new_rows += 1;
                Ok(row.result.unwrap_or_default())
            }
            Err(e) => self.store_failed(e),
        }
    }

    async fn sleep(&mut self, ms: u64) -> wasmtime::Result<()> {
        self.charge()?;
        let ms = i64::try_from(ms).unwrap_or(i64::MAX / 4);
        let call = self.call("sleep", &ms.to_string());
        let db = self.db.clone();
        let now = match detached(async move { db.now_ms().await }).await {
            Ok(now) => now,
            Err(e) => return self.store_failed(e),
        };
        if let Some(row) = self.replayed(&call)? {
            let wake_at: i64 = row.result.as_deref().and_then(|r| r.parse().ok()).unwrap_or(0);
            if now >= wake_at {
                return Ok(());
            }
            return self.stop(Interrupt::Sleep { delay_ms: wake_at - now });
        }
        // Record the wake time first, so a segment that dies here still
        // wakes on time rather than sleeping again from scratch.
        let wake_at = now.saturating_add(ms);
        let op = LocalOp::Record { value: wake_at.to_string() };
        self.flush_stream().await?;
        if let Err(e) = self.local(&call, op).await {
            return self.store_failed(e);
        }
        self.new_rows += 1;
        self.stop(Interrupt::Sleep { delay_ms: ms })
    }

    async fn log(&mut self, level: u8, message: String) -> wasmtime::Result<()> {
        self.charge()?;
        let run_id = self.lease.run_id;
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

impl WasiView for SegmentState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// How long a delta or a `kv.put` may wait in a segment's buffer before it
/// is written. Either is written with the segment's next write (another
/// effect, a suspension, the close), or this long after it was made,
/// whichever comes first; so a thread's readers see a delta, and other
/// runs a put, at most this late, and a turn that streams many small
/// deltas (model tokens) or makes several puts costs one write per window
/// rather than one per call. Deltas and puts still buffered when a host
/// dies are lost with it and made again by the replay: the stream resumes
/// at the run's stored `emit_pos`, and a put with no ledger row is not
/// recorded, so it is performed again. 10 ms.
pub const EMIT_FLUSH: Duration = Duration::from_millis(10);

/// The turn's output stream. Each delta has a position; positions below
/// `recorded` (the run's `emit_pos` at segment start) are already in the
/// stream from an earlier segment and are not written again. New deltas
/// are buffered (see [`EMIT_FLUSH`]).
struct Stream {
    db: Store,
    lease: Lease,
    pos: i64,
    recorded: i64,
    bytes: usize,
    cap: usize,
    /// Why the last delta was refused.
    stopped: Option<Interrupt>,
    buffer: Arc<tokio::sync::Mutex<Buffer>>,
}

/// Deltas emitted and not yet written. The lock is held across each write,
/// so writes keep the stream's order.
#[derive(Default)]
struct Buffer {
    deltas: Vec<String>,
    /// `kv.put`s made and not yet written (see [`HeldPut`]).
    puts: Vec<HeldPut>,
    /// A timed flush is scheduled.
    armed: bool,
    /// The segment has taken the buffer for its last write.
    closed: bool,
    /// A timed flush failed; the next host call stops the guest with this.
    failed: Option<Interrupt>,
}

/// `text` as the store keeps it: each NUL replaced by U+FFFD. PostgreSQL
/// cannot store NUL in text (SQLite can), so without this a guest that
/// wrote one would fail differently on each backend, and on PostgreSQL only
/// after its segments had been abandoned until the reaper gave up.
pub(crate) fn storable(text: String) -> String {
    if text.contains('\0') { text.replace('\0', "\u{FFFD}") } else { text }
}

fn interrupt_for(e: StoreError) -> Interrupt {
    match e {
        StoreError::LeaseLost(_) => Interrupt::LeaseLost,
        other => Interrupt::Store(other.to_string()),
    }
}

/// Writes the buffered deltas, if any, under the caller's lock.
async fn write_buffered(db: &Store, lease: &Lease, buf: &mut Buffer) -> Result<(), Interrupt> {
    if let Some(why) = buf.failed.take() {
        return Err(why);
    }
    if buf.deltas.is_empty() && buf.puts.is_empty() {
        return Ok(());
    }
    let (deltas, puts) = (std::mem::take(&mut buf.deltas), std::mem::take(&mut buf.puts));
    let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
    db.write_held(lease, &refs, &puts).await.map_err(interrupt_for)
}

/// What a segment still holds when it ends: its last deltas and puts, for
/// its close or suspension to write.
#[derive(Debug, Default)]
pub(crate) struct Held {
    pub deltas: Vec<String>,
    pub puts: Vec<HeldPut>,
}

impl Stream {
    /// Writes the buffered deltas now (before another write of the
    /// segment, so the ledger's `emit_pos` matches the stored stream).
    async fn flush(&mut self) -> Result<(), Interrupt> {
        let (db, lease, buffer) = (self.db.clone(), self.lease.clone(), self.buffer.clone());
        // Detached: a lost lease may drop the guest call, never a write.
        match tokio::spawn(async move { write_buffered(&db, &lease, &mut *buffer.lock().await).await }).await {
            Ok(r) => r,
            Err(e) => Err(Interrupt::Store(format!("store task failed: {e}"))),
        }
    }
}

impl DeltaSink for Stream {
    async fn delta(&mut self, text: String) -> Result<(), ()> {
        let text = storable(text);
        let pos = self.pos;
        self.pos += 1;
        self.bytes += text.len();
        if self.bytes > self.cap {
            let message = format!("emitted more than {} bytes", self.cap);
            self.stopped = Some(Interrupt::Limit { kind: GuestErrorKind::OutputTooLarge, message });
            return Err(());
        }
        if pos < self.recorded {
            return Ok(()); // already in the stream
        }
        let mut buf = self.buffer.lock().await;
        if let Some(why) = buf.failed.take() {
            self.stopped = Some(why);
            return Err(());
        }
        buf.deltas.push(text);
        self.arm(&mut buf);
        Ok(())
    }
}

impl Stream {
    /// Holds a `kv.put` for the segment's next write. `Err`: a timed flush
    /// failed; the guest must stop.
    async fn hold(&mut self, put: HeldPut) -> Result<(), Interrupt> {
        let mut buf = self.buffer.lock().await;
        if let Some(why) = buf.failed.take() {
            return Err(why);
        }
        buf.puts.push(put);
        self.arm(&mut buf);
        Ok(())
    }

    /// Schedules a timed flush of the buffer, unless one is scheduled.
    fn arm(&self, buf: &mut Buffer) {
        if buf.armed {
            return;
        }
        buf.armed = true;
        let (db, lease, buffer) = (self.db.clone(), self.lease.clone(), self.buffer.clone());
        tokio::spawn(async move {
            tokio::time::sleep(EMIT_FLUSH).await;
            let mut buf = buffer.lock().await;
            buf.armed = false;
            if buf.closed {
                return;
            }
            if let Err(why) = write_buffered(&db, &lease, &mut buf).await {
                buf.failed = Some(why);
            }
        });
    }
}

impl SegmentState {
    /// Writes buffered deltas before another write; a failure stops the
    /// guest like a failed write of its own.
    async fn flush_stream(&mut self) -> wasmtime::Result<()> {
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
    pub(crate) fn take_stream_tail(
        &self,
    ) -> impl std::future::Future<Output = Result<Held, Interrupt>> + Send + 'static {
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

pub(crate) fn add_to_linker(linker: &mut Linker<SegmentState>) -> wasmtime::Result<()> {
    Turn::add_to_linker::<_, HasSelf<_>>(linker, |s| s)
}

/// Runs a store operation in its own task and waits for it. If the guest
/// call awaiting it is dropped (a lost lease drops the call mid-flight), the
/// operation still runs to completion: cancelling a database future half-way
/// can leave its pooled connection inside an unfinished transaction that the
/// connection's next user inherits. A write that lands late is harmless: it
/// is fenced.
async fn detached<T: Send + 'static>(
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
    serde_json::json!({ "kind": kind, "message": message }).to_string()
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

struct FrozenWallClock(Duration);

impl wasmtime_wasi::HostWallClock for FrozenWallClock {
    fn resolution(&self) -> Duration {
        Duration::from_millis(1)
    }
    fn now(&self) -> Duration {
        self.0
    }
}

/// Advances 1 µs per reading: deterministic, and never stands still (some
/// runtimes spin until the clock moves).
#[derive(Default)]
struct SteppingClock(std::sync::atomic::AtomicU64);

impl wasmtime_wasi::HostMonotonicClock for SteppingClock {
    fn resolution(&self) -> u64 {
        1_000
    }
    fn now(&self) -> u64 {
        self.0.fetch_add(1_000, std::sync::atomic::Ordering::Relaxed)
    }
}

fn seeded_rng(run_id: i64, stream: u64) -> rand010::rngs::StdRng {
    use rand010::SeedableRng;
    rand010::rngs::StdRng::seed_from_u64((run_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream)
}
