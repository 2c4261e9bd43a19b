//! Criterion: one claim (the lease statement) against the raw baseline
//! (`UPDATE … RETURNING` setting only the status), on SQLite, and on
//! PostgreSQL when `LEASEHOLD_BENCH_DATABASE_URL` names a database that holds
//! no runs. Compare the two lines of a backend, not absolute numbers.

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use leasehold::bench::BENCH_PLUGIN;
use leasehold::store::{Store, baseline_sql};

fn bench_backend(c: &mut Criterion, name: &str, url: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(Store::connect(url)).expect("connect");
    let mut group = c.benchmark_group(format!("claim/{name}"));
    group.measurement_time(Duration::from_secs(3));

    group.bench_function("lease_claim", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let store = store.clone();
            async move {
                reload(&store, iters).await;
                let start = Instant::now();
                for _ in 0..iters {
                    store.claim("bench", Duration::from_secs(60)).await.unwrap().unwrap();
                }
                start.elapsed()
            }
        })
    });
    group.bench_function("baseline", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let store = store.clone();
            async move {
                reload(&store, iters).await;
                let sql = baseline_sql(&store, 1);
                let start = Instant::now();
                for _ in 0..iters {
                    let n = sqlx::query(sql).bind(1_i64).fetch_all(store.pool()).await.unwrap().len();
                    assert_eq!(n, 1);
                }
                start.elapsed()
            }
        })
    });
    group.finish();
    rt.block_on(async {
        sqlx::query("DELETE FROM runs WHERE plugin = $1").bind(BENCH_PLUGIN).execute(store.pool()).await.unwrap();
        store.shutdown().await;
    });
}

async fn reload(store: &Store, n: u64) {
    sqlx::query("DELETE FROM runs WHERE plugin = $1").bind(BENCH_PLUGIN).execute(store.pool()).await.unwrap();
    store.bulk_load_queued(n as i64, BENCH_PLUGIN).await.unwrap();
}

fn claim(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    bench_backend(c, "sqlite", &url);
    if let Ok(url) = std::env::var("LEASEHOLD_BENCH_DATABASE_URL") {
        bench_backend(c, "postgres", &url);
    }
}

criterion_group!(benches, claim);
criterion_main!(benches);
