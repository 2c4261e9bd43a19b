-- The W3C traceparent a run was started under (docs/operations.md,
-- "Tracing"): its submitter's, or its parent run's segment's. NULL: the
-- run's trace is its own, derived from its id.
ALTER TABLE runs ADD COLUMN trace_parent TEXT;
