//! Domain types of the store: runs, leases, events, ledger rows, errors.

use std::fmt;

use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::any::AnyRow;

/// The state of a run. See docs/concepts.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Running,
    WaitingInput,
    WaitingTakeover,
    Completed,
    Failed,
    Aborted,
    Cancelled,
}

impl RunStatus {
    pub const ALL: [RunStatus; 8] = [
        RunStatus::Queued,
        RunStatus::Running,
        RunStatus::WaitingInput,
        RunStatus::WaitingTakeover,
        RunStatus::Completed,
        RunStatus::Failed,
        RunStatus::Aborted,
        RunStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Queued => "queued",
            RunStatus::Running => "running",
            RunStatus::WaitingInput => "waiting_input",
            RunStatus::WaitingTakeover => "waiting_takeover",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Aborted => "aborted",
            RunStatus::Cancelled => "cancelled",
        }
    }

    /// Terminal runs never change again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Completed | RunStatus::Failed | RunStatus::Aborted | RunStatus::Cancelled
        )
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RunStatus {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, StoreError> {
        RunStatus::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown run status {s:?}")))
    }
}

/// A run row. Times are epoch milliseconds from the database clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Run {
    pub id: i64,
    pub thread_id: String,
    pub plugin: String,
    pub plugin_digest: String,
    /// The turn's input, JSON text.
    pub input: String,
    pub idempotency_key: Option<String>,
    pub status: RunStatus,
    pub lease_owner: Option<String>,
    /// Never decreases. Every claim and every cancel increments it.
    pub fence: i64,
    pub lease_expires_at: Option<i64>,
    pub attempt: i64,
    pub max_attempts: i64,
    /// Higher is claimed first; within one priority, runs go in the order
    /// they became eligible. Default 0.
    pub priority: i64,
    /// Its concurrency key, if any (see `store::concurrency`).
    pub concurrency_key: Option<String>,
    pub heartbeat_at: Option<i64>,
    /// Streamed output not yet promoted to `output`. Only as read through
    /// the store's run reads (`get_run`, lists), which join what a flush
    /// appended since the last fold (see `store::partial`).
    pub partial: String,
    /// How many emits `partial` holds (the next emit's position).
    pub emit_pos: i64,
    /// Where the stored `partial` stops (see `store::partial`).
    #[serde(skip)]
    pub(crate) folded: crate::store::partial::Folded,
    /// Input delivered to a `waiting_input` run, not yet consumed.
    pub pending_input: Option<String>,
    pub output: Option<String>,
    pub error: Option<String>,
    pub not_before: i64,
    pub created_at: i64,
    pub updated_at: i64,
    pub finished_at: Option<i64>,
    /// When the run's first segment started (its first claim); `None`
    /// until then. `started_at - created_at` is the time it queued.
    pub started_at: Option<i64>,
    /// The run's own random secret (hex), which seeds its guest's WASI
    /// random. Never shown by the API. `None` for runs submitted before it
    /// existed.
    #[serde(skip)]
    pub secret: Option<String>,
    /// The version an `auto` upgrade last checked the run against.
    pub upgrade_checked: Option<String>,
    /// What came of it: moved, or why the run stays on its version.
    pub upgrade_note: Option<String>,
    /// The run whose turn spawned this one; `None` for a run submitted
    /// through the API.
    pub parent_id: Option<i64>,
    /// The root of its tree: the run submitted through the API that it
    /// descends from (itself for a root).
    pub root_id: i64,
    /// What a `queued` run waits for before it is due: `children` (its
    /// turn awaits runs it spawned). `None` otherwise.
    pub waiting_for: Option<String>,
    /// When an operator paused the run (`store::pause`); `None`: not
    /// paused. A paused run is not claimed until it is resumed.
    pub paused_at: Option<i64>,
    /// The run this one reruns (`store::rerun`), and the ledger position
    /// it reran from; `None` for a run that is no rerun.
    pub rerun_of: Option<i64>,
    pub rerun_from: Option<i64>,
    /// The schedule that started this run (`store::ticks`), and the time
    /// it was scheduled for (epoch ms); `None` for a run it did not start.
    pub schedule_id: Option<String>,
    pub scheduled_at: Option<i64>,
    /// The W3C `traceparent` the run was started under: its submitter's,
    /// or its parent run's segment's (`traces`). `None`: its own trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_parent: Option<String>,
    /// The reruns of this run, newest last (shown by `GET /v1/runs/{id}`;
    /// empty elsewhere).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reruns: Vec<i64>,
}

