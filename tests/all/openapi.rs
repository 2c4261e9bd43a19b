//! The OpenAPI description: it names every endpoint the CLI and the
//! dashboard call, and schemathesis (from PyPI, in the venv
//! `scripts/toolchains` makes) fuzzes a live `leasehold serve` against it
//! on both backends: no 5xx, every answer as described, and the database's
//! schema the same afterwards.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sqlx::Row;

use crate::harness::{TestDb, both};
use crate::serve_proc::{self, ServeArgs, ServeProc, TEST_TOKEN};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `path` (`/v1/runs/7/input`) is an instance of the documented
/// template `doc` (`/v1/runs/{id}/input`).
fn matches(doc: &str, path: &str) -> bool {
    let (d, p): (Vec<_>, Vec<_>) = (doc.split('/').collect(), path.split('/').collect());
    d.len() == p.len() && d.iter().zip(&p).all(|(d, p)| (d.starts_with('{') && !p.is_empty()) || d == p)
}

/// Every `/v1/…` path a source file names, with its placeholders (`{id}`,
/// `${id}`, `{}`) as one segment each.
fn paths_named_in(file: &Path) -> Result<Vec<String>> {
    let source = std::fs::read_to_string(file).with_context(|| file.display().to_string())?;
    // A template literal's `${…}` (however nested) becomes one `{x}`.
    let mut text = String::with_capacity(source.len());
    let mut rest = source.as_str();
    while let Some(at) = rest.find("${") {
        text.push_str(&rest[..at]);
        let mut depth = 0;
        let end = rest[at + 1..].char_indices().find_map(|(i, c)| {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(at + 1 + i + 1)
        });
        let Some(end) = end else { break };
        text.push_str("{x}");
        rest = &rest[end..];
    }
    text.push_str(rest);
    let mut found = Vec::new();
    for (i, _) in text.match_indices("/v1/") {
        let rest = &text[i..];
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || "/_:.{}$-".contains(c))).unwrap_or(rest.len());
        let mut path = &rest[..end];
        // `/v1/runs${query}`: a placeholder glued to a segment is a query
        // string, not a segment.
        if let Some(cut) = path.char_indices().find(|&(i, c)| c == '{' && i > 0 && !path[..i].ends_with('/')) {
            path = &path[..cut.0];
        }
        let path = path.trim_end_matches(['/', '.', ':']);
        // `/v1/runs:batch` is one path; a bare `/v1/` prefix names none.
        if path.len() > 4 {
            found.push(path.to_string());
        }
    }
    Ok(found)
}

async fn description(base: &str) -> Result<Value> {
    let resp = reqwest::get(format!("{base}/v1/openapi.json")).await?;
    ensure!(resp.status() == 200, "GET /v1/openapi.json: {}", resp.status());
    Ok(resp.json().await?)
}

fn serve(db: &TestDb, dir: &Path) -> Result<ServeProc> {
    leasehold::effects::http::install_tls();
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    std::fs::write(plugins.join("testkit.wasm"), crate::plugins::rust_plugin("testkit")?)?;
    let mut args = ServeArgs::new(db.url(), &plugins, "fuzzed".into())?;
    args.log = dir.join("serve.log");
    ServeProc::spawn(&args)
}

/// The schema as the database describes it: tables, columns, indexes.
async fn schema(db: &TestDb) -> Result<Vec<String>> {
    let q = match db.backend {
        leasehold::store::Backend::Sqlite => {
            "SELECT type || ' ' || name || ' ' || COALESCE(sql, '') AS d FROM sqlite_master ORDER BY type, name"
        }
        leasehold::store::Backend::Postgres => {
            "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable AS d \
             FROM information_schema.columns WHERE table_schema = 'public' \
             UNION ALL SELECT indexdef AS d FROM pg_indexes WHERE schemaname = 'public' ORDER BY d"
        }
    };
    let rows = sqlx::query(q).fetch_all(db.store.pool()).await?;
    rows.iter().map(|r| Ok(r.try_get::<String, _>("d")?)).collect()
}

