//! The benchmarks, apart from the host's core: `leasehold bench claim`
//! ([`claim`]), `leasehold bench e2e` ([`e2e`]) and `leasehold bench drain`
//! ([`drain`], with [`peers`] beside it). Each measures the host
//! against a baseline in the same run and reports the ratio, which stays
//! meaningful on a noisy, shared machine.

pub mod claim;
mod command;
pub mod drain;
pub mod e2e;
mod peers;
pub mod progress;

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

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}