/// A text column, copied once: sqlx's `Any` row already holds it as a
/// `String`, and decoding a `String` from it goes through `Display`
/// (about 1% of the host's CPU a no-op run went to that in claims).
fn text(row: &AnyRow, column: &str) -> Result<String, sqlx::Error> {
    Ok(row.try_get::<&str, _>(column)?.to_owned())
}

/// [`text`], for a column that may be NULL.
fn text_or_null(row: &AnyRow, column: &str) -> Result<Option<String>, sqlx::Error> {
    Ok(row.try_get::<Option<&str>, _>(column)?.map(str::to_owned))
}

impl Run {
    pub(crate) fn from_row(row: &AnyRow) -> Result<Run, StoreError> {
        let status: &str = row.try_get("status")?;
        let id: i64 = row.try_get("id")?;
        Ok(Run {
            id,
            thread_id: text(row, "thread_id")?,
            plugin: text(row, "plugin")?,
            plugin_digest: text(row, "plugin_digest")?,
            input: text(row, "input")?,
            idempotency_key: text_or_null(row, "idempotency_key")?,
            status: status.parse()?,
            lease_owner: text_or_null(row, "lease_owner")?,
            fence: row.try_get("fence")?,
            lease_expires_at: row.try_get("lease_expires_at")?,
            attempt: row.try_get("attempt")?,
            max_attempts: row.try_get("max_attempts")?,
            priority: row.try_get("priority")?,
            concurrency_key: Some(row.try_get::<&str, _>("concurrency_key")?).filter(|k| !k.is_empty()).map(str::to_owned),
            heartbeat_at: row.try_get("heartbeat_at")?,
            partial: text(row, "partial")?,
            emit_pos: row.try_get("emit_pos")?,
            folded: crate::store::partial::Folded::from_row(row)?,
            pending_input: text_or_null(row, "pending_input")?,
            output: text_or_null(row, "output")?,
            error: text_or_null(row, "error")?,
            not_before: row.try_get("not_before")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            finished_at: row.try_get("finished_at")?,
            started_at: row.try_get("started_at")?,
            secret: text_or_null(row, "secret")?,
            upgrade_checked: text_or_null(row, "upgrade_checked")?,
            upgrade_note: text_or_null(row, "upgrade_note")?,
            parent_id: row.try_get("parent_id")?,
            root_id: row.try_get::<Option<i64>, _>("root_id")?.unwrap_or(id),
            waiting_for: row.try_get::<Option<&str>, _>("waiting_for")?.filter(|_| status == "queued").map(str::to_owned),
            paused_at: row.try_get("paused_at")?,
            rerun_of: row.try_get("rerun_of")?,
            rerun_from: row.try_get("rerun_from")?,
            schedule_id: text_or_null(row, "schedule_id")?,
            scheduled_at: row.try_get("scheduled_at")?,
            trace_parent: text_or_null(row, "trace_parent")?,
            reruns: Vec::new(),
        })
    }
}

/// What a caller asks for when it enqueues a run.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub plugin: String,
    /// The version the run keeps: a digest; [`NewRun::CURRENT_VERSION`],
    /// the plugin's current version as the statement that writes the run
    /// reads it; or empty, whatever version is current when a segment
    /// starts (tests and benches). Default: empty.
    pub plugin_digest: String,
    /// JSON text. The store does not interpret it.
    pub input: String,
    /// Default: a fresh random thread id.
    pub thread_id: Option<String>,
    /// Default: [`NewRun::DEFAULT_MAX_ATTEMPTS`].
    pub max_attempts: Option<i64>,
    /// A second create with the same key returns the first run.
    pub idempotency_key: Option<String>,
    /// Higher is claimed first, within [`crate::store::priority::PRIORITIES`].
    /// Default 0.
    pub priority: i64,
    /// Its runs share the key's limit and take turns with other keys
    /// ([`crate::store::concurrency`]). Default: none.
    pub concurrency_key: Option<String>,
    /// Tokens the run's tree (it and the runs it spawns) may have
    /// `model.chat` use (`store::budgets`). Default: none.
    pub budget_tokens: Option<i64>,
    /// US dollars (whole nano-dollars) its tree's priced `model.chat`
    /// calls may cost (`store::budgets`). Default: none.
    pub budget_usd_nanos: Option<i64>,
    /// A W3C `traceparent` to start the run's trace under (`traces`),
    /// checked by the caller. Default: none.
    pub trace_parent: Option<String>,
}

impl NewRun {
    /// Consecutive failed segments allowed before a run is aborted.
    pub const DEFAULT_MAX_ATTEMPTS: i64 = 3;

