//! The guest's WASI, as leasehold gives it: its context and table, random
//! numbers seeded from the run's secret, and waits on its virtual clocks
//! (short ones waited, long ones made durable `wasi.sleep` calls).

use std::time::Duration;

use serde_json::json;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtxView, WasiView};

use super::clocks::{self, GuestTime};
use super::host::SegmentState;
use super::text::request_hash;

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
        if self.offline {
            // Past the recorded calls: replay does not wait.
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

/// The guest's stdout and stderr, together: only the last
/// [`OUTPUT_TAIL`] bytes are kept, the rest is dropped without the guest
/// seeing an error, so a chatty guest runs as it would with a terminal.
/// A failed run's error ends with it: a Rust panic's message, a Python
/// traceback. Not recorded and not replayed.
#[derive(Clone, Default)]
pub(crate) struct GuestOutput(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

/// How much of the guest's output a failed run's error shows: 4 KiB.
pub const OUTPUT_TAIL: usize = 4096;

impl GuestOutput {
    /// The kept output, as text (`None` when the guest wrote nothing).
    pub(crate) fn tail(&self) -> Option<String> {
        let buf = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let start = buf.len().saturating_sub(OUTPUT_TAIL);
        let text = String::from_utf8_lossy(&buf[start..]).trim_end().to_string();
        (!text.is_empty()).then(|| super::text::storable(text))
    }
}

impl wasmtime_wasi::cli::IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for GuestOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl tokio::io::AsyncWrite for GuestOutput {
    fn poll_write(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>, data: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let mut buf = self.0.lock().unwrap_or_else(|e| e.into_inner());
        buf.extend_from_slice(data);
        // Bounded: keep twice the tail at most, so trimming is rare.
        if buf.len() > 2 * OUTPUT_TAIL {
            let cut = buf.len() - OUTPUT_TAIL;
            buf.drain(..cut);
        }
        std::task::Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}
