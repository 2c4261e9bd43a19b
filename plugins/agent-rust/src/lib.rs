//! An example agent turn, the same in all four example languages.
//!
//! Input: `{"prompt": "…", "tool_url": "http://…", "ask": false}`.
//! 1. asks the model (`model.chat`; its answer streams into the run's output);
//! 2. sends the answer to a tool over `http` (keyed: retried safely);
//! 3. stores the tool's reply as the note `note` (`kv.put`, exactly once);
//! 4. when `ask` is true, asks the user (`wait-input`; the run suspends);
//! 5. returns `{"message": "<answer>\ntool: <reply>[\nyou: <input>]"}`.
//!
//! Its effects go through the typed helpers `leasehold new --lang rust`
//! ships (`templates/rust/src/helpers.rs`).
//!
//! Build: `cargo build --release --target wasm32-wasip2`
//! (output `target/wasm32-wasip2/release/agent_rust.wasm`).

wit_bindgen::generate!({ path: "../../wit", world: "turn" });

/// The typed helpers `leasehold new --lang rust` ships, from the one source.
#[path = "../../../templates/rust/src/helpers.rs"]
mod helpers;

use helpers::{http, kv, log, model, wait_input};
use serde_json::json;

struct Agent;

impl Guest for Agent {
    fn run(input: String) -> Result<String, String> {
        let input: serde_json::Value = serde_json::from_str(&input).map_err(|e| format!("bad input: {e}"))?;
        let prompt = input["prompt"].as_str().ok_or("bad input: `prompt` must be a string")?;
        let tool_url = input["tool_url"].as_str().ok_or("bad input: `tool_url` must be a string")?;
        let ask = input["ask"].as_bool().unwrap_or(false);
        log("agent: start");

        let content = model::chat(&[model::Message::user(prompt)])?;
        let tool = http::post(tool_url, &json!(content))?;
        kv::put("note", &json!(tool.body))?;

        let mut text = format!("{content}\ntool: {}", tool.body);
        if ask {
            let reply = wait_input("Anything to add?");
            text.push_str(&format!("\nyou: {reply}"));
        }
        Ok(json!({ "message": text }).to_string())
    }
}

export!(Agent);
