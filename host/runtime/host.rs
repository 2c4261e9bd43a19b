//! The host side of `leasehold:turn/host`: one [`SegmentState`] per segment,
//! holding the lease and a replay cursor over the run's ledger, and how it
//! replays, records and performs a call (the calls themselves are in
//! `calls`). A call that must stop the guest (suspension, a lost lease, a
//! limit) sets `SegmentState::interrupt` and traps; the executor reads
//! the reason.
//!
//! Everything the guest controls is capped before the host stores it (and
//! a host call carries at most [`Limits::max_hostcall_bytes`] at all): effect
//! names, requests, prompts, log lines, WASI random, resources, and the
//! run's whole ledger.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use wasmtime::component::{HasSelf, Linker, ResourceTable};
use wasmtime_wasi::WasiCtx;

use super::clocks::{self, GuestTime};
use super::kv_quota::KvQuotaState;
use super::replay::Recorded;
use super::stream::{Buffer, Stream};
use super::output::GuestOutput;
use crate::effects::model::ModelConfig;
use crate::effects::{self, Effect};
use crate::store::{Completion, EffectCall, EffectClass, EffectRow, EffectState, HeldPut, Lease, LocalOp, Store, StoreError, Streamed};
use crate::runtime::{GuestErrorKind, Limits};

pub use super::interrupt::{CallView, Divergence, Interrupt, Interrupted, NextCall};
pub(crate) use super::interrupt::interrupt_for;
pub(crate) use super::limits::Limiter;
pub(crate) use super::phase::Phase;
pub use super::stream::EMIT_FLUSH;
pub(crate) use super::stream::Held;
pub(crate) use super::text::storable;
pub use super::text::{MAX_EFFECT_NAME, escape_log, request_hash, request_preview};
use super::text::{decode_error, encode_error};
use super::random::seeded_random;

// The current world (`wit/turn.wit`, 0.2.0). Components built against an
// earlier version link against its host interface too (`v0_1`): they keep
// running unchanged.
wasmtime::component::bindgen!({
    path: "wit",
    world: "turn",
    imports: { default: async | trappable },
    exports: { default: async },
});

/// `leasehold:turn@0.1.0` (`wit/0.1.0/turn.wit`): the host interface as the
/// first release defined it, served by the same calls.
pub(crate) mod v0_1 {
    wasmtime::component::bindgen!({
        path: "wit/0.1.0",
        world: "turn",
        imports: { default: async | trappable },
        exports: { default: async },
    });
}

pub(super) use self::leasehold::turn::host::EffectError as WitEffectError;
pub use crate::effects::EffectError;

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
    /// Where guests' `http` goes (default: direct, public addresses only).
    pub egress: crate::effects::http::Egress,
    /// Where answer links point (`serve --public-url`); `None`: the host
    /// makes none (`answer-link` is denied).
    pub answer_base: Option<Arc<str>>,
    /// Offline replay (`leasehold replay`): recorded outcomes are returned
    /// and the first call with none stops the guest
    /// ([`Interrupt::Frontier`]); nothing is performed or written and
    /// timers do not wait. `false` for live segments.
    pub offline: bool,
    /// The segment's place in its run's trace (`traces`); `None` offline.
    pub trace: Option<Arc<crate::traces::SegmentTrace>>,
    /// Whether the lease is still live by this worker's clock; asked just
    /// before a remote call goes out, so a host that was frozen past its
    /// lease sends nothing it had begun. `None`: no lease to watch.
    pub lease_live: Option<LeaseLive>,
}

/// See [`SegmentInit::lease_live`].
pub type LeaseLive = Arc<dyn Fn() -> bool + Send + Sync>;

