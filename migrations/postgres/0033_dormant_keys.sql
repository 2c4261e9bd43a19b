-- Dormant keys (docs/flow-control.md, "Fair shares"): a key whose runs are
-- all asleep, waiting or leased (nothing claimable before `due_at`)
-- leaves the turns until then, so claims stop visiting it and a key that
-- has a run due is reached at once. A claim that serves a key and finds
-- nothing to take sets `due_at` to its runs' earliest eligible time (at
-- most 30 s on: a wake that went unseen costs that much at worst); a
-- submit, a run becoming claimable (its input arrives, it is retried) or a
-- run of the key due sooner (a suspend, a wake) brings it forward. Same
-- claim signature: hosts of the previous release call this one.
ALTER TABLE concurrency_keys ADD COLUMN due_at BIGINT;
CREATE INDEX concurrency_keys_ready ON concurrency_keys (turn, key) WHERE active AND NOT paused AND due_at IS NULL;
CREATE INDEX concurrency_keys_due ON concurrency_keys (due_at) WHERE active AND NOT paused AND due_at IS NOT NULL;

CREATE OR REPLACE FUNCTION leasehold_key_wakes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO concurrency_keys (key, active) VALUES (NEW.concurrency_key, true)
    ON CONFLICT (key) DO UPDATE SET active = true, due_at = NULL;
    RETURN NULL;
END
$$;

-- A keyed run due sooner than its dormant key: the key is due then. The
-- write is unconditional so that it takes the key's row lock, as
-- leasehold_key_wakes does: a claim putting the key to sleep at the same
-- moment is waited for, then corrected.
CREATE FUNCTION leasehold_key_due() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE concurrency_keys SET due_at = CASE WHEN due_at > NEW.not_before THEN NEW.not_before ELSE due_at END
    WHERE key = NEW.concurrency_key;
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_key_due AFTER UPDATE OF not_before, status ON runs FOR EACH ROW
    WHEN (NEW.concurrency_key <> '' AND NEW.status IN ('queued','waiting_takeover')
          AND (NEW.not_before IS DISTINCT FROM OLD.not_before OR NEW.status IS DISTINCT FROM OLD.status))
    EXECUTE FUNCTION leasehold_key_due();

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
    due BIGINT;
BEGIN
    -- Dormant keys whose time has come take turns again.
    UPDATE concurrency_keys SET due_at = NULL WHERE key IN (SELECT key FROM concurrency_keys
        WHERE active AND NOT paused AND due_at IS NOT NULL AND due_at <= now_ms ORDER BY due_at LIMIT lim FOR UPDATE SKIP LOCKED);
    SELECT array_agg(key ORDER BY turn, key), array_agg(concurrency ORDER BY turn, key) INTO ks, caps
    FROM (SELECT key, concurrency, turn FROM concurrency_keys WHERE active AND NOT paused AND due_at IS NULL
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
        IF got = 0 THEN
            -- Nothing to take now: the key leaves the turns until its
            -- earliest run is due, or for good if it has none.
            SELECT MIN(CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END) INTO due FROM runs
            WHERE (status IN ('queued','waiting_takeover','running')
                   OR (status = 'waiting_input' AND pending_input IS NOT NULL))
              AND concurrency_key = ks[k];
            IF due IS NULL THEN
                UPDATE concurrency_keys SET active = false WHERE key = ks[k];
            ELSIF due > now_ms THEN
                UPDATE concurrency_keys SET due_at = LEAST(due, now_ms + 30000) WHERE key = ks[k];
            END IF;
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
