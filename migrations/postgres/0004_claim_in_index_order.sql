-- The runs a claim takes, chosen by a statement planned on its own, with
-- sorting turned off: it can only read runs_claim in order and stop after
-- `lim` runs, however few claimable runs the planner believes there are.
--
-- Why: inside the larger claim and close statements, PostgreSQL caches a
-- generic plan after five executions, costed with the table as it was
-- then. Planned while the queue was small, that plan reads every claimable
-- run through a bitmap scan and sorts them all to take the first few, so
-- each claim costs time in proportion to the queue. Measured with
-- `leasehold bench e2e --runs 20000 --concurrency 8`: the close batch took
-- 1.1 ms with an empty queue and 6.7 ms with 11000 runs queued, and the
-- peak fell to 885-1140 runs/s.
--
-- ROWS 1: the callers join its ids to runs by primary key; the default
-- estimate (1000 rows) turned that join into a scan of the whole table.
-- VOLATILE because it locks rows. Called from a statement that has already
-- written (a close), it sees that statement's writes; `skip` excludes the
-- statement's own runs anyway. The condition and order must stay identical
-- to claimable!/eligible_at! in host/lib.rs and to runs_claim's.
CREATE FUNCTION leasehold_claimable(lim BIGINT, skip BIGINT[]) RETURNS SETOF BIGINT
LANGUAGE plpgsql VOLATILE ROWS 1
SET enable_sort = off
SET enable_indexscan = on
AS $$
BEGIN
    RETURN QUERY
    SELECT id FROM runs
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL))
      AND (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END)
          <= (extract(epoch from now()) * 1000)::bigint
      AND attempt < max_attempts
      AND NOT (id = ANY (skip))
    ORDER BY (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END), id
    LIMIT lim
    FOR UPDATE SKIP LOCKED;
END
$$;
