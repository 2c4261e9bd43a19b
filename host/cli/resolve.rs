//! `leasehold runs resolve`: an operator writes the outcome of a call in
//! doubt or failed, and the run goes on from it
//! (`POST /v1/runs/{id}/effects/{seq}/resolve`, docs/operations.md).

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::Api;

#[derive(clap::Args)]
pub struct ResolveArgs {
    /// The run.
    id: i64,
    /// The ledger row's position (`runs effects ID` lists them).
    seq: i64,
    /// The call happened and returned this JSON (text that is not JSON is
    /// taken as a JSON string).
    #[arg(long, required_unless_present = "error", conflicts_with = "error")]
    result: Option<String>,
    /// The call did not happen: it fails with this message.
    #[arg(long)]
    error: Option<String>,
    /// Who resolved it, kept with the row. Default: $USER, else `cli`.
    #[arg(long)]
    by: Option<String>,
}

pub async fn resolve(api: &Api, args: ResolveArgs) -> Result<()> {
    let by = args.by.or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty())).unwrap_or_else(|| "cli".into());
    let mut body = json!({ "by": by });
    match (args.result, args.error) {
        (Some(r), _) => body["result"] = serde_json::from_str(&r).unwrap_or(Value::String(r)),
        (_, Some(e)) => body["error"] = Value::String(e),
        (None, None) => unreachable!("clap requires one of --result and --error"),
    }
    let url = api.url(&format!("/v1/runs/{}/effects/{}/resolve", args.id, args.seq));
    let v = api.send(api.client().post(url).json(&body)).await.context("resolving the effect")?;
    api.print(&v, |r| {
        let e = &r["effect"];
        println!(
            "run {} row {} ({}) resolved as {} by {}; the run is {}",
            args.id,
            args.seq,
            e["name"].as_str().unwrap_or(""),
            e["state"].as_str().unwrap_or(""),
            e["resolved_by"].as_str().unwrap_or(""),
            r["run"]["status"].as_str().unwrap_or("")
        );
    });
    Ok(())
}
