//! The guest's clocks and its WASI waits.
//!
//! A turn sees *virtual* time, the same on every replay: the monotonic
//! clock starts at 0, advances 1 µs per reading and, when the turn waits
//! (a WASI timer, or `sleep`), by the time it waited; the wall clock reads
//! the run's creation time plus the monotonic clock.
//!
//! A WASI wait (`wasi:io/poll` on monotonic-clock pollables: Rust's
//! `std::thread::sleep`, Python's `time.sleep`, a JavaScript timer) that
//! ends before what is left of the segment's budget just waits. A longer
//! one ends the segment like `sleep`: it is recorded (`wasi.sleep`, with
//! its wake time) and the run is suspended until then, so a worker is never
//! held, nor a lease renewed, for a guest that sleeps. On replay, a wait
//! below the recorded frontier returns at once (the guest cannot tell: its
//! clock moves on all the same), and a recorded `wasi.sleep` returns once
//! it is due.
//!
//! The host shadows `wasi:clocks/monotonic-clock` and `wasi:io/poll` in the
//! linker. A poll that mixes timers with other pollables (stdin, streams)
//! is left to wasmtime-wasi, with the timers waiting in real time; the
//! segment's timer stops it like a computing guest at the budget.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::{DynPollable, Pollable, subscribe};

/// The WASI version whose interfaces are shadowed; imports of any 0.2.x
/// version resolve to it.
const WASI: &str = "0.2.12";

/// One reading of the monotonic clock moves it on this much, so it never
/// stands still (some runtimes spin until it moves). 1 µs.
const STEP_NS: u64 = 1_000;

/// The guest's virtual time and its live timers.
#[derive(Default)]
pub(crate) struct GuestTime {
    /// Monotonic nanoseconds since the turn started, shared with the
    /// timers and the wall clock.
    now: Arc<AtomicU64>,
    /// Live timer pollables: the pollable's table index to its timer's.
    timers: HashMap<u32, u32>,
    /// WASI waits so far in this turn (replay numbers them the same).
    pub(crate) waits: u64,
}

impl GuestTime {
    /// A reading of the monotonic clock (it moves on by a step).
    pub(crate) fn read(&self) -> u64 {
        self.now.fetch_add(STEP_NS, Ordering::Relaxed)
    }

    /// The clock, without moving it.
    pub(crate) fn peek(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }

    /// Moves the clock on to `to` (never back).
    pub(crate) fn advance_to(&self, to: u64) {
        self.now.fetch_max(to, Ordering::Relaxed);
    }

    /// Moves the clock on by `ms`, after a `sleep` returns.
    pub(crate) fn advance_ms(&self, ms: i64) {
        let ns = u64::try_from(ms).unwrap_or(0).saturating_mul(1_000_000);
        self.now.fetch_add(ns, Ordering::Relaxed);
    }

    /// The monotonic clock as wasmtime-wasi reads it (for interfaces that
    /// read it directly): the same virtual time.
    pub(crate) fn monotonic_clock(&self) -> MonotonicClock {
        MonotonicClock(self.now.clone())
    }

    /// The wall clock: `created_at_ms` plus the monotonic clock.
    pub(crate) fn wall_clock(&self, created_at_ms: i64) -> WallClock {
        WallClock { created_at: Duration::from_millis(created_at_ms.max(0) as u64), now: self.now.clone() }
    }

    /// A pollable that is ready at monotonic `deadline`.
    pub(crate) fn subscribe(&mut self, table: &mut ResourceTable, deadline: u64) -> wasmtime::Result<Resource<DynPollable>> {
        let timer = table.push(Timer { deadline, now: self.now.clone() })?;
        let timer_index = timer.rep();
        let pollable = subscribe(table, timer)?;
        self.timers.insert(pollable.rep(), timer_index);
        Ok(pollable)
    }

    /// The deadline of `pollable` if it is one of this guest's timers.
    pub(crate) fn deadline(&self, table: &mut ResourceTable, pollable: &Resource<DynPollable>) -> Option<u64> {
        let timer = *self.timers.get(&pollable.rep())?;
        // The index may have been reused since the timer was dropped.
        table.get_any_mut(timer).ok()?.downcast_ref::<Timer>().map(|t| t.deadline)
    }
}

/// A monotonic-clock pollable.
struct Timer {
    deadline: u64,
    now: Arc<AtomicU64>,
}

