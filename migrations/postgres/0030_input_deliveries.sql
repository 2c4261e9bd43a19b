-- Named input delivered once (docs/concepts.md, "Named waits"): a
-- delivery with an idempotency key is recorded with the key, first, in the
-- delivery's transaction, so a retried delivery (its response lost) finds
-- the key and delivers nothing again, even after a wait took the first.
-- Deleted with its run by the retention cleaner.
CREATE TABLE input_deliveries (
    run_id          BIGINT NOT NULL,
    idempotency_key TEXT NOT NULL,
    name            TEXT NOT NULL,
    input_sha256    TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (run_id, idempotency_key)
);
