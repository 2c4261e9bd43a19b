-- leasehold schema v1 (PostgreSQL). Keep identical in shape to migrations/sqlite/0001.
-- All times are milliseconds since the Unix epoch, read from the database clock.

CREATE TABLE runs (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- never reused: run_id:seq is an idempotency key
    thread_id        TEXT    NOT NULL,
    plugin           TEXT    NOT NULL,
    plugin_digest    TEXT    NOT NULL,
    input            TEXT    NOT NULL,                  -- JSON
    idempotency_key  TEXT    UNIQUE,
    status           TEXT    NOT NULL CHECK (status IN ('queued','running','waiting_input','waiting_takeover','completed','failed','aborted','cancelled')),
    lease_owner      TEXT,
    fence            BIGINT  NOT NULL DEFAULT 0,
    lease_expires_at BIGINT,
    attempt          BIGINT  NOT NULL DEFAULT 0,
    max_attempts     BIGINT  NOT NULL CHECK (max_attempts > 0),
    heartbeat_at     BIGINT,
    partial          TEXT    NOT NULL DEFAULT '',
    emit_pos         BIGINT  NOT NULL DEFAULT 0,        -- number of emits in partial
    pending_input    TEXT,                              -- delivered to a waiting_input run
    output           TEXT,
    error            TEXT,
    not_before       BIGINT  NOT NULL,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL,
    finished_at      BIGINT
);

-- The claim path (see claimable!/eligible_at! in host/lib.rs): one range
-- scan over runs whose eligible time has passed. Finished and still-waiting
-- runs are not in it, so a claim stays fast however many finished runs the
-- table holds. Keep the expression and predicate identical to the macros.
CREATE INDEX runs_claim ON runs ((CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END), id)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL));
-- Expired leases, for the reaper.
CREATE INDEX runs_lease ON runs (lease_expires_at) WHERE status = 'running';
-- Listing by status. Running runs are left out on purpose: otherwise both
-- planners pick this index for `status = 'running' AND lease_expires_at < now`
-- and filter every in-flight run on each claim; runs_lease serves them.
CREATE INDEX runs_status ON runs (status, id) WHERE status <> 'running';
CREATE INDEX runs_thread ON runs (thread_id, id);

CREATE TABLE threads (
    id       TEXT    PRIMARY KEY,
    last_seq BIGINT  NOT NULL
);

CREATE TABLE events (
    thread_id  TEXT    NOT NULL,
    seq        BIGINT  NOT NULL,
    run_id     BIGINT  NOT NULL REFERENCES runs (id),
    fence      BIGINT  NOT NULL,
    kind       TEXT    NOT NULL,
    payload    TEXT    NOT NULL,                        -- JSON
    created_at BIGINT  NOT NULL,
    PRIMARY KEY (thread_id, seq)
);
CREATE INDEX events_run ON events (run_id, seq);

CREATE TABLE effects (
    run_id          BIGINT  NOT NULL REFERENCES runs (id),
    seq             BIGINT  NOT NULL,
    name            TEXT    NOT NULL,
    request_hash    TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    class           TEXT    NOT NULL CHECK (class IN ('local','keyed','unkeyed')),
    state           TEXT    NOT NULL CHECK (state IN ('started','committed','failed','in_doubt')),
    result          TEXT,
    emit_pos        BIGINT  NOT NULL,
    fence_started   BIGINT  NOT NULL,
    fence_completed BIGINT,
    created_at      BIGINT  NOT NULL,
    updated_at      BIGINT  NOT NULL,
    PRIMARY KEY (run_id, seq)
);

CREATE TABLE kv (
    namespace  TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    value      TEXT    NOT NULL,
    updated_at BIGINT  NOT NULL,
    PRIMARY KEY (namespace, key)
);
