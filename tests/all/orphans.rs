//! A claim, or a close that claims the next run, whose reply is lost after
//! the server committed it leaves runs leased to a host that does not know
//! it holds them. They are found by the statement's token and handed back
//! at once, with the attempt the claim counted: not left to wait out their
//! leases and then cost an attempt (a run allowed one would be aborted
//! without ever running).

use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::Backend;
use leasehold::store::{NewRun, Outcome, RunStatus};

use crate::harness::{TestDb, run_on};

const TTL: Duration = Duration::from_secs(30);

async fn one_shot_runs(db: &TestDb, n: usize) -> Result<Vec<i64>> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let mut new = NewRun::new("testkit", r#"{"steps":1}"#);
        new.max_attempts = Some(1);
        ids.push(db.store.create_run(&new).await?.0.id);
    }
    Ok(ids)
}

/// PostgreSQL only: SQLite's claims run in-process and roll back when
/// they fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_gives_its_runs_back_with_their_attempts() -> Result<()> {
    run_on(Backend::Postgres, async |db: &TestDb| {
        let ids = one_shot_runs(db, 3).await?;
        db.store.faults().lose_claim_replies(1);
        let lost = db.store.claim_batch_charging("lost", TTL, 3, 2).await;
        ensure!(lost.is_err(), "the claim's reply was lost, yet it answered {lost:?}");
        let got = db.store.claim_batch("other", TTL, 3).await?;
        let mut got_ids: Vec<i64> = got.iter().map(|c| c.run.id).collect();
        got_ids.sort();
        ensure!(got_ids == ids, "another host claims them at once: {got_ids:?}, want {ids:?}");
        for c in &got {
            ensure!(c.run.attempt == 1, "run {} is on attempt {} (the lost claim's was returned)", c.run.id, c.run.attempt);
        }
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_whose_reply_is_lost_gives_back_the_run_it_claimed() -> Result<()> {
    run_on(Backend::Postgres, async |db: &TestDb| {
        let ids = one_shot_runs(db, 2).await?;
        let first = db.store.claim("h", TTL).await?.expect("a run");
        ensure!(first.run.id == ids[0]);
        db.store.faults().lose_claim_replies(1);
        let out = Outcome::Completed { output: "\"done\"".into() };
        let lost = db.store.close_and_claim(&first.lease, &[], &[], &out, Some(("h", TTL))).await;
        ensure!(lost.is_err(), "the close's reply was lost, yet it answered {lost:?}");
        ensure!(db.store.get_run(ids[0]).await?.status == RunStatus::Completed, "the close itself was written");
        let next = db.store.claim("other", TTL).await?;
        let next = next.ok_or_else(|| anyhow::anyhow!("the run the lost close claimed is not claimable"))?;
        ensure!(next.run.id == ids[1] && next.run.attempt == 1, "{:?}", next.run);
        Ok(())
    })
    .await
}
