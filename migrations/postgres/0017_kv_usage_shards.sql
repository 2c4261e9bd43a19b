-- kv_usage's one row per namespace was a hot row: every statement that
-- writes a namespace's kv moved it, so every close carrying a run's
-- `kv.put` queued on that row's lock until the one before had committed
-- (the one-put drain: about 800 runs/s, its statements waiting on
-- `transactionid`). The counters are now split in shards, one per
-- connection's backend (pid modulo 64), so concurrent writers move
-- different rows; a namespace's usage is the sum of its shards.
--
-- `kv_usage` stays, as a view with the same columns, so hosts of the
-- previous release (which read it, and write it only through these
-- triggers) keep working during a rolling upgrade.
LOCK TABLE kv, kv_usage IN EXCLUSIVE MODE;

CREATE TABLE kv_usage_shards (
    namespace TEXT   NOT NULL,
    shard     INT    NOT NULL,
    keys      BIGINT NOT NULL,
    bytes     BIGINT NOT NULL,
    PRIMARY KEY (namespace, shard)
);

INSERT INTO kv_usage_shards (namespace, shard, keys, bytes) SELECT namespace, 0, keys, bytes FROM kv_usage;

DROP TABLE kv_usage;

CREATE VIEW kv_usage AS
SELECT namespace, SUM(keys)::bigint AS keys, SUM(bytes)::bigint AS bytes FROM kv_usage_shards GROUP BY namespace;

CREATE OR REPLACE FUNCTION kv_usage_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kv_usage_shards AS u (namespace, shard, keys, bytes)
    SELECT namespace, pg_backend_pid() % 64, COUNT(*), SUM(octet_length(key) + octet_length(value)) FROM new_rows
    GROUP BY namespace ORDER BY namespace
    ON CONFLICT (namespace, shard) DO UPDATE SET keys = u.keys + excluded.keys, bytes = u.bytes + excluded.bytes;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION kv_usage_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kv_usage_shards AS u (namespace, shard, keys, bytes)
    SELECT n.namespace, pg_backend_pid() % 64, 0, SUM(octet_length(n.value) - octet_length(o.value))
    FROM new_rows n JOIN old_rows o ON o.namespace = n.namespace AND o.key = n.key
    GROUP BY n.namespace ORDER BY n.namespace
    ON CONFLICT (namespace, shard) DO UPDATE SET bytes = u.bytes + excluded.bytes;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION kv_usage_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kv_usage_shards AS u (namespace, shard, keys, bytes)
    SELECT namespace, pg_backend_pid() % 64, -COUNT(*), -SUM(octet_length(key) + octet_length(value)) FROM old_rows
    GROUP BY namespace ORDER BY namespace
    ON CONFLICT (namespace, shard) DO UPDATE SET keys = u.keys + excluded.keys, bytes = u.bytes + excluded.bytes;
    RETURN NULL;
END $$;
