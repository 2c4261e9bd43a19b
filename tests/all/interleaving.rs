//! Randomised interleaving: simulated workers (some of them zombies holding
//! stale leases), a reaper, cancels and input deliveries, in a seeded random
//! order, against a clock that advances by backdating (never by sleeping).
//!
//! Prints its seed; `LEASEHOLD_SEED=N` replays it. `LEASEHOLD_STEPS` sets
//! the length (default 400).

use std::collections::HashMap;

use anyhow::{Result, bail, ensure};
use leasehold::store::{Completion, EffectCall, EffectClass, Lease, LocalOp, NewRun, Outcome, Run, StoreError, Suspend};
use leasehold::maintenance::reaper::{self, ReaperConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::harness::{TTL, TestDb, both};

fn seed() -> u64 {
    match std::env::var("LEASEHOLD_SEED") {
        Ok(s) => s.parse().expect("LEASEHOLD_SEED must be a u64"),
        Err(_) => rand::rng().random(),
    }
}

/// Errors a guarded operation may legitimately return in the simulation.
fn expected(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::LeaseLost(_)
            | StoreError::EffectExists { .. }
            | StoreError::EffectNotOpen { .. }
            | StoreError::Conflict { .. }
    )
}

struct Sim<'a> {
    db: &'a TestDb,
    rng: StdRng,
    /// Every lease each worker ever got; old ones make it a zombie.
    leases: Vec<Vec<Lease>>,
    /// The lease of the latest claim of each run, while it is running.
    current: HashMap<i64, Lease>,
    /// Per run: the (owner, fence) pairs that wrote successfully after each claim.
    writers: HashMap<(i64, i64), Vec<(String, i64)>>,
    runs: Vec<i64>,
    snapshot: HashMap<i64, Run>,
    writes_ok: u64,
    writes_rejected: u64,
    /// Writes of the current holder refused because its lease ran out.
    expired_refused: u64,
    /// (run, fence) of each abort by the reaper, cancel and input
    /// delivery: the events those write carry that fence.
    aborts: std::collections::HashSet<(i64, i64)>,
    cancels: std::collections::HashSet<(i64, i64)>,
    inputs: std::collections::HashSet<(i64, i64)>,
    /// Claims that took over a lease (its expiry had passed).
    takeovers: u64,
}

