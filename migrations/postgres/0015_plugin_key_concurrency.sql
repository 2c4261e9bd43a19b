-- A plugin's default limit for its runs' concurrency keys
-- (docs/flow-control.md): a submit of a keyed run gives its key this limit
-- when no operator ever set one for it. A column of its own, not a field of
-- the settings JSON: hosts of the previous release read that JSON strictly
-- and would refuse a plugin whose settings held a field they do not know.
ALTER TABLE plugins ADD COLUMN key_concurrency BIGINT CHECK (key_concurrency IS NULL OR key_concurrency > 0);
