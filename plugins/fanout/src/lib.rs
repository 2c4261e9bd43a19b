//! `fanout`: an example of child runs (`leasehold:turn/children@0.2.0`).
//!
//! Spawns `n` children (default 3) and waits for them, then returns their
//! outputs as a JSON array in spawn order. Input fields, all optional:
//!
//! * `plugin` (default `testkit`) and `input` (default `{}`): what each
//!   child runs; or `inputs`, one input per child (then `n` is its
//!   length). With `depth` > 1 the children are `fanout` runs of the same
//!   input with `depth - 1`, so `depth` levels of `n` make a tree.
//! * `options`: spawn options (`priority`, `concurrency_key`,
//!   `max_attempts`, `detached`), the same for every child.
//! * `mode`: `all` (default) or `any`; `timeout_ms`: the wait's deadline.
//! * `then`: `fail` fails the turn right after spawning (its open children
//!   are then cancelled unless `detached`); `leave` completes without
//!   waiting.
//!
//! An entry of the output is the child's output (JSON when it is JSON, a
//! string otherwise), or `{"failed": …}`, `{"aborted": …}`,
//! `{"cancelled": true}`, `{"pending": true}`.

wit_bindgen::generate!({ path: "../../wit", world: "turn" });

use leasehold::turn::children::{AwaitMode, ChildOutcome, await_children, spawn};
use leasehold::turn::host::{EffectError, emit};
use serde_json::{Value, json};

struct Fanout;

fn describe(e: EffectError) -> String {
    match e {
        EffectError::Failed(m) => format!("failed: {m}"),
        EffectError::InDoubt(m) => format!("in-doubt: {m}"),
        EffectError::Denied(m) => format!("denied: {m}"),
    }
}

fn entry(outcome: ChildOutcome) -> Value {
    match outcome {
        ChildOutcome::Completed(out) => serde_json::from_str(&out).unwrap_or(Value::String(out)),
        ChildOutcome::Failed(e) => json!({ "failed": e }),
        ChildOutcome::Aborted(e) => json!({ "aborted": e }),
        ChildOutcome::Cancelled => json!({ "cancelled": true }),
        ChildOutcome::Pending => json!({ "pending": true }),
    }
}

impl Guest for Fanout {
    fn run(input: String) -> Result<String, String> {
        let v: Value = serde_json::from_str(&input).map_err(|e| format!("bad input: {e}"))?;
        let depth = v["depth"].as_u64().unwrap_or(1).max(1);
        let (plugin, inputs) = if depth > 1 {
            let mut deeper = v.clone();
            deeper["depth"] = json!(depth - 1);
            ("fanout".to_string(), vec![deeper; v["n"].as_u64().unwrap_or(3) as usize])
        } else if let Some(each) = v["inputs"].as_array() {
            (v["plugin"].as_str().unwrap_or("testkit").to_string(), each.clone())
        } else {
            let input = v.get("input").cloned().unwrap_or(json!({}));
            (v["plugin"].as_str().unwrap_or("testkit").to_string(), vec![input; v["n"].as_u64().unwrap_or(3) as usize])
        };
        let n = inputs.len();
        let options = v.get("options").cloned().unwrap_or(json!({})).to_string();
        let mut ids = Vec::with_capacity(n);
        for input in &inputs {
            ids.push(spawn(&plugin, &input.to_string(), &options).map_err(describe)?);
        }
        emit(&format!("spawned {n} children of {plugin}\n"));
        match v["then"].as_str() {
            Some("fail") => return Err(format!("failing on purpose after spawning {ids:?}")),
            Some("leave") => return Ok(json!({ "spawned": ids }).to_string()),
            _ => {}
        }
        let mode = if v["mode"].as_str() == Some("any") { AwaitMode::Any } else { AwaitMode::All };
        let results = await_children(&ids, mode, v["timeout_ms"].as_u64()).map_err(describe)?;
        let outputs: Vec<Value> = results.into_iter().map(|r| entry(r.outcome)).collect();
        Ok(Value::Array(outputs).to_string())
    }
}

export!(Fanout);
