-- Idempotency keys through a partial unique index: most runs have no key,
-- and a btree keeps an entry for every row version, NULL keys included.
-- Every claim and every close writes a new version of the run row (they
-- change indexed columns, so neither is a HOT update), and each version
-- added a NULL entry to the key's index. Without them a run costs two
-- index insertions fewer between its claim and its close.
-- Upserts name the index's predicate: ON CONFLICT (idempotency_key)
-- WHERE idempotency_key IS NOT NULL. (SQLite updates only the indexes
-- whose columns change, so its UNIQUE column stays.)
CREATE UNIQUE INDEX runs_idempotency ON runs (idempotency_key) WHERE idempotency_key IS NOT NULL;
ALTER TABLE runs DROP CONSTRAINT runs_idempotency_key_key;