both! {
    async fn the_description_is_openapi_3_1_and_names_every_endpoint_the_cli_and_dashboard_call(db) {
        let dir = tempfile::tempdir()?;
        let host = serve(db, dir.path())?;
        let http = serve_proc::client(reqwest::Client::builder())?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        // No token needed: it describes, it holds no data.
        let doc = description(&host.base).await?;
        ensure!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.1")), "{}", doc["openapi"]);
        let documented: Vec<String> = doc["paths"].as_object().context("paths")?.keys().cloned().collect();
        for want in ["/v1/runs", "/v1/runs:batch", "/v1/runs/{id}", "/v1/runs/{id}/input", "/v1/runs/{id}/cancel",
            "/v1/runs/{id}/effects", "/v1/plugins", "/v1/plugins/{name}", "/v1/threads/{id}/events", "/v1/stats",
            "/v1/leases", "/v1/openapi.json", "/healthz", "/metrics"]
        {
            ensure!(documented.iter().any(|d| d == want), "{want} is not described: {documented:?}");
        }
        ensure!(doc["components"]["schemas"]["ErrorBody"].is_object() && doc["components"]["schemas"]["Run"].is_object());
        // Every path the CLI and the dashboard call is a described one.
        let sources = ["host/cli.rs", "host/cli/limits.rs", "host/cli/schedules.rs", "host/api/dashboard/schedules.js", "host/api/dashboard/charts.js", "host/cli/dev.rs", "host/cli/replay.rs", "host/api/dashboard/app.js", "host/api/dashboard/queues.js", "host/api/dashboard/tree.js"];
        let mut called = 0;
        for source in sources {
            for path in paths_named_in(&root().join(source))? {
                called += 1;
                ensure!(documented.iter().any(|d| matches(d, &path)), "{source} calls {path}, which the description does not name");
            }
        }
        ensure!(called >= 10, "found only {called} calls: the scan is broken");
        // And every described operation is served (none falls through to
        // the router's 404 for unknown paths).
        for (path, item) in doc["paths"].as_object().context("paths")? {
            for method in item.as_object().context("item")?.keys() {
                let url = format!("{}{}", host.base, path.replace("{id}", "1").replace("{name}", "nope"));
                let req = http.request(method.to_uppercase().parse()?, &url).header("content-type", "application/json").body("{}");
                let resp = req.send().await?;
                let status = resp.status();
                let body = resp.text().await?;
                ensure!(!body.contains("no such endpoint"), "{method} {path}: {status} {body}");
                // Every POST and PATCH is JSON only: another web page's
                // form (or fetch without a preflight) cannot send it.
                if method == "post" || method == "patch" {
                    let form = http.request(method.to_uppercase().parse()?, &url).header("content-type", "application/x-www-form-urlencoded").body("a=1");
                    let status = form.send().await?.status();
                    ensure!(status == 415, "{method} {path} as a form: {status}, not 415");
                }
            }
        }
        Ok(())
    }

    async fn schemathesis_finds_no_server_error_and_no_answer_off_the_description(db) {
        let st = root().join("target/toolchains/st/bin/schemathesis");
        ensure!(st.exists(), "{} not found: run scripts/toolchains (it installs schemathesis in a venv)", st.display());
        let dir = tempfile::tempdir()?;
        let host = serve(db, dir.path())?;
        let http = serve_proc::client(reqwest::Client::builder())?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let before = schema(db).await?;
        let out = tokio::process::Command::new(&st)
            .arg("--config-file")
            .arg(root().join("tests/schemathesis.toml"))
            .arg("run")
            .arg(format!("{}/v1/openapi.json", host.base))
            .args(["--header", &format!("Authorization: Bearer {TEST_TOKEN}")])
            .args(["--checks", "all", "--max-examples", "25", "--seed", "1", "--no-color"])
            .args(["--workers", "2", "--request-timeout", "20", "--generation-database", "none"])
            .current_dir(dir.path())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(600), out).await.context("schemathesis took over 600 s")??;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The summary, for the record (`--nocapture` shows it).
        println!("{}", stdout.lines().rev().take(25).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n"));
        ensure!(out.status.success(), "schemathesis failed ({}):\n{stdout}\n{stderr}", out.status);
        let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();
        ensure!(!log.contains("panicked"), "the host panicked:\n{log}");
        ensure!(schema(db).await? == before, "the database schema changed under the fuzzer");
        drop(host);
        Ok(())
    }
}
