-- When the run's first segment started: set by its first claim, from the
-- database clock, and kept by later claims. NULL until then. The queue wait
-- of a run is started_at - created_at.
ALTER TABLE runs ADD COLUMN started_at BIGINT;
