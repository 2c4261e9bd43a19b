-- Plugins registered through the API (or loaded from a directory at start),
-- shared by every host on the database: a host that meets a run of a plugin
-- it has not loaded loads it from here.
CREATE TABLE plugins (
    name       TEXT    PRIMARY KEY,
    digest     TEXT    NOT NULL,                        -- sha256:<hex> of component
    component  BLOB    NOT NULL,
    settings   TEXT    NOT NULL,                        -- JSON: {"http_allow": [...]}
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
