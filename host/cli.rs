//! The binary's commands. Most talk to a running `leasehold serve` over its
//! HTTP API: plugins, submit, runs, events, limits, schedules. Output is a
//! table or text for a terminal; `--json` prints the API's JSON for
//! scripts. An API error is printed with its code and the command exits
//! non-zero. Beside them, the plugin author's local commands: `new`
//! (a project from `templates/`), `run` (one turn on a throwaway
//! database), `dev` (serve, watching a project) and `replay` (a recorded
//! ledger against a component).

pub mod dev;
pub mod limits;
pub mod new;
pub mod replay;
pub mod rerun;
pub mod resolve;
pub mod run;
pub mod schedules;
pub mod schema;
mod submit_batch;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Where the API is.
#[derive(clap::Args)]
pub struct Api {
    /// The service's base URL.
    #[arg(long, env = "LEASEHOLD_SERVER", default_value = "http://127.0.0.1:8080", global = true)]
    server: String,
    /// Bearer token. [default: read from --token-file]
    #[arg(long, env = "LEASEHOLD_API_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// The service's token file. [default: the one `leasehold serve` uses
    /// for LEASEHOLD_DATABASE_URL, else ./leasehold.token, else
    /// ~/.config/leasehold/token, whichever exists]
    #[arg(long, env = "LEASEHOLD_TOKEN_FILE", global = true)]
    token_file: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(clap::Subcommand)]
pub enum PluginsCommand {
    /// Register a component (a .wasm file) under NAME, replacing any earlier version.
    Add {
        name: String,
        file: PathBuf,
        /// Comma-separated hosts (host or host:port) its `http` effects may reach.
        #[arg(long, default_value = "")]
        http_allow: String,
        /// How runs in flight take this version: `pinned` (they finish on
        /// theirs) or `auto` (one moves at its next segment if its ledger
        /// replays clean on this version). [default: pinned]
        #[arg(long, default_value = "pinned")]
        upgrade: String,
        /// Comma-separated models its `model.chat` may ask for (`*`: any).
        /// [default: none: model.chat is denied to it]
        #[arg(long, default_value = "")]
        model_allow: String,
        /// The most `max_tokens` one of its calls may ask for. [default: 4096]
        #[arg(long)]
        model_max_tokens: Option<u64>,
        /// The limit its runs' concurrency keys get when no operator set
        /// one for the key. [default: none]
        #[arg(long)]
        key_concurrency: Option<i64>,
        /// Comma-separated plugins whose runs its turns may spawn as
        /// children (`*`: any). [default: none: spawn is denied to it]
        #[arg(long, default_value = "")]
        spawn_allow: String,
    },
    /// List registered plugins.
    List,
    /// Register FILE as NAME's new version, as `add` does: runs in flight
    /// finish on the version they started with. With --check, change
    /// nothing: replay every open run of NAME against FILE (offline, from
    /// the database) and report which would replay clean on it and which
    /// diverge, at which call; exits 1 if any diverges.
    Upgrade {
        name: String,
        file: PathBuf,
        #[arg(long)]
        check: bool,
        /// As for `add`.
        #[arg(long, default_value = "")]
        http_allow: String,
        /// As for `add`.
        #[arg(long, default_value = "pinned")]
        upgrade: String,
        /// As for `add`.
        #[arg(long, default_value = "")]
        model_allow: String,
        /// As for `add`.
        #[arg(long)]
        model_max_tokens: Option<u64>,
        /// As for `add`.
        #[arg(long)]
        key_concurrency: Option<i64>,
        /// As for `add`.
        #[arg(long, default_value = "")]
        spawn_allow: String,
        /// --check only.
        #[command(flatten)]
        offline: crate::cli::replay::Offline,
    },
}

