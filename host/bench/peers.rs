//! `bench drain --peers SCRIPT`: runs the peers' drain (`../shared/peers/run`:
//! graphile-worker and pg-boss on fresh databases of the same PostgreSQL
//! server) right after leasehold's, and puts leasehold's rate beside each.

use std::path::Path;
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Runs `script --server SERVER --n RUNS` and returns the JSON lines it
/// printed, one per system and configuration.
pub fn run(script: &Path, database_url: &str, runs: i64) -> Result<Vec<Value>> {
    let server = server_of(database_url)?;
    let out = std::process::Command::new(script)
        .arg("--server")
        .arg(&server)
        .arg("--n")
        .arg(runs.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("jobs_per_sec").is_some())
        .collect();
    if lines.is_empty() {
        bail!("{} printed no result line", script.display());
    }
    Ok(lines)
}

/// Leasehold's `runs_per_sec` over each peer's `jobs_per_sec`, named by
/// system and configuration.
pub fn ratios(runs_per_sec: f64, peers: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    for p in peers {
        let system = p["system"].as_str().unwrap_or("?");
        let name = match (system, p.get("concurrency").and_then(Value::as_u64)) {
            ("graphile-worker", Some(c)) => format!("graphile-worker (concurrency {c})"),
            _ => system.to_string(),
        };
        if let Some(rate) = p["jobs_per_sec"].as_f64().filter(|r| *r > 0.0) {
            out.insert(name, json!((runs_per_sec / rate * 1000.0).round() / 1000.0));
        }
    }
    Value::Object(out)
}

/// `postgres://user@host:port` of a database URL: the server the peers
/// make their own databases on.
fn server_of(url: &str) -> Result<String> {
    let parsed = url::Url::parse(url).with_context(|| "parsing --database-url")?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        bail!("--peers needs a PostgreSQL --database-url (the peers run on PostgreSQL)");
    }
    let mut server = parsed.clone();
    server.set_path("");
    server.set_query(None);
    Ok(server.as_str().trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_of_a_database_url_drops_the_database() {
        assert_eq!(server_of("postgres://postgres@127.0.0.1:5432/bench?sslmode=disable").unwrap(), "postgres://postgres@127.0.0.1:5432");
        assert!(server_of("sqlite://x.db").is_err());
    }

    #[test]
    fn ratios_name_each_configuration() {
        let peers = [
            json!({"system": "graphile-worker", "concurrency": 64, "jobs_per_sec": 20000}),
            json!({"system": "graphile-worker", "concurrency": 24, "jobs_per_sec": 2500}),
            json!({"system": "pg-boss", "jobs_per_sec": 10000}),
        ];
        let r = ratios(5000.0, &peers);
        assert_eq!(r["graphile-worker (concurrency 64)"], json!(0.25));
        assert_eq!(r["graphile-worker (concurrency 24)"], json!(2.0));
        assert_eq!(r["pg-boss"], json!(0.5));
    }
}
