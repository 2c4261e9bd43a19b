-- What each plugin's kv namespace holds (keys, and bytes of keys and
-- values), so a put's quota check reads one row rather than the namespace.
-- Kept by triggers (SQLite has one writer, so no lock order to keep).
CREATE TABLE kv_usage (
    namespace TEXT    PRIMARY KEY,
    keys      INTEGER NOT NULL,
    bytes     INTEGER NOT NULL
);

INSERT INTO kv_usage (namespace, keys, bytes)
SELECT namespace, COUNT(*), SUM(length(CAST(key AS BLOB)) + length(CAST(value AS BLOB))) FROM kv GROUP BY namespace;

CREATE TRIGGER kv_usage_inserted AFTER INSERT ON kv BEGIN
    INSERT INTO kv_usage (namespace, keys, bytes)
    VALUES (NEW.namespace, 1, length(CAST(NEW.key AS BLOB)) + length(CAST(NEW.value AS BLOB)))
    ON CONFLICT (namespace) DO UPDATE SET keys = keys + 1, bytes = bytes + excluded.bytes;
END;

CREATE TRIGGER kv_usage_updated AFTER UPDATE OF value ON kv BEGIN
    UPDATE kv_usage SET bytes = bytes + length(CAST(NEW.value AS BLOB)) - length(CAST(OLD.value AS BLOB))
    WHERE namespace = NEW.namespace;
END;

CREATE TRIGGER kv_usage_deleted AFTER DELETE ON kv BEGIN
    UPDATE kv_usage SET keys = keys - 1, bytes = bytes - length(CAST(OLD.key AS BLOB)) - length(CAST(OLD.value AS BLOB))
    WHERE namespace = OLD.namespace;
END;

-- Bytes of key and value a `kv.put` row wrote: a put counts against its
-- run's ledger budget by its size, and its row keeps only a preview of its
-- request, so a resumed segment reads the size here.
ALTER TABLE effects ADD COLUMN kv_bytes INTEGER NOT NULL DEFAULT 0;
