//! The vacuum loop (PostgreSQL): `runs` is vacuumed once its dead row
//! versions pass the threshold, so claims do not walk finished runs' dead
//! index entries; on SQLite it does nothing.

use std::time::Duration;

use anyhow::{bail, ensure};
use leasehold::Backend;
use leasehold::store::NewRun;
use leasehold::maintenance::vacuum::{self, Tick, VacuumConfig};

use crate::harness::{both, eventually_some};

both! {
    async fn runs_is_vacuumed_once_its_dead_rows_pass_the_threshold(db) {
        let config = VacuumConfig { dead_rows: 500, scale: 0.0 };
        if db.store.backend() == Backend::Sqlite {
            ensure!(vacuum::tick(&db.store, &config).await? == Tick::Off, "SQLite has nothing to vacuum");
            return Ok(());
        }
        ensure!(vacuum::tick(&db.store, &VacuumConfig { dead_rows: 0, ..config.clone() }).await? == Tick::Off, "0 is off");
        let news: Vec<NewRun> = (0..1000).map(|i| NewRun::new("testkit", i.to_string())).collect();
        db.store.create_runs(&news).await?;
        // Two new versions of each row, as a claim and a close write; on
        // one connection, whose statistics are flushed at once after.
        let mut conn = db.store.pool().acquire().await?;
        for _ in 0..2 {
            sqlx::query("UPDATE runs SET not_before = not_before + 1").execute(&mut *conn).await?;
        }
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await?;
        drop(conn);
        // Ticked until it vacuums; the last tick's answer if it never does.
        let last = std::cell::RefCell::new(String::new());
        let dead = eventually_some(Duration::from_secs(15), async || Ok(format!("not vacuumed: {}", last.borrow())), async || {
            match vacuum::tick(&db.store, &config).await? {
                Tick::Vacuumed { dead, .. } => Ok(Some(dead)),
                waiting @ Tick::Waiting { .. } => {
                    *last.borrow_mut() = format!("{waiting:?}");
                    Ok(None)
                }
                other => bail!("not vacuumed: {other:?}"),
            }
        })
        .await?;
        ensure!(dead >= 1000, "{dead} dead rows");
        // Counted as gone: the next tick has nothing to do.
        match vacuum::tick(&db.store, &config).await? {
            Tick::Waiting { dead, threshold } => ensure!(dead < threshold, "{dead} dead rows left"),
            other => bail!("vacuumed again: {other:?}"),
        }
        Ok(())
    }
}
