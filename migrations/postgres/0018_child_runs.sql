-- Child runs (docs/concepts.md, "Child runs"). A run spawned by a turn
-- keeps its parent (`parent_id`), its tree's root (`root_id`; NULL on a
-- root) and the parent's ledger position that spawned it (`spawn_seq`):
-- one child per (parent, position), so a parent that replays its spawn
-- never makes a second child.
--
-- A parent awaiting its children is `queued` with `waiting_for =
-- 'children'` and `not_before` at its deadline (or far ahead): claimable
-- when due, like a sleeping run, with no change to the claim. It waits at
-- ledger position `await_seq` for `await_left` more of its children, each
-- marked with that position (`awaited_at`). The trigger below wakes it
-- (`not_before` = now) in the transaction that records the child's end,
-- whichever statement does (a close, a batch of closes, a cancel, the
-- reaper's abort).
--
-- `detached` children are not cancelled when their parent fails or is
-- aborted. Columns only: hosts of the previous release neither read nor
-- write them, and a run they insert is a root.
ALTER TABLE runs ADD COLUMN parent_id BIGINT;
ALTER TABLE runs ADD COLUMN root_id BIGINT;
ALTER TABLE runs ADD COLUMN spawn_seq BIGINT;
ALTER TABLE runs ADD COLUMN detached BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN waiting_for TEXT;
ALTER TABLE runs ADD COLUMN await_seq BIGINT;
ALTER TABLE runs ADD COLUMN await_left BIGINT;
ALTER TABLE runs ADD COLUMN awaited_at BIGINT;

CREATE UNIQUE INDEX runs_spawn ON runs (parent_id, spawn_seq) WHERE parent_id IS NOT NULL;
-- Open children, for the sweep that applies a finished parent's policy.
CREATE INDEX runs_open_children ON runs (parent_id)
    WHERE parent_id IS NOT NULL AND status NOT IN ('completed','failed','aborted','cancelled');

CREATE FUNCTION leasehold_child_ends() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE runs SET await_left = await_left - 1,
        not_before = CASE WHEN await_left <= 1 THEN (extract(epoch from now()) * 1000)::bigint ELSE not_before END,
        waiting_for = CASE WHEN await_left <= 1 THEN NULL ELSE waiting_for END
    WHERE id = NEW.parent_id AND status = 'queued' AND waiting_for = 'children' AND await_seq = NEW.awaited_at;
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_child_ends AFTER UPDATE OF status ON runs FOR EACH ROW
    WHEN (NEW.awaited_at IS NOT NULL
          AND NEW.status IN ('completed','failed','aborted','cancelled')
          AND OLD.status NOT IN ('completed','failed','aborted','cancelled'))
    EXECUTE FUNCTION leasehold_child_ends();

-- Which plugins a plugin's turns may spawn runs of (JSON list of names;
-- '*' for any). A column of its own: the previous release reads the
-- settings JSON strictly.
ALTER TABLE plugins ADD COLUMN spawn_allow TEXT NOT NULL DEFAULT '[]';