#[derive(clap::Args)]
pub struct SubmitArgs {
    /// The plugin to run.
    plugin: String,
    /// The input, as JSON (a bare word is sent as a JSON string). Default: null.
    input: Option<String>,
    /// Thread to append to. Default: a new thread.
    #[arg(long)]
    thread: Option<String>,
    /// Submitting the same key again returns the same run.
    #[arg(long)]
    idempotency_key: Option<String>,
    /// Failed segments allowed before the run is aborted. Default: 3.
    #[arg(long)]
    max_attempts: Option<i64>,
    /// Higher is claimed first, -1000 to 1000. Default: 0.
    #[arg(long, allow_negative_numbers = true)]
    priority: Option<i64>,
    /// The run's concurrency key: it shares the key's limit (`leasehold
    /// limits`) and takes turns with other keys. Default: none.
    #[arg(long)]
    key: Option<String>,
    /// Tokens the run and the runs it spawns may have `model.chat` use.
    /// Default: no budget.
    #[arg(long)]
    budget_tokens: Option<i64>,
    /// US dollars the run and the runs it spawns may have priced
    /// `model.chat` calls cost (`serve --model-price`). Default: no budget.
    #[arg(long)]
    budget_usd: Option<f64>,
    /// Stream the run's events until it finishes or waits for input.
    #[arg(long)]
    follow: bool,
}

#[derive(clap::Subcommand)]
pub enum RunsCommand {
    /// List runs, newest first.
    List {
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        plugin: Option<String>,
        /// Only the children of this run (the runs its turn spawned).
        #[arg(long)]
        parent: Option<i64>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Show runs older than this id (from a previous page).
        #[arg(long)]
        cursor: Option<i64>,
    },
    /// Show one run.
    Show { id: i64 },
    /// Show a run's effect ledger.
    Effects { id: i64 },
    /// Write a run and its whole ledger as one JSON file, for `leasehold
    /// replay --ledger FILE --component NEW.wasm`. The run's random secret
    /// is not in it (the API never shows it).
    Export {
        id: i64,
        /// Where to write it; `-` for stdout.
        #[arg(long, short, default_value = "-")]
        output: PathBuf,
    },
    /// Deliver input to a run waiting for it.
    Input { id: i64, input: String },
    /// Cancel a run, and every run below it.
    Cancel { id: i64 },
    /// Write the outcome of a call in doubt or failed (the run's last
    /// row); the run goes on from it.
    Resolve(resolve::ResolveArgs),
    /// Start a new run from a point in a run's ledger: the rows below it
    /// replay, the rest runs live.
    Rerun(rerun::RerunArgs),
    /// Pause a run: it is not claimed until resumed (a running one stops
    /// at its next slice point).
    Pause { id: i64 },
    /// Resume a paused run.
    Resume { id: i64 },
    /// Show the budget of a run's tree (what it spent and holds), or set
    /// it with --tokens and/or --usd, which lets its runs waiting for
    /// budget go on.
    Budget {
        id: i64,
        #[arg(long)]
        tokens: Option<i64>,
        #[arg(long)]
        usd: Option<f64>,
    },
    /// Submit many runs: FILE (or - for stdin) holds one JSON object per
    /// line, as the body of `POST /v1/runs`, each with its own
    /// `idempotency_key`. Sent 1000 to a request (`POST /v1/runs:batch`),
    /// each request one commit; sending the file again submits nothing twice.
    SubmitBatch { file: PathBuf },
}

#[derive(clap::Args)]
pub struct EventsArgs {
    thread: String,
    /// Only events after this seq.
    #[arg(long, default_value_t = 0)]
    after: i64,
    /// Keep streaming new events (Ctrl-C to stop).
    #[arg(long, short)]
    follow: bool,
}

