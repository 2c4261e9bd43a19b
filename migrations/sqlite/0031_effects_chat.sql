-- A tree's spend reads only its committed model.chat rows; see PostgreSQL's 0035.
CREATE INDEX effects_chat ON effects (run_id) WHERE name = 'model.chat' AND state = 'committed';
