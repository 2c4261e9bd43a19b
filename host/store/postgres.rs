//! The PostgreSQL dialect. Claims lock their rows with `FOR UPDATE SKIP
//! LOCKED`, so concurrent claimers on any number of hosts never wait on each
//! other and never take the same run.

use super::Dialect;

/// The claim as two CTEs: `c` locks up to `$limit` claimable runs, never
/// one whose id is in the `bigint[]` expression `$skip`, through the
/// `leasehold_claimable` function (migrations 0004 and 0012: it reads the
/// claim index one priority at a time, each in order, never sorting the
/// queue), and numbers them (`k`, from 1) and
/// reads the clock once a run (`t`: a lease runs from when it is given,
/// not from when the statement began, which may have waited on locks); `n`
/// leases them to `$owner` for `$ttl` ms, counts an attempt for those that
/// meet `$charge` (a condition on `c.k`), and returns their rows with
/// `charged`, and writes `$token` on them (`claim_token`, negated on those
/// it did not charge: see `store::orphans`). Shared by the claim statement and the close
/// that claims the next run (`Store::close_and_claim`).
///
/// A run inserted after this statement's snapshot can be locked by the
/// function (which takes its own) and then not be seen by `n`: it stays
/// queued and the claim returns fewer runs, which its caller handles as a
/// short queue (the dispatcher then waits for a wake-up or its poll).
macro_rules! claim_ctes {
    ($owner:literal, $ttl:literal, $limit:literal, $skip:literal, $charge:literal, $token:literal) => {
        concat!(
            "c AS (SELECT f.id, row_number() OVER () AS k, {clock} AS t FROM leasehold_claimable(", $limit, ", ", $skip, ") AS f(id)), ",
            "n AS (UPDATE runs x SET status = 'running', lease_owner = ", $owner, ", fence = x.fence + 1, ",
            "attempt = x.attempt + CASE WHEN ", $charge, " THEN 1 ELSE 0 END, lease_expires_at = c.t + ", $ttl,
            ", heartbeat_at = c.t, claim_token = CASE WHEN ", $charge, " THEN (", $token, ")::bigint ELSE -(", $token, ")::bigint END, updated_at = {now}, started_at = COALESCE(x.started_at, {now}) ",
            "FROM c WHERE x.id = c.id RETURNING {runs@x}, (", $charge, ") AS charged)"
        )
    };
}
pub(crate) use claim_ctes;

macro_rules! claim {
    () => {
        concat!("WITH ", claim_ctes!("$1", "$2", "$3", "'{}'::bigint[]", "c.k <= $4", "$5"), " SELECT * FROM n")
    };
}

macro_rules! baseline {
    () => {
        concat!(
            "WITH c AS (SELECT id FROM runs WHERE ", crate::claimable!(),
            " AND priority = 0 AND ", crate::eligible_at!(), " <= {now}",
            " ORDER BY ", crate::eligible_at!(), ", id LIMIT $1 FOR UPDATE SKIP LOCKED) ",
            "UPDATE runs r SET status = 'running' FROM c WHERE r.id = c.id RETURNING r.id"
        )
    };
}

pub static DIALECT: Dialect = Dialect {
    // now() is the transaction's start: one consistent instant per statement.
    now: "(extract(epoch from now()) * 1000)::bigint",
    clock: "(extract(epoch from clock_timestamp()) * 1000)::bigint",
    unfolded: "CASE WHEN runs.emit_pos > runs.partial_pos THEN COALESCE((SELECT string_agg(e.payload::jsonb ->> 'delta', '' ORDER BY e.seq) FROM events e \
               WHERE e.run_id = runs.id AND e.kind = 'delta' AND e.seq > runs.partial_seq), '') ELSE '' END",
    // Under READ COMMITTED, FOR UPDATE re-checks the WHERE clause on the
    // newest row version after locking it, so a run claimed or closed by a
    // concurrent transaction is skipped or dropped, never claimed twice.
    claim: claim!(),
    claim_one: claim!(),
    bulk_load: concat!(
        "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, created_at, updated_at) ",
        "SELECT 'bench-' || i, $2, '', '{}', $3, 3, {now}, {now}, {now} FROM generate_series(1, $1::bigint) AS s(i)"
    ),
    // The claim's own index path (runs_claim, at the benches' one
    // priority), so the ratio measures what the protocol adds: fence,
    // attempt, lease, priorities and the returned row.
    // (Ordering by id instead let the planner walk the primary key past
    // every claimed row.)
    baseline_claim: baseline!(),
    baseline_claim_one: baseline!(),
};