    /// As `plugin_digest`: the plugin's current version, read by the
    /// statement that writes the run (no digest starts so). A plugin that
    /// is not registered then fails the write.
    pub const CURRENT_VERSION: &'static str = "current";

    pub fn new(plugin: impl Into<String>, input: impl Into<String>) -> NewRun {
        NewRun {
            plugin: plugin.into(),
            plugin_digest: String::new(),
            input: input.into(),
            thread_id: None,
            max_attempts: None,
            idempotency_key: None,
            priority: 0,
            concurrency_key: None,
            budget_tokens: None,
            budget_usd_nanos: None,
            trace_parent: None,
        }
    }
}

/// Proof of holding a run: every guarded write carries it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Lease {
    pub run_id: i64,
    pub owner: String,
    pub fence: i64,
}

/// A successful claim: the run as it is now, and the lease to write with.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The run as claimed. Its `partial` is the stored, folded part only
    /// (see `store::partial`): a segment resumes from `emit_pos`, never
    /// from the text, so a claim does not read the deltas back.
    pub run: Run,
    pub lease: Lease,
    /// Whether the claim counted an attempt (`attempt` includes it). An
    /// attempt counts a segment that starts the guest: a claim made for a
    /// worker's local queue does not count one, and its segment counts it
    /// when it starts (its first renewal), so a host that dies with runs
    /// queued costs them nothing.
    pub charged: bool,
}

/// How a segment ends without finishing the turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Suspend {
    /// `waiting_input`: resumes once input is delivered.
    WaitInput { prompt: String },
    /// `waiting_takeover`: the segment budget is used up; any worker may
    /// claim it next.
    Takeover,
    /// `queued` with `not_before = now + delay_ms` (a durable sleep or a
    /// backoff).
    Sleep { delay_ms: i64 },
    /// `queued` with `not_before = now + delay_ms`: an effect's rate limit
    /// (`key`) has no room yet; the `suspended` event names the key.
    Rate { delay_ms: i64, key: String },
    /// `queued` until the children a turn waits for are done or its
    /// deadline passes (see `store::children`).
    Children(crate::store::ChildWait),
    /// `queued` until input is delivered to a name or the deadline passes
    /// (see `store::inbox`).
    Named(crate::store::NamedWait),
    /// `queued` until the tree's budget has room for a call of `tokens`
    /// and `usd_nanos` (`None`: its model has no price; see
    /// `store::budgets`).
    Budget { tokens: i64, usd_nanos: Option<i64> },
}

/// How a turn finishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Completed { output: String },
    Failed { error: String },
}

/// One event of a thread's durable log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub thread_id: String,
    /// Per-thread sequence, from 1, without gaps.
    pub seq: i64,
    pub run_id: i64,
    /// The fence of the segment that wrote it (0 for writes outside a lease,
    /// such as submit; the bumped fence for a cancel).
    pub fence: i64,
    pub kind: String,
    /// JSON text.
    pub payload: String,
    pub created_at: i64,
}

/// How a provider's effect survives a crash. See docs/concepts.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EffectClass {
    /// Applied in the host's database in the same transaction as its ledger
    /// commit: exactly once.
    Local,
    /// Carries `Idempotency-Key: <run_id>:<seq>`; re-issued when in doubt.
    Keyed,
    /// Never re-issued; an in-doubt result reaches the guest.
    Unkeyed,
}

impl EffectClass {
    pub fn as_str(self) -> &'static str {
        match self {
            EffectClass::Local => "local",
            EffectClass::Keyed => "keyed",
            EffectClass::Unkeyed => "unkeyed",
        }
    }
    fn parse(s: &str) -> Result<Self, StoreError> {
        match s {
            "local" => Ok(EffectClass::Local),
            "keyed" => Ok(EffectClass::Keyed),
            "unkeyed" => Ok(EffectClass::Unkeyed),
            _ => Err(StoreError::Corrupt(format!("unknown effect class {s:?}"))),
        }
    }
}

/// The state of one ledger row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EffectState {
    Started,
    Committed,
    Failed,
    /// Started by a segment that is gone; whether it happened is unknown.
    InDoubt,
}

impl EffectState {
    pub const ALL: [EffectState; 4] = [EffectState::Started, EffectState::Committed, EffectState::Failed, EffectState::InDoubt];

