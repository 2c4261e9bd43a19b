//! `approval`: an example of named waits (`leasehold:turn/waits@0.2.0`).
//!
//! Waits for input delivered under `name` (default `approval`), showing
//! `prompt`, for at most `timeout_ms` if given, and returns
//! `{"input": …}` or `{"timeout": true}`. Input fields, all optional:
//!
//! * `notify_url`: first makes a one-use answer link and POSTs
//!   `{"link": …}` there with `http` (as an email or a chat message
//!   would carry it), so whoever gets it can answer without the API token;
//! * `sleep_ms`: a durable sleep before the wait (input may arrive then);
//! * `spin`: iterations of work after the wait, before returning;
//! * `sleep_after_ms`: a durable sleep after the wait.

wit_bindgen::generate!({ path: "../../wit", world: "turn" });

use leasehold::turn::host::{EffectError, effect, sleep};
use leasehold::turn::waits::{answer_link, wait_for};
use serde_json::{Value, json};

struct Approval;

fn describe(e: EffectError) -> String {
    match e {
        EffectError::Failed(m) => format!("failed: {m}"),
        EffectError::InDoubt(m) => format!("in-doubt: {m}"),
        EffectError::Denied(m) => format!("denied: {m}"),
    }
}

fn spin(n: u64) -> u64 {
    let mut x = 0u64;
    for i in 0..n {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
    }
    x
}

impl Guest for Approval {
    fn run(input: String) -> Result<String, String> {
        let v: Value = serde_json::from_str(&input).map_err(|e| format!("bad input: {e}"))?;
        let name = v["name"].as_str().unwrap_or("approval");
        let prompt = v["prompt"].as_str().unwrap_or("Approve?");
        if let Some(url) = v["notify_url"].as_str() {
            let link = answer_link(name).map_err(describe)?;
            let request = json!({ "method": "POST", "url": url, "body": { "link": link } });
            effect("http", &request.to_string()).map_err(describe)?;
        }
        if let Some(ms) = v["sleep_ms"].as_u64() {
            sleep(ms);
        }
        let got = wait_for(name, prompt, v["timeout_ms"].as_u64());
        spin(v["spin"].as_u64().unwrap_or(0));
        if let Some(ms) = v["sleep_after_ms"].as_u64() {
            sleep(ms);
        }
        Ok(match got {
            Some(input) => json!({ "input": input }),
            None => json!({ "timeout": true }),
        }
        .to_string())
    }
}

export!(Approval);