impl Api {
    fn client(&self) -> reqwest::Client {
        leasehold::effects::http::install_tls();
        reqwest::Client::new()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.server.trim_end_matches('/'), path)
    }

    /// The token to send: given, or read from the token file `serve`
    /// wrote. `Err` when a token file exists but cannot be used.
    fn token(&self) -> Result<Option<String>> {
        if let Some(t) = self.token.as_ref().filter(|t| !t.is_empty()) {
            return Ok(Some(t.clone()));
        }
        let candidates: Vec<PathBuf> = match &self.token_file {
            Some(file) => vec![file.clone()],
            None => {
                let mut c = Vec::new();
                if let Ok(url) = std::env::var("LEASEHOLD_DATABASE_URL") {
                    c.push(crate::config::default_token_file(&url));
                }
                c.push(crate::config::default_token_file("sqlite://leasehold.db"));
                c.push(crate::config::default_token_file("postgres://"));
                c
            }
        };
        for file in candidates {
            if file.exists() {
                return Ok(Some(crate::config::read_token(&file)?.expose().to_string()));
            }
        }
        Ok(None)
    }

    fn auth(&self, b: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self.token() {
            Ok(Some(t)) => b.bearer_auth(t),
            Ok(None) => b,
            Err(e) => {
                eprintln!("warning: {e:#}");
                b
            }
        }
    }

    async fn send(&self, b: reqwest::RequestBuilder) -> Result<Value> {
        let resp = self
            .auth(b)
            .send()
            .await
            .with_context(|| format!("could not reach leasehold at {} (is `leasehold serve` running?)", self.server))?;
        let status = resp.status();
        let body = resp.text().await.context("reading the response")?;
        let value: Value = serde_json::from_str(&body).unwrap_or(Value::String(body));
        if !status.is_success() {
            let code = value["error"]["code"].as_str().unwrap_or("error");
            let message = value["error"]["message"].as_str().map(str::to_string).unwrap_or_else(|| value.to_string());
            if status == reqwest::StatusCode::UNAUTHORIZED && matches!(self.token(), Ok(None)) {
                bail!(
                    "{status}: {code}: {message}\nno API token found: pass --token, set LEASEHOLD_API_TOKEN, \
                     or --token-file (serve writes it beside a SQLite database as <name>.token)"
                );
            }
            bail!("{status}: {code}: {message}");
        }
        Ok(value)
    }

    fn print(&self, v: &Value, text: impl FnOnce(&Value)) {
        if self.json {
            println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
        } else {
            text(v);
        }
    }
}

pub async fn plugins(api: &Api, command: PluginsCommand) -> Result<()> {
    match command {
        PluginsCommand::Upgrade { name, file, check: true, offline, .. } => {
            if !crate::cli::replay::upgrade_check(&name, &file, &offline, api.json).await? {
                std::process::exit(1);
            }
        }
        PluginsCommand::Add { name, file, http_allow, upgrade, model_allow, model_max_tokens, key_concurrency, spawn_allow }
        | PluginsCommand::Upgrade { name, file, http_allow, upgrade, model_allow, model_max_tokens, key_concurrency, spawn_allow, .. } => {
            let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let mut query =
                vec![("http_allow", http_allow), ("upgrade", upgrade), ("model_allow", model_allow), ("spawn_allow", spawn_allow)];
            if let Some(n) = model_max_tokens {
                query.push(("model_max_tokens", n.to_string()));
            }
            if let Some(n) = key_concurrency {
                query.push(("key_concurrency", n.to_string()));
            }
            let req = api.client().put(api.url(&format!("/v1/plugins/{name}"))).query(&query).body(bytes);
            let v = api.send(req).await?;
            api.print(&v, |v| println!("registered {} {}", v["name"].as_str().unwrap_or(""), v["digest"].as_str().unwrap_or("")));
        }
        PluginsCommand::List => {
            let v = api.send(api.client().get(api.url("/v1/plugins"))).await?;
            api.print(&v, |v| {
                println!("{:<20}  {:>10}  {:<20}  HTTP_ALLOW", "NAME", "BYTES", "DIGEST");
                for p in v["plugins"].as_array().into_iter().flatten() {
                    let digest = p["digest"].as_str().unwrap_or("");
                    println!(
                        "{:<20}  {:>10}  {:<20}  {}",
                        p["name"].as_str().unwrap_or(""),
                        p["size"].to_string(),
                        &digest[..digest.len().min(19)],
                        p["settings"]["http_allow"].as_array().map(|a| a.iter().filter_map(|h| h.as_str()).collect::<Vec<_>>().join(",")).unwrap_or_default()
                    );
                }
            });
        }
    }
    Ok(())
}