impl Sim<'_> {
    fn pick_lease(&mut self, w: usize) -> Option<Lease> {
        let held = &self.leases[w];
        if held.is_empty() {
            return None;
        }
        // Mostly the newest lease; sometimes an old one (a zombie write).
        let i = if self.rng.random_bool(0.7) { held.len() - 1 } else { self.rng.random_range(0..held.len()) };
        Some(held[i].clone())
    }

    /// Records the result of a guarded write by `lease`.
    async fn guarded<T>(&mut self, lease: &Lease, r: Result<T, StoreError>, ends_segment: bool) -> Result<()> {
        match r {
            Ok(_) => {
                let Some(cur) = self.current.get(&lease.run_id) else {
                    bail!("write by {lease:?} succeeded on a run nobody holds");
                };
                ensure!(cur == lease, "stale write landed: {lease:?} while {cur:?} holds the run");
                self.writers
                    .entry((lease.run_id, lease.fence))
                    .or_default()
                    .push((lease.owner.clone(), lease.fence));
                if ends_segment {
                    self.current.remove(&lease.run_id);
                }
                self.writes_ok += 1;
            }
            Err(e) if expected(&e) => {
                if e.is_lease_lost() {
                    if self.current.get(&lease.run_id) == Some(lease) {
                        // The holder is refused only once its lease has run
                        // out (a renewal: with less than an eighth of it left).
                        let s = &self.db.store;
                        let expires: Option<i64> = sqlx::query_scalar("SELECT lease_expires_at FROM runs WHERE id = $1")
                            .bind(lease.run_id)
                            .fetch_one(s.pool())
                            .await?;
                        let left = expires.unwrap_or(i64::MIN) - s.now_ms().await?;
                        ensure!(left < TTL.as_millis() as i64 / 8, "the current holder {lease:?} was refused with {left} ms of its lease left");
                        self.expired_refused += 1;
                    }
                    self.writes_rejected += 1;
                }
            }
            Err(e) => bail!("unexpected error for {lease:?}: {e}"),
        }
        Ok(())
    }

    async fn step(&mut self, workers: usize) -> Result<()> {
        let s = &self.db.store;
        let w = self.rng.random_range(0..workers);
        let owner = format!("w{w}");
        match self.rng.random_range(0..100) {
            0..8 => {
                let mut new = NewRun::new("p", "{}");
                new.max_attempts = Some(self.rng.random_range(1..4));
                new.thread_id = Some(format!("t{}", self.rng.random_range(0..3)));
                self.runs.push(s.create_run(&new).await?.0.id);
            }
            8..25 => {
                let n = self.rng.random_range(1..3);
                // The leases as the database has them before the claim: a
                // claim may take a running run only once its lease expired.
                let expiries: HashMap<i64, i64> = sqlx::query_as::<_, (i64, i64)>(
                    "SELECT id, lease_expires_at FROM runs WHERE status = 'running'",
                )
                .fetch_all(s.pool())
                .await?
                .into_iter()
                .collect();
                let claimed = s.claim_batch(&owner, TTL, n).await?;
                let now = s.now_ms().await?;
                for c in claimed {
                    if let Some(prev) = self.current.get(&c.run.id) {
                        ensure!(c.lease.fence > prev.fence, "fence did not grow");
                    }
                    if let Some(expiry) = expiries.get(&c.run.id) {
                        ensure!(*expiry < now, "run {} was claimed while its lease had {} ms left", c.run.id, expiry - now);
                        self.takeovers += 1;
                    }
                    ensure!(c.run.lease_owner.as_deref() == Some(owner.as_str()), "{:?}", c.run);
                    self.current.insert(c.run.id, c.lease.clone());
                    self.leases[w].push(c.lease);
                }
            }
            25..70 => {
                let Some(lease) = self.pick_lease(w) else { return Ok(()) };
                let seq = self.rng.random_range(0..4);
                let call = EffectCall { seq, name: "e".into(), request_hash: "h".into(), request: String::new(), emit_pos: 0 };
                match self.rng.random_range(0..9) {
                    0 => { let r = s.renew(&lease, TTL).await; self.guarded(&lease, r, false).await? }
                    1 | 2 => { let r = s.emit(&lease, "x").await; self.guarded(&lease, r, false).await? }
                    3 => { let r = s.begin_effect(&lease, &call, EffectClass::Keyed).await; self.guarded(&lease, r, false).await? }
                    4 => {
                        let r = s.complete_effect(&lease, seq, &Completion::Committed("ok".into())).await;
                        self.guarded(&lease, r, false).await?
                    }
                    5 => {
                        let op = LocalOp::KvPut { namespace: "p".into(), key: format!("k{seq}"), value: owner.clone() };
                        let r = s.local_effect(&lease, &call, &op).await;
                        self.guarded(&lease, r, false).await?
                    }
                    6 => { let r = s.reconcile(&lease).await; self.guarded(&lease, r, false).await? }
                    7 => {
                        let how = match self.rng.random_range(0..3) {
                            0 => Suspend::Takeover,
                            1 => Suspend::WaitInput { prompt: "?".into() },
                            _ => Suspend::Sleep { delay_ms: self.rng.random_range(0..60_000) },
                        };
                        let r = s.suspend(&lease, &how).await;
                        self.guarded(&lease, r, true).await?
                    }
                    _ => {
                        let outcome = if self.rng.random_bool(0.8) {
                            Outcome::Completed { output: owner.clone() }
                        } else {
                            Outcome::Failed { error: owner.clone() }
                        };
                        let r = s.close(&lease, &outcome).await;
                        self.guarded(&lease, r, true).await?
                    }
                }
            }
            70..80 => {
                // The clock advances: by nothing, half a lease, or past it.
                let ms = [0, TTL.as_millis() as i64 / 2, TTL.as_millis() as i64 + 1][self.rng.random_range(0..3)];
                self.db.advance_clock(ms).await?;
            }
            80..88 => {
                let report = reaper::tick(s, &ReaperConfig::default()).await?;
                for id in report.aborted {
                    self.current.remove(&id);
                    // Terminal now: its fence is the one the abort wrote with.
                    self.aborts.insert((id, s.get_run(id).await?.fence));
                }
            }
            88..92 => {
                if let Some(&id) = self.runs.get(self.rng.random_range(0..self.runs.len().max(1))) {
                    match s.cancel(id).await {
                        Ok(run) => {
                            self.current.remove(&id);
                            self.cancels.insert((id, run.fence));
                        }
                        Err(e) if expected(&e) => {}
                        Err(e) => bail!("cancel: {e}"),
                    }
                }
            }
            _ => {
                if let Some(&id) = self.runs.get(self.rng.random_range(0..self.runs.len().max(1))) {
                    match s.deliver_input(id, "\"hi\"").await {
                        Ok(run) => {
                            self.inputs.insert((id, run.fence));
                        }
                        Err(e) if expected(&e) => {}
                        Err(e) => bail!("deliver_input: {e}"),
                    }
                }
            }
        }
        Ok(())
    }

    /// Fences never decrease; terminal runs never change.
    async fn check_invariants(&mut self) -> Result<()> {
        for run in self.db.store.list_runs(None, None, None, 10_000).await? {
            if let Some(prev) = self.snapshot.get(&run.id) {
                ensure!(run.fence >= prev.fence, "fence of run {} went {} -> {}", run.id, prev.fence, run.fence);
                if prev.status.is_terminal() {
                    ensure!(&run == prev, "terminal run changed:\n{prev:?}\n{run:?}");
                }
            }
            self.snapshot.insert(run.id, run);
        }
        Ok(())
    }
}

