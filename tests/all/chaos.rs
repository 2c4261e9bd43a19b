//! The fault-injection suite (issue 5): three real `leasehold serve`
//! processes on one database run a mixed load while a seeded schedule of
//! faults hits them; then, once everything is quiet, the invariants are
//! counted, not sampled.
//!
//! Faults, each counted:
//! * **kill**: SIGKILL of a host at a random moment (mid-effect included),
//!   then a restart under a new owner id. Each kill is classified by where
//!   the killed host's runs stood in the ledger (`kill_points`).
//! * **zombie**: SIGSTOP a host holding runs until every one of them has
//!   been taken over with a later fence, then SIGCONT. Its writes must be
//!   refused by the fence (`leasehold_fenced_writes_rejected_total`).
//! * **database**: PostgreSQL: `pg_terminate_backend` of every host
//!   connection, and restarts of the server (fast and immediate) mid-load,
//!   on a cluster the suite owns. SQLite: an outside process holds the
//!   write lock for up to 2 s (kills may also land mid-transaction; that
//!   is not detected separately).
//! * **partition** (PostgreSQL): each host runs in a network namespace of
//!   its own (`netns.rs`), reaching the database and the sink through a
//!   veth pair; a host's link is cut while it holds runs, until every one
//!   is taken over elsewhere, then restored. Its writes, held up in TCP,
//!   arrive late and must all be refused (no stale write); its runs come
//!   back within the takeover bound. Without namespaces (not root, or a
//!   kernel that refuses them) the PostgreSQL run fails, naming why.
//! * **clock skew**: host 1 runs an hour ahead and host 2 an hour behind
//!   (`--test-clock-skew-ms`); leases use the database clock, so no lease
//!   is taken before it expires (`steals`), every lease expiry written is
//!   within a TTL of the database's now (`skewed_leases`), and a dead
//!   host's runs come back within the lease TTL plus the reaper interval.
//! * **duplicate delivery**: some runs are submitted three times at once,
//!   to three hosts, with one idempotency key; `wait` runs get their input
//!   twice at once.
//! * **hostile guests**: loops, memory bombs, emit bombs, traps and huge
//!   outputs mixed into the load.
//! * **priorities**: a quarter of the load at priority 7 or -7 and one run
//!   in sixteen at 1000, so claims read several priorities throughout.
//! * **limits**: one run in eight carries one of two concurrency keys with
//!   a limit, sampled throughout; and the load opens with a burst of runs
//!   whose calls go to a second sink under a rate limit (`http:IP:PORT`),
//!   several times more than it allows, so calls wait in place and runs
//!   suspend while hosts die.
//!
//! At the end: every acknowledged run is terminal; each chaos run's local
//! counter equals its steps; each keyed POST reached the sink under one
//! key; no unkeyed POST reached it twice; no key ever ran more runs at once
//! than its limit; no second of the rated sink's arrivals held more
//! charged calls than the rate allows; audit triggers installed in the
//! test database saw no ledger row or thread event written under a fence
//! other than the run's current one; no host crashed.
//!
//! Settings (environment): `LEASEHOLD_CHAOS_SEED` (default: random; printed,
//! and the same seed replays the same schedule and load),
//! `LEASEHOLD_CHAOS_RUNS` (200), `LEASEHOLD_CHAOS_KILLS` (10),
//! `LEASEHOLD_CHAOS_ZOMBIES` (kills / 5, at least 2),
//! `LEASEHOLD_CHAOS_DB_FAULTS` (kills / 5, at least 3),
//! `LEASEHOLD_CHAOS_PARTITIONS` (kills / 5, at least 2; 0 leaves the fault
//! out), `LEASEHOLD_CHAOS_PREFETCH` (each host's `--prefetch`; default `serve`'s,
//! and in the long mode a mix: the default, none, 256). The long mode is
//! `LEASEHOLD_CHAOS_RUNS=10000 LEASEHOLD_CHAOS_KILLS=200`. Each run ends with
//! one JSON line on stderr, also written to `target/chaos/`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use leasehold::{Backend, Store};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc};
use crate::lockwatch::LockWatch;
use crate::netns::Net;
use crate::sink::Sink;

const HOSTS: usize = 3;
const TTL_MS: u64 = 3000;
const REAPER_MS: u64 = 500;
const POLL_MS: u64 = 200;
/// Host 0 keeps the true time; host 1 is an hour ahead, host 2 an hour behind.
const SKEWS_MS: [i64; HOSTS] = [0, 3_600_000, -3_600_000];
/// Acknowledged runs not yet finished, at most: fewer than the workers left
/// when one host is down, so a dead host's runs find a free worker as soon
/// as their leases run out (recovery measures the protocol, not a queue).
const IN_FLIGHT: i64 = 16;
const WORKERS: usize = 8;
const TERMINAL: &str = "('completed','failed','aborted','cancelled')";
const HOSTILE: [&str; 5] = ["loop", "oom", "emit-bomb", "trap", "big-output"];

fn env_num(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[derive(Debug, Clone)]
struct Settings {
    seed: u64,
    runs: usize,
    kills: usize,
    zombies: usize,
    db_faults: usize,
    /// PostgreSQL only: a host's link to the database cut while it holds
    /// runs, then restored.
    partitions: usize,
}

impl Settings {
    fn from_env() -> Settings {
        let seed = env_num("LEASEHOLD_CHAOS_SEED").unwrap_or_else(rand::random);
        let runs = env_num("LEASEHOLD_CHAOS_RUNS").unwrap_or(200) as usize;
        let kills = env_num("LEASEHOLD_CHAOS_KILLS").unwrap_or(10) as usize;
        let zombies = env_num("LEASEHOLD_CHAOS_ZOMBIES").map_or((kills / 5).max(2), |v| v as usize);
        let db_faults = env_num("LEASEHOLD_CHAOS_DB_FAULTS").map_or((kills / 5).max(3), |v| v as usize);
        let partitions = env_num("LEASEHOLD_CHAOS_PARTITIONS").map_or((kills / 5).max(2), |v| v as usize);
        Settings { seed, runs, kills, zombies, db_faults, partitions }
    }
}

// ---------------------------------------------------------------- schedule

#[derive(Debug, Clone, Copy, PartialEq)]
enum DbFault {
    TerminateBackends,
    RestartFast,
    RestartImmediate,
    HoldWriteLock { ms: u64 },
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL `host`; restart it `restart_after_ms` later.
    Kill { host: usize, restart_after_ms: u64 },
    Zombie { host: usize },
    Db(DbFault),
    /// Cut `host`'s network link (database, sink and API) while it holds
    /// runs, until they are all taken over; then restore it.
    Partition { host: usize },
}

#[derive(Debug, Clone)]
enum Kind {
    /// testkit `chaos` with `steps` steps; the sink answers each POST
    /// `delay_ms` late (long enough, for some runs, that leases are renewed
    /// mid-effect).
    /// Part of them with `max_attempts` 1 to 3 (the rest 100): attempts
    /// must count failed segments only.
    Chaos { steps: u64, spin: u64, delay_ms: u64, max_attempts: i64 },
    /// Submitted three times at once with one idempotency key.
    Duplicate { steps: u64 },
    /// Cancelled `after_ms` after it is acknowledged.
    Cancel { steps: u64, after_ms: u64 },
    /// Paused `after_ms` after it is acknowledged and resumed `for_ms`
    /// later, through any host: it must still end completed, each effect
    /// once.
    Paused { steps: u64, after_ms: u64, for_ms: u64 },
    /// testkit `chaos` whose POSTs go to the rated sink, answered at once.
    Rated { steps: u64 },
    /// testkit `wait`; its input is delivered twice at once. Its waiting
    /// for input must never use up its `max_attempts` (1 to 3).
    Wait { max_attempts: i64 },
    /// `fanout` spawning two testkit `chaos` children of `steps` steps
    /// (tags `<tag>c0`, `<tag>c1`) and waiting for both: hosts die around
    /// its spawns and its wait, and it must end with exactly two children,
    /// each checked as a `Chaos` run.
    Parent { steps: u64 },
    Hostile(&'static str),
}

impl Kind {
    fn max_attempts(&self) -> i64 {
        match self {
            Kind::Chaos { max_attempts, .. } | Kind::Wait { max_attempts } => *max_attempts,
            Kind::Hostile(_) => 2,
            Kind::Duplicate { .. } | Kind::Cancel { .. } | Kind::Paused { .. } | Kind::Rated { .. } | Kind::Parent { .. } => 100,
        }
    }
}

/// Run `i`'s priority, from the seed alone: most runs 0, one in eight 7,
/// one in eight -7, one in sixteen 1000 (so claims read several priorities,
/// and some runs wait behind others, while hosts die).
fn priority_of(seed: u64, i: usize) -> i64 {
    match (seed ^ i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60 {
        0 | 1 => 7,
        2 | 3 => -7,
        4 => 1000,
        _ => 0,
    }
}

/// The concurrency keys part of the load carries, and their limits: the
/// sampler checks, on the database's clock, that no key ever has more
/// runs holding a slot (running, lease live) than its limit.
const KEY_LIMITS: [(&str, i64); 2] = [("tenant-a", 2), ("tenant-b", 3)];

/// Run `i`'s concurrency key, from the seed alone: one in sixteen each key
/// of [`KEY_LIMITS`], the rest none.
fn key_of(seed: u64, i: usize) -> Option<&'static str> {
    match (seed ^ i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 60 {
        0 => Some(KEY_LIMITS[0].0),
        1 => Some(KEY_LIMITS[1].0),
        _ => None,
    }
}

/// The rated sink's limit, calls a minute across every host.
const RATE_PER_MINUTE: i64 = 600;
/// The runs that open the load and post to the rated sink, 3 steps (six
/// calls) each: at once they ask for several times the rate.
const RATED_RUNS: usize = 10;

/// The error each hostile mode must fail its run with.
fn hostile_error(mode: &str) -> &'static str {
    match mode {
        "loop" => "timeout",
        "oom" => "out-of-memory",
        "trap" => "trap",
        _ => "output-too-large", // emit-bomb, big-output
    }
}

/// The schedule and the load: both come from the seed alone.
fn plan(s: &Settings, backend: Backend) -> (Vec<(u64, Fault)>, Vec<Kind>) {
    let mut rng = StdRng::seed_from_u64(s.seed);
    let mut faults = Vec::new();
    for _ in 0..s.kills {
        faults.push(Fault::Kill { host: rng.random_range(0..HOSTS), restart_after_ms: rng.random_range(0..800) });
    }
    for _ in 0..s.zombies {
        faults.push(Fault::Zombie { host: rng.random_range(0..HOSTS) });
    }
    for _ in 0..s.db_faults {
        faults.push(Fault::Db(match backend {
            Backend::Postgres => match rng.random_range(0..3) {
                0 => DbFault::TerminateBackends,
                1 => DbFault::RestartFast,
                _ => DbFault::RestartImmediate,
            },
            Backend::Sqlite => DbFault::HoldWriteLock { ms: rng.random_range(300..2000) },
        }));
    }
    // SQLite hosts share a file, not a network.
    if backend == Backend::Postgres {
        for _ in 0..s.partitions {
            faults.push(Fault::Partition { host: rng.random_range(0..HOSTS) });
        }
    }
    faults.shuffle(&mut rng);
    let schedule = faults.into_iter().map(|f| (rng.random_range(100..700), f)).collect();
    let load = (0..s.runs)
        .map(|_| {
            let steps = rng.random_range(1..=3);
            let few = rng.random_range(1..=3);
            let max_attempts = if rng.random_bool(0.3) { few } else { 100 };
            match rng.random_range(0..100) {
                0..3 => Kind::Hostile(HOSTILE[rng.random_range(0..HOSTILE.len())]),
                3..7 => Kind::Wait { max_attempts: few },
                7..12 => Kind::Duplicate { steps },
                12..15 => Kind::Cancel { steps, after_ms: rng.random_range(0..150) },
                15..20 => Kind::Chaos { steps, spin: 0, delay_ms: rng.random_range(1000..1800), max_attempts },
                20..25 => Kind::Parent { steps },
                25..29 => Kind::Paused { steps, after_ms: rng.random_range(0..300), for_ms: rng.random_range(100..1500) },
                // About a second a run: enough in flight that faults land
                // on busy hosts, mid-effect.
                _ => Kind::Chaos { steps, spin: rng.random_range(0..3_000_000), delay_ms: rng.random_range(50..400), max_attempts },
            }
        })
        .enumerate()
        .map(|(i, kind)| if i < RATED_RUNS.min(s.runs / 4) { Kind::Rated { steps: 3 } } else { kind })
        .collect();
    (schedule, load)
}

/// The most calls that reached a sink in any one second that does not meet
/// one of `spans`, and how many more that is than `per_minute` allows in a
/// second (one more on its boundary). Every arrival counts: a keyed
/// re-issue is a request the provider counts, and is charged like one.
pub(crate) fn rate_excess(hits: &[crate::sink::Hit], per_minute: i64, spans: &[(Instant, Instant)]) -> (usize, i64) {
    let mut at: Vec<Instant> = hits.iter().map(|h| h.at).collect();
    at.sort_unstable();
    let (mut most, mut end) = (0, 0);
    for start in 0..at.len() {
        while end < at.len() && at[end] - at[start] < Duration::from_secs(1) {
            end += 1;
        }
        let second = (at[start], at[start] + Duration::from_secs(1));
        if !spans.iter().any(|(from, to)| second.0 < *to && *from < second.1) {
            most = most.max(end - start);
        }
    }
    (most, most as i64 - (per_minute / 60 + 1))
}

// ---------------------------------------------------------------- database

/// A PostgreSQL cluster of the suite's own, so it can be restarted.
struct PgCluster {
    dir: tempfile::TempDir,
    pg_ctl: PathBuf,
    runas: Vec<String>,
    url: String,
}

fn pg_bin(name: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|d| d.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop()
}

/// `program`, run as the `postgres` user when we are root (`runas`).
fn as_postgres(runas: &[String], program: &Path) -> Command {
    match runas.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(program);
            c
        }
        None => Command::new(program),
    }
}

