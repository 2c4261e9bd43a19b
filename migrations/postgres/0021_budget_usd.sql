-- Budgets in US dollars (docs/concepts.md, "Budgets"), beside the token
-- budgets of 0020: a run's tree may also carry `budget_usd_nanos` (whole
-- nano-dollars, so sums are exact). Its spend is the sum of the
-- `cost_usd_nanos` its committed `model.chat` rows recorded, at the
-- prices of the moment (`serve --model-price`); a call in flight holds its
-- estimate in dollars too.
ALTER TABLE runs ADD COLUMN budget_usd_nanos BIGINT;
ALTER TABLE budget_holds ADD COLUMN usd_nanos BIGINT NOT NULL DEFAULT 0;
