-- Schedules; see PostgreSQL's 0025 for the why of each part.
CREATE TABLE schedules (
    id                TEXT    PRIMARY KEY,
    plugin            TEXT    NOT NULL,
    input             TEXT    NOT NULL,
    -- One of the two: a cron expression, or an interval in ms (anchored at
    -- the Unix epoch).
    cron              TEXT,
    interval_ms       INTEGER,
    time_zone         TEXT    NOT NULL,
    -- skip | buffer_one | allow_all | cancel_other
    overlap           TEXT    NOT NULL,
    catchup_window_ms INTEGER  NOT NULL,
    jitter_ms         INTEGER  NOT NULL,
    priority          INTEGER  NOT NULL DEFAULT 0,
    concurrency_key   TEXT    NOT NULL DEFAULT '',
    max_attempts      INTEGER  NOT NULL,
    budget_tokens     INTEGER,
    budget_usd_nanos  INTEGER,
    paused            INTEGER  NOT NULL DEFAULT 0,
    note              TEXT,
    -- The next scheduled time (ms); NULL when the expression has no more.
    next_at           INTEGER,
    -- Bumped by every tick and change: the compare-and-set.
    version           INTEGER  NOT NULL DEFAULT 0,
    created_at        INTEGER  NOT NULL,
    updated_at        INTEGER  NOT NULL
);
CREATE INDEX schedules_due ON schedules (next_at) WHERE paused = 0;

-- One row per scheduled time a schedule reached: the run it started, or
-- why it started none (skipped), or that it waits for the open run to end
-- (buffered). The key is the tick's identity: a time is recorded once.
CREATE TABLE schedule_ticks (
    schedule_id  TEXT    NOT NULL,
    scheduled_at INTEGER  NOT NULL,
    -- started | skipped | buffered
    outcome      TEXT    NOT NULL,
    run_id       INTEGER,
    reason       TEXT,
    backfill     INTEGER  NOT NULL DEFAULT 0,
    recorded_at  INTEGER  NOT NULL,
    PRIMARY KEY (schedule_id, scheduled_at)
);
CREATE INDEX schedule_ticks_buffered ON schedule_ticks (schedule_id) WHERE outcome = 'buffered';
CREATE INDEX schedule_ticks_recorded ON schedule_ticks (recorded_at);

-- A run a schedule started names it and its scheduled time; one run per
-- (schedule, time). Its open runs, for the overlap policy, by a partial
-- index that only open runs are in.
ALTER TABLE runs ADD COLUMN schedule_id TEXT;
ALTER TABLE runs ADD COLUMN scheduled_at INTEGER;
CREATE UNIQUE INDEX runs_schedule ON runs (schedule_id, scheduled_at) WHERE schedule_id IS NOT NULL;
CREATE INDEX runs_schedule_open ON runs (schedule_id)
    WHERE schedule_id IS NOT NULL AND status NOT IN ('completed', 'failed', 'aborted', 'cancelled');
