-- A tree's spend reads only its committed model.chat rows
-- (store::budgets), not every row of every ledger in the tree: each budget
-- hold reads it under the root's lock.
CREATE INDEX effects_chat ON effects (run_id) WHERE name = 'model.chat' AND state = 'committed';
