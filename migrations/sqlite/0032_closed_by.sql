-- The host whose close finished the run. A run's first segment that
-- completes it gets no row in the segment log: its time line reads the
-- segment from the run row (store::segments), one insert less a run.
ALTER TABLE runs ADD COLUMN closed_by TEXT;
