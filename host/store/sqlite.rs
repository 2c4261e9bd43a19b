//! The SQLite dialect. WAL journal, one writer at a time: every multi-statement
//! transaction starts with a write, so it takes the write lock up front and
//! `busy_timeout` applies (a deferred read-then-write could fail with
//! `BUSY_SNAPSHOT` instead of waiting).

use std::time::Duration;

use super::Dialect;

macro_rules! claim_set {
    () => {
        "status = 'running', lease_owner = $1, fence = fence + 1, attempt = attempt + 1, \
         lease_expires_at = {now} + $2, heartbeat_at = {now}, updated_at = {now}, \
         started_at = COALESCE(started_at, {now})"
    };
}

/// The runs a claim takes from one lane (`$limit` of them; `$lane` is a
/// concurrency key, or `''` for the runs without one), highest priority
/// first and within a priority in eligible order. The priorities to read are 0 and
/// those `lv` walks down runs_priority (claimable runs whose priority is
/// not 0, an empty index while none is), one probe each. `IN` walks that
/// list in runs_claim's order, so nothing is sorted, and for each priority
/// the claim reads runs_claim from its first entry up to the clock: a
/// priority whose runs are all asleep or leased costs one probe. One scan
/// ordered by (priority, eligible time) would instead step over every
/// not-yet-eligible run of the higher priorities on each claim.
///
/// Takeovers come first: a run of the lane whose lease ran out (its host
/// died) is taken before any queued run, whatever their priorities, oldest
/// expiry first (a paused one is left to the reaper, which parks it); the
/// priorities' read then steps over running runs.
macro_rules! claim_select {
    ($limit:literal, $lane:literal) => {
        concat!(
            "WITH RECURSIVE lv(p) AS (SELECT * FROM (", next_priority!($lane, "1 = 1"), ") ",
            "UNION ALL SELECT (", next_priority!($lane, "priority < lv.p"), ") FROM lv WHERE lv.p IS NOT NULL) ",
            "SELECT id FROM (SELECT id FROM runs INDEXED BY runs_lease WHERE status = 'running' AND lease_expires_at < ", now_bound!(),
            " AND concurrency_key = ", $lane, " AND attempt < max_attempts AND paused_at IS NULL ORDER BY lease_expires_at LIMIT ", $limit, ") ",
            "UNION ALL SELECT id FROM (",
            "SELECT id FROM runs INDEXED BY runs_claim WHERE concurrency_key = ", $lane, " AND priority IN (SELECT 0 UNION ALL SELECT p FROM lv) AND ",
            crate::claimable!(), " AND ", crate::eligible_at!(), " <= ", now_bound!(), " AND attempt < max_attempts AND status <> 'running'",
            " ORDER BY priority DESC, ", crate::eligible_at!(), ", id LIMIT ", $limit, ") LIMIT ", $limit
        )
    };
}

/// The keyless lane's claim statements hold while no concurrency key is
/// taking turns: then the claim is one statement, as before keys. While
/// one is, they claim nothing and the claim goes through the keys' turns
/// (`store::concurrency::claim_lanes_sqlite`).
macro_rules! no_turns {
    () => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM concurrency_keys INDEXED BY concurrency_keys_ready WHERE active AND NOT paused AND due_at IS NULL) ",
            "AND NOT EXISTS (SELECT 1 FROM concurrency_keys INDEXED BY concurrency_keys_due ",
            "WHERE active AND NOT paused AND due_at IS NOT NULL AND due_at <= ", now_bound!(), ")"
        )
    };
}

/// The database's now (ms) as a claim's range end in runs_claim: not cast
/// to an integer as `{now}` is, because a cast gives the bound INTEGER
/// affinity, and SQLite then will not compare it with the index's
/// expression (which has none) inside the index: the claim read every
/// not-yet-eligible run of its priority (leased or asleep) and filtered
/// them, whenever the queue was shorter than the claim. For whole numbers,
/// `e <= x` and `e <= floor(x)` agree.
macro_rules! now_bound {
    () => {
        "(unixepoch('subsec') * 1000)"
    };
}

