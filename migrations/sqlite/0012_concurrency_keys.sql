-- Concurrency keys (docs/flow-control.md): a run may carry a key, '' for
-- none; a key may have a limit on the runs holding a slot at once (a slot
-- is held by a `running` run with a live lease; each claim counts them
-- afresh). runs_claim now leads with the key, so each key's claimable runs
-- are a lane of their own and a key at its limit costs the others nothing;
-- keys take turns (concurrency_keys.turn). See PostgreSQL's 0013 for the
-- rules; the claim is host/store/concurrency.rs. Keep the expressions and
-- predicates identical to the macros.
ALTER TABLE runs ADD COLUMN concurrency_key TEXT NOT NULL DEFAULT '';

CREATE TABLE concurrency_keys (
    key TEXT PRIMARY KEY,
    concurrency INTEGER CHECK (concurrency IS NULL OR concurrency >= 0),
    paused INTEGER NOT NULL DEFAULT 0,
    active INTEGER NOT NULL DEFAULT 0,
    turn INTEGER NOT NULL DEFAULT 0,
    updated_at INTEGER NOT NULL DEFAULT 0
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
CREATE INDEX runs_key_running ON runs (concurrency_key, lease_expires_at)
    WHERE status = 'running' AND concurrency_key <> '';

-- A keyed run that becomes claimable again makes its key active.
CREATE TRIGGER runs_key_wakes AFTER UPDATE OF status, pending_input ON runs FOR EACH ROW
    WHEN NEW.concurrency_key <> ''
     AND (NEW.status IN ('queued','waiting_takeover','running')
          OR (NEW.status = 'waiting_input' AND NEW.pending_input IS NOT NULL))
     AND NOT (OLD.status IN ('queued','waiting_takeover','running')
          OR (OLD.status = 'waiting_input' AND OLD.pending_input IS NOT NULL))
BEGIN
    INSERT INTO concurrency_keys (key, active) VALUES (NEW.concurrency_key, 1)
    ON CONFLICT (key) DO UPDATE SET active = 1;
END;
