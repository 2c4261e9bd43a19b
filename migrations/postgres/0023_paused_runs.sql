-- Paused runs (docs/operations.md, "Pausing a run"). A paused run is not
-- claimed: its `not_before` stays at the end of time (9999-12-31). What
-- would have made it due meanwhile (its sleep's end, a delivered input,
-- its children's end, a raised budget, a slice's end) is kept in
-- `paused_not_before` by the trigger below, whoever writes it, and resume
-- puts it back. A running run that is paused stops at its next slice
-- point; its suspend lands here too.
ALTER TABLE runs ADD COLUMN paused_at BIGINT;
ALTER TABLE runs ADD COLUMN paused_not_before BIGINT;

CREATE FUNCTION leasehold_hold_paused() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.paused_not_before := NEW.not_before;
    NEW.not_before := 253402300799999;
    RETURN NEW;
END
$$;
CREATE TRIGGER runs_paused BEFORE UPDATE OF not_before ON runs FOR EACH ROW
    WHEN (NEW.paused_at IS NOT NULL AND NEW.not_before <> 253402300799999)
    EXECUTE FUNCTION leasehold_hold_paused();
