-- Nothing to change on SQLite: its claim pins runs_claim with INDEXED BY
-- (host/store/sqlite.rs), which PostgreSQL has no way to say. This file
-- keeps the two backends' migrations numbered alike; PostgreSQL's 0004
-- adds the function its claims take their runs from.
SELECT 1;
