-- A run of missed times is one record (docs/operations.md, "Schedules"):
-- `scheduled_at` to `through_at` (NULL: `scheduled_at` alone), `times` of
-- them. Hosts of the previous release write one record a time, as before.
ALTER TABLE schedule_ticks ADD COLUMN through_at BIGINT;
ALTER TABLE schedule_ticks ADD COLUMN times BIGINT NOT NULL DEFAULT 1;