fn parse_input(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_string()))
}

pub async fn submit(api: &Api, args: SubmitArgs) -> Result<()> {
    let body = json!({
        "plugin": args.plugin,
        "input": args.input.as_deref().map(parse_input).unwrap_or(Value::Null),
        "thread_id": args.thread,
        "idempotency_key": args.idempotency_key,
        "max_attempts": args.max_attempts,
        "priority": args.priority,
        "concurrency_key": args.key,
    });
    let mut body = body;
    if args.budget_tokens.is_some() || args.budget_usd.is_some() {
        body["budget"] = json!({ "tokens": args.budget_tokens, "usd": args.budget_usd });
    }
    let run = api.send(api.client().post(api.url("/v1/runs")).json(&body)).await?;
    api.print(&run, |r| println!("run {} queued on thread {}", r["id"], r["thread_id"].as_str().unwrap_or("")));
    if args.follow {
        let thread = run["thread_id"].as_str().unwrap_or_default().to_string();
        let id = run["id"].as_i64().unwrap_or_default();
        follow(api, &thread, 0, Some(id)).await?;
    }
    Ok(())
}

fn run_line(r: &Value) -> String {
    format!(
        "{:>8}  {:<16}  {:<16}  {:>5}  {:>3}/{:<3}  {}",
        r["id"].to_string(),
        r["status"].as_str().unwrap_or(""),
        r["plugin"].as_str().unwrap_or(""),
        r["fence"].to_string(),
        r["attempt"].to_string(),
        r["max_attempts"].to_string(),
        r["thread_id"].as_str().unwrap_or("")
    )
}

