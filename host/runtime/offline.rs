//! Offline replay (`leasehold replay`): a component run against a run's
//! recorded ledger with nothing performed. Each call the turn makes is
//! checked against the row at its seq, as a resumed segment checks it, and
//! gets the recorded outcome; the first call with no outcome ends the
//! replay (the frontier), and so does the first that differs (a
//! divergence). No effect is performed, nothing is written, timers do not
//! wait: the segment runs with `SegmentInit::offline`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use wasmtime::UpdateDeadline;

use super::host::{CallView, Divergence, Interrupt, NextCall, SegmentInit};
use super::replay::Recorded;
use super::{Plugin, Runtime, limit_trap};
use crate::store::{EffectRow, Lease, Run, Store, StoreError};

/// What replay needs of a recorded run.
#[derive(Debug, Clone)]
pub struct Recording {
    pub run_id: i64,
    /// The turn's input, JSON text.
    pub input: String,
    /// The run's creation time (epoch ms): where the guest's wall clock starts.
    pub created_at_ms: i64,
    /// The run's random secret. Without it (an export, or a run older than
    /// secrets) a turn that draws WASI random draws other bytes than it did.
    pub secret: Option<String>,
    /// The run's ledger, any order.
    pub effects: Vec<EffectRow>,
    /// The run's stream position (`runs.emit_pos`): emits below it are
    /// recorded.
    pub emit_pos: i64,
    /// The run's output, if it finished with one: shown beside the replay's.
    pub output: Option<String>,
    /// The run's stream so far (`runs.partial`).
    pub partial: String,
}

impl Recording {
    /// `run` as recorded, with its ledger `effects`.
    pub fn of(run: Run, effects: Vec<EffectRow>) -> Recording {
        Recording {
            run_id: run.id,
            input: run.input,
            created_at_ms: run.created_at,
            secret: run.secret,
            effects,
            emit_pos: run.emit_pos,
            output: run.output,
            partial: run.partial,
        }
    }
}

/// How a replay ended.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The turn returned, every call it made matching the ledger.
    Returned { output: String },
    /// The turn returned an error, every call it made matching the ledger.
    Failed { error: String },
    /// Every recorded call matched; the turn went on to a call with no
    /// recorded outcome, where a live segment would go on.
    Frontier { next: NextCall },
    /// A call differs from the recorded one, or the turn ended before the
    /// ledger did.
    Diverged { divergence: Divergence },
    /// A trap, a sandbox limit, or the replay's time limit.
    Stopped { reason: String },
}

/// What `leasehold replay` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub run_id: i64,
    /// The component replayed (its digest).
    pub component: String,
    /// Rows in the recorded ledger.
    pub recorded_calls: i64,
    /// Calls the turn made that matched a recorded row.
    pub replayed_calls: i64,
    #[serde(flatten)]
    pub outcome: Outcome,
    /// The run's recorded output, when it finished with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded_output: Option<String>,
    /// What the turn emitted past the recorded stream.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub new_emits: Vec<String>,
    /// The turn's stream as the replay leaves it: the recorded stream and
    /// the new emits. For a turn that has not returned, what it has
    /// produced so far.
    pub stream: String,
}

impl Report {
    /// A replay that matched the ledger as far as it went.
    pub fn clean(&self) -> bool {
        matches!(self.outcome, Outcome::Returned { .. } | Outcome::Failed { .. } | Outcome::Frontier { .. })
    }
}

