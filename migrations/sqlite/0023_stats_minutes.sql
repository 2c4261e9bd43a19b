-- The dashboard's per-minute rollup; see PostgreSQL's 0026.
CREATE TABLE stats_minutes (
    minute INTEGER NOT NULL,
    series TEXT   NOT NULL,
    n      INTEGER NOT NULL,
    PRIMARY KEY (minute, series)
);