pub async fn runs(api: &Api, command: RunsCommand) -> Result<()> {
    let c = api.client();
    match command {
        RunsCommand::SubmitBatch { file } => submit_batch::submit_batch(api, &file).await?,
        RunsCommand::Resolve(args) => resolve::resolve(api, args).await?,
        RunsCommand::Rerun(args) => rerun::rerun(api, args).await?,
        RunsCommand::Pause { id } | RunsCommand::Resume { id } => {
            let (verb, url) = match command {
                RunsCommand::Pause { .. } => ("paused", api.url(&format!("/v1/runs/{id}/pause"))),
                _ => ("resumed", api.url(&format!("/v1/runs/{id}/resume"))),
            };
            let v = api.send(c.post(url).json(&json!({}))).await?;
            api.print(&v, |r| println!("run {} {verb}: {}{}", r["id"], r["status"].as_str().unwrap_or(""), if r["paused_at"].is_null() { "" } else { ", paused" }));
        }
        RunsCommand::List { status, plugin, parent, limit, cursor } => {
            let mut q = vec![("limit", limit.to_string())];
            q.extend(status.map(|s| ("status", s)));
            q.extend(plugin.map(|p| ("plugin", p)));
            q.extend(parent.map(|p| ("parent", p.to_string())));
            q.extend(cursor.map(|c| ("cursor", c.to_string())));
            let v = api.send(c.get(api.url("/v1/runs")).query(&q)).await?;
            api.print(&v, |v| {
                println!("{:>8}  {:<16}  {:<16}  {:>5}  {:>7}  THREAD", "ID", "STATUS", "PLUGIN", "FENCE", "ATTEMPT");
                for r in v["runs"].as_array().into_iter().flatten() {
                    println!("{}", run_line(r));
                }
                if let Some(next) = v["next_cursor"].as_i64() {
                    println!("(more: --cursor {next})");
                }
            });
        }
        RunsCommand::Show { id } => {
            let v = api.send(c.get(api.url(&format!("/v1/runs/{id}")))).await?;
            api.print(&v, |r| {
                for key in ["id", "status", "waiting_for", "parent_id", "root_id", "plugin", "thread_id", "attempt", "max_attempts", "priority", "concurrency_key", "fence", "lease_owner", "lease_expires_at", "plugin_digest", "upgrade_note", "error"] {
                    if !r[key].is_null() {
                        println!("{key:<17} {}", r[key].as_str().map(str::to_string).unwrap_or_else(|| r[key].to_string()));
                    }
                }
                if let (Some(created), Some(started)) = (r["created_at"].as_i64(), r["started_at"].as_i64()) {
                    println!("queued            {} ms before its first segment", started - created);
                }
                println!("input             {}", r["input"].as_str().unwrap_or(""));
                if let Some(p) = r["partial"].as_str().filter(|p| !p.is_empty()) {
                    println!("streamed          {p}");
                }
                if let Some(o) = r["output"].as_str() {
                    println!("output            {o}");
                }
            });
        }
        RunsCommand::Effects { id } => {
            let v = api.send(c.get(api.url(&format!("/v1/runs/{id}/effects")))).await?;
            api.print(&v, |v| {
                println!("{:>5}  {:<14}  {:<8}  {:<10}  {:>5}  RESULT", "SEQ", "NAME", "CLASS", "STATE", "FENCE");
                for e in v["effects"].as_array().into_iter().flatten() {
                    let result = e["result"].as_str().unwrap_or("");
                    let short: String = result.chars().take(60).collect();
                    println!(
                        "{:>5}  {:<14}  {:<8}  {:<10}  {:>5}  {short}",
                        e["seq"].to_string(), e["name"].as_str().unwrap_or(""), e["class"].as_str().unwrap_or(""),
                        e["state"].as_str().unwrap_or(""), e["fence_started"].to_string()
                    );
                }
            });
        }
        RunsCommand::Export { id, output } => {
            let run = api.send(c.get(api.url(&format!("/v1/runs/{id}")))).await?;
            let mut effects = Vec::new();
            let mut after = -1i64;
            loop {
                let page = api.send(c.get(api.url(&format!("/v1/runs/{id}/effects?after={after}&limit=10000")))).await?;
                let rows: Vec<leasehold::store::EffectRow> =
                    serde_json::from_value(page["effects"].clone()).context("reading the ledger page")?;
                effects.extend(rows);
                match page["next_after"].as_i64() {
                    Some(next) if next > after => after = next,
                    _ => break,
                }
            }
            let export = crate::cli::replay::Export { format: crate::cli::replay::EXPORT_FORMAT.into(), run, effects };
            let text = serde_json::to_string_pretty(&export)? + "\n";
            if output.as_os_str() == "-" {
                print!("{text}");
            } else {
                std::fs::write(&output, text).with_context(|| format!("writing {}", output.display()))?;
                eprintln!("run {id}: {} ledger rows written to {}", export.effects.len(), output.display());
            }
        }
        RunsCommand::Input { id, input } => {
            let body = json!({ "input": parse_input(&input) });
            let v = api.send(c.post(api.url(&format!("/v1/runs/{id}/input"))).json(&body)).await?;
            api.print(&v, |r| println!("input delivered to run {}", r["id"]));
        }
        RunsCommand::Budget { id, tokens, usd } => {
            let url = api.url(&format!("/v1/runs/{id}/budget"));
            let v = match (tokens, usd) {
                (None, None) => api.send(c.get(url)).await?,
                _ => api.send(c.post(url).json(&json!({ "tokens": tokens, "usd": usd }))).await?,
            };
            api.print(&v, |b| {
                let tokens = b["tokens"].as_i64().map_or("none".to_string(), |t| t.to_string());
                println!("budget of run {} and the runs below it:", b["holder_id"]);
                println!("  tokens: {tokens}, spent {}, held {}", b["spent"], b["held"]);
                let usd = b["usd"].as_f64().map_or("none".to_string(), |u| format!("${u:.6}"));
                let dollars = |k: &str| format!("${:.6}", b[k].as_f64().unwrap_or(0.0));
                println!("  usd: {usd}, spent {}, held {}", dollars("spent_usd"), dollars("held_usd"));
            });
        }
        RunsCommand::Cancel { id } => {
            let v = api.send(c.post(api.url(&format!("/v1/runs/{id}/cancel"))).json(&json!({}))).await?;
            api.print(&v, |r| println!("run {} cancelled (fence {})", r["id"], r["fence"]));
        }
    }
    Ok(())
}