/// The highest priority other than 0 that a claimable run of `$lane`
/// holds, among those meeting `$cond` (runs_priority).
macro_rules! next_priority {
    ($lane:literal, $cond:literal) => {
        concat!(
            "SELECT priority FROM runs INDEXED BY runs_priority WHERE ", crate::claimable!(),
            " AND concurrency_key = ", $lane, " AND priority <> 0 AND ", $cond, " ORDER BY priority DESC LIMIT 1"
        )
    };
}

macro_rules! baseline_select {
    () => {
        concat!(
            "SELECT id FROM runs INDEXED BY runs_claim WHERE ", crate::claimable!(),
            " AND concurrency_key = '' AND priority = 0 AND ", crate::eligible_at!(), " BETWEEN 0 AND {now}",
            " ORDER BY ", crate::eligible_at!(), ", id LIMIT $1"
        )
    };
}

pub static DIALECT: Dialect = Dialect {
    now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    // A statement never waits on a lock once it runs (it waits before).
    clock: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    unfolded: "CASE WHEN runs.emit_pos > runs.partial_pos THEN COALESCE((SELECT group_concat(e.payload ->> 'delta', '' ORDER BY e.seq) FROM events e \
               WHERE e.run_id = runs.id AND e.kind = 'delta' AND e.seq > runs.partial_seq), '') ELSE '' END",
    // One statement: SQLite runs the sub-select and the update under the
    // same write lock, so no other writer can claim the same run between them.
    // INDEXED BY pins the claim to runs_claim: without statistics SQLite may
    // prefer another index and sort the queue on every claim, and if the
    // index ever stops matching, the statement fails to prepare instead of
    // going slow.
    claim: concat!(
        "UPDATE runs SET ", claim_set!(), " WHERE id IN (", claim_select!("$3", "''"), ") AND ", no_turns!(), " RETURNING {runs}"
    ),
    // `id = (…)` lets SQLite update in one pass; `id IN (…)` first collects
    // the ids, which costs more than the rest of the claim (measured: 124 µs
    // against 53 µs per claim on the same machine).
    claim_one: concat!(
        "UPDATE runs SET ", claim_set!(), " WHERE id = (", claim_select!("$3", "''"), ") AND ", no_turns!(), " RETURNING {runs}"
    ),
    bulk_load: concat!(
        "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < $1) ",
        "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, created_at, updated_at) ",
        "SELECT 'bench-' || i, $2, '', '{}', $3, 3, {now}, {now}, {now} FROM s"
    ),
    // The claim's own index path (runs_claim), so the ratio measures what
    // the protocol adds: fence, attempt, lease and the returned row. The
    // baseline leaves lease_expires_at NULL, so its claimed rows keep a NULL
    // key in runs_claim, which SQLite sorts first; the lower bound seeks past
    // them (real claims always set a lease, so they leave no NULL keys).
    baseline_claim: concat!(
        "UPDATE runs SET status = 'running' WHERE id IN (", baseline_select!(), ") RETURNING id"
    ),
    baseline_claim_one: concat!(
        "UPDATE runs SET status = 'running' WHERE id = (", baseline_select!(), ") RETURNING id"
    ),
};

/// The claims of several owners or lease lengths in one statement (a
/// group-committed batch, [`crate::store::Store::claim_batch`]): `$1` is a
/// JSON list with one `[owner, ttl_ms]` slot per run wanted, `$2` its
/// length, `$3` the attempts each claim counts (1, or 0 for runs claimed
/// for a local queue). The k-th run the claim index yields takes the k-th slot; which
/// claim gets which run does not matter, only that each gets its own.
/// One statement, not one per owner: a statement's own cost (its trip to
/// the connection's thread, its start-up, its `RETURNING` rows) was most
/// of a single claim's.
pub(super) const CLAIM_SLOTS: &str = concat!(
    "WITH w AS (SELECT key AS k, value ->> 0 AS owner, value ->> 1 AS ttl FROM jsonb_each($1)), ",
    "p AS (SELECT id, row_number() OVER () - 1 AS k FROM (", claim_select!("$2", "''"), ")) ",
    "UPDATE runs SET status = 'running', lease_owner = w.owner, fence = fence + 1, attempt = attempt + $3, ",
    "lease_expires_at = {now} + w.ttl, heartbeat_at = {now}, updated_at = {now}, ",
    "started_at = COALESCE(started_at, {now}) ",
    "FROM p JOIN w ON w.k = p.k WHERE runs.id = p.id AND ", no_turns!(), " RETURNING {runs}"
);

