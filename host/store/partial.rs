//! A run's streamed output so far (`Run::partial`), kept without rewriting.
//!
//! A flush of streamed output appends `delta` events and moves `emit_pos`
//! on; it leaves `runs.partial` alone, because rewriting a growing text on
//! every flush is quadratic in its length. The text is *folded* into
//! `runs.partial` only when the run ends (close, abort, cancel) or its
//! stream is cut (`retract`): `runs.partial` then holds the stream up to
//! emit position `partial_pos`, and the run's events numbered after
//! `partial_seq` hold the rest. Readers join the two ([`Store::unfold`]);
//! statements that fold use the dialect's `{unfolded}` expression.
//!
//! A fold at the end moves only `partial_pos` (the close's own events are
//! numbered in the same statement): an ended run never streams again.

use sqlx::Row;

use crate::store::log::kind;
use crate::store::{Run, Store, StoreError, sql};

/// Where `runs.partial` stops: the emit position it reaches and the last
/// thread event it was folded from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Folded {
    pub pos: i64,
    pub seq: i64,
}

impl Folded {
    pub(crate) fn from_row(row: &sqlx::any::AnyRow) -> Result<Folded, StoreError> {
        Ok(Folded { pos: row.try_get("partial_pos")?, seq: row.try_get("partial_seq")? })
    }
}

/// The deltas that stand after `events` (a run's `delta` and `retract`
/// events numbered after its fold, in log order), joined, for a stream
/// whose first `base` positions are folded already. A delta below `base`
/// was folded (a read that raced a fold) and is skipped.
pub(crate) fn unfolded_text<'a>(base: i64, events: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut stream: Vec<String> = Vec::new();
    for (kind, payload) in events {
        let v: serde_json::Value = serde_json::from_str(payload).unwrap_or_default();
        match kind {
            kind::DELTA => {
                let Some(at) = v["pos"].as_i64().and_then(|p| usize::try_from(p - base).ok()) else { continue };
                stream.truncate(at);
                if stream.len() == at {
                    stream.push(v["delta"].as_str().unwrap_or_default().to_string());
                }
            }
            kind::RETRACT => stream.truncate(usize::try_from(v["from"].as_i64().unwrap_or(0) - base).unwrap_or(0)),
            _ => {}
        }
    }
    stream.concat()
}

impl Store {
    /// Completes `run.partial` with the deltas not yet folded into it; no
    /// read when there are none (every ended run, most others).
    pub(crate) async fn unfold(&self, run: &mut Run) -> Result<(), StoreError> {
        if run.emit_pos <= run.folded.pos {
            return Ok(());
        }
        let rows = sqlx::query(sql!(
            self,
            "SELECT kind, payload FROM events WHERE run_id = $1 AND seq > $2 AND kind IN ('delta', 'retract') ORDER BY seq"
        ))
        .bind(run.id)
        .bind(run.folded.seq)
        .fetch_all(self.pool())
        .await?;
        let events = rows
            .iter()
            .map(|r| Ok((r.try_get::<String, _>("kind")?, r.try_get::<String, _>("payload")?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        run.partial.push_str(&unfolded_text(run.folded.pos, events.iter().map(|(k, p)| (k.as_str(), p.as_str()))));
        Ok(())
    }

    /// [`Store::unfold`] for each of `runs`.
    pub(crate) async fn unfold_all(&self, runs: &mut [Run]) -> Result<(), StoreError> {
        for run in runs {
            self.unfold(run).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::unfolded_text;

    #[test]
    fn unfolded_text_applies_retracts_and_skips_folded_positions() {
        let ev = [
            ("delta", r#"{"pos":2,"delta":"c"}"#),
            ("delta", r#"{"pos":3,"delta":"d"}"#),
            ("retract", r#"{"from":3,"to":4}"#),
            ("delta", r#"{"pos":3,"delta":"D"}"#),
            ("delta", r#"{"pos":1,"delta":"folded"}"#),
            ("delta", r#"{"pos":4,"delta":"e"}"#),
        ];
        assert_eq!(unfolded_text(2, ev), "cDe");
        assert_eq!(unfolded_text(0, [("delta", r#"{"pos":0,"delta":"a"}"#), ("delta", r#"{"pos":2,"delta":"gap"}"#)]), "a");
    }
}