impl PgCluster {
    /// A cluster listening on 127.0.0.1 and, with `also`, on that address
    /// (the chaos hosts' namespaces reach it there).
    fn start(also: Option<std::net::Ipv4Addr>) -> Result<PgCluster> {
        let (Some(initdb), Some(pg_ctl)) = (pg_bin("initdb"), pg_bin("pg_ctl")) else {
            bail!("the PostgreSQL chaos run restarts its own cluster: install the server (apt-get install postgresql)");
        };
        let dir = tempfile::Builder::new().prefix("leasehold-chaos-pg").tempdir()?;
        let mut runas = Vec::new();
        // initdb refuses to run as root.
        if Command::new("id").arg("-u").output()?.stdout.starts_with(b"0") {
            if !Command::new("id").arg("postgres").output()?.status.success() {
                Command::new("useradd").args(["--system", "--no-create-home", "postgres"]).status()?;
            }
            Command::new("chown").arg("postgres").arg(dir.path()).status()?;
            runas = vec!["runuser".into(), "-u".into(), "postgres".into(), "--".into()];
        }
        let port = crate::serve_proc::free_port()?;
        let data = dir.path().join("data");
        let out = as_postgres(&runas, &initdb).arg("-D").arg(&data).args(["-U", "postgres", "--auth=trust"]).output()?;
        ensure!(out.status.success(), "initdb: {}", String::from_utf8_lossy(&out.stderr));
        let mut listen = "127.0.0.1".to_string();
        if let Some(ip) = also {
            listen = format!("{listen},{ip}");
            // initdb trusts loopback only; the namespaces' addresses too.
            use std::io::Write;
            std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("pg_hba.conf"))?
                .write_all(b"host all all 10.0.0.0/8 trust\n")?;
        }
        let opts = format!(
            "-p {port} -k {} -c listen_addresses={listen} -c fsync=off -c max_connections=300",
            dir.path().display()
        );
        let log = dir.path().join("server.log");
        let host = also.unwrap_or(std::net::Ipv4Addr::LOCALHOST);
        let cluster = PgCluster { url: format!("postgres://postgres@{host}:{port}/postgres"), dir, pg_ctl, runas };
        cluster.pg_ctl(&["-l", log.to_str().context("log path")?, "-w", "-o", &opts, "start"])?;
        Ok(cluster)
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<()> {
        let data = self.dir.path().join("data");
        let out = as_postgres(&self.runas, &self.pg_ctl).arg("-D").arg(&data).args(args).output()?;
        ensure!(out.status.success(), "pg_ctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    fn restart(&self, mode: &str) -> Result<()> {
        // -l: the new postmaster must not inherit our pipes, or reading
        // pg_ctl's output never ends.
        let log = self.dir.path().join("server.log");
        self.pg_ctl(&["-w", "-m", mode, "-l", log.to_str().context("log path")?, "restart"])
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "stop"]);
    }
}

/// Test-only audit triggers, on the database's clock:
/// * a ledger row or thread event written under a fence other than the
///   run's current one is a stale write (`chaos_stale`);
/// * every takeover is recorded with how long its old lease had left
///   (`chaos_takeovers`): a steal is a takeover of a lease not yet expired;
/// * a lease expiry written outside `[now - 1 s, now + TTL + 1 s]`
///   (`chaos_leases`) was computed from some other clock: a skewed host's.
pub(crate) const AUDIT_SQLITE: &str = "
CREATE TABLE chaos_stale (tbl TEXT, run_id INTEGER, row_fence INTEGER, run_fence INTEGER, seq INTEGER);
CREATE TABLE chaos_takeovers (run_id INTEGER, old_owner TEXT, old_fence INTEGER, new_owner TEXT, expires_in_ms INTEGER, taken_at INTEGER);
CREATE TABLE chaos_leases (run_id INTEGER, owner TEXT, expires_in_ms INTEGER);
CREATE TABLE chaos_bounds (max_lease_ms INTEGER);
CREATE TRIGGER chaos_effects_insert AFTER INSERT ON effects
  WHEN NEW.fence_started <> (SELECT fence FROM runs WHERE id = NEW.run_id)
  BEGIN INSERT INTO chaos_stale VALUES ('effects', NEW.run_id, NEW.fence_started, (SELECT fence FROM runs WHERE id = NEW.run_id), NEW.seq); END;
CREATE TRIGGER chaos_effects_start AFTER UPDATE OF fence_started ON effects
  WHEN NEW.fence_started IS NOT OLD.fence_started AND NEW.fence_started <> (SELECT fence FROM runs WHERE id = NEW.run_id)
  BEGIN INSERT INTO chaos_stale VALUES ('effects', NEW.run_id, NEW.fence_started, (SELECT fence FROM runs WHERE id = NEW.run_id), NEW.seq); END;
CREATE TRIGGER chaos_effects_complete AFTER UPDATE OF fence_completed ON effects
  WHEN NEW.fence_completed IS NOT OLD.fence_completed AND NEW.fence_completed <> (SELECT fence FROM runs WHERE id = NEW.run_id)
  BEGIN INSERT INTO chaos_stale VALUES ('effects', NEW.run_id, NEW.fence_completed, (SELECT fence FROM runs WHERE id = NEW.run_id), NEW.seq); END;
CREATE TRIGGER chaos_events AFTER INSERT ON events
  WHEN NEW.fence <> (SELECT fence FROM runs WHERE id = NEW.run_id)
  BEGIN INSERT INTO chaos_stale VALUES ('events', NEW.run_id, NEW.fence, (SELECT fence FROM runs WHERE id = NEW.run_id), NEW.seq); END;
CREATE TRIGGER chaos_takeover AFTER UPDATE ON runs
  WHEN OLD.status = 'running' AND NEW.status = 'running' AND NEW.fence > OLD.fence
  BEGIN INSERT INTO chaos_takeovers VALUES (OLD.id, OLD.lease_owner, OLD.fence, NEW.lease_owner,
        OLD.lease_expires_at - CAST(unixepoch('subsec') * 1000 AS INTEGER), CAST(unixepoch('subsec') * 1000 AS INTEGER)); END;
CREATE TRIGGER chaos_lease AFTER UPDATE OF lease_expires_at ON runs
  WHEN NEW.lease_expires_at IS NOT NULL AND NEW.lease_expires_at IS NOT OLD.lease_expires_at
   AND (NEW.lease_expires_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000
        OR NEW.lease_expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT max_lease_ms FROM chaos_bounds))
  BEGIN INSERT INTO chaos_leases VALUES (NEW.id, NEW.lease_owner,
        NEW.lease_expires_at - CAST(unixepoch('subsec') * 1000 AS INTEGER)); END;
";

pub(crate) const AUDIT_POSTGRES: &str = "
CREATE TABLE chaos_stale (tbl TEXT, run_id BIGINT, row_fence BIGINT, run_fence BIGINT, seq BIGINT);
CREATE TABLE chaos_takeovers (run_id BIGINT, old_owner TEXT, old_fence BIGINT, new_owner TEXT, expires_in_ms BIGINT, taken_at BIGINT);
CREATE TABLE chaos_leases (run_id BIGINT, owner TEXT, expires_in_ms BIGINT);
CREATE TABLE chaos_bounds (max_lease_ms BIGINT);
CREATE FUNCTION chaos_effect() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE f BIGINT;
BEGIN
  SELECT fence INTO f FROM runs WHERE id = NEW.run_id;
  IF TG_OP = 'INSERT' OR NEW.fence_started IS DISTINCT FROM OLD.fence_started THEN
    IF NEW.fence_started <> f THEN INSERT INTO chaos_stale VALUES ('effects', NEW.run_id, NEW.fence_started, f, NEW.seq); END IF;
  END IF;
  IF TG_OP = 'UPDATE' AND NEW.fence_completed IS DISTINCT FROM OLD.fence_completed AND NEW.fence_completed <> f THEN
    INSERT INTO chaos_stale VALUES ('effects', NEW.run_id, NEW.fence_completed, f, NEW.seq);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER chaos_effects AFTER INSERT OR UPDATE ON effects FOR EACH ROW EXECUTE FUNCTION chaos_effect();
