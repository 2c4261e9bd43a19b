-- Takeovers first (docs/design.md, "How claims work"): in each lane, a
-- run whose lease ran out (its host died, its in-doubt calls waiting to be
-- settled) is claimed before any queued run, whatever their priorities,
-- oldest expiry first, so a backlog of a higher priority never starves it;
-- a paused one is left to the reaper, which parks it. Then the lane's
-- priorities as before, without the runs the first read took or could
-- not. The takeovers' read walks runs_lease in its order (no sort, which
-- this function turns off). Same signature: hosts of the previous release
-- call this one.
CREATE OR REPLACE FUNCTION leasehold_claim_lane(lane TEXT, lim BIGINT, skip BIGINT[]) RETURNS SETOF BIGINT
LANGUAGE plpgsql VOLATILE ROWS 1
SET enable_sort = off
SET enable_indexscan = on
AS $$
DECLARE
    lvl BIGINT;
    below BIGINT;
    wanted BIGINT := lim;
    got BIGINT;
    now_ms BIGINT := (extract(epoch from now()) * 1000)::bigint;
    overs BIGINT[];
BEGIN
    IF wanted <= 0 THEN
        RETURN;
    END IF;
    overs := ARRAY(SELECT id FROM runs
        WHERE status = 'running' AND lease_expires_at < now_ms AND concurrency_key = lane
          AND attempt < max_attempts AND paused_at IS NULL AND NOT (id = ANY (skip))
        ORDER BY lease_expires_at
        LIMIT wanted
        FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT unnest(overs);
    wanted := wanted - COALESCE(array_length(overs, 1), 0);
    IF wanted <= 0 THEN
        RETURN;
    END IF;
    SELECT GREATEST(0, (SELECT priority FROM runs
        WHERE (status IN ('queued','waiting_takeover','running')
               OR (status = 'waiting_input' AND pending_input IS NOT NULL)) AND priority <> 0
          AND concurrency_key = lane
        ORDER BY priority DESC LIMIT 1)) INTO lvl;
    LOOP
        RETURN QUERY
        SELECT id FROM runs
        WHERE (status IN ('queued','waiting_takeover','running')
               OR (status = 'waiting_input' AND pending_input IS NOT NULL))
          AND concurrency_key = lane
          AND priority = lvl
          AND (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END)
              <= (extract(epoch from now()) * 1000)::bigint
          AND attempt < max_attempts
          AND status <> 'running'
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
          AND concurrency_key = lane
          AND priority < lvl
        ORDER BY priority DESC LIMIT 1;
        lvl := CASE WHEN lvl > 0 THEN GREATEST(0, below) ELSE below END;
        EXIT WHEN lvl IS NULL;
    END LOOP;
END
$$;
