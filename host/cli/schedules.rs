//! `leasehold schedules`: make, list, show, change, pause, delete and
//! backfill schedules through the API (`/v1/schedules`,
//! docs/operations.md, "Schedules").

use anyhow::{Context, Result};
use serde_json::{Map, Value, json};

use super::Api;

#[derive(clap::Subcommand)]
pub enum SchedulesCommand {
    /// Make a schedule: runs of PLUGIN at the times of --cron or --every.
    Add {
        /// Its id (A-Z a-z 0-9 . _ -). Default: a random one.
        #[arg(long)]
        id: Option<String>,
        plugin: String,
        /// Each run's input, as JSON. Default: null.
        #[arg(long)]
        input: Option<String>,
        #[command(flatten)]
        times: Times,
        #[command(flatten)]
        policy: Policy,
        /// Make it paused.
        #[arg(long)]
        paused: bool,
    },
    /// List the schedules with their next tick.
    List,
    /// Show a schedule: its next times and its latest ticks.
    Show { id: String },
    /// Change a schedule (only what is given).
    Set {
        id: String,
        #[arg(long)]
        input: Option<String>,
        #[command(flatten)]
        times: Times,
        #[command(flatten)]
        policy: Policy,
    },
    /// Pause a schedule: no ticks until it is resumed.
    Pause {
        id: String,
        /// Why, for other operators.
        #[arg(long)]
        note: Option<String>,
    },
    /// Resume a schedule from the next time after now.
    Resume { id: String },
    /// Delete a schedule and its tick records (its runs stay).
    Rm { id: String },
    /// Record the ticks of a past range now: FROM and TO are RFC 3339
    /// times (2026-12-01T00:00:00Z) or epoch ms, both included.
    Backfill {
        id: String,
        from: String,
        to: String,
        /// skip, buffer_one, allow_all or cancel_other. Default: the schedule's.
        #[arg(long)]
        overlap: Option<String>,
    },
}

#[derive(clap::Args)]
pub struct Times {
    /// A cron expression: 5 fields (minute hour day month weekday), 6 with
    /// seconds first, or @hourly, @daily…
    #[arg(long, conflicts_with = "every")]
    cron: Option<String>,
    /// An interval instead: 30s, 15m, 1h30m.
    #[arg(long)]
    every: Option<String>,
    /// The IANA time zone of --cron. Default: UTC.
    #[arg(long = "tz")]
    time_zone: Option<String>,
}

#[derive(clap::Args)]
pub struct Policy {
    /// While the last run is open: skip (default), buffer_one, allow_all, cancel_other.
    #[arg(long)]
    overlap: Option<String>,
    /// Ticks later than this (after downtime) are skipped. Default: 1h.
    #[arg(long)]
    catchup_window: Option<String>,
    /// Each run waits a further 0 to this long. Default: 0.
    #[arg(long)]
    jitter: Option<String>,
}

fn body(input: Option<String>, times: Times, policy: Policy) -> Result<Map<String, Value>> {
    let mut b = Map::new();
    if let Some(input) = input {
        b.insert("input".into(), serde_json::from_str(&input).context("--input is not JSON")?);
    }
    let fields = [
        ("cron", times.cron),
        ("interval", times.every),
        ("time_zone", times.time_zone),
        ("overlap", policy.overlap),
        ("catchup_window", policy.catchup_window),
        ("jitter", policy.jitter),
    ];
    for (k, v) in fields {
        if let Some(v) = v {
            b.insert(k.into(), Value::String(v));
        }
    }
    Ok(b)
}

/// Epoch ms as RFC 3339 UTC, seconds precision.
fn when(ms: &Value) -> String {
    match ms.as_i64() {
        Some(ms) => jiff::Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| t.round(jiff::Unit::Second).map_or(t, |r| r).to_string()),
        None => "-".into(),
    }
}

fn every(s: &Value) -> String {
    match s["cron"].as_str() {
        Some(c) => format!("{c} ({})", s["time_zone"].as_str().unwrap_or("UTC")),
        None => format!("every {}", s["interval"].as_str().unwrap_or("?")),
    }
}

const HEADER: &str = "ID                        PLUGIN          NEXT                  STATE   TIMES";

fn line(s: &Value) -> String {
    let next = s["upcoming"].get(0).map_or("-".to_string(), when);
    let state = if s["paused"].as_bool() == Some(true) { "paused" } else { "active" };
    format!("{:<24}  {:<14}  {:<20}  {state:<6}  {}", s["id"].as_str().unwrap_or(""), s["plugin"].as_str().unwrap_or(""), next, every(s))
}

