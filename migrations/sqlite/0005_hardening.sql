-- What the review of the promise under hostile input added (issue 15).

-- One random id per database, created once here: the first part of every
-- idempotency key (<database id>:<run id>:<seq>), so keys never repeat
-- across deployments or after a database is reset.
CREATE TABLE deployment (id TEXT NOT NULL);
INSERT INTO deployment (id) VALUES (lower(hex(randomblob(16))));

-- A per-run secret (hex) that seeds the guest's WASI random, so no one can
-- compute a run's "secure" random from its id. NULL for runs submitted
-- before this migration: they keep the id-based seed they started with.
ALTER TABLE runs ADD COLUMN secret TEXT;

-- How many emits a recorded call streamed (and their bytes), failed calls
-- included: replay moves the stream position on by them.
ALTER TABLE effects ADD COLUMN deltas INTEGER NOT NULL DEFAULT 0;
ALTER TABLE effects ADD COLUMN delta_bytes INTEGER NOT NULL DEFAULT 0;
UPDATE effects SET
    deltas = COALESCE(CAST(json_extract(result, '$.deltas') AS INTEGER), 0),
    delta_bytes = COALESCE(length(CAST(json_extract(result, '$.content') AS BLOB)), 0)
WHERE name = 'model.chat' AND state = 'committed' AND json_valid(result);

-- Every version of every plugin, so a run resumes on the component it was
-- submitted with (runs.plugin_digest). `plugins` keeps naming the current
-- version (and its component, for hosts of the previous release).
CREATE TABLE plugin_versions (
    name       TEXT    NOT NULL,
    digest     TEXT    NOT NULL,
    component  BLOB    NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (name, digest)
);
INSERT INTO plugin_versions (name, digest, component, created_at)
SELECT name, digest, component, updated_at FROM plugins;
