//! The benchmarks, apart from the host's core: `leasehold bench claim`
//! ([`claim`]), `leasehold bench e2e` ([`e2e`]) and `leasehold bench drain`
//! ([`drain`], with [`peers`] beside it). Each measures the host
//! against a baseline in the same run and reports the ratio, which stays
//! meaningful on a noisy, shared machine.

pub mod claim;
mod command;
pub mod dashboard;
pub mod drain;
pub mod e2e;
pub mod fairness;
pub mod harness;
mod peers;
pub mod progress;
pub mod submit;

use crate::store::{Store, StoreError};

pub use command::BenchCommand;

/// The plugin name of bench rows; the bench deletes only these.
pub const BENCH_PLUGIN: &str = "__leasehold_bench__";

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(
        "the database holds {0} runs that are not the bench's; point the bench at an empty \
         database (it would claim real work)"
    )]
    NotEmpty(i64),
    #[error("the bench claimed {got} runs, expected {want}")]
    Miscount { got: u64, want: i64 },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("bench task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("{0}")]
    Setup(String),
}

/// The setup of the benches that run turns: refuses a database holding
/// runs, registers the test plugin at `plugin_file` as `plugin`, and
/// returns an executor for `workers` segments at once, owned by `owner`.
async fn executor_with_plugin(
    store: &Store,
    plugin_file: &std::path::Path,
    cache_dir: &std::path::Path,
    plugin: &str,
    workers: usize,
    owner: &str,
) -> Result<std::sync::Arc<crate::executor::Executor>, BenchError> {
    use crate::runtime::{Runtime, RuntimeConfig};
    let existing: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(store.pool()).await.map_err(StoreError::from)?;
    if existing > 0 {
        return Err(BenchError::NotEmpty(existing));
    }
    let bytes = std::fs::read(plugin_file).map_err(|e| {
        BenchError::Setup(format!("reading {}: {e} (build it with ./scripts/build-plugins)", plugin_file.display()))
    })?;
    let runtime = std::sync::Arc::new(
        Runtime::new(RuntimeConfig { cache_dir: cache_dir.to_path_buf(), max_instances: workers as u32 + 2, ..RuntimeConfig::default() })
            .map_err(|e| BenchError::Setup(format!("{e:#}")))?,
    );
    crate::plugins::register(store, &runtime, plugin, bytes, crate::plugins::PluginSettings::default())
        .await
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    let config = crate::executor::ExecutorConfig { owner: owner.into(), model: None, ..Default::default() };
    Ok(std::sync::Arc::new(crate::executor::Executor::new(store.clone(), runtime, config)))
}

/// Before a measured phase: no dead row versions left by the phases before
/// it, and fresh statistics. PostgreSQL runs `vacuums` (`VACUUM ANALYZE …`),
/// one statement per call: VACUUM cannot run in a transaction block, which
/// a multi-statement string would be. SQLite keeps no dead row versions; it
/// runs `ANALYZE`.
async fn vacuum(store: &Store, vacuums: &[&'static str]) -> Result<(), StoreError> {
    match store.backend() {
        crate::Backend::Postgres => {
            for q in vacuums {
                sqlx::raw_sql(*q).execute(store.writer()).await?;
            }
        }
        crate::Backend::Sqlite => {
            sqlx::raw_sql("ANALYZE").execute(store.writer()).await?;
        }
    }
    Ok(())
}

/// The runs running (the lease index) and those due (the claim index, up
/// to now): a read of the runs left, never of the finished ones, nor of
/// runs sleeping until later. (A count of the whole claim index read the
/// sleepers too and took the CPU a SQLite drain is measured by.)
async fn open_runs(store: &Store) -> Result<(i64, i64), StoreError> {
    let row: (i64, i64) = sqlx::query_as(crate::store::sql!(
        store,
        concat!(
            "SELECT (SELECT COUNT(*) FROM runs WHERE status = 'running'), (SELECT COUNT(*) FROM runs WHERE ",
            crate::claimable!(),
            " AND ",
            crate::eligible_at!(),
            " <= {now})"
        )
    ))
    .fetch_one(store.pool())
    .await?;
    Ok(row)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}