fn show_one(s: &Value) {
    println!("{HEADER}\n{}", line(s));
    println!("overlap {}, catch-up window {}, jitter {}", s["overlap"].as_str().unwrap_or(""), s["catchup_window"].as_str().unwrap_or(""), s["jitter"].as_str().unwrap_or(""));
    if let Some(note) = s["note"].as_str() {
        println!("note: {note}");
    }
    let upcoming: Vec<String> = s["upcoming"].as_array().into_iter().flatten().map(when).collect();
    if !upcoming.is_empty() {
        println!("next: {}", upcoming.join(", "));
    }
    if let Some(ticks) = s["recent"].as_array().filter(|t| !t.is_empty()) {
        println!("\nSCHEDULED             OUTCOME   RUN      STATUS            REASON");
        for t in ticks {
            println!("{}", tick_line(t));
        }
    }
}

fn tick_line(t: &Value) -> String {
    format!(
        "{:<20}  {:<8}  {:>7}  {:<16}  {}{}",
        when(&t["scheduled_at"]),
        t["outcome"].as_str().unwrap_or(""),
        t["run_id"].as_i64().map_or("-".to_string(), |r| r.to_string()),
        t["run_status"].as_str().unwrap_or("-"),
        t["reason"].as_str().unwrap_or(""),
        if t["backfill"].as_bool() == Some(true) { " (backfill)" } else { "" },
    )
}

fn path(id: &str) -> Result<String> {
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        anyhow::bail!("{id:?} is no schedule id: ids are A-Z a-z 0-9 . _ -");
    }
    Ok(format!("/v1/schedules/{id}"))
}

/// A time as the API takes it: epoch ms as a number, else the text.
fn time_arg(t: &str) -> Value {
    t.parse::<i64>().map_or_else(|_| Value::String(t.to_string()), Value::from)
}

pub async fn schedules(api: &Api, command: SchedulesCommand) -> Result<()> {
    let c = api.client();
    match command {
        SchedulesCommand::Add { id, plugin, input, times, policy, paused } => {
            let mut b = body(input, times, policy)?;
            b.insert("plugin".into(), Value::String(plugin));
            if let Some(id) = id {
                b.insert("id".into(), Value::String(id));
            }
            if paused {
                b.insert("paused".into(), Value::Bool(true));
            }
            let v = api.send(c.post(api.url("/v1/schedules")).json(&b)).await?;
            api.print(&v, show_one);
        }
        SchedulesCommand::List => {
            let (mut all, mut after) = (Vec::new(), String::new());
            loop {
                let page = api.send(c.get(api.url("/v1/schedules")).query(&[("after", after.as_str()), ("limit", "1000")])).await?;
                all.extend(page["schedules"].as_array().cloned().unwrap_or_default());
                match page["next"].as_str() {
                    Some(next) if next > after.as_str() => after = next.to_string(),
                    _ => break,
                }
            }
            api.print(&json!({ "schedules": all }), |_| {
                println!("{HEADER}");
                for s in &all {
                    println!("{}", line(s));
                }
            });
        }
        SchedulesCommand::Show { id } => {
            let v = api.send(c.get(api.url(&path(&id)?))).await?;
            api.print(&v, show_one);
        }
        SchedulesCommand::Set { id, input, times, policy } => {
            let b = body(input, times, policy)?;
            if b.is_empty() {
                anyhow::bail!("nothing to change: give --input, --cron, --every, --tz, --overlap, --catchup-window or --jitter");
            }
            let v = api.send(c.patch(api.url(&path(&id)?)).json(&b)).await?;
            api.print(&v, show_one);
        }
        SchedulesCommand::Pause { id, note } => {
            let mut b = json!({ "paused": true });
            if let Some(n) = note {
                b["note"] = Value::String(n);
            }
            let v = api.send(c.patch(api.url(&path(&id)?)).json(&b)).await?;
            api.print(&v, |s| println!("schedule {} paused", s["id"].as_str().unwrap_or("")));
        }
        SchedulesCommand::Resume { id } => {
            let v = api.send(c.patch(api.url(&path(&id)?)).json(&json!({ "paused": false }))).await?;
            api.print(&v, |s| println!("schedule {} resumed; next tick {}", s["id"].as_str().unwrap_or(""), s["upcoming"].get(0).map_or("-".into(), when)));
        }
        SchedulesCommand::Rm { id } => {
            api.send(c.delete(api.url(&path(&id)?))).await?;
            api.print(&json!({ "deleted": id }), |_| println!("schedule {id} deleted; its runs are kept"));
        }
        SchedulesCommand::Backfill { id, from, to, overlap } => {
            let mut b = json!({ "from": time_arg(&from), "to": time_arg(&to) });
            if let Some(o) = overlap {
                b["overlap"] = Value::String(o);
            }
            let v = api.send(c.post(api.url(&format!("{}/backfill", path(&id)?))).json(&b)).await?;
            api.print(&v, |v| {
                println!("SCHEDULED             OUTCOME   RUN      STATUS            REASON");
                for t in v["ticks"].as_array().into_iter().flatten() {
                    println!("{}", tick_line(t));
                }
            });
        }
    }
    Ok(())
}
