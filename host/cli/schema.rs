//! `leasehold schema`: the migrations a database has and its contract
//! steps (docs/operations.md, "Upgrades"), on the database directly.

use anyhow::{Context, Result};
use leasehold::store::contract::Step;

use crate::cli::replay::existing;

#[derive(clap::Subcommand)]
pub enum SchemaCommand {
    /// The migrations applied, and each contract step this release knows:
    /// taken or pending.
    Status(SchemaArgs),
    /// Take every pending contract step. Only once no host of an older
    /// release runs on this database: what this release's hosts then
    /// write, those hosts would not read. Hosts see it within 5 s.
    Contract(SchemaArgs),
}

#[derive(clap::Args)]
pub struct SchemaArgs {
    /// The database (as `serve --database-url`). It is not migrated: a
    /// `serve` of this release does that. [default: sqlite://leasehold.db]
    #[arg(long, env = "LEASEHOLD_DATABASE_URL")]
    database_url: Option<String>,
}

pub async fn schema(command: SchemaCommand) -> Result<()> {
    let (SchemaCommand::Status(args) | SchemaCommand::Contract(args)) = &command;
    let url = args.database_url.clone().unwrap_or_else(|| "sqlite://leasehold.db".into());
    let store = existing(&url).await?;
    let applied: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations")
        .fetch_one(store.pool())
        .await
        .context("reading the migrations applied (has a `leasehold serve` ever run on this database?)")?;
    let taken = store.read_contract_steps().await.context(
        "reading the contract steps: this database has not been migrated by this release; start a `leasehold serve` of this release on it first",
    )?;
    if let SchemaCommand::Contract(_) = command {
        let now = store.contract().await.context("taking the contract steps")?;
        for step in &now {
            println!("taken: {}", step.name());
        }
        if now.is_empty() {
            println!("every contract step was already taken");
        }
        return Ok(());
    }
    println!("migrations applied: up to {}", applied.unwrap_or(0));
    for step in Step::ALL {
        println!("{:<20} {}", step.name(), if taken.contains(&step) { "taken" } else { "pending" });
    }
    Ok(())
}
