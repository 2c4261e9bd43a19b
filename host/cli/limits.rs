//! `leasehold limits`: concurrency keys' limits and pauses, and the rate
//! limits of effects (keys `http:HOST:PORT`, `model:NAME`), through the API
//! (`/v1/limits`, docs/flow-control.md).

use anyhow::Result;
use serde_json::{Value, json};

use super::Api;

#[derive(clap::Subcommand)]
pub enum LimitsCommand {
    /// Set a key's limit: at most N of its runs run at once; or, for a
    /// rate key (`http:HOST:PORT`, `model:NAME`), at most N calls (and M
    /// tokens) a minute across every run and host.
    Set {
        key: String,
        /// The most of its runs that run at once. Default: no limit.
        #[arg(long, conflicts_with_all = ["per_minute", "tokens_per_minute"])]
        concurrency: Option<i64>,
        /// Claim none of its runs until `limits resume` (runs already
        /// running finish their segment, then wait).
        #[arg(long, conflicts_with_all = ["per_minute", "tokens_per_minute"])]
        paused: bool,
        /// Rate keys: calls a minute, spaced evenly.
        #[arg(long)]
        per_minute: Option<i64>,
        /// `model:` keys: tokens a minute.
        #[arg(long)]
        tokens_per_minute: Option<i64>,
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

fn rate_line(k: &Value) -> String {
    let n = |f: &str| k[f].as_i64().map_or("-".to_string(), |n| n.to_string());
    let held = match k["held_until"].as_i64() {
        Some(_) => "held (Retry-After)",
        None => "",
    };
    format!("{:<32}  {:>10}  {:>10}  {:>7}  {held}", k["key"].as_str().unwrap_or(""), n("per_minute"), n("tokens_per_minute"), n("wait_ms"))
}

const RATE_HEADER: &str = "RATE KEY                          PER MINUTE  TOKENS/MIN  WAIT MS";

fn is_rate(k: &Value) -> bool {
    k.get("per_minute").is_some()
}

/// One key, as a table of one row of its kind.
fn show_one(k: &Value) {
    if is_rate(k) {
        println!("{RATE_HEADER}\n{}", rate_line(k));
    } else {
        println!("{HEADER}\n{}", line(k));
    }
}

pub async fn limits(api: &Api, command: LimitsCommand) -> Result<()> {
    let c = api.client();
    match command {
        LimitsCommand::Set { key, concurrency, paused, per_minute, tokens_per_minute } => {
            let body = if per_minute.is_some() || tokens_per_minute.is_some() {
                json!({ "per_minute": per_minute, "tokens_per_minute": tokens_per_minute })
            } else {
                json!({ "concurrency": concurrency, "paused": paused })
            };
            let v = api.send(c.put(api.url(&path(&key))).json(&body)).await?;
            api.print(&v, show_one);
        }
        LimitsCommand::Pause { key } => toggle(api, &key, true).await?,
        LimitsCommand::Resume { key } => toggle(api, &key, false).await?,
        LimitsCommand::Show { key } => {
            let v = api.send(c.get(api.url(&path(&key)))).await?;
            api.print(&v, show_one);
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
                let all = v["limits"].as_array().cloned().unwrap_or_default();
                let (rates, keys): (Vec<Value>, Vec<Value>) = all.into_iter().partition(is_rate);
                println!("{HEADER}");
                for k in &keys {
                    println!("{}", line(k));
                }
                if !rates.is_empty() {
                    println!("\n{RATE_HEADER}");
                    for k in &rates {
                        println!("{}", rate_line(k));
                    }
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
    // Without `concurrency` the limit stays as it is, a plugin's default included.
    let v = api.send(c.put(api.url(&path(key))).json(&json!({ "paused": paused }))).await?;
    api.print(&v, |k| println!("{HEADER}\n{}", line(k)));
    Ok(())
}