/// The store data of one segment.
pub struct SegmentState {
    pub(super) wasi: WasiCtx,
    pub(super) table: ResourceTable,
    pub(crate) limiter: Limiter,
    pub(super) db: Store,
    pub(super) lease: Lease,
    /// The plugin name: the kv namespace.
    pub(super) namespace: String,
    pub(super) limits: Limits,
    pub(super) model: Option<Arc<ModelConfig>>,
    pub(super) reserved: Arc<[SocketAddr]>,
    pub(super) egress: crate::effects::http::Egress,
    pub(super) recorded: Recorded,
    pub(super) next_seq: i64,
    /// Rows and bytes of the run's ledger, this segment's included.
    pub(super) ledger_rows: i64,
    pub(super) ledger_bytes: i64,
    /// Input delivered to the run and not yet consumed by a `wait-input`.
    pub(super) pending_input: Option<String>,
    /// The turn's output stream (`emit` and `model.chat` deltas).
    pub(super) stream: Stream,
    /// What the segment knows of its plugin's kv usage.
    pub(super) kv: KvQuotaState,
    pub(crate) time: GuestTime,
    pub(super) started: Instant,
    pub(super) host_calls: u64,
    pub(super) logs: u64,
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
    /// See [`SegmentInit::offline`].
    pub(super) offline: bool,
    /// The run's secret (answer links are derived from it) and where
    /// they point.
    pub(super) secret: Option<String>,
    pub(super) answer_base: Option<Arc<str>>,
    /// The guest's stdout and stderr, the tail kept for a failed run's error.
    pub(crate) output: GuestOutput,
    /// See [`SegmentInit::trace`].
    pub(super) trace: Option<Arc<crate::traces::SegmentTrace>>,
    /// See [`SegmentInit::lease_live`].
    pub(super) lease_live: Option<LeaseLive>,
}

