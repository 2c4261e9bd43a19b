//! A resumed segment's view of its run's ledger: read a page at a time as
//! the replay reaches it, not whole at every segment start, so a long
//! ledger costs memory and reads in proportion to what is replayed.

use std::collections::HashMap;

use crate::store::{EffectRow, LedgerSummary, Store, StoreError};

/// Rows read per page.
const PAGE: i64 = 256;

/// The recorded ledger of a run, as far as one segment needs it.
pub struct Recorded {
    /// Where to read further pages; `None`: every row is already here.
    source: Option<(Store, i64)>,
    page: HashMap<i64, EffectRow>,
    /// The highest recorded seq; -1 when the ledger is empty.
    last_seq: i64,
    /// Rows and bytes the ledger held at segment start.
    pub(crate) rows: i64,
    pub(crate) bytes: i64,
}

impl Recorded {
    /// An empty ledger (a run's first segment).
    pub fn empty() -> Recorded {
        Recorded::from_rows(Vec::new())
    }

    /// A ledger held whole in memory (tests and benches).
    pub fn from_rows(rows: Vec<EffectRow>) -> Recorded {
        let last_seq = rows.iter().map(|r| r.seq).max().unwrap_or(-1);
        let bytes = rows.iter().map(|r| (r.name.len() + r.result.as_ref().map_or(0, String::len)) as i64).sum();
        Recorded { source: None, rows: rows.len() as i64, bytes, last_seq, page: rows.into_iter().map(|r| (r.seq, r)).collect() }
    }

    /// Run `run_id`'s ledger, described by `summary`, read from `store` in
    /// pages as it is needed.
    pub fn paged(store: Store, run_id: i64, summary: &LedgerSummary) -> Recorded {
        let last_seq = summary.last.as_ref().map_or(-1, |r| r.seq);
        let mut page = HashMap::new();
        if let Some(last) = &summary.last {
            page.insert(last.seq, last.clone());
        }
        Recorded { source: Some((store, run_id)), page, last_seq, rows: summary.rows, bytes: summary.bytes }
    }

    /// Whether `seq` is below the recorded frontier: a call there replays.
    pub fn replaying(&self, seq: i64) -> bool {
        seq <= self.last_seq
    }

    /// The row recorded at `seq`, reading its page first if need be.
    pub async fn get(&mut self, seq: i64) -> Result<Option<EffectRow>, StoreError> {
        if seq > self.last_seq || seq < 0 {
            return Ok(None);
        }
        if let Some(row) = self.page.get(&seq) {
            return Ok(Some(row.clone()));
        }
        let Some((store, run_id)) = &self.source else { return Ok(None) };
        let rows = store.effects_page(*run_id, seq, PAGE).await?;
        let last = self.page.remove(&self.last_seq);
        self.page = rows.into_iter().map(|r| (r.seq, r)).collect();
        if let Some(last) = last {
            self.page.insert(last.seq, last);
        }
        Ok(self.page.get(&seq).cloned())
    }
}
