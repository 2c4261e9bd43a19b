-- Expand: a closed run's `message` event can be read from the run row
-- (its status, output and error) at the thread position `message_seq`,
-- instead of an `events` row written by the close. Hosts write it that
-- way only once the step `derived_messages` is contracted (store::contract):
-- a previous release's host reads messages from `events` alone.
ALTER TABLE runs ADD COLUMN message_seq INTEGER;
CREATE INDEX runs_messages ON runs (thread_id, message_seq) WHERE message_seq IS NOT NULL;

-- The contract steps an operator has taken (`leasehold schema contract`),
-- or that a database created by a release that knew them started with.
CREATE TABLE contract_steps (
    name    TEXT   PRIMARY KEY,
    done_at INTEGER NOT NULL
);
