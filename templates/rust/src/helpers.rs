//! Typed helpers over leasehold's host functions: each effect takes and
//! returns Rust values instead of JSON strings, and fails with an [`Error`]
//! that says which effect failed and how. Every call is recorded in the
//! run's ledger and replayed when the run resumes, so make the same calls
//! in the same order every time (see the WIT, `wit/turn.wit`).
//!
//! This file is shipped with `leasehold new --lang rust`; it needs the
//! bindings of `wit_bindgen::generate!` in the crate root and `serde_json`.

#![allow(dead_code)]

use serde_json::{Value, json};

use crate::leasehold::turn::host::{self, EffectError};

/// Why an effect gave no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The provider ran and failed (an HTTP error status, a bad request).
    Failed { effect: &'static str, message: String },
    /// An unkeyed effect was started by a segment that died: it may or may
    /// not have happened, and is never re-issued.
    InDoubt { effect: &'static str, message: String },
    /// Refused without being performed (not allowed, over a cap).
    Denied { effect: &'static str, message: String },
    /// The result was not what the provider promises (a host bug).
    BadResult { effect: &'static str, message: String },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Failed { effect, message } => write!(f, "{effect} failed: {message}"),
            Error::InDoubt { effect, message } => write!(f, "{effect} in doubt: {message}"),
            Error::Denied { effect, message } => write!(f, "{effect} denied: {message}"),
            Error::BadResult { effect, message } => write!(f, "{effect}: unexpected result: {message}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

/// Performs effect `name` with a JSON request and parses its JSON result.
pub fn effect(name: &'static str, request: &Value) -> Result<Value, Error> {
    let result = host::effect(name, &request.to_string()).map_err(|e| host_error(name, e))?;
    serde_json::from_str(&result).map_err(|e| Error::BadResult { effect: name, message: e.to_string() })
}

/// Appends text to the turn's streamed output.
pub fn emit(text: &str) {
    host::emit(text)
}

/// Suspends the run until someone delivers input, and returns it.
pub fn wait_input(prompt: &str) -> String {
    host::wait_input(prompt)
}

/// A durable timer: the run is suspended for `ms` milliseconds.
pub fn sleep_ms(ms: u64) {
    host::sleep(ms)
}

/// Writes a line to the host's log (not recorded).
pub fn log(message: &str) {
    host::log(2, message)
}

fn host_error(effect: &'static str, e: EffectError) -> Error {
    match e {
        EffectError::Failed(message) => Error::Failed { effect, message },
        EffectError::InDoubt(message) => Error::InDoubt { effect, message },
        EffectError::Denied(message) => Error::Denied { effect, message },
    }
}

/// Named waits (docs/plugins.md, "Named waits"): input delivered to this
/// run under a name, taken when the turn gets there.
pub mod waits {
    use super::{Error, host_error};
    use crate::leasehold::turn::waits as wit;

    /// Waits for input delivered under `name` (it may have arrived
    /// already) and returns it; `None` once `timeout_ms` has passed.
    pub fn wait_for(name: &str, prompt: &str, timeout_ms: Option<u64>) -> Option<String> {
        wit::wait_for(name, prompt, timeout_ms)
    }

    /// A one-use link that delivers input to the wait on `name` without
    /// the API token (`POST <link>` with `{"input"}`).
    pub fn answer_link(name: &str) -> Result<String, Error> {
        wit::answer_link(name).map_err(|e| host_error("answer-link", e))
    }
}

/// Child runs (docs/plugins.md, "Child runs"): spawn runs of other plugins
/// (granted by the plugin's `spawn_allow`) and wait for them.
pub mod children {
    use super::{Error, Value, host_error};
    pub use crate::leasehold::turn::children::ChildOutcome as Outcome;
    use crate::leasehold::turn::children::{self as wit, AwaitMode};

    /// Spawns a run of `plugin` with `input` as a child of this run and
    /// returns its id. `options`: `{"priority", "concurrency_key",
    /// "max_attempts", "detached"}`, or `json!({})`.
    pub fn spawn(plugin: &str, input: &Value, options: &Value) -> Result<u64, Error> {
        wit::spawn(plugin, &input.to_string(), &options.to_string()).map_err(|e| host_error("spawn", e))
    }

    /// Waits for every child in `ids` to end (or `timeout_ms` to pass)
    /// and returns their outcomes in the order of `ids`.
    pub fn await_all(ids: &[u64], timeout_ms: Option<u64>) -> Result<Vec<Outcome>, Error> {
        wait(ids, AwaitMode::All, timeout_ms)
    }

    /// Waits for the first child in `ids` to end (or `timeout_ms` to
    /// pass); the others are `Outcome::Pending`.
    pub fn await_any(ids: &[u64], timeout_ms: Option<u64>) -> Result<Vec<Outcome>, Error> {
        wait(ids, AwaitMode::Any, timeout_ms)
    }

    fn wait(ids: &[u64], mode: AwaitMode, timeout_ms: Option<u64>) -> Result<Vec<Outcome>, Error> {
        let results = wit::await_children(ids, mode, timeout_ms).map_err(|e| host_error("await-children", e))?;
        Ok(results.into_iter().map(|r| r.outcome).collect())
    }
}

pub mod http {
    use super::{Error, Value, effect, json};

    /// An HTTP response: status below 400 (a higher one is [`Error::Failed`]).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Response {
        pub status: u16,
        pub body: String,
    }

    fn response(v: Value) -> Result<Response, Error> {
        let bad = |m: &str| Error::BadResult { effect: "http", message: m.to_string() };
        let status = v["status"].as_u64().ok_or_else(|| bad("no status"))? as u16;
        let body = v["body"].as_str().ok_or_else(|| bad("no body"))?.to_string();
        Ok(Response { status, body })
    }

    /// `GET url`. Keyed: a re-issue after a crash carries the same
    /// `Idempotency-Key`.
    pub fn get(url: &str) -> Result<Response, Error> {
        response(effect("http", &json!({ "method": "GET", "url": url }))?)
    }

    /// `POST url` with a JSON body. Keyed, as [`get`].
    pub fn post(url: &str, body: &Value) -> Result<Response, Error> {
        response(effect("http", &json!({ "method": "POST", "url": url, "body": body }))?)
    }
}

pub mod kv {
    use super::{Error, Value, effect, json};

    /// The value stored under `key` in this plugin's namespace, if any.
    pub fn get(key: &str) -> Result<Option<Value>, Error> {
        let v = effect("kv.get", &json!({ "key": key }))?;
        Ok((!v.is_null()).then_some(v))
    }

    /// Stores `value` under `key`, exactly once however often the run dies.
    pub fn put(key: &str, value: &Value) -> Result<(), Error> {
        effect("kv.put", &json!({ "key": key, "value": value })).map(|_| ())
    }
}

pub mod model {
    use super::{Error, effect, json};

    /// One chat message.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Message {
        pub role: String,
        pub content: String,
    }

    impl Message {
        pub fn user(content: &str) -> Message {
            Message { role: "user".into(), content: content.into() }
        }
        pub fn system(content: &str) -> Message {
            Message { role: "system".into(), content: content.into() }
        }
    }

    /// Asks the host's model; its answer also streams into the output.
    pub fn chat(messages: &[Message]) -> Result<String, Error> {
        let messages: Vec<_> = messages.iter().map(|m| json!({ "role": m.role, "content": m.content })).collect();
        let v = effect("model.chat", &json!({ "messages": messages }))?;
        v["content"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Error::BadResult { effect: "model.chat", message: "no content".into() })
    }
}
