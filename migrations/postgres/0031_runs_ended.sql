-- Parents that ended by failing, an abort or a cancel, by when: the
-- reaper's sweep of their open children reads the recent ones
-- (`store::children::cancel_orphans`), not every open child each tick.
CREATE INDEX runs_ended ON runs (finished_at) WHERE status IN ('cancelled','failed','aborted');