    pub fn as_str(self) -> &'static str {
        match self {
            EffectState::Started => "started",
            EffectState::Committed => "committed",
            EffectState::Failed => "failed",
            EffectState::InDoubt => "in_doubt",
        }
    }
    pub(crate) fn parse(s: &str) -> Result<Self, StoreError> {
        match s {
            "started" => Ok(EffectState::Started),
            "committed" => Ok(EffectState::Committed),
            "failed" => Ok(EffectState::Failed),
            "in_doubt" => Ok(EffectState::InDoubt),
            _ => Err(StoreError::Corrupt(format!("unknown effect state {s:?}"))),
        }
    }
}

/// One row of the effect ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EffectRow {
    pub run_id: i64,
    pub seq: i64,
    pub name: String,
    pub request_hash: String,
    /// The request's first 1,024 bytes (`None` for rows older than the
    /// column).
    pub request: Option<String>,
    /// `<database id>:<run_id>:<seq>`, stable across attempts, unique
    /// across databases.
    pub idempotency_key: String,
    pub class: EffectClass,
    pub state: EffectState,
    pub result: Option<String>,
    /// The run's emit position when the row was written.
    pub emit_pos: i64,
    /// How many emits the call streamed (`model.chat`), failed or not, and
    /// their bytes: replay moves the stream position on by them.
    pub deltas: i64,
    pub delta_bytes: i64,
    pub fence_started: i64,
    pub fence_completed: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    /// Who resolved the row by hand (`store::resolve`), if anyone did.
    #[serde(default)]
    pub resolved_by: Option<String>,
    /// When they did (ms since the epoch, the database's clock).
    #[serde(default)]
    pub resolved_at: Option<i64>,
}

impl EffectRow {
    pub(crate) fn from_row(row: &AnyRow) -> Result<EffectRow, StoreError> {
        let class: String = row.try_get("class")?;
        let state: String = row.try_get("state")?;
        Ok(EffectRow {
            run_id: row.try_get("run_id")?,
            seq: row.try_get("seq")?,
            name: row.try_get("name")?,
            request_hash: row.try_get("request_hash")?,
            request: row.try_get("request")?,
            idempotency_key: row.try_get("idempotency_key")?,
            class: EffectClass::parse(&class)?,
            state: EffectState::parse(&state)?,
            result: row.try_get("result")?,
            emit_pos: row.try_get("emit_pos")?,
            deltas: row.try_get("deltas")?,
            delta_bytes: row.try_get("delta_bytes")?,
            fence_started: row.try_get("fence_started")?,
            fence_completed: row.try_get("fence_completed")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            resolved_by: row.try_get("resolved_by")?,
            resolved_at: row.try_get("resolved_at")?,
        })
    }
}

/// Errors of the store, shaped by what the caller does next.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The (owner, fence) guard failed: another segment owns the run now, or
    /// it was cancelled or reaped. Stop and write nothing else.
    #[error("lease lost on run {} (owner {:?}, fence {})", .0.run_id, .0.owner, .0.fence)]
    LeaseLost(Lease),
    #[error("run {0} not found")]
    RunNotFound(i64),
    /// The run exists but is not in a state that allows the operation.
    #[error("run {run_id} is {status}: {message}")]
    Conflict {
        run_id: i64,
        status: RunStatus,
        message: &'static str,
    },
    /// `begin_effect` at a position that already has a ledger row: the
    /// caller must replay it instead.
    #[error("run {run_id} already has a ledger row at seq {seq}")]
    EffectExists { run_id: i64, seq: i64 },
    /// No ledger row at that position.
    #[error("run {run_id} has no ledger row at seq {seq}")]
    EffectNotFound { run_id: i64, seq: i64 },
    /// Completing an effect that was never started (or already completed).
    #[error("run {run_id} has no open ledger row at seq {seq}")]
    EffectNotOpen { run_id: i64, seq: i64 },
    #[error("invalid store configuration: {0}")]
    Config(String),
    /// A row holds a value the code does not know: a newer schema or manual
    /// edits.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// A group-committed write whose batch failed in a way that does not
    /// tell whether it was written (the connection broke after the
    /// statement was sent, or its result could not be read).
    #[error("the outcome of the write is unknown: {0}")]
    Unknown(String),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// Refused for a reason the message gives (the request is sound, the
    /// data does not allow it).
    #[error("{0}")]
    Refused(String),
    /// What was named does not exist (a schedule); the message says what.
    #[error("{0}")]
    NotFound(String),
    /// What was asked for existed once and is gone for good (a used
    /// answer link).
    #[error("{0}")]
    Gone(String),
}

impl StoreError {
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, StoreError::LeaseLost(_))
    }
}
