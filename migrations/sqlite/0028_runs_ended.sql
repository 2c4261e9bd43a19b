-- Parents that ended by failing, an abort or a cancel; see PostgreSQL's 0031.
CREATE INDEX runs_ended ON runs (finished_at) WHERE status IN ('cancelled','failed','aborted');
