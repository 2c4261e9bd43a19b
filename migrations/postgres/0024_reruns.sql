-- Reruns from a point in the ledger (docs/operations.md, "Rerunning from
-- a point in the ledger"): a new run whose ledger starts with another's
-- rows below `rerun_from`. The run it reruns is never changed; it finds
-- its reruns through the index.
ALTER TABLE runs ADD COLUMN rerun_of BIGINT;
ALTER TABLE runs ADD COLUMN rerun_from BIGINT;
CREATE INDEX runs_rerun_of ON runs (rerun_of) WHERE rerun_of IS NOT NULL;
