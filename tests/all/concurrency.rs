//! Many workers on separate connections claiming from one queue.

use std::collections::HashSet;

use anyhow::ensure;
use leasehold::store::StoreError;

use crate::harness::{TTL, both};

both! {
    async fn concurrent_claimers_take_each_run_exactly_once(db) {
        const RUNS: i64 = 2_000;
        const WORKERS: usize = 8;
        ensure!(db.store.bulk_load_queued(RUNS, "p").await? == RUNS as u64);
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..WORKERS {
            // Its own pool and connection: a separate worker as far as the
            // database can tell. SQLite busy errors are retried inside the
            // store; any error that surfaces fails the test.
            let store = db.another_store(1).await?;
            tasks.spawn(async move {
                let owner = format!("worker-{w}");
                let mut mine = Vec::new();
                loop {
                    let batch = store.claim_batch(&owner, TTL, if w % 2 == 0 { 1 } else { 7 }).await?;
                    if batch.is_empty() {
                        break;
                    }
                    mine.extend(batch.into_iter().map(|c| (c.run.id, c.run.fence, c.run.attempt)));
                }
                store.shutdown().await;
                Ok::<_, StoreError>(mine)
            });
        }
        let mut all = Vec::new();
        let mut per_worker = Vec::new();
        while let Some(r) = tasks.join_next().await {
            let mine = r??;
            per_worker.push(mine.len());
            all.extend(mine);
        }
        let distinct: HashSet<i64> = all.iter().map(|c| c.0).collect();
        ensure!(all.len() == RUNS as usize, "{} claims for {RUNS} runs", all.len());
        ensure!(distinct.len() == RUNS as usize, "a run was claimed twice");
        ensure!(all.iter().all(|&(_, fence, attempt)| fence == 1 && attempt == 1));
        ensure!(db.store.claim("late", TTL).await?.is_none());
        eprintln!("{:?}: claims per worker {per_worker:?}", db.backend);
        Ok(())
    }
}
