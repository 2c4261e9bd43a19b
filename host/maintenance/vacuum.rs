//! The vacuum loop: on PostgreSQL, vacuums `runs` once enough dead row
//! versions have piled up (why: `store::upkeep`). Needs no leader: the
//! count comes from the server's statistics, so when one host (or
//! autovacuum) has vacuumed, the others find nothing to do; a vacuum
//! already running makes another skip the table. Does nothing on SQLite.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::store::{Store, StoreError};

/// When to vacuum. Every field documents its default.
#[derive(Debug, Clone)]
pub struct VacuumConfig {
    /// Vacuum once `runs` holds more dead row versions than this plus
    /// `scale` times its live rows. 0 turns the loop off (leave it to
    /// autovacuum). Default: 50,000.
    pub dead_rows: i64,
    /// Default: 0.05, so a big table is not vacuumed for every 50,000 rows.
    pub scale: f64,
}

impl Default for VacuumConfig {
    fn default() -> Self {
        VacuumConfig { dead_rows: 50_000, scale: 0.05 }
    }
}

/// What one tick did.
#[derive(Debug, Clone, PartialEq)]
pub enum Tick {
    /// SQLite, or the loop is off.
    Off,
    /// Too few dead rows (`dead` of the `threshold`).
    Waiting { dead: i64, threshold: i64 },
    /// Vacuumed `dead` dead row versions' worth.
    Vacuumed { dead: i64, took: Duration },
}

/// Looks at `runs`' dead row versions once and vacuums if they are over
/// the threshold.
pub async fn tick(store: &Store, config: &VacuumConfig) -> Result<Tick, StoreError> {
    if config.dead_rows <= 0 {
        return Ok(Tick::Off);
    }
    let Some((dead, live)) = store.runs_row_versions().await? else { return Ok(Tick::Off) };
    let threshold = config.dead_rows + (config.scale * live as f64) as i64;
    if dead <= threshold {
        return Ok(Tick::Waiting { dead, threshold });
    }
    let started = Instant::now();
    store.vacuum_runs().await?;
    let took = started.elapsed();
    crate::metrics::global().runs_vacuums.fetch_add(1, Ordering::Relaxed);
    tracing::info!(dead, live, took_ms = took.as_millis() as u64, "vacuumed the runs table");
    Ok(Tick::Vacuumed { dead, took })
}

/// Ticks every `every` until `stop` turns true. A failed tick is logged
/// (a host whose database user may not vacuum `runs` says so once).
pub async fn run(store: Store, config: VacuumConfig, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(every.max(Duration::from_millis(10)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = false;
    loop {
        tokio::select! {
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            _ = interval.tick() => match tick(&store, &config).await {
                Ok(Tick::Off) => return,
                Ok(_) => {}
                Err(e) if !warned => {
                    warned = true;
                    tracing::warn!(error = %e, "vacuuming the runs table failed; claims slow down as dead rows pile up unless autovacuum runs (set --pg-vacuum-dead-rows 0 to leave it to autovacuum)");
                }
                Err(_) => {}
            },
        }
    }
}
