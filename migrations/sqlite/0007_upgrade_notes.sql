-- A plugin's `auto` upgrade policy moves an in-flight run to the current
-- version when its ledger replays clean on it. Recorded on the run: the
-- version it was last checked against, and what came of it, in a sentence.
ALTER TABLE runs ADD COLUMN upgrade_checked TEXT;
ALTER TABLE runs ADD COLUMN upgrade_note TEXT;
