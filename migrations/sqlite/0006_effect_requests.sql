-- The request of each recorded call, as far as its first 1,024 bytes
-- (cut at a character boundary): `leasehold replay` shows it beside the
-- call a changed component makes instead. Replay still decides by
-- `request_hash`, over the whole request. NULL for rows written before
-- this migration.
ALTER TABLE effects ADD COLUMN request TEXT;
