//! A text search (`q=`) reads runs a window at a time and starts no window
//! once its time is up: a search for text no run holds no longer reads the
//! whole table in one statement that runs on after its request timed out.

use std::time::Duration;

use anyhow::ensure;
use leasehold::store::search::WINDOW;
use leasehold::store::{NewRun, RunFilter, RunStatus};

use crate::harness::both;

both! {
    async fn a_search_out_of_time_stops_after_one_window_and_says_where_to_go_on(db) {
        let (needle, _) = db.store.create_run(&NewRun::new("testkit", r#"{"find":"needle"}"#)).await?;
        let n = 2 * WINDOW + 10;
        db.store.bulk_load(n, "testkit", RunStatus::Completed).await?;
        let filter = RunFilter { text: Some("NEEDLE".into()), ..RunFilter::default() };
        // No time at all: each page reads one window.
        let mut cursor = None;
        let mut pages = 0;
        let found = loop {
            let page = db.store.search_runs(&filter, cursor, 50, i64::MAX, Duration::ZERO).await?;
            pages += 1;
            ensure!(pages <= 4, "{pages} pages for {} runs in windows of {WINDOW}", n + 1);
            if let Some(run) = page.runs.first() {
                ensure!(page.next_cursor.is_none(), "the last page has no cursor: {:?}", page.next_cursor);
                break run.id;
            }
            let next = page.next_cursor.ok_or_else(|| anyhow::anyhow!("an empty page without a cursor on page {pages}"))?;
            if let Some(before) = cursor {
                ensure!(before - next == WINDOW, "page {pages} read {} ids, not one window", before - next);
            }
            cursor = Some(next);
        };
        ensure!(found == needle.id && pages == 3, "found {found} on page {pages}");
        // With time to spare, one page finds it.
        let page = db.store.search_runs(&filter, None, 50, i64::MAX, Duration::from_secs(60)).await?;
        ensure!(page.runs.len() == 1 && page.runs[0].id == needle.id && page.next_cursor.is_none(), "{:?}", page.next_cursor);
        Ok(())
    }
}
