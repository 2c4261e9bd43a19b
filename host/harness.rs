//! `leasehold bench harness-adapter`: a host served in this process, with
//! the harness adapter ([`leasehold::bench::harness`]) driving it through
//! its API. One process, so that the harness's SIGKILL of a replica kills
//! a host mid-segment, as a crash would.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use leasehold::bench::harness::{self, Adapter, Settings};
use leasehold::store::{Store, StoreOptions};
use tokio::sync::watch;

use crate::config::ServeOptions;
use crate::serve;

/// How long the host may take to answer its first `/healthz`.
const READY_WITHIN: Duration = Duration::from_secs(120);
/// The host's grace at SIGTERM: the harness wants an exit within about 5 s.
const SHUTDOWN_GRACE_MS: &str = "3000";

/// The `serve` flags, parsed as the command line would be, so that the
/// host's LEASEHOLD_* variables apply here as they do to `serve`.
#[derive(Parser)]
struct ServeFlags {
    #[command(flatten)]
    options: ServeOptions,
}

pub async fn run(plugin_file: &Path) -> Result<()> {
    let settings = Settings::from_env(|k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    let database_url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set (the harness sets it to the system's database)")?;
    let component = std::fs::read(plugin_file)
        .with_context(|| format!("reading the test plugin {} (build it with ./scripts/build-plugins)", plugin_file.display()))?;
    // A free port: the harness may run several replicas on one machine.
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let token = uuid::Uuid::new_v4().simple().to_string();
    let mut cfg = ServeFlags::try_parse_from([
        "serve",
        "--database-url",
        &database_url,
        "--listen",
        &listen.to_string(),
        "--api-token",
        &token,
        "--workers",
        &settings.workers.to_string(),
        "--shutdown-grace-ms",
        SHUTDOWN_GRACE_MS,
    ])
    .map_err(|e| anyhow::anyhow!("{e}"))?
    .options
    .resolve(None)?;
    // No plugins directory: the plugin is registered through the API.
    cfg.plugins_dir = std::path::PathBuf::new();
    leasehold::metrics::set_start_tap(harness::tap);

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        serve::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let mut host_stop = stop_rx.clone();
    let host = tokio::spawn(serve::serve_until(cfg, None, async move {
        let _ = host_stop.wait_for(|s| *s).await;
    }));
    let api = format!("http://{listen}");
    leasehold::effects::http::install_tls();
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        if host.is_finished() {
            return match host.await? {
                Ok(()) => Ok(()),
                Err(e) => Err(e.context("the host stopped before it was up")),
            };
        }
        if client.get(format!("{api}/healthz")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the host did not answer /healthz within {READY_WITHIN:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let registered = client
        .put(format!("{api}/v1/plugins/{}", harness::PLUGIN))
        .bearer_auth(&token)
        .body(component)
        .send()
        .await
        .context("registering the test plugin")?;
    anyhow::ensure!(registered.status().is_success(), "registering the test plugin: {} {}", registered.status(), registered.text().await.unwrap_or_default());
    // The adapter's own connection, for the queue depth: not one of the host's.
    let store = Store::connect_with(&database_url, StoreOptions { max_connections: Some(1), ..StoreOptions::default() }).await?;
    let db_name = database_url.rsplit('/').next().unwrap_or_default().split('?').next().unwrap_or_default().to_string();
    let adapter = Adapter { settings, api, token, store: store.clone(), db_name };
    adapter.run(stop_rx).await?;
    store.shutdown().await;
    host.await?
}
