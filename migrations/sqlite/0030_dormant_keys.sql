-- Dormant keys; see PostgreSQL's 0033. SQLite has one writer, so the
-- triggers write only what changes.
ALTER TABLE concurrency_keys ADD COLUMN due_at INTEGER;
CREATE INDEX concurrency_keys_ready ON concurrency_keys (turn, key) WHERE active AND NOT paused AND due_at IS NULL;
CREATE INDEX concurrency_keys_due ON concurrency_keys (due_at) WHERE active AND NOT paused AND due_at IS NOT NULL;

DROP TRIGGER runs_key_wakes;
CREATE TRIGGER runs_key_wakes AFTER UPDATE OF status, pending_input ON runs FOR EACH ROW
    WHEN NEW.concurrency_key <> ''
     AND (NEW.status IN ('queued','waiting_takeover','running')
          OR (NEW.status = 'waiting_input' AND NEW.pending_input IS NOT NULL))
     AND NOT (OLD.status IN ('queued','waiting_takeover','running')
          OR (OLD.status = 'waiting_input' AND OLD.pending_input IS NOT NULL))
BEGIN
    INSERT INTO concurrency_keys (key, active) VALUES (NEW.concurrency_key, 1)
    ON CONFLICT (key) DO UPDATE SET active = 1, due_at = NULL;
END;

CREATE TRIGGER runs_key_due AFTER UPDATE OF not_before, status ON runs FOR EACH ROW
    WHEN NEW.concurrency_key <> '' AND NEW.status IN ('queued','waiting_takeover')
     AND (NEW.not_before IS NOT OLD.not_before OR NEW.status IS NOT OLD.status)
BEGIN
    UPDATE concurrency_keys SET due_at = NEW.not_before WHERE key = NEW.concurrency_key AND due_at > NEW.not_before;
END;
