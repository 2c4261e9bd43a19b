-- Expand: the event counter of a thread that has one run can live in that
-- run's row (`thread_seq`) instead of a `threads` row, so its submit
-- inserts no `threads` row and its emits and close move no second row.
-- The first write to the thread by anything else (another run submitted
-- to it, an input, a pause) moves the count to a `threads` row and clears
-- `thread_seq` for good (store::log::bump). Hosts submit runs that hold
-- their counter only once the step `run_counters` is contracted
-- (store::contract): a previous release's host would number such a
-- thread from its `threads` row alone.
ALTER TABLE runs ADD COLUMN thread_seq BIGINT;
