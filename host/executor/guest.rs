//! A segment's guest call: the plugin instantiated and `run` called, with
//! the lease cover, the epoch deadline and the segment's timers in force.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use wasmtime::UpdateDeadline;

use super::Executor;
use super::renewer::{self, LAST_CHANCE, LeaseWatch};
use crate::runtime::host::{Interrupt, Phase, SegmentInit, SegmentState};
use crate::runtime::{EPOCH_TICK, Plugin};

impl Executor {
    /// Instantiates the plugin and calls `run`, with the segment's lease
    /// cover (`watch`), the epoch deadline and the segment's timers in
    /// force. Returns the call's result and the final state.
    ///
    /// Epochs only interrupt running wasm, so a timer stops a guest blocked
    /// in a host or WASI call too: at the budget (a host call in flight gets
    /// the grace first), and at the lease deadline. The lease is renewed
    /// until the budget plus the grace, never longer.
    pub(super) async fn guest_call(
        &self,
        plugin: &Plugin,
        init: SegmentInit,
        input: &str,
        watch: &LeaseWatch,
        charge: Option<&mut renewer::Charge>,
    ) -> (wasmtime::Result<Result<String, String>>, SegmentState) {
        let init_lease = init.lease.clone();
        // The watch's `lost` is read by the epoch callback (sync); its
        // `lost_now` wakes the select below at once.
        // The lease deadline as an offset from the segment's start (its
        // cover's), in ms; moved on by each renewal. Measured on this
        // worker's monotonic clock only to stop its own guest early: the
        // database decides who holds the lease. The budget runs from the
        // guest's own start.
        let clock = self.config.clock.clone();
        let (start, guest_start) = (watch.start, clock.now());
        let lease_deadline = &watch.deadline_ms;
        let budget = plugin.limits.segment_budget;
        let hard_stop = budget + plugin.limits.slice_grace;
        // Renewed until the budget plus the grace, never longer.
        watch.renew_for(hard_stop);

        let mut store = self.runtime.store(plugin, init);
        let phase = store.data().phase.clone();
        let (watch_cb, stop_cb) = (watch.clone(), self.stop.clone());
        // Wakes the segment's timer when the epoch callback sees the lease
        // deadline pass (after a pause both notice at once anyway).
        let past_deadline = Arc::new(tokio::sync::Notify::new());
        let (past_cb, clock_cb) = (past_deadline.clone(), clock.clone());
        // The deadline the callback saw pass, and when it saw it.
        let mut noticed: Option<(i64, Duration)> = None;
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |mut ctx| {
            let elapsed = clock_cb.since(start);
            let running = clock_cb.since(guest_start);
            if watch_cb.lost.load(Ordering::Relaxed) {
                ctx.data_mut().interrupt = Some(Interrupt::LeaseLost);
                return Ok(UpdateDeadline::Interrupt);
            }
            // Past the local deadline the guest goes on for LAST_CHANCE from
            // when this host noticed, while the segment's timer asks the
            // database one last time: a host that was paused for longer
            // than its lease asks before it gives the run up.
            let deadline = watch_cb.deadline_ms.load(Ordering::Relaxed);
            if elapsed.as_millis() as i64 >= deadline {
                let at = match noticed {
                    Some((d, at)) if d == deadline => at,
                    _ => {
                        noticed = Some((deadline, elapsed));
                        past_cb.notify_one();
                        elapsed
                    }
                };
                if elapsed >= at + LAST_CHANCE {
                    ctx.data_mut().interrupt = Some(Interrupt::LeaseLost);
                    return Ok(UpdateDeadline::Interrupt);
                }
            }
            if stop_cb.stopped.load(Ordering::Relaxed) {
                ctx.data_mut().interrupt = Some(Interrupt::Shutdown);
                return Ok(UpdateDeadline::Interrupt);
            }
            if watch_cb.paused.load(Ordering::Relaxed) {
                ctx.data_mut().interrupt = Some(Interrupt::Pause);
                return Ok(UpdateDeadline::Interrupt);
            }
            if running >= budget {
                ctx.data_mut().interrupt = Some(Interrupt::Slice);
                return Ok(UpdateDeadline::Interrupt);
            }
            Ok(UpdateDeadline::Yield(1))
        });

