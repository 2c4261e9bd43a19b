-- Keys' turns serve up to 4 runs each (docs/flow-control.md, "Fair
-- shares"): leasehold_claimable as in 0013, but a lane's share of a batch
-- is at least 4 runs. A batch of 64 over 1,000 keys served 64 keys a run
-- each, and each key served costs a count of its slots, a read of its lane
-- and its turn; now about 16 keys serve it. The keys the claim locked and
-- did not reach keep their turn, so they come first next time. Same
-- signature: hosts of the previous release call this one.
CREATE OR REPLACE FUNCTION leasehold_claimable(lim BIGINT, skip BIGINT[]) RETURNS SETOF BIGINT
LANGUAGE plpgsql VOLATILE ROWS 1
SET enable_sort = off
SET enable_indexscan = on
AS $$
DECLARE
    now_ms BIGINT := (extract(epoch from now()) * 1000)::bigint;
    ks TEXT[];
    caps BIGINT[];
    rooms BIGINT[];
    more BOOLEAN[];
    n INT;
    u INT;
    k INT;
    served INT := 0;
    plain_more BOOLEAN := false;
    share BIGINT;
    wanted BIGINT := lim;
    take BIGINT;
    ids BIGINT[];
    -- What this claim has taken: a lane read again must step over them
    -- (SKIP LOCKED skips only other transactions' locks).
    taken BIGINT[] := '{}';
    got BIGINT;
BEGIN
    SELECT array_agg(key ORDER BY turn, key), array_agg(concurrency ORDER BY turn, key) INTO ks, caps
    FROM (SELECT key, concurrency, turn FROM concurrency_keys WHERE active AND NOT paused
          ORDER BY turn, key LIMIT lim FOR UPDATE SKIP LOCKED) t;
    IF ks IS NULL THEN
        RETURN QUERY SELECT * FROM leasehold_claim_lane('', lim, skip);
        RETURN;
    END IF;
    n := array_length(ks, 1);
    -- A key's turn serves up to 4 of its runs (the quantum), or its fair
    -- share when that is more: fewer keys served a batch, so fewer
    -- counts, lane reads and turns per run claimed.
    share := GREATEST(4, lim / (n + 1));
    u := floor(random() * (n + 1))::int + 1;
    rooms := array_fill(0::bigint, ARRAY[n]);
    more := array_fill(false, ARRAY[n]);
    FOR i IN 1..n + 1 LOOP
        EXIT WHEN wanted <= 0;
        IF i = u THEN
            take := LEAST(share, wanted);
            ids := ARRAY(SELECT leasehold_claim_lane('', take, skip));
            got := COALESCE(array_length(ids, 1), 0);
            taken := taken || ids;
            RETURN QUERY SELECT unnest(ids);
            wanted := wanted - got;
            plain_more := got = take;
            CONTINUE;
        END IF;
        k := CASE WHEN i > u THEN i - 1 ELSE i END;
        served := k;
        -- Slots: the key's running runs whose lease is live, read after
        -- taking the key's row (a fresh snapshot), so a host that admitted
        -- runs of this key before us has committed them.
        rooms[k] := CASE WHEN caps[k] IS NULL THEN lim ELSE caps[k] - (SELECT COUNT(*) FROM runs
            WHERE status = 'running' AND concurrency_key <> '' AND concurrency_key = ks[k]
              AND lease_expires_at >= now_ms) END;
        take := LEAST(rooms[k], share, wanted);
        CONTINUE WHEN take <= 0;
        ids := ARRAY(SELECT leasehold_claim_lane(ks[k], take, skip));
        got := COALESCE(array_length(ids, 1), 0);
        taken := taken || ids;
        RETURN QUERY SELECT unnest(ids);
        wanted := wanted - got;
        rooms[k] := rooms[k] - got;
        more[k] := got = take AND rooms[k] > 0;
        IF got = 0 AND NOT EXISTS (SELECT 1 FROM runs
            WHERE (status IN ('queued','waiting_takeover','running')
                   OR (status = 'waiting_input' AND pending_input IS NOT NULL))
              AND concurrency_key = ks[k]) THEN
            UPDATE concurrency_keys SET active = false WHERE key = ks[k];
        END IF;
    END LOOP;
    IF wanted > 0 AND plain_more THEN
        ids := ARRAY(SELECT leasehold_claim_lane('', wanted, skip || taken));
        RETURN QUERY SELECT unnest(ids);
        wanted := wanted - COALESCE(array_length(ids, 1), 0);
    END IF;
    FOR k IN 1..served LOOP
        EXIT WHEN wanted <= 0;
        CONTINUE WHEN NOT more[k];
        ids := ARRAY(SELECT leasehold_claim_lane(ks[k], LEAST(rooms[k], wanted), skip || taken));
        RETURN QUERY SELECT unnest(ids);
        wanted := wanted - COALESCE(array_length(ids, 1), 0);
    END LOOP;
    UPDATE concurrency_keys SET turn = now_ms WHERE key = ANY (ks[1:served]);
END
$$;