impl SegmentState {
    pub fn new(init: SegmentInit) -> SegmentState {
        let time = GuestTime::default();
        let mut wasi = WasiCtx::builder();
        // Replay-safe WASI: virtual clocks (see `clocks`) and random seeded
        // from the run's secret. No network, no filesystem, no environment,
        // no stdin; stdout and stderr go to a capped buffer for errors.
        let (secure, insecure, seed) = seeded_random(init.secret.as_deref(), init.lease.run_id);
        wasi.wall_clock(time.wall_clock(init.created_at_ms))
            .monotonic_clock(time.monotonic_clock())
            .secure_random(secure)
            .insecure_random(insecure)
            .insecure_random_seed(seed)
            .max_random_size(init.limits.max_random_bytes);
        let output = GuestOutput::default();
        wasi.stdout(output.clone()).stderr(output.clone());
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
                max_emits: i64::try_from(init.limits.max_emits).unwrap_or(i64::MAX),
                stopped: None,
                buffer: Arc::new(tokio::sync::Mutex::new(Buffer::default())),
                offline: init.offline,
                trace: init.trace.clone(),
            },
            db: init.db,
            lease: init.lease,
            namespace: init.namespace,
            model: init.model,
            reserved: init.reserved,
            egress: init.egress,
            ledger_rows: init.recorded.rows,
            ledger_bytes: init.recorded.bytes,
            recorded: init.recorded,
            kv: KvQuotaState::default(),
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
            offline: init.offline,
            secret: init.secret,
            answer_base: init.answer_base,
            output,
            trace: init.trace,
            lease_live: init.lease_live,
        }
    }

    /// Records why the guest must stop and returns the trap that stops it.
    pub(super) fn stop<T>(&mut self, why: Interrupt) -> wasmtime::Result<T> {
        self.interrupt = Some(why);
        Err(wasmtime::Error::new(Interrupted))
    }

    pub(super) fn limit<T>(&mut self, kind: GuestErrorKind, message: String) -> wasmtime::Result<T> {
        self.stop(Interrupt::Limit { kind, message })
    }

    /// Maps a store error to the interrupt it means.
    pub(super) fn store_failed<T>(&mut self, e: StoreError) -> wasmtime::Result<T> {
        self.stop(interrupt_for(e))
    }

    /// Counts a host call against the segment's budget.
    pub(super) fn charge(&mut self) -> wasmtime::Result<()> {
        self.host_calls += 1;
        if self.host_calls > self.limits.max_host_calls {
            let message = format!("more than {} host calls in one segment", self.limits.max_host_calls);
            return self.limit(GuestErrorKind::HostCalls, message);
        }
        Ok(())
    }

    pub(super) fn call(&mut self, name: &str, request: &str) -> EffectCall {
        let seq = self.next_seq;
        self.next_seq += 1;
        EffectCall {
            seq,
            name: name.to_string(),
            request_hash: request_hash(name, request),
            request: request_preview(request),
            emit_pos: self.stream.pos,
        }
    }

    /// Checks that the run's ledger may take one more row of `bytes`.
    pub(super) fn room(&mut self, bytes: usize) -> wasmtime::Result<()> {
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
    pub(super) fn wrote(&mut self, call: &EffectCall, result: usize) {
        self.ledger_rows += 1;
        self.ledger_bytes += (call.name.len() + result) as i64;
    }

    /// The recorded row at `call.seq`, checked against the call; `Err` is a
    /// non-determinism stop.
    pub(super) async fn replayed(&mut self, call: &EffectCall) -> wasmtime::Result<Option<EffectRow>> {
        let _db = self.phase.enter(Phase::DATABASE);
        let row = match self.recorded.get(call.seq).await {
            Ok(row) => row,
            Err(e) => return self.store_failed(e),
        };
        let Some(row) = row else { return Ok(None) };
        let why = if row.name != call.name {
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
        let divergence = Divergence {
            seq: call.seq,
            recorded: CallView { name: row.name, request: row.request, emit_pos: row.emit_pos },
            now: Some(CallView { name: call.name.clone(), request: Some(call.request.clone()), emit_pos: call.emit_pos }),
            why,
        };
        self.stop(Interrupt::NonDeterminism(divergence))
    }

    /// Offline replay: stops the guest at `call`, which has no recorded
    /// outcome, saying `why`.
    pub(super) fn frontier<T>(&mut self, call: &EffectCall, why: &str) -> wasmtime::Result<T> {
        let call_view = CallView { name: call.name.clone(), request: Some(call.request.clone()), emit_pos: call.emit_pos };
        self.stop(Interrupt::Frontier(NextCall { seq: call.seq, call: call_view, why: why.to_string() }))
    }

    /// Records a refusal at `call` (so replay returns it again) and returns it.
    pub(super) async fn refuse(&mut self, call: &EffectCall, error: EffectError) -> wasmtime::Result<Result<String, EffectError>> {
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
    pub(super) async fn refuse_reissue(&mut self, call: &EffectCall, error: EffectError) -> wasmtime::Result<Result<String, EffectError>> {
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
    pub(super) async fn replay_effect(
        &mut self,
        row: EffectRow,
        call: EffectCall,
        request: &str,
    ) -> wasmtime::Result<Result<String, EffectError>> {
        match (row.state, row.class) {
            (EffectState::Committed, _) => {
                // Its deltas are already in the stream: move past them.
                self.stream.replayed(&row).await;
                Ok(Ok(row.result.unwrap_or_default()))
            }
            (EffectState::Failed, _) => {
                self.stream.replayed(&row).await;
                Ok(Err(decode_error(row.result.as_deref().unwrap_or(""))))
            }
            // Re-issued with the same idempotency key: the remote side
            // deduplicates.
            (EffectState::InDoubt | EffectState::Started, EffectClass::Keyed) if self.offline => {
                self.frontier(&call, "a segment started it and died before its outcome was recorded; a live resume re-issues it")
            }
            (EffectState::InDoubt | EffectState::Started, EffectClass::Keyed) => {
                match effects::resolve(&call.name, request, &self.grants()) {
                    Ok(effect) => self.perform_timed(call, effect, true).await,
                    Err(error) => self.refuse_reissue(&call, error).await,
                }
            }
            (EffectState::InDoubt | EffectState::Started, _) => Ok(Err(EffectError::InDoubt(format!(
                "{} (call {}) was started by a segment that died; it may or may not have happened",
                call.name, call.seq
            )))),
        }
    }

    pub(super) async fn perform(&mut self, call: EffectCall, effect: Effect, reissue: bool) -> wasmtime::Result<Result<String, EffectError>> {
        // The callers stop offline replay before this; the one place every
        // effect passes is checked again, so no path can perform one.
        if self.offline {
            return self.frontier(&call, "not recorded");
        }
        let _db = self.phase.enter(Phase::DATABASE);
        // A put is counted by its size (its row's `kv_bytes`).
        let put_bytes = match &effect {
            Effect::Local(LocalOp::KvPut { key, value, .. }) => key.len() + value.len(),
            _ => 0,
        };
        if !reissue {
            self.room(put_bytes)?;
        }
        // A put is held for the segment's next write (see `EMIT_FLUSH`), so
        // a turn's puts and deltas cost one write together. Other runs see
        // it at most `EMIT_FLUSH` later; everything this segment does that
        // others can observe (a remote call, any other write, its end)
        // writes it first, and `kv.get` too, so a turn reads its own puts.
        let effect = match effect {
            Effect::Local(LocalOp::KvPut { namespace, key, value }) => {
                // See `kv_quota`: exact only when the estimate is over.
                let (db, ns) = (self.db.clone(), self.namespace.clone());
                if !self.kv.fits_estimate(&self.limits.kv, put_bytes as i64, || db.kv_seen(&ns)) {
                    self.flush_stream().await?;
                    let (db, ns, k) = (self.db.clone(), self.namespace.clone(), key.clone());
                    let room = match detached(async move { db.kv_room(&ns, Some(&k)).await }).await {
                        Ok(room) => room,
                        Err(e) => return self.store_failed(e),
                    };
                    self.db.kv_seen_read(&self.namespace, room.usage);
                    if let Err(refusal) = self.kv.decide(&self.limits.kv, room, put_bytes as i64, &self.namespace) {
                        return self.refuse(&call, refusal).await;
                    }
                }
                self.db.kv_seen_put(&self.namespace, put_bytes as i64);
                let put = HeldPut { call: call.clone(), namespace, key, value };
                return match self.stream.hold(put).await {
                    Ok(()) => {
                        self.settled += 1;
                        self.wrote(&call, put_bytes + 4);
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
        let mut remote = remote;
        let budget_held = match self.hold_budget(&mut remote, &call).await? {
            Ok(held) => held,
            Err(refusal) => return self.refuse_budget(&call, refusal, reissue).await,
        };
        let ticket = self.admit(&remote).await?;
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
            idempotency_key: crate::store::idempotency_key(&self.database_id().await?, self.lease.run_id, call.seq),
            reissue,
            traceparent: self.trace.as_ref().and_then(|t| t.http_header(call.seq)),
        };
        self.in_flight = Some((call.seq, call.name.clone(), None));
        let bytes_before = self.stream.bytes;
        let outcome = {
            let _remote = self.phase.enter(Phase::REMOTE);
            self.remote_until_answered(remote, &ctx, &ticket).await
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
        self.settle_rate(&ticket, &outcome).await;
        if budget_held {
            self.release_budget(call.seq).await;
        }
        Ok(outcome)
    }

    pub(super) async fn database_id(&mut self) -> wasmtime::Result<Arc<str>> {
        let _db = self.phase.enter(Phase::DATABASE);
        let db = self.db.clone();
        match detached(async move { db.database_id().await }).await {
            Ok(id) => Ok(id),
            Err(e) => self.store_failed(e),
        }
    }

    pub(super) fn grants(&self) -> effects::Grants<'_> {
        effects::Grants {
            namespace: &self.namespace,
            http_allow: &self.limits.http_allow,
            reserved: &self.reserved,
            model: self.model.as_deref(),
            model_grant: &self.limits.model,
            max_kv_value_bytes: self.limits.max_kv_value_bytes,
        }
    }

    /// A local effect, run detached. Not an `async fn`: the future must not
    /// borrow `self`, which is not `Sync`.
    pub(super) fn local(&self, call: &EffectCall, op: LocalOp) -> impl std::future::Future<Output = Result<EffectRow, StoreError>> + Send + 'static {
        let (db, lease, call) = (self.db.clone(), self.lease.clone(), call.clone());
        detached(async move { db.local_effect(&lease, &call, &op).await })
    }

    /// Writes buffered deltas before another write; a failure stops the
    /// guest like a failed write of its own.
    pub(super) async fn flush_stream(&mut self) -> wasmtime::Result<()> {
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


pub(crate) fn add_to_linker(linker: &mut Linker<SegmentState>) -> wasmtime::Result<()> {
    Turn::add_to_linker::<_, HasSelf<_>>(linker, |s| s)?;
    v0_1::leasehold::turn::host::add_to_linker::<_, HasSelf<_>>(linker, |s| s)?;
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