both! {
    async fn random_interleavings_keep_fences_monotonic_and_writers_unique(db) {
        let seed = seed();
        let steps: usize = std::env::var("LEASEHOLD_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(400);
        eprintln!("{:?}: seed = {seed} (replay with LEASEHOLD_SEED={seed})", db.backend);
        const WORKERS: usize = 3;
        let mut sim = Sim {
            db,
            rng: StdRng::seed_from_u64(seed),
            leases: vec![Vec::new(); WORKERS],
            current: HashMap::new(),
            writers: HashMap::new(),
            runs: Vec::new(),
            snapshot: HashMap::new(),
            writes_ok: 0,
            writes_rejected: 0,
            expired_refused: 0,
            aborts: Default::default(),
            cancels: Default::default(),
            inputs: Default::default(),
            takeovers: 0,
        };
        for step in 0..steps {
            if let Err(e) = sim.step(WORKERS).await {
                bail!("seed {seed}, step {step}: {e:#}");
            }
            if let Err(e) = sim.check_invariants().await {
                bail!("seed {seed}, step {step}: {e:#}");
            }
        }
        for ((run, fence), writers) in &sim.writers {
            let first = &writers[0];
            ensure!(writers.iter().all(|w| w == first), "run {run} fence {fence}: several writers {writers:?}");
        }
        // Every event carries the fence of the write that made it: a
        // segment that held the run (its deltas, suspensions and closes),
        // the reaper's abort, a cancel or an input delivery.
        for id in &sim.runs {
            for e in db.store.run_events(*id).await? {
                let key = (e.run_id, e.fence);
                let from_holder = sim.writers.contains_key(&key);
                let ok = match e.kind.as_str() {
                    "submitted" => e.fence == 0,
                    "delta" | "suspended" => from_holder,
                    "message" => from_holder || sim.aborts.contains(&key),
                    "cancelled" => sim.cancels.contains(&key),
                    "input" => sim.inputs.contains(&key),
                    _ => false,
                };
                ensure!(ok, "seed {seed}: event {e:?} was not written by a write that held fence {}", e.fence);
            }
        }
        eprintln!(
            "{:?}: seed {seed}: {} runs, {} writes landed, {} stale writes rejected, {} takeovers",
            db.backend, sim.runs.len(), sim.writes_ok, sim.writes_rejected, sim.takeovers
        );
        ensure!(sim.writes_ok > 0 && sim.writes_rejected > 0, "the mix exercised both outcomes");
        ensure!(sim.takeovers > 0, "seed {seed}: no claim took over an expired lease");
        Ok(())
    }
}
