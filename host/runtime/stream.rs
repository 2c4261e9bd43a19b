//! The turn's output stream: `emit` and `model.chat` deltas, positioned
//! and buffered, and the `kv.put`s held with them.

use std::sync::Arc;
use std::time::Duration;

use super::interrupt::{Interrupt, interrupt_for};
use super::text::storable;
use crate::effects::model::DeltaSink;
use crate::runtime::GuestErrorKind;
use crate::store::{HeldPut, Lease, Store};
use crate::traces::SegmentTrace;

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
pub(super) struct Stream {
    pub(super) db: Store,
    pub(super) lease: Lease,
    /// The next emit's position.
    pub(super) pos: i64,
    pub(super) recorded: i64,
    /// Bytes emitted so far in the turn, replayed ones included.
    pub(super) bytes: usize,
    pub(super) cap: usize,
    /// Emits the turn may make in all, replayed ones included.
    pub(super) max_emits: i64,
    /// Why the last delta was refused.
    pub(super) stopped: Option<Interrupt>,
    pub(super) buffer: Arc<tokio::sync::Mutex<Buffer>>,
    /// Offline replay: new deltas stay in the buffer, never written.
    pub(super) offline: bool,
    /// Where the puts it writes are reported (`traces`).
    pub(super) trace: Option<Arc<SegmentTrace>>,
}

/// Deltas emitted and not yet written. The lock is held across each write,
/// so writes keep the stream's order.
#[derive(Default)]
pub(super) struct Buffer {
    pub(super) deltas: Vec<String>,
    /// `kv.put`s made and not yet written (see [`HeldPut`]).
    pub(super) puts: Vec<HeldPut>,
    /// A timed flush is scheduled.
    armed: bool,
    /// The segment has taken the buffer for its last write.
    pub(super) closed: bool,
    /// A timed flush failed; the next host call stops the guest with this.
    pub(super) failed: Option<Interrupt>,
}

/// Writes the buffered deltas, if any, under the caller's lock, and
/// reports the puts it wrote to the segment's trace.
async fn write_buffered(db: &Store, lease: &Lease, buf: &mut Buffer, trace: Option<&SegmentTrace>) -> Result<(), Interrupt> {
    if let Some(why) = buf.failed.take() {
        return Err(why);
    }
    if buf.deltas.is_empty() && buf.puts.is_empty() {
        return Ok(());
    }
    let (deltas, puts) = (std::mem::take(&mut buf.deltas), std::mem::take(&mut buf.puts));
    let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
    let start = crate::traces::now_ns();
    db.write_held(lease, &refs, &puts).await.map_err(interrupt_for)?;
    if let Some(trace) = trace.filter(|t| t.exporting()) {
        trace.puts_written(start, puts.iter().map(|p| p.call.seq));
    }
    Ok(())
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
    pub(super) async fn flush(&mut self) -> Result<(), Interrupt> {
        if self.offline {
            return Ok(());
        }
        let (db, lease, buffer, trace) = (self.db.clone(), self.lease.clone(), self.buffer.clone(), self.trace.clone());
        // Detached: a lost lease may drop the guest call, never a write.
        match tokio::spawn(async move { write_buffered(&db, &lease, &mut *buffer.lock().await, trace.as_deref()).await }).await {
            Ok(r) => r,
            Err(e) => Err(Interrupt::Store(format!("store task failed: {e}"))),
        }
    }
}

impl Stream {
    /// Moves past `deltas` emits of `bytes` a replayed call made: they are
    /// already in the stream.
    pub(super) fn skip(&mut self, deltas: i64, bytes: i64) {
        self.pos += deltas;
        self.bytes += usize::try_from(bytes).unwrap_or(0);
    }

    /// Moves past the deltas a replayed call made ([`Stream::skip`]). A
    /// rerun's prefix (rows copied from the run it reruns, `store::rerun`)
    /// was never streamed to this run: its deltas are written instead, a
    /// chat's whole answer as the first and the others empty (the split is
    /// not kept), so the stream holds the same text at the same positions.
    /// A failed call's partial answer is not kept: its deltas are empty.
    pub(super) async fn replayed(&mut self, row: &crate::store::EffectRow) {
        if row.deltas == 0 || self.pos < self.recorded {
            return self.skip(row.deltas, row.delta_bytes);
        }
        let content = match row.state {
            crate::store::EffectState::Committed => row.result.as_deref().and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok()),
            _ => None,
        };
        let mut first = content.as_ref().and_then(|v| v["content"].as_str()).unwrap_or_default().to_string();
        for _ in 0..row.deltas {
            // Past a cap, `stopped` is set and the turn's next call stops it.
            let _ = self.delta(std::mem::take(&mut first)).await;
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
        // Each emit is an event row of the thread: bounded by count too,
        // so a turn of one-byte emits cannot write millions of rows.
        if self.pos > self.max_emits {
            let message = format!("emitted more than {} times", self.max_emits);
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
    pub(super) async fn hold(&mut self, put: HeldPut) -> Result<(), Interrupt> {
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
        if buf.armed || self.offline {
            return;
        }
        buf.armed = true;
        let (db, lease, buffer, trace) = (self.db.clone(), self.lease.clone(), self.buffer.clone(), self.trace.clone());
        tokio::spawn(async move {
            tokio::time::sleep(EMIT_FLUSH).await;
            let mut buf = buffer.lock().await;
            buf.armed = false;
            if buf.closed {
                return;
            }
            if let Err(why) = write_buffered(&db, &lease, &mut buf, trace.as_deref()).await {
                buf.failed = Some(why);
            }
        });
    }
}

