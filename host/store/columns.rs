//! The columns a statement returns, spelled out. Templates say `{runs}`,
//! `{effects}` or `{events}` (or `{runs@r}` for `r.id, r.thread_id, …`)
//! where they would say `*`, and [`spell_out`] writes the list when the
//! statement is rendered.
//!
//! Why: a `*` grows when a later release adds a column, and a host of this
//! release still running beside it (a rolling upgrade) would then get rows
//! of a shape its prepared statements did not expect. sqlx's SQLite driver
//! panics on that (an index out of bounds in its worker thread, which
//! fails the statement and drops the connection); PostgreSQL refuses a
//! cached plan whose result type changed. A spelled-out list keeps its
//! shape.

/// Every column of `runs` this release reads (PostgreSQL's
/// `claim_token` is written and read in SQL only).
const RUNS: &[&str] = &[
    "id", "thread_id", "plugin", "plugin_digest", "input", "idempotency_key", "status", "lease_owner", "fence",
    "lease_expires_at", "attempt", "max_attempts", "heartbeat_at", "partial", "emit_pos", "pending_input", "output", "error",
    "not_before", "created_at", "updated_at", "finished_at", "started_at", "secret", "upgrade_checked", "upgrade_note",
    "partial_pos", "partial_seq", "priority", "concurrency_key", "parent_id", "root_id", "waiting_for", "paused_at",
    "rerun_of", "rerun_from", "schedule_id", "scheduled_at", "trace_parent",
];

const EFFECTS: &[&str] = &[
    "run_id", "seq", "name", "request_hash", "idempotency_key", "class", "state", "result", "emit_pos", "fence_started",
    "fence_completed", "created_at", "updated_at", "deltas", "delta_bytes", "request", "kv_bytes", "resolved_by", "resolved_at",
];

const EVENTS: &[&str] = &["thread_id", "seq", "run_id", "fence", "kind", "payload", "created_at"];

/// `sql` with each `{runs}`, `{effects}`, `{events}` (and `{…@alias}`)
/// replaced by the table's column list.
pub(crate) fn spell_out(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find('{') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let end = after.find('}');
        let spelled = end.and_then(|end| {
            let (table, alias) = match after[..end].split_once('@') {
                Some((t, a)) => (t, Some(a)),
                None => (&after[..end], None),
            };
            let columns = match table {
                "runs" => RUNS,
                "effects" => EFFECTS,
                "events" => EVENTS,
                _ => return None,
            };
            Some(
                columns
                    .iter()
                    .map(|c| match alias {
                        Some(a) => format!("{a}.{c}"),
                        None => (*c).to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        });
        match (spelled, end) {
            (Some(list), Some(end)) => {
                out.push_str(&list);
                rest = &after[end + 1..];
            }
            // Not a placeholder (a JSON literal, say): kept as it is.
            _ => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::spell_out;

    #[test]
    fn placeholders_become_column_lists_and_other_braces_stay() {
        assert_eq!(spell_out("SELECT {events} FROM events"), "SELECT thread_id, seq, run_id, fence, kind, payload, created_at FROM events");
        assert!(spell_out("SELECT {runs@r} FROM r").starts_with("SELECT r.id, r.thread_id, r.plugin,"));
        assert_eq!(spell_out("SELECT '{}'::bigint[], {x}"), "SELECT '{}'::bigint[], {x}");
    }
}
