-- Named waits (docs/concepts.md, "Named waits"); see PostgreSQL's 0019: input delivered to a run
-- under a name waits here until the run's turn reaches a wait on that
-- name, which takes it (deleting the row) in the transaction that records
-- it. One pending delivery per (run, name): a second is refused until the
-- first is taken.
--
-- A run waiting on a name is `queued` with `waiting_for = 'input:<name>'`
-- and `not_before` at its deadline (or far ahead), as a parent waits for
-- its children; a delivery makes it due.
CREATE TABLE inbox (
    run_id     INTEGER NOT NULL,
    name       TEXT   NOT NULL,
    input      TEXT   NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (run_id, name)
);

-- One-use links that deliver to a run's named wait without the API
-- token: only the SHA-256 of the token is kept. Deleted when used, and
-- when the wait they answer ends.
CREATE TABLE answer_links (
    token_hash TEXT   PRIMARY KEY,
    run_id     INTEGER NOT NULL,
    name       TEXT   NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX answer_links_run ON answer_links (run_id, name);
