-- Budgets in US dollars (docs/concepts.md, "Budgets"); see PostgreSQL's
-- 0021. A run's tree may also carry `budget_usd_nanos` (whole
-- nano-dollars); its spend is the sum of the `cost_usd_nanos` its
-- committed `model.chat` rows recorded, and a call in flight holds its
-- estimate in dollars too.
ALTER TABLE runs ADD COLUMN budget_usd_nanos INTEGER;
ALTER TABLE budget_holds ADD COLUMN usd_nanos INTEGER NOT NULL DEFAULT 0;
