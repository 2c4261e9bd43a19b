-- Budget waiters are woken by whatever ends a hold; see PostgreSQL's 0029.
ALTER TABLE runs ADD COLUMN wait_tokens INTEGER;
ALTER TABLE runs ADD COLUMN wait_usd_nanos INTEGER;
CREATE INDEX runs_budget_waits ON runs (id) WHERE waiting_for = 'budget';

CREATE TRIGGER runs_budget_hold_ends AFTER UPDATE OF status ON runs FOR EACH ROW
    WHEN NEW.status IN ('completed','failed','aborted','cancelled')
     AND OLD.status NOT IN ('completed','failed','aborted','cancelled')
     AND (NEW.root_id IS NOT NULL OR NEW.budget_tokens IS NOT NULL OR NEW.budget_usd_nanos IS NOT NULL)
     AND EXISTS (SELECT 1 FROM budget_holds WHERE run_id = NEW.id)
BEGIN
    UPDATE runs SET not_before = CAST(unixepoch('subsec') * 1000 AS INTEGER), waiting_for = NULL,
        updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
    WHERE (id = COALESCE(NEW.root_id, NEW.id) OR root_id = COALESCE(NEW.root_id, NEW.id))
      AND status = 'queued' AND waiting_for = 'budget';
END;
