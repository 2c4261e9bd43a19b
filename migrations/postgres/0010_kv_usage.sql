-- What each plugin's kv namespace holds (keys, and bytes of keys and
-- values), so a put's quota check reads one row rather than the namespace.
-- Kept by statement-level triggers: each statement that writes kv moves
-- the counters once per namespace, in namespace order, after its kv rows,
-- so two statements never wait on each other's counters in a cycle.
CREATE TABLE kv_usage (
    namespace TEXT   PRIMARY KEY,
    keys      BIGINT NOT NULL,
    bytes     BIGINT NOT NULL
);

INSERT INTO kv_usage (namespace, keys, bytes)
SELECT namespace, COUNT(*), SUM(octet_length(key) + octet_length(value)) FROM kv GROUP BY namespace;

CREATE FUNCTION kv_usage_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kv_usage AS u (namespace, keys, bytes)
    SELECT namespace, COUNT(*), SUM(octet_length(key) + octet_length(value)) FROM new_rows
    GROUP BY namespace ORDER BY namespace
    ON CONFLICT (namespace) DO UPDATE SET keys = u.keys + excluded.keys, bytes = u.bytes + excluded.bytes;
    RETURN NULL;
END $$;

CREATE FUNCTION kv_usage_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kv_usage AS u (namespace, keys, bytes)
    SELECT n.namespace, 0, SUM(octet_length(n.value) - octet_length(o.value))
    FROM new_rows n JOIN old_rows o ON o.namespace = n.namespace AND o.key = n.key
    GROUP BY n.namespace ORDER BY n.namespace
    ON CONFLICT (namespace) DO UPDATE SET bytes = u.bytes + excluded.bytes;
    RETURN NULL;
END $$;

CREATE FUNCTION kv_usage_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kv_usage AS u (namespace, keys, bytes)
    SELECT namespace, -COUNT(*), -SUM(octet_length(key) + octet_length(value)) FROM old_rows
    GROUP BY namespace ORDER BY namespace
    ON CONFLICT (namespace) DO UPDATE SET keys = u.keys + excluded.keys, bytes = u.bytes + excluded.bytes;
    RETURN NULL;
END $$;

CREATE TRIGGER kv_usage_inserted AFTER INSERT ON kv REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kv_usage_inserted();
CREATE TRIGGER kv_usage_updated AFTER UPDATE ON kv REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kv_usage_updated();
CREATE TRIGGER kv_usage_deleted AFTER DELETE ON kv REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kv_usage_deleted();

-- Bytes of key and value a `kv.put` row wrote: a put counts against its
-- run's ledger budget by its size, and its row keeps only a preview of its
-- request, so a resumed segment reads the size here.
ALTER TABLE effects ADD COLUMN kv_bytes BIGINT NOT NULL DEFAULT 0;
