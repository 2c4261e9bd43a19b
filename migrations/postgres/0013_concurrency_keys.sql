-- Concurrency keys (docs/flow-control.md). A run may carry a key (a
-- tenant, a user, a document); '' is no key, so a run without one keeps
-- today's claim path. A key may have a limit: at most `concurrency` of its
-- runs hold a slot at once, and a slot is held only by a `running` run
-- whose lease is live. Nothing counts slots: each claim counts them
-- afresh, so a run that dies, sleeps, waits or is cancelled gives its slot
-- back by that fact alone.
--
-- runs_claim now leads with the key: each key's claimable runs are a lane
-- of their own, read in priority then eligible order as before, so a key
-- at its limit, however long its queue, costs the other keys nothing.
-- Keys take turns: concurrency_keys.turn orders the keys that have
-- claimable runs (active), least recently served first, and a claim
-- serves each key it takes (FOR UPDATE SKIP LOCKED, which also makes two
-- hosts admit one key's runs one after the other) at most a fair share of
-- its batch. Building the indexes locks the table against writes for as
-- long as the build takes.
ALTER TABLE runs ADD COLUMN concurrency_key TEXT NOT NULL DEFAULT '';

CREATE TABLE concurrency_keys (
    key TEXT PRIMARY KEY,
    -- NULL: no limit (the key's runs still take turns with other keys).
    concurrency BIGINT CHECK (concurrency IS NULL OR concurrency >= 0),
    paused BOOLEAN NOT NULL DEFAULT false,
    -- Has (or may have) claimable runs: set by a submit and by a run that
    -- becomes claimable again (trigger below), cleared by a claim that
    -- finds none. Only active keys take turns.
    active BOOLEAN NOT NULL DEFAULT false,
    -- The database's now (ms) when a claim last served the key.
    turn BIGINT NOT NULL DEFAULT 0,
    updated_at BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX concurrency_keys_turn ON concurrency_keys (turn, key) WHERE active AND NOT paused;
-- The keys the cleaner forgets: no limit, no pause, nothing to claim.
CREATE INDEX concurrency_keys_idle ON concurrency_keys (key) WHERE NOT active AND concurrency IS NULL AND NOT paused;

DROP INDEX runs_claim;
DROP INDEX runs_priority;
CREATE INDEX runs_claim ON runs (concurrency_key, priority DESC, (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END), id)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL));
CREATE INDEX runs_priority ON runs (concurrency_key, priority)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL)) AND priority <> 0;
-- The slots a key's runs hold: its running runs (live or not).
CREATE INDEX runs_key_running ON runs (concurrency_key, lease_expires_at)
    WHERE status = 'running' AND concurrency_key <> '';

-- A keyed run that becomes claimable again (its input arrives, an
-- operator retries it) makes its key active. The write is unconditional
-- so that it takes the key's row lock: a claim deciding the key has
-- nothing left either skips the key while this transaction holds it or
-- is waited for and then overwritten.
CREATE FUNCTION leasehold_key_wakes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO concurrency_keys (key, active) VALUES (NEW.concurrency_key, true)
    ON CONFLICT (key) DO UPDATE SET active = true;
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_key_wakes AFTER UPDATE OF status, pending_input ON runs FOR EACH ROW
    WHEN (NEW.concurrency_key <> ''
          AND (NEW.status IN ('queued','waiting_takeover','running')
               OR (NEW.status = 'waiting_input' AND NEW.pending_input IS NOT NULL))
          AND NOT (OLD.status IN ('queued','waiting_takeover','running')
               OR (OLD.status = 'waiting_input' AND OLD.pending_input IS NOT NULL)))
    EXECUTE FUNCTION leasehold_key_wakes();

-- One lane's claim: migration 0012's leasehold_claimable for the runs of
-- `lane` (a key, or '' for runs without one), one priority at a time,
-- highest first, each in eligible order, never sorting.
CREATE FUNCTION leasehold_claim_lane(lane TEXT, lim BIGINT, skip BIGINT[]) RETURNS SETOF BIGINT
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

-- The claim: up to `lim` runs, never one in `skip`. The keys whose turn
-- it is, least recently served first, and the runs without a key (one
-- more lane, at a random place among them, so that it gets its share
-- even from claims of one run) each take up to a fair share of the batch
-- (the batch over the lanes taken), a key no more than its free slots;
-- then, while the batch has room, the lanes that filled their share take
-- more. The keys served move to the back of the turn order; one found
-- with no claimable run at all leaves it until a submit or the trigger
-- above brings it back. The conditions and order must stay identical to
-- host/store/claims.rs and host/store/concurrency.rs.
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
    share := GREATEST(1, lim / (n + 1));
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
