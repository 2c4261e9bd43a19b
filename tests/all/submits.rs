//! A batch of submits is written once: when something fails after its
//! statement committed, the batch finds out what it wrote instead of
//! writing it again (a submit without an idempotency key would become two
//! runs, and repeat its effects).

use anyhow::{Result, ensure};
use leasehold::Backend;
use leasehold::store::NewRun;

use crate::harness::{TestDb, run_on};

fn submit(key: Option<&str>) -> NewRun {
    let mut new = NewRun::new("testkit", r#"{"steps":1}"#);
    new.idempotency_key = key.map(str::to_string);
    new
}

async fn runs(db: &TestDb) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(db.store.pool()).await?)
}

/// PostgreSQL only: the batch's read after its commit is what the killed
/// session breaks (SQLite writes and reads a batch in one transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_batch_whose_read_after_commit_dies_writes_each_run_once() -> Result<()> {
    run_on(Backend::Postgres, async |db: &TestDb| {
        let (first, _) = db.store.create_run(&submit(Some("taken"))).await?;
        // A taken key makes the batch read its holder after the commit.
        db.store.faults().kill_submit_reads(1);
        let batch = [submit(Some("taken")), submit(None), submit(None)];
        let created = db.store.create_runs(&batch).await;
        db.store.faults().kill_submit_reads(0);
        let created = match created {
            Ok(c) => c,
            // An error here, with the rows committed, sends the caller
            // round again: two runs for each submit without a key.
            Err(e) => anyhow::bail!("the batch failed though it was written ({} runs now): {e}", runs(db).await?),
        };
        ensure!(created.len() == 3, "{created:?}");
        ensure!(created[0].0.id == first.id && !created[0].1, "the taken key's run: {:?}", created[0]);
        ensure!(created[1].1 && created[2].1 && created[1].0.id != created[2].0.id, "{created:?}");
        ensure!(runs(db).await? == 3, "{} runs for 3 submits", runs(db).await?);
        Ok(())
    })
    .await
}
