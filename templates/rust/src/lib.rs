//! {{name}}: a leasehold turn. Input: `{"url": "http://…"}`. It fetches the
//! URL (`http`), counts its visits in `kv`, streams a line (`emit`) and
//! returns a summary. Every effect goes through the typed helpers in
//! `helpers.rs`; each is recorded, and replayed when the run resumes, so
//! the turn must make the same calls in the same order every time.

wit_bindgen::generate!({ path: "wit", world: "turn" });

mod helpers;

use helpers::{emit, http, kv};
use serde_json::{Value, json};

struct Turn;

impl Guest for Turn {
    fn run(input: String) -> Result<String, String> {
        let input: Value = serde_json::from_str(&input).map_err(|e| format!("bad input: {e}"))?;
        let url = input["url"].as_str().ok_or("bad input: `url` must be a string")?;

        let page = http::get(url)?;
        let visits = kv::get("visits")?.and_then(|v| v.as_u64()).unwrap_or(0) + 1;
        kv::put("visits", &json!(visits))?;
        emit(&format!("fetched {url}\n"));
        Ok(format!("fetched {} bytes (HTTP {}); visit {visits}", page.body.len(), page.status))
    }
}

export!(Turn);
