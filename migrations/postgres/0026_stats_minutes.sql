-- The last hours, a row per minute and series (docs/operations.md,
-- "Metrics and logs"): what the dashboard's charts draw, so that drawing
-- them reads a few hundred rows, not the runs. Series: `finished:STATUS`
-- (runs that ended that minute, counted once the minute is over by the
-- host that claims it with the `counted` row), `queued` and `running`
-- (sampled then), and `wait:I` (first claims whose wait from submit fell
-- in bucket I, added by every host from what it observed).
CREATE TABLE stats_minutes (
    minute BIGINT NOT NULL,
    series TEXT   NOT NULL,
    n      BIGINT NOT NULL,
    PRIMARY KEY (minute, series)
);
