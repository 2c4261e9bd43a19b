-- The segment log (docs/operations.md, "The dashboard"): a row per segment
-- a host ran, written behind it, for the run page's time line. Deleted
-- with its run by the retention cleaner.
CREATE TABLE segments (
    run_id BIGINT NOT NULL,
    fence BIGINT NOT NULL,
    owner TEXT NOT NULL,
    started_at BIGINT NOT NULL,
    ended_at BIGINT NOT NULL,
    outcome TEXT NOT NULL,
    PRIMARY KEY (run_id, fence)
);
