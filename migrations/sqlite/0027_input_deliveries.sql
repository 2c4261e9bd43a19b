-- Named input delivered once; see PostgreSQL's 0030.
CREATE TABLE input_deliveries (
    run_id          INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    name            TEXT NOT NULL,
    input_sha256    TEXT NOT NULL,
    created_at      INTEGER NOT NULL,
    PRIMARY KEY (run_id, idempotency_key)
);
