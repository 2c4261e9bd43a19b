-- A run of missed times is one record; see PostgreSQL's 0032.
ALTER TABLE schedule_ticks ADD COLUMN through_at INTEGER;
ALTER TABLE schedule_ticks ADD COLUMN times INTEGER NOT NULL DEFAULT 1;
