-- Budget waiters are woken by whatever ends a hold (docs/concepts.md,
-- "Budgets"). A run waiting for budget records what its call needs
-- (`wait_tokens`, `wait_usd_nanos`), so the reaper's sweep wakes it only
-- once that fits; the trigger below wakes a tree's waiters in the same
-- transaction as a run of the tree that holds budget ends, whichever
-- statement ends it (a close, a batch of closes, a cancel, the reaper's
-- abort). Columns only for the previous release, which writes neither.
ALTER TABLE runs ADD COLUMN wait_tokens BIGINT;
ALTER TABLE runs ADD COLUMN wait_usd_nanos BIGINT;
CREATE INDEX runs_budget_waits ON runs (id) WHERE waiting_for = 'budget';

CREATE FUNCTION leasehold_budget_hold_ends() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM budget_holds WHERE run_id = NEW.id) THEN
        UPDATE runs SET not_before = (extract(epoch from now()) * 1000)::bigint, waiting_for = NULL,
            updated_at = (extract(epoch from now()) * 1000)::bigint
        WHERE (id = COALESCE(NEW.root_id, NEW.id) OR root_id = COALESCE(NEW.root_id, NEW.id))
          AND status = 'queued' AND waiting_for = 'budget';
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_budget_hold_ends AFTER UPDATE OF status ON runs FOR EACH ROW
    WHEN (NEW.status IN ('completed','failed','aborted','cancelled')
          AND OLD.status NOT IN ('completed','failed','aborted','cancelled')
          AND (NEW.root_id IS NOT NULL OR NEW.budget_tokens IS NOT NULL OR NEW.budget_usd_nanos IS NOT NULL))
    EXECUTE FUNCTION leasehold_budget_hold_ends();
