-- A run's streamed output is no longer rewritten into runs.partial on every
-- flush (quadratic in its length): the delta events hold it, and partial is
-- folded from them only when the run ends or its stream is cut. partial
-- holds the stream up to emit position partial_pos; the run's delta events
-- numbered after partial_seq (thread order) hold the rest.
ALTER TABLE runs ADD COLUMN partial_pos BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN partial_seq BIGINT NOT NULL DEFAULT 0;
-- Every partial written before this is whole.
UPDATE runs SET partial_pos = emit_pos,
    partial_seq = COALESCE((SELECT MAX(e.seq) FROM events e WHERE e.run_id = runs.id), 0)
WHERE emit_pos > 0;
