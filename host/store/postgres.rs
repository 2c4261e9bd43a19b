//! The PostgreSQL dialect. Claims lock their rows with `FOR UPDATE SKIP
//! LOCKED`, so concurrent claimers on any number of hosts never wait on each
//! other and never take the same run.

use super::Dialect;

pub static DIALECT: Dialect = Dialect {
    // now() is the transaction's start: one consistent instant per statement.
    now: "(extract(epoch from now()) * 1000)::bigint",
    // Under READ COMMITTED, FOR UPDATE re-checks the WHERE clause on the
    // newest row version after locking it, so a run claimed or closed by a
    // concurrent transaction is skipped or dropped, never claimed twice.
    // FOR UPDATE is not allowed under UNION, hence one CTE per path; CTE
    // scans are pulled on demand, so `open` locks only the rows the LIMIT
    // takes. Expired leases first (resuming dead work), then open runs.
    claim: concat!(
        "WITH expired AS (SELECT id FROM runs WHERE ", crate::claim_expired!(),
        " ORDER BY lease_expires_at LIMIT $3 FOR UPDATE SKIP LOCKED), ",
        "open AS (SELECT id FROM runs WHERE ", crate::claim_open!(),
        " ORDER BY not_before, id LIMIT $3 FOR UPDATE SKIP LOCKED), ",
        "c AS (SELECT id FROM expired UNION ALL SELECT id FROM open LIMIT $3) ",
        "UPDATE runs r SET status = 'running', lease_owner = $1, fence = r.fence + 1, ",
        "attempt = r.attempt + 1, lease_expires_at = {now} + $2, heartbeat_at = {now}, updated_at = {now} ",
        "FROM c WHERE r.id = c.id RETURNING r.*"
    ),
    bulk_load: concat!(
        "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, created_at, updated_at) ",
        "SELECT 'bench-' || i, $2, '', '{}', $3, 3, {now}, {now}, {now} FROM generate_series(1, $1::bigint) AS s(i)"
    ),
    baseline_claim: "WITH c AS (SELECT id FROM runs WHERE status = 'queued' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) \
        UPDATE runs r SET status = 'running' FROM c WHERE r.id = c.id RETURNING r.id",
};