#[wasmtime_wasi::async_trait]
impl Pollable for Timer {
    /// Only for polls that mix timers with other pollables: waits in real
    /// time (the segment's own timer bounds it), then moves the clock on.
    async fn ready(&mut self) {
        let now = self.now.load(Ordering::Relaxed);
        if self.deadline > now {
            tokio::time::sleep(Duration::from_nanos(self.deadline - now)).await;
            self.now.fetch_max(self.deadline, Ordering::Relaxed);
        }
    }
}

/// The guest's wall clock (see [`GuestTime::wall_clock`]).
pub(crate) struct WallClock {
    created_at: Duration,
    now: Arc<AtomicU64>,
}

impl wasmtime_wasi::HostWallClock for WallClock {
    fn resolution(&self) -> Duration {
        Duration::from_micros(1)
    }
    fn now(&self) -> Duration {
        self.created_at + Duration::from_nanos(self.now.load(Ordering::Relaxed))
    }
}

/// The guest's monotonic clock (see [`GuestTime::monotonic_clock`]).
pub(crate) struct MonotonicClock(Arc<AtomicU64>);

impl wasmtime_wasi::HostMonotonicClock for MonotonicClock {
    fn resolution(&self) -> u64 {
        STEP_NS
    }
    fn now(&self) -> u64 {
        self.0.fetch_add(STEP_NS, Ordering::Relaxed)
    }
}

/// What the host state behind the shadowed WASI functions provides.
pub(crate) trait Waits: Send + 'static {
    fn time(&mut self) -> (&mut GuestTime, &mut ResourceTable);
    /// Waits until the guest's clock reaches `target` (a live wait, a
    /// durable one, or none on replay); `Err` stops the guest.
    fn wait_until(&mut self, target: u64) -> impl std::future::Future<Output = wasmtime::Result<()>> + Send;
}

/// Shadows `wasi:clocks/monotonic-clock` and `wasi:io/poll` (added by
/// wasmtime-wasi before) with the guest's virtual time.
pub(crate) fn add_to_linker<T: Waits>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let mut clock = linker.instance(&format!("wasi:clocks/monotonic-clock@{WASI}"))?;
    clock.func_wrap("now", |mut store, (): ()| Ok((store.data_mut().time().0.read(),)))?;
    clock.func_wrap("resolution", |_, (): ()| Ok((STEP_NS,)))?;
    clock.func_wrap("subscribe-instant", |mut store, (when,): (u64,)| {
        let (time, table) = store.data_mut().time();
        Ok((time.subscribe(table, when)?,))
    })?;
    clock.func_wrap("subscribe-duration", |mut store, (after,): (u64,)| {
        let (time, table) = store.data_mut().time();
        let deadline = time.peek().saturating_add(after);
        Ok((time.subscribe(table, deadline)?,))
    })?;
    let mut io = linker.instance(&format!("wasi:io/poll@{WASI}"))?;
    io.func_wrap_async("poll", |mut store, (list,): (Vec<Resource<DynPollable>>,)| {
        Box::new(async move { poll(store.data_mut(), list).await.map(|r| (r,)) })
    })?;
    io.func_wrap_async("[method]pollable.block", |mut store, (p,): (Resource<DynPollable>,)| {
        Box::new(async move { poll(store.data_mut(), vec![p]).await.map(|_| ()) })
    })?;
    io.func_wrap_async("[method]pollable.ready", |mut store, (p,): (Resource<DynPollable>,)| {
        Box::new(async move {
            let state = store.data_mut();
            let (time, table) = state.time();
            match time.deadline(table, &p) {
                Some(deadline) => Ok((deadline <= time.peek(),)),
                None => Ok((wasmtime_wasi::p2::bindings::io::poll::HostPollable::ready(table, p).await?,)),
            }
        })
    })?;
    linker.allow_shadowing(false);
    Ok(())
}

/// `wasi:io/poll.poll`: a list of this guest's timers waits in virtual
/// time (see the module's doc); anything else goes to wasmtime-wasi.
async fn poll<T: Waits>(state: &mut T, list: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
    let deadlines: Option<Vec<u64>> = {
        let (time, table) = state.time();
        list.iter().map(|p| time.deadline(table, p)).collect()
    };
    let Some(deadlines) = deadlines.filter(|d| !d.is_empty()) else {
        let (_, table) = state.time();
        return wasmtime_wasi::p2::bindings::io::poll::Host::poll(table, list).await;
    };
    let target = deadlines.iter().copied().min().unwrap_or(0);
    if target > state.time().0.peek() {
        state.wait_until(target).await?;
    }
    let now = state.time().0.peek();
    Ok((0..deadlines.len() as u32).filter(|&i| deadlines[i as usize] <= now).collect())
}
