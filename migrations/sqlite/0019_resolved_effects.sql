-- Effects an operator resolved by hand; see PostgreSQL's 0022.
ALTER TABLE effects ADD COLUMN resolved_by TEXT;
ALTER TABLE effects ADD COLUMN resolved_at INTEGER;