/// Replays `plugin` against `recording`, for at most `budget` of wall time.
pub async fn replay(rt: &Runtime, plugin: &Plugin, recording: Recording, budget: Duration) -> Result<Report, StoreError> {
    // The segment needs a store to hold; offline it never reads or writes
    // one (the guard against that is in `SegmentState::perform`).
    let scratch = Store::connect("sqlite::memory:").await?;
    let recorded_calls = recording.effects.len() as i64;
    let recorded_stream = recording.partial.clone();
    let frontier = recording.effects.iter().map(|r| r.seq).max().unwrap_or(-1);
    let init = SegmentInit {
        db: scratch,
        lease: Lease { run_id: recording.run_id, owner: "replay".into(), fence: 0 },
        namespace: plugin.name.clone(),
        limits: plugin.limits.clone(),
        model: None,
        recorded: Recorded::from_rows(recording.effects),
        pending_input: None,
        recorded_emit_pos: recording.emit_pos,
        created_at_ms: recording.created_at_ms,
        secret: recording.secret,
        reserved: Vec::new().into(),
        egress: Default::default(),
        answer_base: None,
        offline: true,
        trace: None,
        lease_live: None,
    };
    let mut store = rt.store(plugin, init);
    let start = Instant::now();
    let timed_out = Arc::new(AtomicBool::new(false));
    let flag = timed_out.clone();
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(move |_| {
        if start.elapsed() >= budget {
            flag.store(true, Ordering::Relaxed);
            return Ok(UpdateDeadline::Interrupt);
        }
        Ok(UpdateDeadline::Yield(1))
    });
    let call = async {
        let turn = plugin.pre.instantiate_async(&mut store).await?;
        turn.call_run(&mut store, &recording.input).await
    };
    // Epochs stop running wasm; the timeout stops anything else.
    let result = tokio::time::timeout(budget + Duration::from_secs(1), call).await.ok();
    let mut state = store.into_data();
    let tail = state.take_stream_tail().await.map(|held| held.deltas).unwrap_or_default();
    let made = state.next_seq;
    let over_time = || Outcome::Stopped { reason: format!("the turn ran for longer than the replay's {budget:?}") };
    let outcome = match (result, state.interrupt.clone()) {
        (None, _) => over_time(),
        (Some(Err(_)), Some(Interrupt::Frontier(next))) => Outcome::Frontier { next },
        (Some(Err(_)), Some(Interrupt::NonDeterminism(divergence))) => Outcome::Diverged { divergence },
        (Some(Err(_)), Some(Interrupt::Limit { kind, message })) => Outcome::Stopped { reason: format!("{}: {message}", kind.as_str()) },
        (Some(Err(_)), Some(other)) => Outcome::Stopped { reason: format!("stopped: {other:?}") },
        (Some(Err(_)), None) if timed_out.load(Ordering::Relaxed) => over_time(),
        (Some(Err(trap)), None) => {
            let reason = if state.limiter.memory_refused {
                format!("the guest asked for more than its {}-byte memory cap", state.limiter.max_memory)
            } else {
                limit_trap(&trap).unwrap_or_else(|| format!("trap: {trap:#}"))
            };
            let reason = match state.output.tail() {
                Some(output) => format!("{reason}\nguest output:\n{output}"),
                None => reason,
            };
            Outcome::Stopped { reason }
        }
        (Some(Ok(_)), _) if made <= frontier => {
            let row = state.recorded.get(made).await?;
            let next = row.as_ref().map_or_else(|| format!("call {made}"), |r| format!("call {made} ({:?})", r.name));
            let why = format!("the turn ended after {made} calls, but the ledger records {recorded_calls}: {next} is not made");
            let recorded = row.map_or(CallView { name: String::new(), request: None, emit_pos: 0 }, |r| CallView {
                name: r.name,
                request: r.request,
                emit_pos: r.emit_pos,
            });
            Outcome::Diverged { divergence: Divergence { seq: made, recorded, now: None, why } }
        }
        (Some(Ok(Ok(output))), _) => Outcome::Returned { output },
        (Some(Ok(Err(error))), _) => Outcome::Failed { error },
    };
    // The call that diverged or found no outcome took a seq of its own.
    let replayed_calls = match &outcome {
        Outcome::Diverged { divergence } => divergence.seq,
        Outcome::Frontier { next } => next.seq,
        _ => made.min(frontier + 1),
    };
    Ok(Report {
        run_id: recording.run_id,
        component: plugin.digest.clone(),
        recorded_calls,
        replayed_calls,
        outcome,
        recorded_output: recording.output,
        stream: recorded_stream + &tail.concat(),
        new_emits: tail,
    })
}
