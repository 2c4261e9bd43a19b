//! `leasehold serve`: one host. Opens the database (waiting for it), loads
//! the plugins directory, starts the worker pool, the reaper and the HTTP
//! API, and on SIGTERM or Ctrl-C stops claiming, lets segments suspend
//! within the grace period, and exits.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use leasehold::api::{self, ApiConfig, AppState};
use leasehold::effects::model::ModelConfig;
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::plugins::{self, PluginSettings};
use leasehold::pool::{PoolConfig, WorkerPool};
use leasehold::maintenance::reaper::{self, ReaperConfig};
use leasehold::schedules::ticker::TickerConfig;
use leasehold::maintenance::cleaner::RetentionConfig;
use leasehold::maintenance::vacuum::{self, VacuumConfig};

/// How often the vacuum loop reads `runs`' dead row count.
const VACUUM_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// How often the retention cleaner looks for finished runs past retention
/// (at once again while it finds full batches).
const CLEANER_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// How often versions no open run uses are unloaded.
const VERSIONS_EVERY: std::time::Duration = std::time::Duration::from_secs(60);
use leasehold::runtime::{Runtime, RuntimeConfig};
use leasehold::store::{SqliteSync, Store, StoreError, StoreOptions};
use tokio::sync::watch;

use crate::config;

pub async fn serve(cfg: config::Serve) -> Result<()> {
    serve_with(cfg, None).await
}

/// [`serve`], and with `dev`, the `leasehold dev` watcher of a project.
pub async fn serve_with(cfg: config::Serve, dev: Option<crate::cli::dev::Project>) -> Result<()> {
    serve_until(cfg, dev, shutdown_signal()).await
}

