//! An example agent turn, the same in all four example languages.
//!
//! Input: `{"prompt": "…", "tool_url": "http://…", "ask": false}`.
//! 1. asks the model (`model.chat`; its answer streams into the run's output);
//! 2. sends the answer to a tool over `http` (keyed: retried safely);
//! 3. stores the tool's reply as the note `note` (`kv.put`, exactly once);
//! 4. when `ask` is true, asks the user (`wait-input`; the run suspends);
//! 5. returns `{"message": "<answer>\ntool: <reply>[\nyou: <input>]"}`.
//!
//! Build: `cargo build --release --target wasm32-wasip2`
//! (output `target/wasm32-wasip2/release/agent_rust.wasm`).

wit_bindgen::generate!({ path: "../../wit", world: "turn" });

use leasehold::turn::host::{EffectError, effect, log, wait_input};
use serde_json::{Value, json};

struct Agent;

fn message(e: EffectError) -> String {
    match e {
        EffectError::Failed(m) | EffectError::InDoubt(m) | EffectError::Denied(m) => m,
    }
}

/// Calls effect `name` and parses its JSON result.
fn call(name: &str, request: Value) -> Result<Value, String> {
    let result = effect(name, &request.to_string()).map_err(|e| format!("{name}: {}", message(e)))?;
    serde_json::from_str(&result).map_err(|e| format!("{name}: bad result: {e}"))
}

impl Guest for Agent {
    fn run(input: String) -> Result<String, String> {
        let input: Value = serde_json::from_str(&input).map_err(|e| format!("bad input: {e}"))?;
        let prompt = input["prompt"].as_str().ok_or("bad input: `prompt` must be a string")?;
        let tool_url = input["tool_url"].as_str().ok_or("bad input: `tool_url` must be a string")?;
        let ask = input["ask"].as_bool().unwrap_or(false);
        log(2, "agent: start");

        let chat = call("model.chat", json!({ "messages": [{ "role": "user", "content": prompt }] }))?;
        let content = chat["content"].as_str().unwrap_or_default();
        let tool = call("http", json!({ "method": "POST", "url": tool_url, "body": content }))?;
        let tool_body = tool["body"].as_str().unwrap_or_default();
        call("kv.put", json!({ "key": "note", "value": tool_body }))?;

        let mut text = format!("{content}\ntool: {tool_body}");
        if ask {
            let reply = wait_input("Anything to add?");
            text.push_str(&format!("\nyou: {reply}"));
        }
        Ok(json!({ "message": text }).to_string())
    }
}

export!(Agent);
