-- Rate limits on effects (docs/flow-control.md). A limit is keyed by what
-- the effect reaches: `http:HOST:PORT` or `model:NAME`. Calls are spaced
-- evenly (a generic cell rate: each call moves the key's clock on by
-- 60 s / per_minute, and a call goes out only once the clock has come),
-- so no minute ever holds more than `per_minute` calls, whichever hosts
-- make them. Tokens the same way, charged from a reservation and settled
-- from the usage the answer reports. A provider's Retry-After holds every
-- call to the key until `held_until`.
CREATE TABLE rate_limits (
    key TEXT PRIMARY KEY,
    -- NULL: no limit of that kind (a row may only carry a hold).
    per_minute INTEGER CHECK (per_minute IS NULL OR per_minute > 0),
    tokens_per_minute INTEGER CHECK (tokens_per_minute IS NULL OR tokens_per_minute > 0),
    -- When the next call may go out, and when the token budget next has
    -- room: epoch microseconds on the database's clock.
    calls_at INTEGER NOT NULL DEFAULT 0,
    tokens_at INTEGER NOT NULL DEFAULT 0,
    -- A provider's Retry-After: no call before this (epoch ms).
    held_until INTEGER NOT NULL DEFAULT 0,
    updated_at INTEGER NOT NULL DEFAULT 0
);
