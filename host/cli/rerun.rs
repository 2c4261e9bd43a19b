//! `leasehold runs rerun`: a new run from a point in a run's ledger
//! (`POST /v1/runs/{id}/rerun`, docs/operations.md).

use anyhow::Result;
use serde_json::json;

use super::Api;

#[derive(clap::Args)]
pub struct RerunArgs {
    /// The run to rerun; it is not changed.
    id: i64,
    /// The ledger position to run live from (`runs effects ID` lists the
    /// rows): the rows below it are replayed, none performed.
    #[arg(long = "from")]
    from_seq: i64,
    /// A version of the same plugin to run (its digest). Default: the run's.
    #[arg(long)]
    digest: Option<String>,
}

pub async fn rerun(api: &Api, args: RerunArgs) -> Result<()> {
    let body = json!({ "from_seq": args.from_seq, "plugin_digest": args.digest });
    let url = api.url(&format!("/v1/runs/{}/rerun", args.id));
    let v = api.send(api.client().post(url).json(&body)).await?;
    api.print(&v, |r| println!("run {} queued: a rerun of run {} from call {}", r["id"], args.id, args.from_seq));
    Ok(())
}
