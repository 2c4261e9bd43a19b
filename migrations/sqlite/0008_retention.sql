-- Retention: the cleaner deletes finished runs oldest first, a batch at a
-- time, through this index. finished_at is set once, when a run finishes.
CREATE INDEX runs_finished ON runs (finished_at) WHERE finished_at IS NOT NULL;
