-- Effects an operator resolved by hand (docs/operations.md, "Resolving an
-- effect by hand"): who wrote the outcome of a call in doubt or failed,
-- and when (the database's clock).
ALTER TABLE effects ADD COLUMN resolved_by TEXT;
ALTER TABLE effects ADD COLUMN resolved_at BIGINT;
