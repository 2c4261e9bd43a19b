//! `leasehold limits`: concurrency keys' limits and pauses, through the API
//! (`/v1/limits`, docs/flow-control.md).

use anyhow::Result;
use serde_json::{Value, json};

use super::Api;

#[derive(clap::Subcommand)]
pub enum LimitsCommand {
    /// Set a key's limit: at most N of its runs run at once.
    Set {
        key: String,
        /// The most of its runs that run at once. Default: no limit.
        #[arg(long)]
        concurrency: Option<i64>,
        /// Claim none of its runs until `limits resume` (runs already
        /// running finish their segment, then wait).
        #[arg(long)]
        paused: bool,
    },
    /// Pause a key, keeping its limit.
    Pause { key: String },
    /// Resume a paused key, keeping its limit.
    Resume { key: String },
    /// Show one key: its limit and its runs queued and running now.
    Show { key: String },
    /// List the keys with a limit, paused, or with runs.
    List,
    /// Remove a key's limit and pause.
    Rm { key: String },
}

/// The key as one path segment.
fn path(key: &str) -> String {
    format!("/v1/limits/{}", urlencoding(key))
}

fn urlencoding(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn line(k: &Value) -> String {
    format!(
        "{:<32}  {:>11}  {:<6}  {:>8}  {:>8}",
        k["key"].as_str().unwrap_or(""),
        k["concurrency"].as_i64().map_or("-".to_string(), |n| n.to_string()),
        if k["paused"].as_bool() == Some(true) { "paused" } else { "" },
        k["queued"].to_string(),
        k["running"].to_string(),
    )
}

const HEADER: &str = "KEY                               CONCURRENCY  PAUSED    QUEUED   RUNNING";

pub async fn limits(api: &Api, command: LimitsCommand) -> Result<()> {
    let c = api.client();
    match command {
        LimitsCommand::Set { key, concurrency, paused } => {
            let body = json!({ "concurrency": concurrency, "paused": paused });
            let v = api.send(c.put(api.url(&path(&key))).json(&body)).await?;
            api.print(&v, |k| println!("{HEADER}\n{}", line(k)));
        }
        LimitsCommand::Pause { key } => toggle(api, &key, true).await?,
        LimitsCommand::Resume { key } => toggle(api, &key, false).await?,
        LimitsCommand::Show { key } => {
            let v = api.send(c.get(api.url(&path(&key)))).await?;
            api.print(&v, |k| println!("{HEADER}\n{}", line(k)));
        }
        LimitsCommand::List => {
            let (mut all, mut after) = (Vec::new(), String::new());
            loop {
                let page = api.send(c.get(api.url("/v1/limits")).query(&[("after", after.as_str()), ("limit", "1000")])).await?;
                all.extend(page["limits"].as_array().cloned().unwrap_or_default());
                match page["next"].as_str() {
                    Some(next) if next > after.as_str() => after = next.to_string(),
                    _ => break,
                }
            }
            let v = json!({ "limits": all });
            api.print(&v, |v| {
                println!("{HEADER}");
                for k in v["limits"].as_array().into_iter().flatten() {
                    println!("{}", line(k));
                }
            });
        }
        LimitsCommand::Rm { key } => {
            api.send(c.delete(api.url(&path(&key)))).await?;
            if !api.json {
                println!("limit on {key:?} removed");
            }
        }
    }
    Ok(())
}

/// Pauses or resumes `key`, keeping its limit.
async fn toggle(api: &Api, key: &str, paused: bool) -> Result<()> {
    let c = api.client();
    let concurrency = match api.send(c.get(api.url(&path(key)))).await {
        Ok(v) => v["concurrency"].as_i64(),
        Err(e) if e.to_string().starts_with("404") => None,
        Err(e) => return Err(e),
    };
    let v = api.send(c.put(api.url(&path(key))).json(&json!({ "concurrency": concurrency, "paused": paused }))).await?;
    api.print(&v, |k| println!("{HEADER}\n{}", line(k)));
    Ok(())
}