CREATE FUNCTION chaos_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE f BIGINT;
BEGIN
  SELECT fence INTO f FROM runs WHERE id = NEW.run_id;
  IF NEW.fence <> f THEN INSERT INTO chaos_stale VALUES ('events', NEW.run_id, NEW.fence, f, NEW.seq); END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER chaos_events AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION chaos_event();
CREATE FUNCTION chaos_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
-- A lease runs from when it is given (the claim and renewals read
-- clock_timestamp()), not from when its transaction began: a claim that
-- waited seconds on a lock gives a lease that long past now() + TTL.
DECLARE now_ms BIGINT := (extract(epoch from now()) * 1000)::bigint;
  clock_ms BIGINT := (extract(epoch from clock_timestamp()) * 1000)::bigint;
BEGIN
  IF OLD.status = 'running' AND NEW.status = 'running' AND NEW.fence > OLD.fence THEN
    INSERT INTO chaos_takeovers VALUES (OLD.id, OLD.lease_owner, OLD.fence, NEW.lease_owner, OLD.lease_expires_at - now_ms, now_ms);
  END IF;
  IF NEW.lease_expires_at IS NOT NULL AND NEW.lease_expires_at IS DISTINCT FROM OLD.lease_expires_at
     AND (NEW.lease_expires_at < now_ms - 1000
          OR NEW.lease_expires_at > clock_ms + (SELECT max_lease_ms FROM chaos_bounds)) THEN
    INSERT INTO chaos_leases VALUES (NEW.id, NEW.lease_owner, NEW.lease_expires_at - clock_ms);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER chaos_runs AFTER UPDATE ON runs FOR EACH ROW EXECUTE FUNCTION chaos_takeover();
";

/// Runs `f` until it succeeds: the harness's own reads must ride out the
/// database faults it injects.
async fn patiently<T, F: AsyncFn() -> Result<T, sqlx::Error>>(f: F) -> Result<T> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

// ---------------------------------------------------------------- hosts

struct Slot {
    proc: Option<ServeProc>,
    port: u16,
    generation: u32,
    /// SIGSTOPped now.
    stopped: bool,
    /// Its link cut now.
    partitioned: bool,
}

struct Cluster<'a> {
    slots: Vec<Mutex<Slot>>,
    db_url: &'a str,
    dir: &'a Path,
    http: reqwest::Client,
    /// Owners (incarnations) that were killed or stopped: only their leases
    /// may be taken over.
    faulted: Mutex<HashSet<String>>,
    host_crashes: AtomicU64,
    /// The sinks' allow-list entries.
    http_allow: Vec<String>,
    /// 5xx answers other than 503 from live hosts.
    server_errors: Mutex<Vec<String>>,
    /// The hosts' network namespaces (PostgreSQL with partitions).
    net: Option<&'a Net>,
    /// Every host process started, by pid: its owner name.
    pids: Mutex<HashMap<u32, String>>,
    /// SQLite: who held the write lock for long (see [`LockWatch`]).
    lock_watch: Option<LockWatch>,
}

/// The long mode's local queues by host: serve's default, none, deep.
const MIXED_PREFETCH: [Option<u32>; HOSTS] = [None, Some(0), Some(256)];

fn owner(host: usize, generation: u32) -> String {
    format!("h{host}.{generation}")
}

impl<'a> Cluster<'a> {
    fn args(&self, host: usize, slot: &Slot) -> Result<ServeArgs<'a>> {
        let mut a = ServeArgs::new(self.db_url, self.dir, owner(host, slot.generation))?;
        a.log = self.dir.join(format!("host-{host}.log"));
        a.port = slot.port;
        if let Some(net) = self.net {
            a.listen_ip = net.host(host).to_string();
            a.wrap = net.exec_prefix(host);
        }
        a.lease_ttl_ms = TTL_MS;
        a.reaper_interval_ms = REAPER_MS;
        a.poll_ms = POLL_MS;
        a.workers = WORKERS;
        a.http_allow = self.http_allow.clone();
        a.extra = vec![
            format!("--test-clock-skew-ms={}", SKEWS_MS[host]),
            "--segment-budget-ms=2000".into(),
            "--shutdown-grace-ms=1000".into(),
            "--spawn-allow=fanout=testkit".into(),
        ];
        // Each host's local queue: serve's default on every host; in the
        // long mode (1,000 runs or more) a mix: the default, none, and a
        // deep one. LEASEHOLD_CHAOS_PREFETCH sets every host's.
        let long = env_num("LEASEHOLD_CHAOS_RUNS").unwrap_or(200) >= 1_000;
        match env_num("LEASEHOLD_CHAOS_PREFETCH") {
            Some(n) => a.extra.push(format!("--prefetch={n}")),
            None if long => a.extra.extend(MIXED_PREFETCH[host].map(|n| format!("--prefetch={n}"))),
            None => {}
        }
        Ok(a)
    }

    async fn start(db_url: &'a str, dir: &'a Path, http_allow: Vec<String>, net: Option<&'a Net>) -> Result<Cluster<'a>> {
        let http = crate::serve_proc::client(
            reqwest::Client::builder().timeout(Duration::from_secs(10)).connect_timeout(Duration::from_secs(1)),
        )?;
        let mut slots = Vec::new();
        for _ in 0..HOSTS {
            slots.push(Mutex::new(Slot {
                proc: None,
                port: crate::serve_proc::free_port()?,
                generation: 0,
                stopped: false,
                partitioned: false,
            }));
        }
        let c = Cluster {
            slots,
            db_url,
            dir,
            http,
            faulted: Mutex::new(HashSet::new()),
            host_crashes: AtomicU64::new(0),
            http_allow,
            server_errors: Mutex::new(Vec::new()),
            net,
            pids: Mutex::new(HashMap::new()),
            lock_watch: None,
        };
        for h in 0..HOSTS {
            c.spawn(h)?;
        }
        for h in 0..HOSTS {
            c.wait_healthy(h).await?;
        }
        let mut c = c;
        if let Some(file) = db_url.strip_prefix("sqlite://") {
            c.lock_watch = Some(LockWatch::start(Path::new(file), Duration::from_millis(1_000))?);
        }
        Ok(c)
    }

    fn spawn(&self, host: usize) -> Result<()> {
        let mut slot = self.slots[host].lock().unwrap();
        slot.generation += 1;
        let p = ServeProc::spawn(&self.args(host, &slot)?)?;
        self.pids.lock().unwrap().insert(p.pid(), owner(host, slot.generation));
        slot.proc = Some(p);
        slot.stopped = false;
        slot.partitioned = false;
        Ok(())
    }

    async fn wait_healthy(&self, host: usize) -> Result<()> {
        crate::serve_proc::wait_healthy(&self.http, &self.base(host), Duration::from_secs(60)).await
    }

    fn base(&self, host: usize) -> String {
        let ip = self.net.map_or(std::net::Ipv4Addr::LOCALHOST, |n| n.host(host));
        format!("http://{ip}:{}", self.slots[host].lock().unwrap().port)
    }

    fn owner_of(&self, host: usize) -> String {
        owner(host, self.slots[host].lock().unwrap().generation)
    }

    fn pid(&self, host: usize) -> Option<u32> {
        self.slots[host].lock().unwrap().proc.as_ref().map(|p| p.pid())
    }

    /// Hosts that answer: running, not stopped, not cut off.
    fn live(&self) -> Vec<usize> {
        (0..HOSTS)
            .filter(|&h| {
                let s = self.slots[h].lock().unwrap();
                s.proc.is_some() && !s.stopped && !s.partitioned
            })
            .collect()
    }

    fn kill(&self, host: usize) {
        let mut slot = self.slots[host].lock().unwrap();
        self.faulted.lock().unwrap().insert(owner(host, slot.generation));
        slot.proc = None; // Drop: SIGKILL and reap
    }

    /// A host that exited without being killed is a crash: counted, then
    /// restarted so the load goes on.
    fn reap_crashes(&self) -> Result<()> {
        for h in 0..HOSTS {
            let exited = {
                let mut s = self.slots[h].lock().unwrap();
                match s.proc.as_mut() {
                    Some(p) => p.child.try_wait()?.is_some(),
                    None => false,
                }
            };
            if exited {
                self.host_crashes.fetch_add(1, Relaxed);
                eprintln!("chaos: host {h} exited on its own; see {}", self.dir.join(format!("host-{h}.log")).display());
                self.spawn(h)?;
            }
        }
        Ok(())
    }
}

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

// ---------------------------------------------------------------- API calls

