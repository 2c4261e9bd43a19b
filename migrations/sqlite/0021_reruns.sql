-- Reruns from a point in the ledger; see PostgreSQL's 0024.
ALTER TABLE runs ADD COLUMN rerun_of INTEGER;
ALTER TABLE runs ADD COLUMN rerun_from INTEGER;
CREATE INDEX runs_rerun_of ON runs (rerun_of) WHERE rerun_of IS NOT NULL;
