-- Priority: a run of higher priority is claimed first; within one
-- priority, runs go in the order they became eligible (as before). Every
-- existing run has priority 0.
--
-- runs_claim now leads with the priority, and the claim
-- (host/store/sqlite.rs) reads it one priority at a time, highest first,
-- each in eligible order as before; the priorities in use other than 0
-- come from runs_priority, which is empty while no run has another. See
-- PostgreSQL's 0012 for why. Keep the expressions and predicates identical
-- to the macros.
ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
DROP INDEX runs_claim;
CREATE INDEX runs_claim ON runs (priority DESC, (CASE WHEN status = 'running' THEN lease_expires_at + 1 ELSE not_before END), id)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL));
CREATE INDEX runs_priority ON runs (priority)
    WHERE (status IN ('queued','waiting_takeover','running')
           OR (status = 'waiting_input' AND pending_input IS NOT NULL)) AND priority <> 0;