/// [`CLAIM_SLOTS`] for runs chosen beforehand (a claim that met a
/// concurrency key, `store::concurrency`): `$2` is the JSON list of their
/// ids, the k-th taking the k-th slot.
pub(super) const CLAIM_SLOTS_OF: &str = concat!(
    "WITH w AS (SELECT key AS k, value ->> 0 AS owner, value ->> 1 AS ttl FROM jsonb_each($1)), ",
    "p AS (SELECT value AS id, key AS k FROM json_each($2)) ",
    "UPDATE runs SET status = 'running', lease_owner = w.owner, fence = fence + 1, attempt = attempt + $3, ",
    "lease_expires_at = {now} + w.ttl, heartbeat_at = {now}, updated_at = {now}, ",
    "started_at = COALESCE(started_at, {now}) ",
    "FROM p JOIN w ON w.k = p.k WHERE runs.id = p.id RETURNING {runs}"
);

/// The claim of runs chosen beforehand (a claim that met a concurrency
/// key): `$1` owner, `$2` lease ms, `$3` the JSON list of their ids.
pub(super) const CLAIM_OF: &str = concat!(
    "UPDATE runs SET ", claim_set!(), " WHERE id IN (SELECT value FROM json_each($3)) RETURNING {runs}"
);

/// The first round of a claim's keys (`store::concurrency`): `$1` is a
/// JSON list of `[key, limit or null]`, `$2` the share of each. For each
/// key: its `room` (its limit less the running runs whose lease is live,
/// or `$2` without a limit), its `take` (the room, at most `$2`), and up
/// to `take` of its claimable runs in lane order, one row each (one row
/// with a null `id` for a key with room and no run). Within a key,
/// takeovers (runs whose lease ran out) go first, then runs by priority
/// then eligible time (not read one priority at a time:
/// a key's own leased or sleeping runs of a higher priority are stepped
/// over, never another key's).
pub(super) const KEYS_ROUND: &str = concat!(
    "WITH k AS (SELECT value ->> 0 AS key, CASE WHEN value ->> 1 IS NULL THEN $2 ELSE (value ->> 1) - ",
    "(SELECT COUNT(*) FROM runs INDEXED BY runs_key_running WHERE status = 'running' AND concurrency_key <> '' ",
    "AND concurrency_key = value ->> 0 AND lease_expires_at >= {now}) END AS room FROM json_each($1)), ",
    "t AS (SELECT key, room, MIN(room, $2) AS take FROM k WHERE room > 0) ",
    "SELECT key, room, take, id FROM (SELECT t.key, t.room, t.take, r.id, row_number() OVER ",
    "(PARTITION BY t.key ORDER BY r.status = 'running' DESC, r.priority DESC, ", "(CASE WHEN r.status = 'running' THEN r.lease_expires_at + 1 ELSE r.not_before END)",
    ", r.id) AS rn FROM t LEFT JOIN runs r ON r.id IN (SELECT id FROM (SELECT id FROM runs INDEXED BY runs_key_running ",
    "WHERE status = 'running' AND concurrency_key <> '' AND concurrency_key = t.key AND lease_expires_at < ", now_bound!(),
    " AND attempt < max_attempts AND paused_at IS NULL ORDER BY concurrency_key, lease_expires_at LIMIT $2) ",
    "UNION ALL SELECT id FROM (SELECT id FROM runs INDEXED BY runs_claim WHERE concurrency_key = t.key AND ",
    crate::claimable!(), " AND ", crate::eligible_at!(), " <= ", now_bound!(), " AND attempt < max_attempts AND status <> 'running' ",
    "ORDER BY concurrency_key, priority DESC, ", crate::eligible_at!(), ", id LIMIT $2))) WHERE rn <= take"
);

/// One lane's claimable runs, `$2` of them, for the claim's choice: `$1`
/// is the key (see [`claim_select!`]).
pub(super) const LANE: &str = claim_select!("$2", "$1");

/// Adds `mode=rwc` so the database file is created when missing.
pub(super) fn normalize_url(url: &str) -> String {
    if url.contains("mode=") || url.contains(":memory:") {
        url.to_string()
    } else if url.contains('?') {
        format!("{url}&mode=rwc")
    } else {
        format!("{url}?mode=rwc")
    }
}

