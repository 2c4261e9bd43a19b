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
