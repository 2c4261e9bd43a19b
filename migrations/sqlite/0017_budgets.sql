-- Token budgets shared by a run's tree (docs/concepts.md, "Budgets"); see PostgreSQL's 0020. A
-- root may carry `budget_tokens`; its tree's spend is the sum of the usage
-- its committed `model.chat` rows report (so a replayed call costs
-- nothing), and a call about to go out holds its estimate in
-- `budget_holds` until its row settles. A run whose call would overspend
-- is `queued` with `waiting_for = 'budget'` until the budget is raised.
ALTER TABLE runs ADD COLUMN budget_tokens INTEGER;
-- A tree's runs, for its spend and its waiting runs.
CREATE INDEX runs_root ON runs (root_id) WHERE root_id IS NOT NULL;
CREATE TABLE budget_holds (
    run_id     INTEGER NOT NULL,
    seq        INTEGER NOT NULL,
    root_id    INTEGER NOT NULL,
    tokens     INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX budget_holds_root ON budget_holds (root_id);