        let call = async {
            let turn = plugin.pre.instantiate_async(&mut store).await?;
            turn.call_run(&mut store, input).await
        };
        // A lost lease drops the call mid-flight (an in-flight effect future
        // with it) rather than waiting for the next epoch tick.
        let stop = self.stop.clone();
        let stopped = async move {
            let notified = stop.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !stop.stopped.load(Ordering::SeqCst) {
                notified.await;
            }
        };
        // The budget, for a guest that is not running wasm (the epoch
        // callback stops one that is): blocked in a WASI call, it is
        // stopped at once; in a remote call, at the end of the grace; in a
        // database write, once the write is done (the lease deadline bounds
        // that), when the epoch callback stops it.
        // The same timer first fires the segment's charge, if it has one
        // (`renewer::Charge`), `CHARGE_AFTER` into the guest.
        let sliced = async {
            match charge {
                Some(charge) => {
                    let first = renewer::CHARGE_AFTER.min(budget);
                    let sleep = tokio::time::sleep(first);
                    tokio::pin!(sleep);
                    sleep.as_mut().await;
                    charge.fire(&self.store, &init_lease, self.config.lease_ttl, watch);
                    sleep.as_mut().reset(tokio::time::Instant::now() + (budget - first));
                    sleep.await;
                }
                None => tokio::time::sleep(budget).await,
            }
            loop {
                match phase.get() {
                    Phase::REMOTE if clock.since(guest_start) < hard_stop => {}
                    Phase::DATABASE => {}
                    _ => return,
                }
                tokio::time::sleep(EPOCH_TICK).await;
            }
        };
        // A quarter lease before the deadline (renewals move it): one that ran out is gone.
        let early = self.config.lease_ttl.as_millis() as i64 / 4;
        let expired = || async {
            loop {
                let left = lease_deadline.load(Ordering::Relaxed) - early - clock.since(start).as_millis() as i64;
                if left <= 0 {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(left as u64)) => {}
                    _ = past_deadline.notified() => {}
                }
            }
        };
        let interrupted = || Err(wasmtime::Error::new(crate::runtime::host::Interrupted));
        let (result, why) = {
            // Pinned in this block, so the call (and its borrow of the
            // store) ends with it.
            tokio::pin!(call, stopped, sliced);
            loop {
                tokio::select! {
                    r = &mut call => break (r, None),
                    _ = watch.lost_now.notified() => break (interrupted(), Some(Interrupt::LeaseLost)),
                    _ = &mut stopped => break (interrupted(), Some(Interrupt::Shutdown)),
                    _ = &mut sliced => break (interrupted(), Some(Interrupt::Slice)),
                    _ = expired() => {
                        // No renewal landed in time (the database was slow, or
                        // this host was paused). One last renewal decides, with
                        // the guest held: a lease still live is kept; one that
                        // ran out, or was taken, is refused, and the guest stops.
                        let asked_at = clock.since(start).as_millis() as i64;
                        let (db, lease, ttl) = (self.store.clone(), init_lease.clone(), self.config.lease_ttl);
                        // Its own task: a renewal is never dropped half-way.
                        let renewal = tokio::time::timeout(LAST_CHANCE, tokio::spawn(async move { db.renew(&lease, ttl).await })).await;
                        match renewal {
                            Ok(Ok(Ok(_))) if clock.since(guest_start) < hard_stop => {
                                lease_deadline.store(asked_at + self.config.lease_ttl.as_millis() as i64, Ordering::Relaxed);
                            }
                            _ => break (interrupted(), Some(Interrupt::LeaseLost)),
                        }
                    }
                }
            }
        };
        if let Some(why) = why {
            // A reason the guest itself gave first stands.
            store.data_mut().interrupt.get_or_insert(why);
        }
        (result, store.into_data())
    }
}
