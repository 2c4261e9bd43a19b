//! A run's streamed output (`partial`): flushes append delta events and
//! leave the stored text alone; the end of a run, a cut and a cancel fold
//! it; every read shows the whole stream.

use anyhow::{Result, ensure};
use leasehold::maintenance::reaper::{self, ReaperConfig};
use leasehold::store::{Claimed, NewRun, Outcome, RunStatus, Store};

use crate::harness::{TTL, TestDb, both};

async fn submit_and_claim(store: &Store, max_attempts: i64) -> Result<Claimed> {
    let mut new = NewRun::new("p", "{}");
    new.max_attempts = Some(max_attempts);
    store.create_run(&new).await?;
    store.claim("a", TTL).await?.ok_or_else(|| anyhow::anyhow!("nothing to claim"))
}

/// The stored column and its fold position, as the database holds them.
async fn stored(db: &TestDb, id: i64) -> Result<(String, i64)> {
    Ok(sqlx::query_as("SELECT partial, partial_pos FROM runs WHERE id = $1").bind(id).fetch_one(db.store.pool()).await?)
}

both! {
    async fn a_flush_appends_to_the_stream_without_rewriting_the_stored_partial(db) {
        let s = &db.store;
        let c = submit_and_claim(s, 3).await?;
        let id = c.run.id;
        let mut whole = String::new();
        for i in 0..40 {
            let (x, y) = (format!("<{i}"), format!("{i}>"));
            s.emit_deltas(&c.lease, &[&x, &y]).await?;
            whole.push_str(&x);
            whole.push_str(&y);
        }
        // Rewriting the stored text on every flush is quadratic in its
        // length; it is written once, when the run ends.
        ensure!(stored(db, id).await? == (String::new(), 0), "a flush rewrote runs.partial: {:?}", stored(db, id).await?);
        let run = s.get_run(id).await?;
        ensure!(run.partial == whole && run.emit_pos == 80, "{:?} at {}", run.partial, run.emit_pos);
        let listed = s.list_runs(None, None, None, 10).await?;
        ensure!(listed.len() == 1 && listed[0].partial == whole, "{:?}", listed[0].partial);
        s.close_with_deltas(&c.lease, &["tail"], &Outcome::Completed { output: "done".into() }).await?;
        whole.push_str("tail");
        ensure!(stored(db, id).await? == (whole.clone(), 81), "{:?}", stored(db, id).await?);
        ensure!(s.get_run(id).await?.partial == whole);
        Ok(())
    }

    async fn a_cut_stream_reads_back_only_the_deltas_that_stand(db) {
        let s = &db.store;
        let c = submit_and_claim(s, 3).await?;
        let id = c.run.id;
        s.emit_deltas(&c.lease, &["a", "b", "c"]).await?;
        ensure!(s.retract(&c.lease, 1).await? == 1);
        ensure!(stored(db, id).await? == ("a".to_string(), 1), "the cut folds: {:?}", stored(db, id).await?);
        s.emit_deltas(&c.lease, &["X", "Y"]).await?;
        let run = s.get_run(id).await?;
        ensure!(run.partial == "aXY" && run.emit_pos == 3, "{:?} at {}", run.partial, run.emit_pos);
        s.close_with_deltas(&c.lease, &["Z"], &Outcome::Completed { output: "done".into() }).await?;
        ensure!(stored(db, id).await? == ("aXYZ".to_string(), 4), "{:?}", stored(db, id).await?);
        Ok(())
    }

    async fn a_cancel_and_an_abort_fold_the_stream(db) {
        let s = &db.store;
        let c = submit_and_claim(s, 3).await?;
        s.emit_deltas(&c.lease, &["one ", "two"]).await?;
        let cancelled = s.cancel(c.run.id).await?;
        ensure!(cancelled.status == RunStatus::Cancelled && cancelled.partial == "one two", "{:?}", cancelled.partial);
        ensure!(stored(db, c.run.id).await? == ("one two".to_string(), 2), "{:?}", stored(db, c.run.id).await?);

        let c = submit_and_claim(s, 1).await?;
        s.emit_deltas(&c.lease, &["half ", "answer"]).await?;
        db.backdate_lease(c.run.id, TTL.as_millis() as i64 + 1).await?;
        let report = reaper::tick(s, &ReaperConfig::default()).await?;
        ensure!(report.aborted == vec![c.run.id], "{report:?}");
        let run = s.get_run(c.run.id).await?;
        ensure!(run.output.as_deref() == Some("half answer"), "the abort salvages the stream: {:?}", run.output);
        ensure!(stored(db, c.run.id).await? == ("half answer".to_string(), 2), "{:?}", stored(db, c.run.id).await?);
        Ok(())
    }
}