/// The file of a `sqlite:` URL, if it names one (not `:memory:`).
pub(super) fn file_of(url: &str) -> Option<std::path::PathBuf> {
    let rest = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"))?;
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() || path.contains(":memory:") || query.contains("mode=memory") {
        return None;
    }
    Some(std::path::PathBuf::from(path))
}

/// Creates the database file readable by this user only (mode 0600)
/// before SQLite opens it: SQLite creates a new file 0644, and its `-wal`
/// and `-shm` with the file's own mode, and these hold every input,
/// output, kv value and run secret. An existing file, or its `-wal` or
/// `-shm`, that others may read is used, with a warning that says how to
/// mend it.
pub(super) fn private_file(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    for suffix in ["", "-wal", "-shm"] {
        let file = std::path::PathBuf::from(format!("{}{suffix}", path.display()));
        let Ok(meta) = std::fs::metadata(&file) else { continue };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                file = %file.display(),
                mode = format!("{mode:o}"),
                "the database file is open to other users; `chmod 600` it (and its -wal and -shm) while the service is stopped"
            );
        }
    }
    Ok(())
}

/// Per-connection settings. Returns one of a fixed set of static strings.
/// Set by the writer's first connection to a new, empty database, before
/// any table exists (the only time it takes effect): retention then gives
/// deleted runs' pages back to the file system. An older database keeps
/// its setting, and reuses freed pages instead.
///
/// Never on every connection: on a database with tables it asks for the
/// write lock, so a reader connecting while a write transaction is open
/// waited out its busy timeout, again and again (a segment stalled for
/// its whole lease).
pub(super) const NEW_DATABASE: &str = "PRAGMA auto_vacuum = INCREMENTAL";

/// The page cache of each connection (`PRAGMA cache_size`, in KiB when
/// negative): SQLite's own 2 MiB for the writer, 16 MiB for each reader.
///
/// Not more for the writer: every commit that split or merged a b-tree
/// page makes SQLite walk the writer's whole page cache. Its b-tree
/// balance renumbers pages through a spare page number (the lock-byte
/// page, 262,145 with 4 KiB pages), which leaves the cache's highest page
/// number there, and the commit's truncation of the cache to the
/// database's size then visits every slot of its hash table. With 64 MiB
/// (16,384 slots over the whole database) that walk was 6–8% of the
/// process's CPU in a no-op drain, on the writer's thread, the drain's
/// bottleneck; with 2 MiB, 1.9%. (Seen with `perf` and `gdb` on SQLite
/// 3.51.) A reader's cache is emptied at the start of every read after a
/// write, so it helps only while the database is quiet: a dashboard page
/// over a large table.
///
/// The writer keeps its temporary files in memory (`temp_store`): the
/// statement journal of a multi-row update, and an `IN (…)` list,
/// otherwise went to a file in `/var/tmp` (about one write a run in a
/// drain). Its statements touch bounded batches; readers, whose sorts can
/// span the whole table, keep the default.
pub(super) fn memory_pragmas(writer: bool) -> &'static str {
    if writer { "PRAGMA temp_store = MEMORY;" } else { "PRAGMA cache_size = -16384;" }
}

pub(super) fn pragmas(sync: SqliteSync, busy: Duration) -> &'static str {
    // busy_timeout is rounded to one of a few fixed values so the statement
    // text stays a constant (no SQL is built from configuration).
    let long = busy >= Duration::from_secs(5);
    match (sync, long) {
        (SqliteSync::Normal, true) => "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;",
        (SqliteSync::Normal, false) => "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 1000;",
        (SqliteSync::Full, true) => "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;",
        (SqliteSync::Full, false) => "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 1000;",
    }
}

/// SQLite's durability setting for the WAL (`PRAGMA synchronous`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SqliteSync {
    /// Every commit is fsynced before it returns: a commit that returned is
    /// on disk. The default. An unkeyed effect is at most once only if its
    /// `started` row is on disk before its request leaves.
    #[default]
    Full,
    /// Durable against a process crash, but a power loss or an OS crash may
    /// drop the last commits (it never corrupts the file). A `started` row
    /// lost that way lets an unkeyed effect that went out be made again.
    Normal,
}
