-- Paused runs; see PostgreSQL's 0023. A paused run's `not_before` stays at
-- the end of time; what would have made it due meanwhile is kept in
-- `paused_not_before`, and resume puts it back.
ALTER TABLE runs ADD COLUMN paused_at INTEGER;
ALTER TABLE runs ADD COLUMN paused_not_before INTEGER;

CREATE TRIGGER runs_paused AFTER UPDATE OF not_before ON runs FOR EACH ROW
    WHEN NEW.paused_at IS NOT NULL AND NEW.not_before <> 253402300799999
BEGIN
    UPDATE runs SET paused_not_before = NEW.not_before, not_before = 253402300799999 WHERE id = NEW.id;
END;
