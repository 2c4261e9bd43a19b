-- Priority: a run of higher priority is claimed first; within one
-- priority, runs go in the order they became eligible (as before). Every
-- existing run has priority 0, so the claim order of a database that uses
-- none is unchanged.
--
-- runs_claim now leads with the priority, and the claim
-- (leasehold_claimable) reads it one priority at a time, highest first,
-- each in eligible order as before: a single scan ordered by (priority,
-- eligible time) would step over every not-yet-eligible run (leased or
-- asleep) of each higher priority on every claim. The priorities in use
-- other than 0 come from runs_priority, a partial index that is empty
-- while no run has another priority: so a database that uses none pays
-- two probes of an empty index per claim, and never walks runs_claim's
-- head twice (its dead entries, on a server without autovacuum, are what
-- a claim already reads the most of). Building the indexes locks the
-- table against writes for as long as the build takes.
ALTER TABLE runs ADD COLUMN priority BIGINT NOT NULL DEFAULT 0;
DROP INDEX runs_claim;
CREATE INDEX runs_claim ON runs (priority DESC, (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END), id)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL));
CREATE INDEX runs_priority ON runs (priority)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL)) AND priority <> 0;

-- As in 0004, planned on its own with sorting off; now one pass per
-- priority, highest first (those of runs_priority above 0, then 0, then
-- those below), until `lim` runs are locked. The conditions and order
-- must stay identical to claimable!/eligible_at! in host/store/claims.rs
-- and to the indexes'.
CREATE OR REPLACE FUNCTION leasehold_claimable(lim BIGINT, skip BIGINT[]) RETURNS SETOF BIGINT
LANGUAGE plpgsql VOLATILE ROWS 1
SET enable_sort = off
SET enable_indexscan = on
AS $$
DECLARE
    lvl BIGINT;
    below BIGINT;
    wanted BIGINT := lim;
    got BIGINT;
BEGIN
    -- GREATEST ignores a NULL: 0 when no run has a priority above it.
    SELECT GREATEST(0, (SELECT priority FROM runs
        WHERE (status IN ('queued','waiting_takeover','running')
               OR (status = 'waiting_input' AND pending_input IS NOT NULL)) AND priority <> 0
        ORDER BY priority DESC LIMIT 1)) INTO lvl;
    LOOP
        RETURN QUERY
        SELECT id FROM runs
        WHERE (status IN ('queued','waiting_takeover','running')
               OR (status = 'waiting_input' AND pending_input IS NOT NULL))
          AND priority = lvl
          AND (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END)
              <= (extract(epoch from now()) * 1000)::bigint
          AND attempt < max_attempts
          AND NOT (id = ANY (skip))
        ORDER BY (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END), id
        LIMIT wanted
        FOR UPDATE SKIP LOCKED;
        GET DIAGNOSTICS got = ROW_COUNT;
        wanted := wanted - got;
        EXIT WHEN wanted <= 0;
        SELECT priority INTO below FROM runs
        WHERE (status IN ('queued','waiting_takeover','running')
               OR (status = 'waiting_input' AND pending_input IS NOT NULL)) AND priority <> 0
          AND priority < lvl
        ORDER BY priority DESC LIMIT 1;
        -- From above 0, priority 0 comes next unless a higher one is left.
        lvl := CASE WHEN lvl > 0 THEN GREATEST(0, below) ELSE below END;
        EXIT WHEN lvl IS NULL;
    END LOOP;
END
$$;