/// Sends a request built by `req` to a live host, moving on to another on a
/// transport error (a host is dead or stopped) or a 503 (its database is
/// down, or it is at a cap), until an answer below 500 arrives. Any other
/// 5xx from a live host is an API bug: it fails the run at once.
async fn call(
    c: &Cluster<'_>,
    rng_seed: u64,
    req: impl Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder,
) -> Result<(u16, Value)> {
    let mut rng = StdRng::seed_from_u64(rng_seed);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let live = c.live();
        if let Some(&h) = live.get(rng.random_range(0..live.len().max(1)))
            && let Ok(r) = req(&c.http, &c.base(h)).send().await
        {
            let status = r.status().as_u16();
            if status < 500 {
                let body = r.json::<Value>().await.unwrap_or(Value::Null);
                return Ok((status, body));
            }
            if status != 503 && c.live().contains(&h) {
                let body = r.text().await.unwrap_or_default();
                c.server_errors.lock().unwrap().push(format!("host {h} answered {status}: {body}"));
                bail!("live host {h} answered {status}: {body}");
            }
        }
        ensure!(Instant::now() < deadline, "no host answered for 300 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------- the run

#[derive(Default)]
struct Counters {
    kills: AtomicU64,
    zombies: AtomicU64,
    zombie_writes_rejected: AtomicU64,
    partitions: AtomicU64,
    partition_writes_rejected: AtomicU64,
    db_faults: AtomicU64,
    duplicate_submits: AtomicU64,
    duplicate_inputs: AtomicU64,
    kill_points: Mutex<BTreeMap<&'static str, u64>>,
    recoveries_ms: Mutex<Vec<u64>>,
    /// Database faults, on the database clock, from their start to when
    /// hosts may still be backing off after them: takeovers of leases that
    /// ran out then are not held to the takeover bound.
    db_fault_windows: Mutex<Vec<(i64, i64)>>,
    /// Zombie, partition and database faults, from their start to 6 s
    /// after their end: the rated sink's arrivals then are not held to the
    /// rate.
    rate_fault_spans: Mutex<Vec<(Instant, Instant)>>,
    /// Faults that never bit (a kill that found its host idle every time,
    /// a zombie that held nothing, whose runs were not taken over, or
    /// whose writes were not refused).
    unbitten: Mutex<Vec<String>>,
    /// Runs the submitter may send beyond its pace: a fault that wants its
    /// target busy raises it.
    extra_load: AtomicU64,
    /// Samples of the keys' slots, and those over a limit.
    key_samples: AtomicU64,
    key_most: Mutex<BTreeMap<String, i64>>,
    key_over_limit: Mutex<Vec<String>>,
    pending_recoveries: AtomicI64,
    faults_done: AtomicU64,
    /// Runs paused while a segment ran them (the pause answered `running`).
    paused_running: AtomicU64,
}

#[derive(Clone)]
struct Acked {
    id: i64,
    kind: Kind,
    tag: String,
}

mod faults_lose_no_run_and_repeat_no_effect {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite() -> Result<()> {
        chaos(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres() -> Result<()> {
        chaos(Backend::Postgres).await
    }
}

async fn chaos(backend: Backend) -> Result<()> {
    let settings = Settings::from_env();
    eprintln!("chaos {}: seed {} ({settings:?})", backend.name(), settings.seed);
    let (schedule, load) = plan(&settings, backend);
    let dir = tempfile::Builder::new().prefix("leasehold-chaos").tempdir()?;
    std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
    std::fs::write(dir.path().join("fanout.wasm"), plugins::rust_plugin("fanout")?)?;
    // The partition fault's namespaces: made or the run fails, loudly
    // (LEASEHOLD_CHAOS_PARTITIONS=0 leaves the fault out).
    let net = match backend {
        Backend::Postgres if settings.partitions > 0 => {
            Some(Net::create(HOSTS).context("the chaos run's partition fault could not make its network namespaces")?)
        }
        _ => None,
    };
    let service = net.as_ref().map(Net::service);
    let pg = match backend {
        Backend::Postgres => Some(PgCluster::start(service)?),
        Backend::Sqlite => None,
    };
    let db_url = match &pg {
        Some(pg) => pg.url.clone(),
        None => format!("sqlite://{}", dir.path().join("chaos.db").display()),
    };
    let store = Store::connect(&db_url).await?;
    sqlx::raw_sql(match backend {
        Backend::Sqlite => AUDIT_SQLITE,
        Backend::Postgres => AUDIT_POSTGRES,
    })
    .execute(store.pool())
    .await
    .context("installing the audit triggers")?;
    sqlx::query("INSERT INTO chaos_bounds (max_lease_ms) VALUES ($1)")
        .bind(TTL_MS as i64 + 1000)
        .execute(store.pool())
        .await?;
    let ip = service.unwrap_or(std::net::Ipv4Addr::LOCALHOST);
    let sink = Sink::start_at(ip, Duration::ZERO, Duration::from_millis(30)).await?;
    let rated = Sink::start_at(ip, Duration::ZERO, Duration::ZERO).await?;
    store.set_rate(&format!("http:{}", rated.allow()), Some(RATE_PER_MINUTE), None).await?;
    leasehold::effects::http::install_tls();
    let cluster = Cluster::start(&db_url, dir.path(), vec![sink.allow(), rated.allow()], net.as_ref()).await?;
    let result = drive(&settings, backend, &schedule, load, &cluster, &store, pg.as_ref(), [&sink, &rated]).await;
    drop(cluster);
    store.shutdown().await;
    if result.is_err() {
        // Keep the host logs for a failed run, and print their warnings:
        // CI keeps only this output, not the directory.
        for h in 0..HOSTS {
            let text = std::fs::read_to_string(dir.path().join(format!("host-{h}.log"))).unwrap_or_default();
            let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).collect();
            for l in &warnings[warnings.len().saturating_sub(15)..] {
                eprintln!("chaos host-{h}.log: {l}");
            }
        }
        let kept = dir.keep();
        eprintln!("chaos {}: host logs kept in {}", backend.name(), kept.display());
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    settings: &Settings,
    backend: Backend,
    schedule: &[(u64, Fault)],
    load: Vec<Kind>,
    cluster: &Cluster<'_>,
    store: &Store,
    pg: Option<&PgCluster>,
    [sink, rated]: [&Sink; 2],
) -> Result<()> {
    let started = Instant::now();
    let counters = Arc::new(Counters::default());
    let terminal = AtomicI64::new(0);
    let submitting_done = AtomicBool::new(false);
    let acked: Mutex<Vec<Acked>> = Mutex::new(Vec::new());
    let total_faults = schedule.len() as u64;

    // Counts finished runs, for pacing.
    let watch_terminal = async {
        while !submitting_done.load(Relaxed) || counters.faults_done.load(Relaxed) < total_faults {
            if let Ok(n) = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM runs WHERE status IN {TERMINAL}"
            )))
            .fetch_one(store.pool())
            .await
            {
                terminal.store(n, Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok::<_, anyhow::Error>(())
    };

    for (key, limit) in KEY_LIMITS {
        store.set_limit(key, Some(limit), false).await?;
    }
    // Samples every key's slots (running runs with a live lease) on the
    // database's clock, for as long as the load runs.
    let key_sampler = async {
        let now = match backend {
            Backend::Postgres => "(extract(epoch from now()) * 1000)::bigint",
            Backend::Sqlite => "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        };
        let sql = format!(
            "SELECT concurrency_key, COUNT(*) FROM runs WHERE status = 'running' AND concurrency_key <> '' \
             AND lease_expires_at >= {now} GROUP BY concurrency_key"
        );
        while !submitting_done.load(Relaxed) || counters.faults_done.load(Relaxed) < total_faults {
            if let Ok(rows) = sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql.clone())).fetch_all(store.pool()).await {
                counters.key_samples.fetch_add(1, Relaxed);
                for (key, n) in rows {
                    let limit = KEY_LIMITS.iter().find(|(k, _)| *k == key).map_or(i64::MAX, |(_, l)| *l);
                    if n > limit {
                        counters.key_over_limit.lock().unwrap().push(format!("{key}: {n} at once, limit {limit}"));
                    }
                    let mut most = counters.key_most.lock().unwrap();
                    let m = most.entry(key).or_default();
                    *m = (*m).max(n);
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Ok::<_, anyhow::Error>(())
    };

    // Submits the load, paced so it spans the whole fault schedule.
    // Cancels and input deliveries run beside the submitter, as their runs
    // are acknowledged (a `wait` run counts as in flight until it gets its
    // input).
    let (side_tx, mut side_rx) = tokio::sync::mpsc::unbounded_channel::<(i64, Kind)>();
    let sides = async {
        type Side<'s> = std::pin::Pin<Box<dyn Future<Output = Result<()>> + 's>>;
        let mut running: futures::stream::FuturesUnordered<Side<'_>> = futures::stream::FuturesUnordered::new();
        let mut open = true;
        while open || !running.is_empty() {
            tokio::select! {
                next = side_rx.recv(), if open => match next {
                    Some((id, Kind::Cancel { after_ms, .. })) => running.push(Box::pin(async move {
                        tokio::time::sleep(Duration::from_millis(after_ms)).await;
                        let (status, body) =
                            call(cluster, id as u64, |http, base| http.post(format!("{base}/v1/runs/{id}/cancel")).json(&json!({}))).await?;
                        ensure!(status == 200 || status == 409, "cancel {id}: {status} {body}");
                        Ok::<_, anyhow::Error>(())
                    })),
                    Some((id, Kind::Paused { after_ms, for_ms, .. })) => {
                        let counters = &counters;
                        running.push(Box::pin(async move {
                            tokio::time::sleep(Duration::from_millis(after_ms)).await;
                            let (status, body) =
                                call(cluster, id as u64, |http, base| http.post(format!("{base}/v1/runs/{id}/pause")).json(&json!({}))).await?;
                            ensure!(status == 200 || status == 409, "pause {id}: {status} {body}");
                            if body["status"] == "running" {
                                counters.paused_running.fetch_add(1, Relaxed);
                            }
                            tokio::time::sleep(Duration::from_millis(for_ms)).await;
                            let (status, body) =
                                call(cluster, id as u64, |http, base| http.post(format!("{base}/v1/runs/{id}/resume")).json(&json!({}))).await?;
                            ensure!(status == 200, "resume {id}: {status} {body}");
                            Ok::<_, anyhow::Error>(())
                        }))
                    }
                    Some((id, Kind::Wait { .. })) => running.push(Box::pin(deliver_twice(cluster, &counters, id))),
                    Some(_) => {}
                    None => open = false,
                },
                Some(done) = futures::StreamExt::next(&mut running) => done?,
            }
        }
        Ok::<_, anyhow::Error>(())
    };

    let submit = async {
        // The planned load, then, while faults are still to come and want
        // busy hosts, filler runs: a fault must find work to land on.
        let planned = load.len();
        let mut filler = StdRng::seed_from_u64(settings.seed ^ 0xf111);
        let mut load = load.into_iter();
        for i in 0.. {
            let kind = match load.next() {
                Some(kind) => Some(kind),
                None => loop {
                    if counters.faults_done.load(Relaxed) >= total_faults {
                        break None;
                    }
                    let wanted = counters.extra_load.load(Relaxed) as usize;
                    if i < planned + wanted {
                        let (steps, spin, delay_ms) = (filler.random_range(1..=3), filler.random_range(0..3_000_000), filler.random_range(50..400));
                        break Some(Kind::Chaos { steps, spin, delay_ms, max_attempts: 100 });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                },
            };
            let Some(kind) = kind else { break };
            loop {
                let done = counters.faults_done.load(Relaxed) as f64;
                let allowed = ((done + 1.0) / (total_faults as f64 + 1.0) * settings.runs as f64).ceil() as usize
                    + counters.extra_load.load(Relaxed) as usize;
                let outstanding = acked.lock().unwrap().len() as i64 - terminal.load(Relaxed);
                if (i < allowed || counters.faults_done.load(Relaxed) >= total_faults) && outstanding < IN_FLIGHT {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let tag = format!("r{i}");
            let key = format!("chaos-{}-{i}", settings.seed);
            let input = match &kind {
                Kind::Chaos { steps, spin, delay_ms, .. } => {
                    json!({ "mode": "chaos", "steps": steps, "spin": spin, "delay_ms": delay_ms, "tag": tag, "url": sink.url })
                }
                Kind::Duplicate { steps } => json!({ "mode": "chaos", "steps": steps, "tag": tag, "url": sink.url }),
                Kind::Rated { steps } => json!({ "mode": "chaos", "steps": steps, "tag": tag, "url": rated.url }),
                // Slow enough that most cancels and pauses land mid-run.
                Kind::Cancel { steps, .. } | Kind::Paused { steps, .. } => {
                    json!({ "mode": "chaos", "steps": steps, "spin": 30_000_000, "tag": tag, "url": sink.url })
                }
                Kind::Wait { .. } => json!({ "mode": "wait" }),
                Kind::Hostile(mode) => json!({ "mode": mode }),
                Kind::Parent { steps } => {
                    let child = |k: u32| {
                        let tag = format!("{tag}c{k}");
                        json!({ "mode": "chaos", "steps": steps, "spin": 1_000_000, "delay_ms": 100, "tag": tag, "url": sink.url })
                    };
                    json!({ "inputs": [child(0), child(1)], "options": { "max_attempts": 100 } })
                }
            };
            let plugin = if let Kind::Parent { .. } = kind { "fanout" } else { "testkit" };
            let max_attempts = kind.max_attempts();
            let priority = priority_of(settings.seed, i);
            let body = json!({
                "plugin": plugin, "input": input, "idempotency_key": key, "max_attempts": max_attempts,
                "priority": priority, "concurrency_key": key_of(settings.seed, i),
            });
            let id = if let Kind::Duplicate { .. } = kind {
                // Three at once, one key: one run.
                let tries = (0..3).map(|k| {
                    let body = body.clone();
                    call(cluster, settings.seed ^ (i as u64) << 8 ^ k, move |http, base| {
                        http.post(format!("{base}/v1/runs")).json(&body)
                    })
                });
                let answers = futures::future::try_join_all(tries).await?;
                let ids: HashSet<i64> = answers.iter().filter_map(|(_, b)| b["id"].as_i64()).collect();
                if ids.len() != 1 {
                    counters.duplicate_submits.fetch_add(1, Relaxed);
                    eprintln!("chaos: one key, {} runs: {answers:?}", ids.len());
                }
                *ids.iter().next().context("no run id from a duplicate submit")?
            } else {
                let (status, run) =
                    call(cluster, settings.seed ^ i as u64, |http, base| http.post(format!("{base}/v1/runs")).json(&body)).await?;
                ensure!(status == 201 || status == 200, "submit {i}: {status} {run}");
                run["id"].as_i64().context("run id")?
            };
            acked.lock().unwrap().push(Acked { id, kind: kind.clone(), tag });
            if matches!(kind, Kind::Cancel { .. } | Kind::Paused { .. } | Kind::Wait { .. }) {
                side_tx.send((id, kind))?;
            }
        }
        submitting_done.store(true, Relaxed);
        drop(side_tx);
        Ok::<_, anyhow::Error>(())
    };

    let faults = async {
        for &(gap_ms, fault) in schedule {
            tokio::time::sleep(Duration::from_millis(gap_ms)).await;
            cluster.reap_crashes()?;
            let began = Instant::now();
            inject(fault, cluster, store, pg, backend, &counters).await?;
            if !matches!(fault, Fault::Kill { .. }) {
                // A stopped, cut-off or starved host's admitted calls may
                // arrive together as it comes back; hosts back off up to
                // 5 s from a failing database.
                counters.rate_fault_spans.lock().unwrap().push((began, Instant::now() + Duration::from_secs(6)));
            }
            counters.faults_done.fetch_add(1, Relaxed);
        }
        // Let the last recoveries land.
        wait_recoveries(&counters).await;
        Ok::<_, anyhow::Error>(())
    };

    tokio::try_join!(watch_terminal, key_sampler, submit, sides, faults)?;
    let acked = acked.into_inner().unwrap();
    let faults_over = Instant::now();

    // Quiet: every acknowledged run must finish.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        cluster.reap_crashes()?;
        let open: i64 = patiently(async || {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM runs WHERE status NOT IN {TERMINAL}")))
                .fetch_one(store.pool())
                .await
        })
        .await?;
        if open == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elapsed = started.elapsed();
    let report = check(settings, backend, &acked, store, [sink, rated], cluster, &counters, elapsed).await?;
    eprintln!("chaos: quiet {:?} after the last fault", faults_over.elapsed());
    let line = serde_json::to_string(&report.json)?;
    eprintln!("{line}");
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/chaos");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join(format!("{}-{}.json", backend.name(), settings.seed)), format!("{line}\n"))?;
    ensure!(report.failures.is_empty(), "chaos {} seed {} failed:\n  {}\n{line}", backend.name(), settings.seed, report.failures.join("\n  "));
    Ok(())
}

/// Waits for a `wait` run to ask, then delivers its input twice at once:
/// exactly one delivery may be accepted.
async fn deliver_twice(cluster: &Cluster<'_>, counters: &Counters, id: i64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (_, run) = call(cluster, id as u64, |http, base| http.get(format!("{base}/v1/runs/{id}"))).await?;
        match run["status"].as_str() {
            Some("waiting_input") => break,
            Some("completed" | "failed" | "aborted" | "cancelled") => return Ok(()),
            _ => {}
        }
        ensure!(Instant::now() < deadline, "run {id} never asked for input");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = json!({ "input": "Ada" });
    let send = |k: u64| {
        let body = body.clone();
        call(cluster, id as u64 ^ k << 32, move |http, base| http.post(format!("{base}/v1/runs/{id}/input")).json(&body))
    };
    let (a, b) = tokio::try_join!(send(1), send(2))?;
    let accepted = [&a, &b].iter().filter(|(s, _)| *s == 200).count();
    if accepted > 1 {
        counters.duplicate_inputs.fetch_add(1, Relaxed);
    }
    ensure!(accepted == 1 || [&a, &b].iter().all(|(s, _)| *s == 409), "run {id}: deliveries answered {a:?} and {b:?}");
    if accepted == 0 {
        // Both refused: either the run was not waiting at either moment (it
        // was being resumed), or one delivery was taken and its answer lost
        // (`call` re-sends to another host when a host dies after its
        // commit, and that re-send is refused as already delivered). Try
        // again until one takes or the run shows it has its input; the
        // audit checks that it completed with it.
        loop {
            let (s, body) = send(3).await?;
            if s == 200 {
                break;
            }
            ensure!(s == 409, "run {id}: input answered {s} {body}");
            let (_, run) = call(cluster, id as u64, |http, base| http.get(format!("{base}/v1/runs/{id}"))).await?;
            if input_taken(&run) {
                break;
            }
            ensure!(Instant::now() < deadline, "run {id}: input never accepted; last answer 409 {body}, the run {run}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Whether a `wait` run's JSON shows it has its input: pending, or the run
/// ended (the audit then checks that it completed with it).
fn input_taken(run: &Value) -> bool {
    let ended = matches!(run["status"].as_str(), Some("completed" | "failed" | "aborted" | "cancelled"));
    ended || !run["pending_input"].is_null()
}

async fn wait_recoveries(counters: &Counters) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while counters.pending_recoveries.load(Relaxed) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Runs held by `owner` right now: (id, fence).
async fn held_by(store: &Store, owner: &str) -> Result<Vec<(i64, i64)>> {
    patiently(async || {
        sqlx::query_as("SELECT id, fence FROM runs WHERE lease_owner = $1 AND status = 'running'")
            .bind(owner)
            .fetch_all(store.pool())
            .await
    })
    .await
}

/// Waits (up to `patience`) until `owner` holds a run, letting the
/// submitter send more work meanwhile.
async fn until_busy(store: &Store, counters: &Counters, owner: &str, patience: Duration) -> Result<()> {
    let deadline = Instant::now() + patience;
    let mut asked = Instant::now() - Duration::from_secs(1);
    while held_by(store, owner).await?.is_empty() && Instant::now() < deadline {
        if asked.elapsed() > Duration::from_millis(500) {
            counters.extra_load.fetch_add(4, Relaxed);
            asked = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Where a killed host's run stood in the ledger.
async fn kill_point(store: &Store, run_id: i64) -> Result<&'static str> {
    let last: Option<(String, String)> = patiently(async || {
        sqlx::query_as("SELECT state, name FROM effects WHERE run_id = $1 ORDER BY seq DESC LIMIT 1")
            .bind(run_id)
            .fetch_optional(store.pool())
            .await
    })
    .await?;
    let input: String = patiently(async || {
        sqlx::query_scalar("SELECT input FROM runs WHERE id = $1").bind(run_id).fetch_one(store.pool()).await
    })
    .await?;
    let steps = serde_json::from_str::<Value>(&input)?["steps"].as_i64().unwrap_or(0);
    let rows: i64 = patiently(async || {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE run_id = $1").bind(run_id).fetch_one(store.pool()).await
    })
    .await?;
    Ok(match last {
        Some((state, _)) if state == "started" || state == "in_doubt" => "between_started_and_committed",
        // Four effects a step; all recorded: only the close is left.
        Some(_) if steps > 0 && rows >= steps * 4 => "after_committed_before_close",
        _ => "before_started",
    })
}

/// Measures, from `since`, how long until each of `held` is re-claimed
/// under a later fence (or finished, by a cancel).
async fn track_recovery(store: Store, counters: Arc<Counters>, held: Vec<(i64, i64)>, since: Instant) {
    let mut pending = held;
    while !pending.is_empty() {
        let mut still = Vec::new();
        for (id, fence) in pending {
            let now: Option<(i64, String)> = sqlx::query_as("SELECT fence, status FROM runs WHERE id = $1")
                .bind(id)
                .fetch_optional(store.pool())
                .await
                .ok()
                .flatten();
            match now {
                Some((f, status)) if f > fence || status != "running" => {
                    counters.recoveries_ms.lock().unwrap().push(since.elapsed().as_millis() as u64);
                    counters.pending_recoveries.fetch_sub(1, Relaxed);
                }
                _ => still.push((id, fence)),
            }
        }
        pending = still;
        if !pending.is_empty() && since.elapsed() > Duration::from_secs(120) {
            // Never recovered: recorded as such, so the bound check fails.
            counters.recoveries_ms.lock().unwrap().push(since.elapsed().as_millis() as u64);
            counters.pending_recoveries.fetch_sub(pending.len() as i64, Relaxed);
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn inject(
    fault: Fault,
    cluster: &Cluster<'_>,
    store: &Store,
    pg: Option<&PgCluster>,
    backend: Backend,
    counters: &Arc<Counters>,
) -> Result<()> {
    match fault {
        Fault::Kill { host, restart_after_ms } => {
            // One dead host at a time, so the others have the workers to
            // take its runs over at once.
            wait_recoveries(counters).await;
            // A kill must land on a host that holds runs: a kill of an idle
            // host proves nothing. Killed idle, it is restarted and tried
            // again.
            let mut tries = 0;
            let (owner, held, killed_at) = loop {
                let owner = cluster.owner_of(host);
                until_busy(store, counters, &owner, Duration::from_secs(5)).await?;
                cluster.kill(host);
                let killed_at = Instant::now();
                let held = held_by(store, &owner).await?;
                tries += 1;
                if !held.is_empty() || tries == 5 {
                    break (owner, held, killed_at);
                }
                eprintln!("chaos: killed {owner} while it held nothing; again");
                cluster.spawn(host)?;
                cluster.wait_healthy(host).await?;
            };
            if held.is_empty() {
                counters.unbitten.lock().unwrap().push(format!("5 kills of host {host} found it holding no run"));
            }
            counters.kills.fetch_add(1, Relaxed);
            eprintln!("chaos: killed {owner} holding {} runs", held.len());
            for (id, _) in &held {
                let point = kill_point(store, *id).await?;
                *counters.kill_points.lock().unwrap().entry(point).or_default() += 1;
            }
            counters.pending_recoveries.fetch_add(held.len() as i64, Relaxed);
            tokio::spawn(track_recovery(store.clone(), counters.clone(), held, killed_at));
            tokio::time::sleep(Duration::from_millis(restart_after_ms)).await;
            cluster.spawn(host)?;
            cluster.wait_healthy(host).await?;
        }
        Fault::Zombie { host } => {
            wait_recoveries(counters).await;
            let owner = cluster.owner_of(host);
            let Some(pid) = cluster.pid(host) else { return Ok(()) };
            cluster.faulted.lock().unwrap().insert(owner.clone());
            counters.zombies.fetch_add(1, Relaxed);
            // A zombie fault bites when runs it held were taken over while
            // it was stopped, and its writes were refused when it woke. Its
            // runs may instead all be finished by writes it sent just
            // before it stopped: then it is tried again.
            let mut rounds = 0;
            let stopped = loop {
                rounds += 1;
                let round = zombie_round(cluster, store, counters, backend, host, pid, &owner).await?;
                // A round tested nothing if none of the zombie's runs was
                // taken over, or if, once woken, none of its writes was
                // refused: it was stopped where it had no write left to
                // make in time (seen once in CI, on a host whose sessions
                // the database had ended meanwhile), or its segment on the
                // run taken over saw its own lease's deadline pass and
                // stopped without writing (seen once in the long mode, the
                // host ending 23 other segments meanwhile).
                let tested = round.as_ref().is_some_and(|(_, taken, rejected, _)| *taken > 0 && *rejected > 0);
                if tested || rounds == 3 {
                    break round;
                }
                // Logged, so a run that fails after three rounds shows why each was retried.
                eprintln!("chaos: zombie {owner} round {rounds} tested nothing ({round:?}); again");
            };
            let mut unbitten = counters.unbitten.lock().unwrap();
            let Some((held, taken, rejected, after)) = stopped else {
                unbitten.push(format!("zombie {owner}: never stopped between SQLite write transactions in {rounds} rounds"));
                return Ok(());
            };
            if held == 0 {
                unbitten.push(format!("zombie {owner} held no run"));
            } else if taken == 0 {
                unbitten.push(format!("zombie {owner}: none of its runs was taken over in {rounds} rounds"));
            } else if rejected == 0 {
                unbitten.push(format!("zombie {owner}: none of its writes was refused after SIGCONT ({after})"));
            }
            counters.zombie_writes_rejected.fetch_add(rejected, Relaxed);
            eprintln!("chaos: zombie {owner} held {held} runs, {taken} taken over; {rejected} of its writes refused after SIGCONT");
        }
        Fault::Partition { host } => partition(cluster, store, counters, host).await?,
        Fault::Db(f) => {
            wait_recoveries(counters).await;
            counters.db_faults.fetch_add(1, Relaxed);
            let began = patiently(async || sqlx::query_scalar::<_, i64>(NOW_MS[backend as usize]).fetch_one(store.pool()).await).await?;
            let result = inject_db(f, cluster, store, pg, backend).await;
            let ended = patiently(async || sqlx::query_scalar::<_, i64>(NOW_MS[backend as usize]).fetch_one(store.pool()).await).await?;
            // A host's claims back off to 5 s while its database fails.
            counters.db_fault_windows.lock().unwrap().push((began, ended + 5_000 + POLL_MS as i64));
            result?;
        }
    }
    Ok(())
}

/// The database clock, in epoch ms, per backend.
const NOW_MS: [&str; 2] =
    ["SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)", "SELECT (extract(epoch from now()) * 1000)::bigint"];

async fn inject_db(f: DbFault, cluster: &Cluster<'_>, store: &Store, pg: Option<&PgCluster>, backend: Backend) -> Result<()> {
    match (f, backend, pg) {
        (DbFault::TerminateBackends, Backend::Postgres, _) => {
            patiently(async || {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .execute(store.pool())
                .await
            })
            .await?;
        }
        (DbFault::RestartFast, Backend::Postgres, Some(pg)) => pg.restart("fast")?,
        (DbFault::RestartImmediate, Backend::Postgres, Some(pg)) => pg.restart("immediate")?,
        (DbFault::HoldWriteLock { ms }, Backend::Sqlite, _) => {
            use sqlx::Connection;
            let mut conn = sqlx::SqliteConnection::connect(cluster.db_url).await?;
            sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut conn).await?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            sqlx::raw_sql("COMMIT").execute(&mut conn).await?;
            conn.close().await?;
        }
        (other, backend, _) => bail!("fault {other:?} does not apply to {}", backend.name()),
    }
    Ok(())
}

/// One try of a zombie fault on `host`: SIGSTOP it while it holds runs,
/// until they are taken over (or finished), then SIGCONT and count its
/// writes refused by the fence. Returns (runs held, taken over, refused,
/// what its segments did after it woke), or `None` if every stop on
/// SQLite caught it inside a write transaction.
/// How a zombie round's report starts when the zombie, once woken, ended
/// no segment and had no write refused.
const QUIET_AFTER_WAKE: &str = "no segment ended after SIGCONT";

async fn zombie_round(
    cluster: &Cluster<'_>,
    store: &Store,
    counters: &Arc<Counters>,
    backend: Backend,
    host: usize,
    pid: u32,
    owner: &str,
) -> Result<Option<(usize, usize, u64, String)>> {
    let base = cluster.base(host);
    // Stop it while it holds runs: wait until it holds some, stop it, and
    // start over if they finished in between.
    let mut tries = 0;
    let mut segments_before = std::collections::HashMap::new();
    let (before, held) = loop {
        until_busy(store, counters, owner, Duration::from_secs(5)).await?;
        let before = scrape(&cluster.http, &base, "leasehold_fenced_writes_rejected_total").await.unwrap_or(0);
        segments_before.clear();
        for outcome in ["completed", "failed", "suspended", "lease_lost", "abandoned"] {
            let name = format!("leasehold_segments_total{{outcome=\"{outcome}\"}}");
            segments_before.insert(outcome, scrape(&cluster.http, &base, &name).await);
        }
        signal(pid, "STOP")?;
        let held = held_by(store, owner).await?;
        tries += 1;
        // On SQLite a host stopped inside a transaction holds the one write
        // lock, and no host can take anything over until it wakes (which
        // is why several hosts need PostgreSQL): stop it between
        // transactions, and never go on with it holding the lock.
        let locked = backend == Backend::Sqlite && sqlite_write_locked(cluster.db_url).await;
        if !held.is_empty() && !locked {
            break (before, held);
        }
        signal(pid, "CONT")?;
        if locked && tries >= 20 {
            return Ok(None);
        }
        if tries >= 20 {
            break (before, Vec::new());
        }
    };
    if held.is_empty() {
        return Ok(Some((0, 0, 0, String::new())));
    }
    cluster.slots[host].lock().unwrap().stopped = true;
    // Until every run it held is taken over, or finished by a write it sent
    // before it stopped.
    let taken = until_taken_over(store, counters, &held, &format!("zombie {owner}")).await?;
    signal(pid, "CONT")?;
    cluster.slots[host].lock().unwrap().stopped = false;
    // Its segments wake up and try to write: every write is refused. A
    // segment may first finish a remote call (the slice's grace is 5 s).
    let rejected = refused_since(cluster, &base, before, taken).await;
    // What its segments did once it woke, for a round with no refusal.
    let mut after = Vec::new();
    if rejected == 0 {
        let mut ended = 0;
        for outcome in ["completed", "failed", "suspended", "lease_lost", "abandoned"] {
            let name = format!("leasehold_segments_total{{outcome=\"{outcome}\"}}");
            let now = scrape(&cluster.http, &base, &name).await;
            let delta = now.zip(segments_before.get(outcome).copied().flatten()).map(|(n, b)| n.saturating_sub(b));
            ended += delta.unwrap_or(1);
            after.push(format!("{outcome} {delta:?}"));
        }
        if ended == 0 {
            after.insert(0, QUIET_AFTER_WAKE.to_string());
        }
        for (id, fence) in &held {
            let (f, status, owner): (i64, String, Option<String>) = patiently(async || {
                sqlx::query_as("SELECT fence, status, lease_owner FROM runs WHERE id = $1").bind(id).fetch_one(store.pool()).await
            })
            .await?;
            after.push(format!("run {id} fence {fence}->{f} {status} {owner:?}"));
        }
    }
    Ok(Some((held.len(), taken, rejected, after.join(", "))))
}

/// The partition fault: cuts `host`'s link while it holds runs, waits
/// until every one is taken over elsewhere (or finished by a write that
/// got out first), then restores the link. Its held-up writes then reach
/// the database late and must all be refused (the audit's stale writes);
/// the refusals its metrics count are reported.
async fn partition(cluster: &Cluster<'_>, store: &Store, counters: &Arc<Counters>, host: usize) -> Result<()> {
    wait_recoveries(counters).await;
    let owner = cluster.owner_of(host);
    // A round whose held runs all finished by writes that got out before
    // the cut (or by a cancel) took nothing over: it tested nothing, and
    // the fault is tried again, as a zombie's is.
    for round in 1..=3 {
        // None: the host held no run to cut off (counted as unbitten).
        let Some(taken) = partition_round(cluster, store, counters, host, &owner).await? else { break };
        if taken > 0 || round == 3 {
            if taken == 0 {
                counters.unbitten.lock().unwrap().push(format!("partition of {owner}: none of its runs was taken over in {round} rounds"));
            }
            break;
        }
        eprintln!("chaos: partition of {owner} round {round} took nothing over; again");
    }
    Ok(())
}

/// One cut of `host` (see [`partition`]): how many of its runs were taken
/// over; `None` if it held none in 20 tries.
async fn partition_round(cluster: &Cluster<'_>, store: &Store, counters: &Arc<Counters>, host: usize, owner: &str) -> Result<Option<usize>> {
    let net = cluster.net.context("a partition fault needs the hosts' namespaces")?;
    let owner = owner.to_string();
    let base = cluster.base(host);
    let mut tries = 0;
    let (before, held) = loop {
        until_busy(store, counters, &owner, Duration::from_secs(5)).await?;
        let before = scrape(&cluster.http, &base, "leasehold_fenced_writes_rejected_total").await.unwrap_or(0);
        net.cut(host)?;
        let held = held_by(store, &owner).await?;
        tries += 1;
        if !held.is_empty() || tries >= 20 {
            break (before, held);
        }
        net.restore(host)?;
    };
    let cut_at = Instant::now();
    cluster.slots[host].lock().unwrap().partitioned = true;
    cluster.faulted.lock().unwrap().insert(owner.clone());
    counters.partitions.fetch_add(1, Relaxed);
    counters.pending_recoveries.fetch_add(held.len() as i64, Relaxed);
    tokio::spawn(track_recovery(store.clone(), counters.clone(), held.clone(), cut_at));
    let taken = until_taken_over(store, counters, &held, &format!("partition of {owner}")).await?;
    let cut_for = cut_at.elapsed();
    net.restore(host)?;
    cluster.slots[host].lock().unwrap().partitioned = false;
    // Its segments' writes arrive as the link comes back (TCP retransmits
    // back off, so give them time): each is refused by the fence.
    let rejected = refused_since(cluster, &base, before, taken).await;
    counters.partition_writes_rejected.fetch_add(rejected, Relaxed);
    if held.is_empty() {
        counters.unbitten.lock().unwrap().push(format!("partition of {owner}: it held no run in 20 tries"));
        return Ok(None);
    }
    eprintln!(
        "chaos: cut {owner} off for {} ms holding {} runs, {taken} taken over; {rejected} of its writes refused after",
        cut_for.as_millis(),
        held.len()
    );
    Ok(Some(taken))
}

/// The writes `base`'s host had refused by the fence since it counted
/// `before`, waiting up to 15 s for a first one when `taken` runs of its
/// were taken over (its segments may first finish a remote call, or wait
/// for TCP to retransmit).
async fn refused_since(cluster: &Cluster<'_>, base: &str, before: u64, taken: usize) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut rejected = 0;
    while taken > 0 && Instant::now() < deadline {
        rejected = scrape(&cluster.http, base, "leasehold_fenced_writes_rejected_total").await.unwrap_or(before).saturating_sub(before);
        if rejected > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rejected
}

/// Waits until every run of `held` is taken over (a later fence) or
/// finished, for up to the lease, the reaper and 10 s; one not resolved
/// then is an unbitten fault of `who`. Returns how many were taken over.
async fn until_taken_over(store: &Store, counters: &Counters, held: &[(i64, i64)], who: &str) -> Result<usize> {
    // A keyed run whose lease ran out waits for its key's slot behind the
    // key's older runs: give it time for them to finish.
    let mut keyed = false;
    for (id, _) in held {
        let key: String = patiently(async || {
            sqlx::query_scalar("SELECT concurrency_key FROM runs WHERE id = $1").bind(id).fetch_one(store.pool()).await
        })
        .await?;
        keyed |= !key.is_empty();
    }
    let wait = if keyed { 40_000 } else { 10_000 };
    let deadline = Instant::now() + Duration::from_millis(TTL_MS + REAPER_MS + wait);
    loop {
        let (mut resolved, mut grew) = (0, 0);
        for (id, fence) in held {
            let (f, status): (i64, String) = patiently(async || {
                sqlx::query_as("SELECT fence, status FROM runs WHERE id = $1").bind(id).fetch_one(store.pool()).await
            })
            .await?;
            grew += usize::from(f > *fence);
            resolved += usize::from(f > *fence || status != "running");
        }
        if resolved == held.len() || Instant::now() > deadline {
            if resolved < held.len() {
                counters.unbitten.lock().unwrap().push(format!(
                    "{who}: {} of its {} runs were neither taken over nor finished",
                    held.len() - resolved,
                    held.len()
                ));
            }
            return Ok(grew);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether some process holds SQLite's write lock for more than a moment.
async fn sqlite_write_locked(db_url: &str) -> bool {
    use sqlx::Connection;
    let Ok(mut conn) = sqlx::SqliteConnection::connect(db_url).await else { return true };
    let locked = match sqlx::raw_sql("PRAGMA busy_timeout = 500; BEGIN IMMEDIATE").execute(&mut conn).await {
        Ok(_) => {
            let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
            false
        }
        Err(_) => true,
    };
    let _ = conn.close().await;
    locked
}

async fn scrape(http: &reqwest::Client, base: &str, name: &str) -> Option<u64> {
    let text = http.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
    metric(&text, name)
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    let status = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status()?;
    ensure!(status.success(), "kill -{sig} {pid} failed");
    Ok(())
}

struct Report {
    json: Value,
    failures: Vec<String>,
}

#[allow(clippy::too_many_arguments)]
async fn check(
    settings: &Settings,
    backend: Backend,
    acked: &[Acked],
    store: &Store,
    [sink, rated]: [&Sink; 2],
    cluster: &Cluster<'_>,
    counters: &Counters,
    elapsed: Duration,
) -> Result<Report> {
    let mut failures = Vec::new();
    // Parents' children are checked as chaos runs of their own: exactly
    // two a parent, whatever died around its spawns.
    let kids: Vec<(i64, i64, String)> = patiently(async || {
        sqlx::query_as("SELECT id, parent_id, input FROM runs WHERE parent_id IS NOT NULL ORDER BY id").fetch_all(store.pool()).await
    })
    .await?;
    let mut acked = acked.to_vec();
    for a in acked.clone() {
        let Kind::Parent { steps } = a.kind else { continue };
        let mine: Vec<&(i64, i64, String)> = kids.iter().filter(|(_, parent, _)| *parent == a.id).collect();
        if mine.len() != 2 {
            failures.push(format!("parent run {} has {} children, not 2", a.id, mine.len()));
        }
        for (id, _, input) in mine {
            let tag = serde_json::from_str::<Value>(input)?["tag"].as_str().unwrap_or_default().to_string();
            acked.push(Acked { id: *id, kind: Kind::Chaos { steps, spin: 0, delay_ms: 0, max_attempts: 100 }, tag });
        }
    }
    let acked = &acked[..];
    let rows: Vec<(i64, String, Option<String>, Option<String>)> = patiently(async || {
        sqlx::query_as("SELECT id, status, output, error FROM runs").fetch_all(store.pool()).await
    })
    .await?;
    let runs: HashMap<i64, (String, Option<String>, Option<String>)> =
        rows.into_iter().map(|(id, s, o, e)| (id, (s, o, e))).collect();
    let distinct: HashSet<i64> = acked.iter().map(|a| a.id).collect();
    if runs.len() != distinct.len() {
        failures.push(format!("{} runs in the database for {} acknowledged", runs.len(), distinct.len()));
    }
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut lost = 0;
    for id in &distinct {
        match runs.get(id) {
            Some((s, _, _)) if ["completed", "failed", "aborted", "cancelled"].contains(&s.as_str()) => {
                *by_status.entry(s.clone()).or_default() += 1
            }
            other => {
                lost += 1;
                failures.push(format!("run {id} not finished: {other:?}"));
            }
        }
    }

    // The sink's view: (tag, step, kind) -> idempotency keys.
    let mut applied: HashMap<(String, i64, String), Vec<String>> = HashMap::new();
    for hit in sink.hits().into_iter().chain(rated.hits()) {
        let b: Value = serde_json::from_str(&hit.body).unwrap_or(Value::Null);
        if let (Some(tag), Some(step), Some(kind)) = (b["tag"].as_str(), b["step"].as_i64(), b["kind"].as_str()) {
            applied.entry((tag.to_string(), step, kind.to_string())).or_default().push(hit.key);
        }
    }
    let kv: HashMap<String, String> = patiently(async || {
        sqlx::query_as::<_, (String, String)>("SELECT key, value FROM kv").fetch_all(store.pool()).await
    })
    .await?
    .into_iter()
    .collect();

    let taken: Vec<(i64, Option<String>, i64, i64)> = patiently(async || {
        sqlx::query_as("SELECT run_id, old_owner, expires_in_ms, taken_at FROM chaos_takeovers").fetch_all(store.pool()).await
    })
    .await?;
    let takeovers: Vec<(i64, Option<String>, i64)> = taken.iter().map(|(r, o, e, _)| (*r, o.clone(), *e)).collect();
    let mut taken_over: HashMap<i64, i64> = HashMap::new();
    for (run, _, _) in &takeovers {
        *taken_over.entry(*run).or_default() += 1;
    }
    // A run may be aborted only for failed segments in a row: it was taken
    // over at least max_attempts - 1 times, and the last one's lease ran
    // out (the abort says so), never for suspensions.
    let mut aborted_on_attempts = 0u64;
    let mut aborted_ok = |a: &Acked, status: &str, error: &Option<String>, failures: &mut Vec<String>| -> bool {
        if status != "aborted" {
            return false;
        }
        let m = a.kind.max_attempts();
        let takeovers = taken_over.get(&a.id).copied().unwrap_or(0);
        let expired = error.as_deref().is_some_and(|e| e.contains("stopped renewing its lease"));
        if m < 100 && takeovers + 1 >= m && expired {
            aborted_on_attempts += 1;
        } else {
            failures.push(format!(
                "run {} ({:?}) was aborted after {takeovers} takeovers with max_attempts {m}: {error:?}",
                a.id, a.kind
            ));
        }
        true
    };

    let mut duplicate_effects = 0;
    let mut missing_effects = 0;
    let mut hostile = 0;
    let mut normal_completed = 0u64;
    for a in acked {
        let Some((status, output, error)) = runs.get(&a.id) else { continue };
        match &a.kind {
            Kind::Chaos { steps, .. } | Kind::Duplicate { steps } | Kind::Cancel { steps, .. } | Kind::Paused { steps, .. } | Kind::Rated { steps } => {
                let cancelled = matches!(a.kind, Kind::Cancel { .. }) && status == "cancelled";
                // Aborted on its attempts: what it did must not repeat, but
                // it need not all have happened.
                let aborted = aborted_ok(a, status, error, &mut failures);
                if !cancelled && !aborted && status != "completed" {
                    failures.push(format!("run {} ({:?}) ended {status}: {error:?}", a.id, a.kind));
                    continue;
                }
                let cancelled = cancelled || aborted;
                normal_completed += u64::from(status == "completed");
                // Local: the counter went up once a step.
                let count: u64 = kv.get(&format!("count-{}", a.tag)).and_then(|v| v.parse().ok()).unwrap_or(0);
                if count > *steps {
                    duplicate_effects += 1;
                    failures.push(format!("run {}: local counter {count} for {steps} steps", a.id));
                } else if !cancelled && count < *steps {
                    missing_effects += 1;
                    failures.push(format!("run {}: local counter {count} for {steps} steps", a.id));
                }
                let in_doubt: u64 = output
                    .as_deref()
                    .and_then(|o| o.split(", ").nth(1))
                    .and_then(|o| o.split(' ').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                let mut unkeyed_missing = 0;
                for step in 0..*steps as i64 {
                    let keyed = applied.get(&(a.tag.clone(), step, "keyed".into()));
                    match keyed {
                        Some(keys) if keys.iter().collect::<HashSet<_>>().len() > 1 => {
                            duplicate_effects += 1;
                            failures.push(format!("run {} step {step}: keyed POST under keys {keys:?}", a.id));
                        }
                        None if !cancelled => {
                            missing_effects += 1;
                            failures.push(format!("run {} step {step}: keyed POST never arrived", a.id));
                        }
                        _ => {}
                    }
                    match applied.get(&(a.tag.clone(), step, "unkeyed".into())).map_or(0, Vec::len) {
                        0 => unkeyed_missing += 1,
                        1 => {}
                        n => {
                            duplicate_effects += 1;
                            failures.push(format!("run {} step {step}: unkeyed POST applied {n} times", a.id));
                        }
                    }
                }
                // An unkeyed POST may be missing only if the guest was told
                // it was in doubt.
                if !cancelled && unkeyed_missing > in_doubt {
                    missing_effects += 1;
                    failures.push(format!("run {}: {unkeyed_missing} unkeyed POSTs missing, {in_doubt} in doubt", a.id));
                }
            }
            Kind::Parent { steps } => {
                // Its children are checked on their own (above); here, that
                // it completed with both their outputs, in order.
                let want = format!("did {steps} chaos steps");
                let outputs: Vec<String> = output.as_deref().and_then(|o| serde_json::from_str(o).ok()).unwrap_or_default();
                if status != "completed" || outputs.len() != 2 || !outputs.iter().all(|o| o.starts_with(&want)) {
                    failures.push(format!("parent run {} ended {status} with {output:?}: {error:?}", a.id));
                }
                normal_completed += u64::from(status == "completed");
            }
            Kind::Wait { .. } => {
                if !aborted_ok(a, status, error, &mut failures)
                    && (status != "completed" || output.as_deref() != Some("hello Ada"))
                {
                    failures.push(format!("wait run {} ({:?}) ended {status} with {output:?}: {error:?}", a.id, a.kind));
                }
                normal_completed += u64::from(status == "completed");
            }
            Kind::Hostile(mode) => {
                hostile += 1;
                let class = hostile_error(mode);
                let classified = status == "failed" && error.as_deref().is_some_and(|e| e.starts_with(&format!("{class}: ")));
                if !classified && !aborted_ok(a, status, error, &mut failures) {
                    failures.push(format!("hostile run {} ({mode}) ended {status}, not failed as {class}: {error:?}", a.id));
                }
            }
        }
    }

    let stale: Vec<(String, i64, i64, i64, i64)> = patiently(async || {
        sqlx::query_as("SELECT tbl, run_id, row_fence, run_fence, seq FROM chaos_stale").fetch_all(store.pool()).await
    })
    .await?;
    for s in stale.iter().take(10) {
        failures.push(format!("stale write: {s:?}"));
    }
    // The threads' logs: each number once, counters at or past their last.
    failures.extend(patiently(async || crate::harness::thread_log_faults(store).await.map_err(|e| sqlx::Error::Protocol(e.to_string()))).await?);
    let steals: Vec<_> = takeovers.iter().filter(|(_, _, left)| *left >= 0).collect();
    if !steals.is_empty() {
        failures.push(format!("leases taken before they expired (run, owner, ms left): {steals:?}"));
    }
    // Live hosts (neither killed nor stopped) lose a lease only when a
    // database fault kept them from renewing it or cut a claim's reply
    // after its commit: a takeover of one outside every fault's window
    // fails the run.
    let faulted = cluster.faulted.lock().unwrap().clone();
    let windows = counters.db_fault_windows.lock().unwrap().clone();
    let in_window = |expired: i64| windows.iter().any(|(from, to)| (*from..=*to).contains(&expired));
    let from_live = takeovers.iter().filter(|(_, o, _)| o.as_ref().is_some_and(|o| !faulted.contains(o))).count();
    let live_outside: Vec<String> = taken
        .iter()
        .filter(|(_, o, _, _)| o.as_ref().is_some_and(|o| !faulted.contains(o)))
        .filter(|(_, _, left, at)| !in_window(at + left))
        .map(|(run, o, left, at)| format!("run {run} of {}, lease ran out at {}, taken at {at}", o.as_deref().unwrap_or("?"), at + left))
        .collect();
    if !live_outside.is_empty() {
        failures.push(format!(
            "{} takeovers of a live host's leases outside any database fault: {:?} (database faults: {windows:?})",
            live_outside.len(),
            &live_outside[..live_outside.len().min(10)]
        ));
    }
    // A panic in a host, even one the host survived (a task's), is a bug.
    for h in 0..HOSTS {
        let log = std::fs::read_to_string(cluster.dir.join(format!("host-{h}.log"))).unwrap_or_default();
        if let Some(line) = log.lines().find(|l| l.contains("panicked")) {
            failures.push(format!("host-{h}.log: {line}"));
        }
    }
    let skewed: Vec<(i64, Option<String>, i64)> = patiently(async || {
        sqlx::query_as("SELECT run_id, owner, expires_in_ms FROM chaos_leases").fetch_all(store.pool()).await
    })
    .await?;
    if !skewed.is_empty() {
        failures.push(format!("lease expiries off the database clock (run, owner, ms ahead): {:?}", &skewed[..skewed.len().min(10)]));
    }
    let leftover: i64 = patiently(async || {
        sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE lease_owner IS NOT NULL").fetch_one(store.pool()).await
    })
    .await?;
    if leftover > 0 {
        failures.push(format!("{leftover} leases left behind"));
    }

    // Informational: from each kill to its runs' takeover.
    let mut rec = counters.recoveries_ms.lock().unwrap().clone();
    rec.sort_unstable();
    let max_recovery = rec.last().copied().unwrap_or(0);
    let p99 = rec.get((rec.len() * 99).div_ceil(100).saturating_sub(1)).copied().unwrap_or(0);
    // Bounded: from the moment a dead (or stopped) host's lease ran out,
    // on the database clock, to its takeover. That is the protocol's part:
    // a free worker's poll, or the reaper's tick then a poll; the time to
    // the expiry itself depends on when the host last renewed.
    // A keyed run may wait for its key's slot after its lease ran out
    // (the key's older runs come first): not held to the bound.
    let keyed: HashSet<i64> = patiently(async || {
        sqlx::query_scalar::<_, i64>("SELECT id FROM runs WHERE concurrency_key <> ''").fetch_all(store.pool()).await
    })
    .await?
    .into_iter()
    .collect();
    // SQLite: each hold of the write lock over 1 s, by whom and doing what.
    // No host could write then: the time a takeover waited inside them is
    // not held to the bound.
    let pids = cluster.pids.lock().unwrap().clone();
    let held = cluster.lock_watch.iter().flat_map(LockWatch::stalls).collect::<Vec<_>>();
    let stalls: Vec<String> = held.iter().map(|s| {
        let who = pids.get(&s.pid).cloned().unwrap_or_else(|| if s.pid == std::process::id() { "the test".into() } else { format!("pid {}", s.pid) });
        format!("{who} from {} for {} ms ({})", s.since_ms, s.held_ms, s.threads)
    }).collect();
    let stalled = |from: i64, to: i64| -> i64 { held.iter().map(|s| (to.min(s.since_ms + s.held_ms) - from.max(s.since_ms)).max(0)).sum() };
    // (run, delay less the write-lock stalls within it)
    let mut delays: Vec<(i64, i64)> = taken
        .iter()
        .filter(|(run, _, _, _)| !keyed.contains(run))
        .filter(|(_, o, _, _)| o.as_ref().is_some_and(|o| faulted.contains(o)))
        .filter(|(_, _, left, at)| !in_window(at + left))
        .map(|(run, _, left, at)| (*run, -left - stalled(at + left, *at)))
        .collect();
    delays.sort_unstable_by_key(|(_, d)| *d);
    let (worst_run, max_delay) = delays.last().copied().unwrap_or((0, 0));
    let bound = 2 * (POLL_MS + REAPER_MS) as i64 + 1_000;
    for s in &stalls {
        eprintln!("chaos: write lock held by {s}");
    }
    if max_delay > bound {
        // Which run, whose, and when (database clock), to match with the
        // faults' log lines and the hosts' logs.
        let worst = taken
            .iter()
            .filter(|(run, o, _, _)| *run == worst_run && o.as_ref().is_some_and(|o| faulted.contains(o)))
            .map(|(run, o, left, at)| format!("run {run} of {}, lease ran out at {}, taken at {at}", o.as_deref().unwrap_or("?"), at + left))
            .next()
            .unwrap_or_default();
        failures.push(format!(
            "a dead host's run was taken over {max_delay} ms (write-lock stalls left out) after its lease ran out; bound {bound} ms ({worst}; \
             database faults: {windows:?}; write-lock holds over 1 s: {stalls:?})"
        ));
    }
    let over = counters.key_over_limit.lock().unwrap().clone();
    if !over.is_empty() {
        failures.push(format!("keys over their limits: {:?}", &over[..over.len().min(10)]));
    }
    let key_samples = counters.key_samples.load(Relaxed);
    if key_samples == 0 {
        failures.push("the keys' slots were never sampled".into());
    }
    let key_most = counters.key_most.lock().unwrap().clone();
    // The rated sink: a host stopped or cut off between its call's
    // admission and its send may deliver that call late, beside later ones.
    // And a call admitted to wait in place (up to a second ahead: at this
    // rate, 10 calls) records its start in a write: a database fault that
    // holds writes back releases those calls together when it ends.
    // Those seconds are left out (`rate_fault_spans`); the rest are held
    // to the rate, and two more.
    let spans = counters.rate_fault_spans.lock().unwrap().clone();
    let rated_hits = rated.hits();
    let (rated_most, rated_over) = rate_excess(&rated_hits, RATE_PER_MINUTE, &spans);
    if rated_over > 2 {
        failures.push(format!(
            "the rated sink took {rated_most} charged calls in one second outside {} fault spans; the limit allows {} and two more",
            spans.len(),
            RATE_PER_MINUTE / 60 + 1
        ));
    }
    if settings.runs >= 4 && rated_hits.is_empty() {
        failures.push("no call reached the rated sink".into());
    }
    let unbitten = counters.unbitten.lock().unwrap().clone();
    for u in &unbitten {
        failures.push(format!("a fault did not bite: {u}"));
    }
    // The long mode must have killed a host at each point of a run; any
    // mode with kills, at least once mid-effect (the point the promise is
    // about).
    let points = counters.kill_points.lock().unwrap().clone();
    let required: &[&str] = if settings.runs >= 1000 {
        &["before_started", "between_started_and_committed", "after_committed_before_close"]
    } else if settings.kills > 0 {
        &["between_started_and_committed"]
    } else {
        &[]
    };
    for class in required {
        if !points.contains_key(*class) {
            failures.push(format!("no kill landed {class} (kill points {points:?})"));
        }
    }
    let server_errors = cluster.server_errors.lock().unwrap().clone();
    for e in server_errors.iter().take(10) {
        failures.push(format!("a live host answered a 5xx other than 503: {e}"));
    }
    let host_crashes = cluster.host_crashes.load(Relaxed);
    if host_crashes > 0 {
        failures.push(format!("{host_crashes} host crashes"));
    }
    let dup_submits = counters.duplicate_submits.load(Relaxed);
    let dup_inputs = counters.duplicate_inputs.load(Relaxed);
    if dup_submits + dup_inputs > 0 {
        failures.push(format!("{dup_submits} split submits, {dup_inputs} double deliveries"));
    }
    let zombies = counters.zombies.load(Relaxed);
    let json = json!({
        "seed": settings.seed,
        "backend": backend.name(),
        "runs": acked.len(),
        "kills": counters.kills.load(Relaxed),
        "zombies": zombies,
        "zombie_writes_rejected": counters.zombie_writes_rejected.load(Relaxed),
        "partitions": counters.partitions.load(Relaxed),
        "partition_writes_rejected": counters.partition_writes_rejected.load(Relaxed),
        "db_faults": counters.db_faults.load(Relaxed),
        "lost": lost,
        "duplicate_effects": duplicate_effects,
        "stale_writes": stale.len(),
        "max_recovery_from_kill_ms": max_recovery,
        "p99_recovery_from_kill_ms": p99,
        "hostile_guests": hostile,
        "paused_running": counters.paused_running.load(Relaxed),
        "host_crashes": host_crashes,
        "missing_effects": missing_effects,
        "steals": steals.len(),
        "takeovers": takeovers.len(),
        "takeovers_from_live_hosts": from_live,
        "skewed_leases": skewed.len(),
        "recoveries": rec.len(),
        "max_takeover_delay_ms": max_delay,
        "keyed_runs": keyed.len(),
        "key_samples": key_samples,
        "key_most_at_once": key_most,
        "keys_over_limit": over.len(),
        "rated_calls": rated_hits.len(),
        "rated_most_in_a_second": rated_most,
        "takeover_delay_bound_ms": bound,
        "write_lock_holds_over_1s": stalls.len(),
        "aborted_on_attempts": aborted_on_attempts,
        "server_errors": server_errors.len(),
        "unbitten_faults": unbitten.len(),
        "kill_points": *counters.kill_points.lock().unwrap(),
        "duplicate_submits": dup_submits,
        "duplicate_inputs": dup_inputs,
        "by_status": by_status,
        "completed_per_sec": (normal_completed as f64 / elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "elapsed_s": elapsed.as_secs(),
    });
    Ok(Report { json, failures })
}
