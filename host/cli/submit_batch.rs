//! `leasehold runs submit-batch`: many runs from a file of JSON lines,
//! through `POST /v1/runs:batch`.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::Api;

/// Runs per `POST /v1/runs:batch` of `runs submit-batch`: the API's limit.
const SUBMIT_BATCH: usize = 1000;

pub(super) async fn submit_batch(api: &Api, file: &std::path::Path) -> Result<()> {
    let text = if file.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading stdin")?
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?
    };
    let mut runs = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("line {}: not JSON", i + 1))?;
        if !v.is_object() {
            bail!("line {}: expected a JSON object, as the body of POST /v1/runs", i + 1);
        }
        runs.push(v);
    }
    if runs.is_empty() {
        bail!("{}: no runs (one JSON object per line)", file.display());
    }
    let (mut created, mut existing, mut refused) = (0, 0, 0);
    for chunk in runs.chunks(SUBMIT_BATCH) {
        let v = api.send(api.client().post(api.url("/v1/runs:batch")).json(&json!({ "runs": chunk }))).await?;
        for r in v["results"].as_array().into_iter().flatten() {
            if r["created"] == true {
                created += 1;
            } else if r["created"] == false {
                existing += 1;
            } else {
                refused += 1;
                eprintln!("{}", r["error"]["message"].as_str().unwrap_or("refused"));
            }
            if api.json {
                println!("{r}");
            }
        }
    }
    if !api.json {
        println!("{created} runs queued, {existing} already submitted, {refused} refused");
    }
    if refused > 0 {
        bail!("{refused} runs were refused (above)");
    }
    Ok(())
}