/// [`serve_with`], shutting down when `shutdown` resolves (SIGTERM or
/// Ctrl-C for `serve`).
pub async fn serve_until(
    cfg: config::Serve,
    dev: Option<crate::cli::dev::Project>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    if cfg.test_clock_skew_ms != 0 {
        leasehold::clock::set_skew_ms(cfg.test_clock_skew_ms);
        tracing::warn!(skew_ms = cfg.test_clock_skew_ms, "test setting: this host's wall clock is skewed");
    }
    let options = StoreOptions { sqlite_sync: cfg.sqlite_sync, ..StoreOptions::default() };
    let store = connect_with_retry(&cfg.database_url, options).await?;
    if let Some(at) = cfg.test_pause_spawns {
        tracing::warn!(?at, "test setting: every spawn pauses for a minute");
        store.faults().pause_spawns(at);
    }
    if cfg.sqlite_sync == SqliteSync::Normal && store.backend() == leasehold::Backend::Sqlite {
        tracing::warn!(
            "--sqlite-synchronous normal: a power loss or OS crash may lose the last commits, \
             and an unkeyed effect whose started record was lost would be made again"
        );
    }
    let mut runtime_config = RuntimeConfig {
        cache_dir: cfg.cache_dir.clone(),
        max_instances: cfg.max_instances,
        // Uploads compile in a child process, stopped with the request.
        compiler: Some(std::env::current_exe().context("finding this program, to compile components with")?),
        ..RuntimeConfig::default()
    };
    runtime_config.default_limits.segment_budget = cfg.segment_budget;
    runtime_config.default_limits.tree_max_runs = cfg.tree_max_runs;
    runtime_config.default_limits.tree_max_open = cfg.tree_max_open;
    let runtime = Arc::new(Runtime::new(runtime_config)?);
    if cfg.plugins_dir.is_dir() {
        let settings = |name: &str| PluginSettings {
            http_allow: cfg.http_allow.clone(),
            spawn_allow: cfg.spawn_allow_for(name),
            model: cfg.model_grant.clone(),
            ..PluginSettings::default()
        };
        let loaded = plugins::load_dir(&store, &runtime, &cfg.plugins_dir, settings)
            .await
            .with_context(|| format!("reading {}", cfg.plugins_dir.display()))?;
        tracing::info!(dir = %cfg.plugins_dir.display(), plugins = ?loaded, "plugins directory loaded");
    } else {
        tracing::info!(dir = %cfg.plugins_dir.display(), "no plugins directory; register plugins with `leasehold plugins add`");
    }
    let model = cfg.model_base_url.clone().map(|url| {
        let mut m = ModelConfig::new(url);
        if let Some(name) = &cfg.model {
            m.default_model = name.clone();
        }
        m.prices = cfg.model_prices.clone();
        Arc::new(m)
    });
    if model.is_none() && !cfg.model_prices.is_empty() {
        tracing::warn!("--model-price is set but --model-base-url is not: model.chat is denied, so the prices go unused");
    }
    if model.is_none() {
        tracing::info!("no --model-base-url: model.chat is denied to plugins");
    }
    // Guests' http never reaches this API unless an allow-list entry names
    // its port.
    let mut exec_config =
        ExecutorConfig { lease_ttl: cfg.lease_ttl, model, reserved: vec![cfg.listen], ..ExecutorConfig::default() };
    if let Some(owner) = &cfg.owner {
        exec_config.owner = owner.clone();
    }
    exec_config.http_traceparent = cfg.http_traceparent;
    if let Some(traces) = &cfg.traces {
        tracing::info!(endpoint = %leasehold::redact::url_shown(&traces.endpoint), "exporting traces over OTLP/HTTP");
        exec_config.tracer = Some(leasehold::traces::Tracer::start(traces.clone()).map_err(anyhow::Error::msg)?);
    }
    let tracer = exec_config.tracer.clone();
    if let Some(proxy) = &cfg.guest_http_proxy {
        exec_config.egress = leasehold::effects::http::Egress::through_proxy(proxy).map_err(anyhow::Error::msg)?;
        tracing::warn!(
            proxy = exec_config.egress.proxy(),
            "guests' http goes through a proxy: the proxy, not leasehold, decides which addresses allowed names reach"
        );
    }
    let mut allowed_hosts = cfg.allowed_hosts.clone();
    if let Some(public) = &cfg.public_url {
        let url = reqwest::Url::parse(public).with_context(|| format!("--public-url {public:?} is not a URL"))?;
        anyhow::ensure!(matches!(url.scheme(), "http" | "https"), "--public-url must be an http or https URL, not {public:?}");
        let host = url.host_str().context("--public-url has no host")?;
        allowed_hosts.push(host.to_string());
        exec_config.answer_base = Some(public.trim_end_matches('/').into());
    }
    let owner = exec_config.owner.clone();
    let executor = Arc::new(Executor::new(store.clone(), runtime.clone(), exec_config));
    let pool = WorkerPool::start(store.clone(), executor, PoolConfig { workers: cfg.workers, poll: cfg.poll, claim_batch: cfg.claim_batch, prefetch: cfg.prefetch });

    let (stop_tx, stop_rx) = watch::channel(false);
    let reaper = tokio::spawn(reaper::run(store.clone(), ReaperConfig::default(), cfg.reaper_interval, stop_rx.clone()));
    let vacuum_config = VacuumConfig { dead_rows: cfg.pg_vacuum_dead_rows, ..VacuumConfig::default() };
    let vacuum = tokio::spawn(vacuum::run(store.clone(), vacuum_config, VACUUM_EVERY, stop_rx.clone()));
    let api_config = ApiConfig {
        token: cfg.api_token.clone(),
        allowed_hosts,
        max_body_bytes: cfg.max_body_bytes,
        max_component_bytes: cfg.max_component_bytes,
        request_timeout: cfg.request_timeout,
        answers_per_second: cfg.answers_per_second,
        answers_burst: cfg.answers_per_second.saturating_mul(5),
        max_schedules: cfg.max_schedules,
        max_backfill_ticks: cfg.max_backfill_ticks,
        retention: cfg.retention,
        ..ApiConfig::default()
    };
    let retention = RetentionConfig { keep: cfg.retention, ..RetentionConfig::default() };
    let cleaner = tokio::spawn(leasehold::maintenance::cleaner::run(store.clone(), retention, CLEANER_EVERY, stop_rx.clone()));
    if cfg.retention.is_zero() {
        tracing::info!("--retention 0: finished runs are kept forever");
    }
    let rollup = tokio::spawn(leasehold::maintenance::rollup::run(store.clone(), stop_rx.clone()));
    let ticker = tokio::spawn(leasehold::schedules::ticker::run(store.clone(), TickerConfig::default(), stop_rx.clone()));
    let versions = tokio::spawn(leasehold::versions::run(store.clone(), runtime.clone(), VERSIONS_EVERY, stop_rx.clone()));
    let watcher = dev.map(|project| tokio::spawn(crate::cli::dev::watch(store.clone(), runtime.clone(), project, stop_rx.clone())));
    let state = AppState::new(store.clone(), runtime, api_config, stop_rx.clone());
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let front = api::listener::ListenerConfig { header_read_timeout: cfg.header_read_timeout, max_connections: cfg.max_connections };
    let server = tokio::spawn(api::listener::serve(listener, api::router(state), front, stop_rx.clone()));
    tracing::info!(
        listen = %cfg.listen,
        backend = store.backend().name(),
        database = %store.url_redacted(),
        workers = cfg.workers,
        prefetch = cfg.prefetch,
        owner = %owner,
        auth = cfg.api_token.is_some(),
        "leasehold is up"
    );
    match (&cfg.api_token, &cfg.token_file) {
        (Some(_), Some(file)) => tracing::info!(
            token_file = %file.display(),
            "clients send the API token in this file as Authorization: Bearer …; the CLI reads it from there; \
             `leasehold dashboard` prints the dashboard's address signed in with it"
        ),
        (Some(_), None) => {}
        (None, _) => tracing::warn!(
            listen = %cfg.listen,
            "--insecure: the API needs no token; anyone who can reach it may submit runs and replace plugins"
        ),
    }
    shutdown.await;
    tracing::info!(grace = ?cfg.shutdown_grace, "shutting down: no new claims");
    let _ = stop_tx.send(true);
    pool.shutdown(cfg.shutdown_grace).await;
    let _ = reaper.await;
    let _ = vacuum.await;
    let _ = versions.await;
    let _ = cleaner.await;
    let _ = ticker.await;
    let _ = rollup.await;
    if let Some(watcher) = watcher {
        let _ = watcher.await;
    }
    if let Err(e) = server.await {
        tracing::error!(error = %e, "HTTP server task failed");
    }
    if let Some(tracer) = tracer {
        // The last segments' spans, within the request timeout.
        tracer.shutdown().await;
    }
    store.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// Opens the database, retrying with backoff while it is unreachable (a
/// host may start before its database). Says at once when it cannot be
/// reached, and why; never logs its password. Ctrl-C gives up.
async fn connect_with_retry(url: &str, options: StoreOptions) -> Result<Store> {
    let shown = leasehold::redact::url(url);
    let mut backoff = Duration::from_millis(500);
    let give_up = shutdown_signal();
    tokio::pin!(give_up);
    loop {
        // One connection first: a pool's connect retries quietly for its
        // whole acquire timeout before it reports anything.
        let opened = match Store::probe(url, Duration::from_secs(10)).await {
            Ok(()) => Store::connect_with(url, options.clone()).await,
            Err(e) => Err(e),
        };
        match opened {
            Ok(store) => return Ok(store),
            Err(e @ (StoreError::Config(_) | StoreError::Migrate(_))) => {
                return Err(anyhow::Error::new(e).context(format!("opening the database {shown}")));
            }
            Err(e) => {
                tracing::warn!(database = %shown, error = %e, ?backoff, "the database cannot be reached; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut give_up => anyhow::bail!("interrupted while waiting for the database {shown}"),
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