/// `leasehold dashboard`: the page's address, signed in by the fragment.
/// Checks the token against the API first, so a wrong one is said here.
pub async fn dashboard(api: &Api) -> Result<()> {
    api.send(api.client().get(api.url("/v1/stats"))).await?;
    let base = api.server.trim_end_matches('/');
    match api.token()? {
        Some(token) => println!("{base}/#token={token}"),
        None => println!("{base}/"),
    }
    Ok(())
}

pub async fn events(api: &Api, args: EventsArgs) -> Result<()> {
    if args.follow {
        return follow(api, &args.thread, args.after, None).await;
    }
    let req = api.client().get(api.url(&format!("/v1/threads/{}/events", args.thread))).query(&[("after", args.after)]);
    let v = api.send(req).await?;
    for e in v["events"].as_array().into_iter().flatten() {
        print_event(api, e);
    }
    Ok(())
}

fn print_event(api: &Api, e: &Value) {
    if api.json {
        println!("{e}");
        return;
    }
    let p = &e["payload"];
    let detail = match e["kind"].as_str().unwrap_or("") {
        "delta" => p["delta"].as_str().map(|d| format!("{d:?}")).unwrap_or_default(),
        "message" => format!("{} {}", p["status"].as_str().unwrap_or(""), p["output"].as_str().or(p["error"].as_str()).unwrap_or("")),
        "suspended" => format!("{} {}", p["status"].as_str().unwrap_or(""), p["prompt"].as_str().unwrap_or("")),
        _ => p.to_string(),
    };
    println!(
        "{:>6}  run {:<6} fence {:<3} {:<10} {detail}",
        e["seq"].to_string(),
        e["run_id"].to_string(),
        e["fence"].to_string(),
        e["kind"].as_str().unwrap_or("")
    );
}

/// Streams a thread's events (SSE), reconnecting from the last seen event.
/// With `until_run`, stops once that run finishes or waits for input.
async fn follow(api: &Api, thread: &str, mut after: i64, until_run: Option<i64>) -> Result<()> {
    use futures::StreamExt;
    loop {
        let req = api
            .client()
            .get(api.url(&format!("/v1/threads/{thread}/events")))
            .header("Accept", "text/event-stream")
            .header("Last-Event-ID", after.to_string());
        let resp = api.auth(req).send().await.with_context(|| format!("could not reach {}", api.server))?;
        if !resp.status().is_success() {
            bail!("{}: {}", resp.status(), resp.text().await.unwrap_or_default());
        }
        let mut body = resp.bytes_stream();
        let mut buf = String::new();
        while let Some(chunk) = body.next().await {
            let Ok(chunk) = chunk else { break };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let frame: String = buf.drain(..end + 2).collect();
                let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data:")) else { continue };
                let Ok(e) = serde_json::from_str::<Value>(data.trim()) else { continue };
                after = e["seq"].as_i64().unwrap_or(after);
                print_event(api, &e);
                let kind = e["kind"].as_str().unwrap_or("");
                let waiting = kind == "suspended" && e["payload"]["status"] == "waiting_input";
                if until_run.is_some_and(|id| e["run_id"].as_i64() == Some(id) && (kind == "message" || kind == "cancelled" || waiting)) {
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
