//! `leasehold serve` settings: flags, environment variables and an optional
//! TOML file, in that order of precedence, then the defaults below. Each
//! field's doc is its `--help` text and names its default.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use leasehold::redact::Secret;
use leasehold::store::SqliteSync;
use serde::Deserialize;

/// Every option of `serve`. As flags and env vars these are optional; unset
/// ones come from `--config`, then from the defaults.
#[derive(Debug, Default, Clone, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeOptions {
    /// Database URL: sqlite://PATH (created if missing) or postgres://USER@HOST/DB.
    /// [default: sqlite://leasehold.db]
    #[arg(long, env = "LEASEHOLD_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Address the HTTP API listens on. [default: 127.0.0.1:8080]
    #[arg(long, env = "LEASEHOLD_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Bearer token required on every /v1 request and /metrics.
    /// [default: the token in --token-file, generated at first start]
    #[arg(long, env = "LEASEHOLD_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<Secret>,
    /// Where the generated API token is kept (mode 0600; a file others may
    /// read is refused). The CLI reads it from the same place.
    /// [default: beside the SQLite file as <name>.token; for PostgreSQL
    /// $XDG_CONFIG_HOME/leasehold/token, else ~/.config/leasehold/token]
    #[arg(long, env = "LEASEHOLD_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// No API token at all: anyone who can reach the listen address (any
    /// local user, on loopback) may submit, cancel and replace plugins.
    /// For a throwaway setup only.
    #[arg(long, env = "LEASEHOLD_INSECURE")]
    #[serde(default)]
    pub insecure: bool,
    /// Names clients reach the API by (e.g. a reverse proxy's), accepted in
    /// the Host header besides IP addresses and localhost; comma-separated.
    /// [default: none]
    #[arg(long = "allowed-host", env = "LEASEHOLD_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Option<Vec<String>>,
    /// SQLite's durability: `full` fsyncs every commit; `normal` is faster
    /// but a power loss or an OS crash may lose the last commits, and with
    /// them the `started` record of an unkeyed effect that went out, which
    /// would then be made again. [default: full]
    #[arg(long, env = "LEASEHOLD_SQLITE_SYNCHRONOUS", value_enum)]
    pub sqlite_synchronous: Option<SqliteSync>,
    /// PostgreSQL: vacuum the runs table once it holds more dead row
    /// versions than this (plus 5% of its rows), so claims stay fast
    /// whether autovacuum is on or off. 0 leaves it to autovacuum.
    /// [default: 50000]
    #[arg(long, env = "LEASEHOLD_PG_VACUUM_DEAD_ROWS")]
    pub pg_vacuum_dead_rows: Option<i64>,
    /// Finished runs (completed, failed, aborted, cancelled) older than
    /// this are deleted with their ledgers and events: a number with a unit
    /// (`s`, `m`, `h`, `d`), or `0` to keep everything. kv data is kept.
    /// [default: 7d]
    #[arg(long, env = "LEASEHOLD_RETENTION")]
    pub retention: Option<String>,
    /// Concurrent segments on this host. [default: 4]
    #[arg(long, env = "LEASEHOLD_WORKERS")]
    pub workers: Option<usize>,
    /// Runs the first claim statement takes when several workers are free
    /// (or the local queue has room); while claims come back full and
    /// unkeyed, each takes twice as many, up to 256. [default: 16]
    #[arg(long, env = "LEASEHOLD_CLAIM_BATCH")]
    pub claim_batch: Option<usize>,
    /// Most runs claimed ahead of free workers and queued on this host, so
    /// a worker that frees finds a run already leased and its close is
    /// written behind it. The queue holds about a second of the workers'
    /// pace, up to this. Queued runs hold leases: one that waits a third
    /// of --lease-ttl-ms is given back, and so are all at shutdown; a
    /// queued run counts its attempt only when it starts. 0 turns the
    /// queue off (long turns, or many hosts sharing a small backlog).
    /// [default: PostgreSQL 4 × --workers, at least 64; SQLite 64 below 8
    /// workers, else 0]
    #[arg(long, env = "LEASEHOLD_PREFETCH")]
    pub prefetch: Option<usize>,
    /// Lease length in ms: how long a dead host's runs wait before another
    /// host takes them. [default: 30000]
    #[arg(long, env = "LEASEHOLD_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// How often the reaper looks for expired leases, in ms. [default: 5000]
    #[arg(long, env = "LEASEHOLD_REAPER_INTERVAL_MS")]
    pub reaper_interval_ms: Option<u64>,
    /// How often idle workers look for work without a wake-up, in ms. [default: 1000]
    #[arg(long, env = "LEASEHOLD_POLL_MS")]
    pub poll_ms: Option<u64>,
    /// At shutdown, how long running segments may finish before they are
    /// suspended for another host, in ms. [default: 10000]
    #[arg(long, env = "LEASEHOLD_SHUTDOWN_GRACE_MS")]
    pub shutdown_grace_ms: Option<u64>,
    /// Directory whose *.wasm components are registered at start (name =
    /// file stem); skipped when missing. [default: target/plugins]
    #[arg(long, env = "LEASEHOLD_PLUGINS_DIR")]
    pub plugins_dir: Option<PathBuf>,
    /// Comma-separated hosts (host or host:port) that plugins loaded from
    /// --plugins-dir may reach with `http`. [default: none]
    #[arg(long, env = "LEASEHOLD_HTTP_ALLOW", value_delimiter = ',')]
    pub http_allow: Option<Vec<String>>,
    /// Comma-separated grants to spawn child runs, each for one plugin
    /// loaded from --plugins-dir: `PLUGIN=GRANT`, where GRANT is a plugin
    /// whose runs it may spawn (`*`: any) or `key:PREFIX`, concurrency keys
    /// its children may take besides its own; `*=GRANT` grants every plugin
    /// in the directory. [default: none]
    #[arg(long, env = "LEASEHOLD_SPAWN_ALLOW", value_delimiter = ',')]
    pub spawn_allow: Option<Vec<String>>,
    /// The address the world reaches this service at
    /// (`https://leasehold.example.com`): the base of the answer links
    /// turns make (`answer-link`), whose host name is then also allowed
    /// (--allowed-host). [default: none: turns cannot make answer links]
    #[arg(long, env = "LEASEHOLD_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// An HTTP proxy every guest `http` request goes through
    /// (`http://host:port`). The proxy resolves the names, so the rule that
    /// guests reach public addresses only becomes the proxy's to enforce
    /// (docs/operations.md). HTTP_PROXY and its kin are never used for
    /// guests. [default: none: guests connect directly]
    #[arg(long, env = "LEASEHOLD_GUEST_HTTP_PROXY")]
    pub guest_http_proxy: Option<String>,
    /// OpenAI-compatible API base for `model.chat`, up to /v1 (key from
    /// LEASEHOLD_MODEL_API_KEY or OPENAI_API_KEY). [default: none: model.chat is denied]
    #[arg(long, env = "LEASEHOLD_MODEL_BASE_URL")]
    pub model_base_url: Option<String>,
    /// Model used when a request names none. [default: gpt-4o-mini]
    #[arg(long, env = "LEASEHOLD_MODEL")]
    pub model: Option<String>,
    /// Comma-separated models the plugins loaded from --plugins-dir may
    /// ask `model.chat` for (`*`: any; a call that names none asks for
    /// --model). [default: none: model.chat is denied to them]
    #[arg(long, env = "LEASEHOLD_MODEL_ALLOW", value_delimiter = ',')]
    pub model_allow: Option<Vec<String>>,
    /// The most `max_tokens` one of their calls may ask for; a call that
    /// asks for none is given this. [default: 4096]
    #[arg(long, env = "LEASEHOLD_MODEL_MAX_TOKENS")]
    pub model_max_tokens: Option<u64>,
    /// A model's price, MODEL=PROMPT/ANSWER in US dollars per million
    /// tokens (`gpt-4o-mini=0.15/0.60`); repeat it, or separate with
    /// commas. Runs may then carry budgets in dollars; a call to a model
    /// without a price is denied under one. [default: none]
    #[arg(long = "model-price", env = "LEASEHOLD_MODEL_PRICES", value_delimiter = ',')]
    pub model_prices: Option<Vec<String>>,
    /// Compiled-component cache: a private directory (created 0700; one
    /// owned by another user or writable by others is refused).
    /// [default: $XDG_CACHE_HOME/leasehold/components, else ~/.cache/leasehold/components]
    #[arg(long, env = "LEASEHOLD_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Instances alive at once (pooling allocator); at least --workers. [default: 64]
    #[arg(long, env = "LEASEHOLD_MAX_INSTANCES")]
    pub max_instances: Option<u32>,
    /// Largest JSON request body, in bytes. [default: 1048576]
    #[arg(long, env = "LEASEHOLD_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Largest component upload, in bytes. [default: 67108864]
    #[arg(long, env = "LEASEHOLD_MAX_COMPONENT_BYTES")]
    pub max_component_bytes: Option<usize>,
    /// Per-request timeout in ms (event streams are exempt). [default: 30000]
    #[arg(long, env = "LEASEHOLD_REQUEST_TIMEOUT_MS")]
    pub request_timeout_ms: Option<u64>,
    /// Answer-link requests (`/v1/answers/…`, which need no API token) this
    /// host takes a second, over all links, with bursts of five times as
    /// many; past it, 429 with Retry-After. [default: 10]
    #[arg(long, env = "LEASEHOLD_ANSWERS_PER_SECOND")]
    pub answers_per_second: Option<u32>,
    /// Schedules at most; a create past it is refused. [default: 10000]
    #[arg(long, env = "LEASEHOLD_MAX_SCHEDULES")]
    pub max_schedules: Option<usize>,
    /// Times one backfill may hold. [default: 1000]
    #[arg(long, env = "LEASEHOLD_MAX_BACKFILL_TICKS")]
    pub max_backfill_ticks: Option<usize>,
    /// How long a client may take to send a request's headers (or leave
    /// its connection idle) before it is closed, in ms. [default: 10000]
    #[arg(long, env = "LEASEHOLD_HEADER_READ_TIMEOUT_MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// Most client connections open at once, event streams included; more
    /// wait to be accepted until one closes. [default: 512]
    #[arg(long, env = "LEASEHOLD_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// An OpenTelemetry collector to export traces to over OTLP/HTTP
    /// (`http://127.0.0.1:4318`; `/v1/traces` is added). The other
    /// OTEL_* variables apply (docs/operations.md, "Tracing").
    /// [default: none: no spans are exported]
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// The service name traces carry. [default: leasehold]
    #[arg(long, env = "OTEL_SERVICE_NAME")]
    pub otel_service_name: Option<String>,
    /// Whether guests' `http` calls send a `traceparent` header (their
    /// call's span), so the services they reach join the run's trace:
    /// `auto`, only while spans are exported; `always`; `never`.
    /// [default: auto]
    #[arg(long, env = "LEASEHOLD_HTTP_TRACEPARENT", value_enum)]
    pub http_traceparent: Option<HttpTraceparent>,
    /// This host's lease owner id. [default: <hostname>-<pid>]
    #[arg(long, env = "LEASEHOLD_OWNER")]
    pub owner: Option<String>,
    /// How long one segment may run before it is sliced (suspended and
    /// resumed by replay, which counts an attempt), in ms. Bounds how long a
    /// looping guest holds a worker. [default: 30000]
    #[arg(long, env = "LEASEHOLD_SEGMENT_BUDGET_MS")]
    pub segment_budget_ms: Option<u64>,
    /// Most runs one tree may spawn in all (its root not counted); a spawn
    /// past it is denied. [default: 10000]
    #[arg(long, env = "LEASEHOLD_TREE_MAX_RUNS")]
    pub tree_max_runs: Option<u64>,
    /// Most spawned runs of one tree open at once; a spawn past it is
    /// denied until some finish. [default: 1000]
    #[arg(long, env = "LEASEHOLD_TREE_MAX_OPEN")]
    pub tree_max_open: Option<u64>,
    /// Test only: shift this host's wall clock (log timestamps) by this many
    /// ms, as if its machine's clock were off. Leases use the database's
    /// clock, so this must change nothing else. [default: 0]
    #[arg(long, env = "LEASEHOLD_TEST_CLOCK_SKEW_MS", hide = true, allow_negative_numbers = true)]
    pub test_clock_skew_ms: Option<i64>,
    /// Test only: hold every spawn for a minute `before` or `after` its
    /// commit, so a test can kill the host there. [default: none]
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub test_pause_spawns: Option<leasehold::store::faults::SpawnPause>,
}

/// When guests' `http` calls send `traceparent` (`--http-traceparent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HttpTraceparent {
    /// Only while this host exports spans.
    Auto,
    Always,
    Never,
}

/// Resolved settings. `Debug` shows no secret.
#[derive(Debug, Clone)]
pub struct Serve {
    pub database_url: String,
    pub listen: SocketAddr,
    /// `None` only with --insecure.
    pub api_token: Option<Secret>,
    /// Where the token was read or written, when it came from a file.
    pub token_file: Option<PathBuf>,
    pub allowed_hosts: Vec<String>,
    pub sqlite_sync: SqliteSync,
    pub pg_vacuum_dead_rows: i64,
    pub retention: Duration,
    pub workers: usize,
    pub claim_batch: usize,
    pub prefetch: usize,
    pub lease_ttl: Duration,
    pub reaper_interval: Duration,
    pub poll: Duration,
    pub shutdown_grace: Duration,
    pub plugins_dir: PathBuf,
    pub http_allow: Vec<String>,
    pub spawn_allow: Vec<String>,
    pub public_url: Option<String>,
    pub guest_http_proxy: Option<String>,
    pub model_base_url: Option<String>,
    pub model: Option<String>,
    /// What the plugins loaded from --plugins-dir may ask of `model.chat`.
    pub model_grant: leasehold::store::ModelGrant,
    pub model_prices: leasehold::effects::prices::Prices,
    pub cache_dir: PathBuf,
    pub max_instances: u32,
    pub max_body_bytes: usize,
    pub max_component_bytes: usize,
    pub request_timeout: Duration,
    pub answers_per_second: u32,
    pub max_schedules: usize,
    pub max_backfill_ticks: usize,
    pub header_read_timeout: Duration,
    pub max_connections: usize,
    pub owner: Option<String>,
    /// Where spans are exported; `None`: nowhere.
    pub traces: Option<leasehold::traces::TraceConfig>,
    /// Whether guests' `http` calls send `traceparent`.
    pub http_traceparent: bool,
    pub segment_budget: Duration,
    pub tree_max_runs: u64,
    pub tree_max_open: u64,
    pub test_clock_skew_ms: i64,
    pub test_pause_spawns: Option<leasehold::store::faults::SpawnPause>,
}

impl ServeOptions {
    /// Flags and env over the file at `config` (if any), over the defaults.
    pub fn resolve(self, config: Option<&std::path::Path>) -> Result<Serve> {
        let file: ServeOptions = match config {
            None => ServeOptions::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
            }
        };
        let ms = Duration::from_millis;
        let database_url = self.database_url.or(file.database_url).unwrap_or_else(|| "sqlite://leasehold.db".into());
        let insecure = self.insecure || file.insecure;
        let explicit = self.api_token.or(file.api_token).filter(|t| !t.expose().is_empty());
        let token_file = self.token_file.or(file.token_file).unwrap_or_else(|| default_token_file(&database_url));
        let (api_token, token_file) = match (explicit, insecure) {
            (Some(t), _) => (Some(t), None),
            (None, true) => (None, None),
            (None, false) => (Some(load_or_create_token(&token_file)?), Some(token_file)),
        };
        let workers = self.workers.or(file.workers).unwrap_or(4);
        // A URL that names no backend fails at connect, with its own error.
        let backend = leasehold::store::Backend::from_url(&database_url).unwrap_or(leasehold::store::Backend::Sqlite);
        let mut serve = Serve {
            listen: self.listen.or(file.listen).unwrap_or_else(|| "127.0.0.1:8080".parse().unwrap()),
            api_token,
            token_file,
            allowed_hosts: self.allowed_hosts.or(file.allowed_hosts).unwrap_or_default(),
            sqlite_sync: self.sqlite_synchronous.or(file.sqlite_synchronous).unwrap_or_default(),
            pg_vacuum_dead_rows: self.pg_vacuum_dead_rows.or(file.pg_vacuum_dead_rows).unwrap_or(50_000),
            retention: parse_duration(self.retention.or(file.retention).as_deref().unwrap_or("7d"))
                .context("--retention")?,
            database_url,
            workers,
            claim_batch: self.claim_batch.or(file.claim_batch).unwrap_or(16),
            prefetch: self.prefetch.or(file.prefetch).unwrap_or_else(|| leasehold::pool::PoolConfig::default_prefetch(workers, backend)),
            lease_ttl: ms(self.lease_ttl_ms.or(file.lease_ttl_ms).unwrap_or(30_000)),
            reaper_interval: ms(self.reaper_interval_ms.or(file.reaper_interval_ms).unwrap_or(5_000)),
            poll: ms(self.poll_ms.or(file.poll_ms).unwrap_or(1_000)),
            shutdown_grace: ms(self.shutdown_grace_ms.or(file.shutdown_grace_ms).unwrap_or(10_000)),
            plugins_dir: self.plugins_dir.or(file.plugins_dir).unwrap_or_else(|| "target/plugins".into()),
            http_allow: self.http_allow.or(file.http_allow).unwrap_or_default(),
            spawn_allow: self.spawn_allow.or(file.spawn_allow).unwrap_or_default(),
            public_url: self.public_url.or(file.public_url).filter(|u| !u.is_empty()),
            guest_http_proxy: self.guest_http_proxy.or(file.guest_http_proxy).filter(|u| !u.is_empty()),
            model_base_url: self.model_base_url.or(file.model_base_url).filter(|u| !u.is_empty()),
            model: self.model.or(file.model),
            model_grant: leasehold::store::ModelGrant {
                models: self.model_allow.or(file.model_allow).unwrap_or_default().into_iter().filter(|m| !m.trim().is_empty()).collect(),
                max_tokens: self.model_max_tokens.or(file.model_max_tokens).unwrap_or(leasehold::store::ModelGrant::default().max_tokens),
            },
            model_prices: leasehold::effects::prices::Prices::parse(&self.model_prices.or(file.model_prices).unwrap_or_default())
                .map_err(anyhow::Error::msg)
                .context("--model-price")?,
            cache_dir: self
                .cache_dir
                .or(file.cache_dir)
                .unwrap_or_else(leasehold::runtime::default_cache_dir),
            max_instances: self.max_instances.or(file.max_instances).unwrap_or(64),
            max_body_bytes: self.max_body_bytes.or(file.max_body_bytes).unwrap_or(1 << 20),
            max_component_bytes: self.max_component_bytes.or(file.max_component_bytes).unwrap_or(64 << 20),
            request_timeout: ms(self.request_timeout_ms.or(file.request_timeout_ms).unwrap_or(30_000)),
            answers_per_second: self.answers_per_second.or(file.answers_per_second).unwrap_or(10).max(1),
            max_schedules: self.max_schedules.or(file.max_schedules).unwrap_or(10_000).max(1),
            max_backfill_ticks: self.max_backfill_ticks.or(file.max_backfill_ticks).unwrap_or(1_000).max(1),
            header_read_timeout: ms(self.header_read_timeout_ms.or(file.header_read_timeout_ms).unwrap_or(10_000).max(1)),
            max_connections: self.max_connections.or(file.max_connections).unwrap_or(512).max(1),
            owner: self.owner.or(file.owner),
            traces: leasehold::traces::TraceConfig::from_env(
                self.otlp_endpoint.or(file.otlp_endpoint).as_deref(),
                self.otel_service_name.or(file.otel_service_name).as_deref(),
                |k| std::env::var(k).ok(),
            )
            .map_err(anyhow::Error::msg)?,
            http_traceparent: false,
            segment_budget: ms(self.segment_budget_ms.or(file.segment_budget_ms).unwrap_or(30_000)),
            tree_max_runs: self.tree_max_runs.or(file.tree_max_runs).unwrap_or(10_000),
            tree_max_open: self.tree_max_open.or(file.tree_max_open).unwrap_or(1_000),
            test_clock_skew_ms: self.test_clock_skew_ms.or(file.test_clock_skew_ms).unwrap_or(0),
            test_pause_spawns: self.test_pause_spawns,
        };
        if serve.pg_vacuum_dead_rows < 0 {
            bail!("--pg-vacuum-dead-rows must be 0 (off) or more");
        }
        if serve.workers == 0 {
            bail!("--workers must be at least 1");
        }
        if serve.claim_batch == 0 {
            bail!("--claim-batch must be at least 1");
        }
        if serve.max_instances < serve.workers as u32 {
            bail!(
                "--max-instances ({}) must be at least --workers ({}): each segment holds one instance",
                serve.max_instances,
                serve.workers
            );
        }
        for entry in &serve.spawn_allow {
            let Some((plugin, grant)) = entry.split_once('=') else {
                bail!(
                    "--spawn-allow {entry:?}: grants are per plugin: write PLUGIN={entry} \
                     (or *={entry} for every plugin in --plugins-dir)"
                );
            };
            if plugin != "*" && !leasehold::plugins::valid_name(plugin) {
                bail!("--spawn-allow {entry:?}: {plugin:?} is not a plugin name (or *)");
            }
            leasehold::plugins::check_spawn_grant(grant).map_err(|e| anyhow::anyhow!("--spawn-allow {entry:?}: {e}"))?;
        }
        serve.http_traceparent = match self.http_traceparent.or(file.http_traceparent).unwrap_or(HttpTraceparent::Auto) {
            HttpTraceparent::Auto => serve.traces.is_some(),
            HttpTraceparent::Always => true,
            HttpTraceparent::Never => false,
        };
        if serve.tree_max_runs == 0 || serve.tree_max_open == 0 {
            bail!("--tree-max-runs and --tree-max-open must be at least 1");
        }
        if serve.segment_budget < Duration::from_millis(10) {
            bail!("--segment-budget-ms must be at least 10");
        }
        if serve.lease_ttl < Duration::from_millis(100) {
            bail!("--lease-ttl-ms must be at least 100");
        }
        Ok(serve)
    }
}

impl Serve {
    /// The spawn grants `--spawn-allow` gives `plugin`: those named for it
    /// and those for `*`.
    pub fn spawn_allow_for(&self, plugin: &str) -> Vec<String> {
        self.spawn_allow
            .iter()
            .filter_map(|e| e.split_once('='))
            .filter(|(p, _)| *p == "*" || *p == plugin)
            .map(|(_, grant)| grant.to_string())
            .collect()
    }
}

/// Where the API token lives by default: beside a SQLite database file
/// (`data/x.db` → `data/x.token`), else in the user's config directory.
pub fn default_token_file(database_url: &str) -> PathBuf {
    let sqlite = database_url.strip_prefix("sqlite://").or_else(|| database_url.strip_prefix("sqlite:"));
    if let Some(path) = sqlite.map(|p| p.split('?').next().unwrap_or(p)).filter(|p| !p.is_empty() && !p.contains(":memory:")) {
        return std::path::Path::new(path).with_extension("token");
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    match (env("XDG_CONFIG_HOME"), env("HOME")) {
        (Some(config), _) => config.join("leasehold/token"),
        (None, Some(home)) => home.join(".config/leasehold/token"),
        (None, None) => PathBuf::from("leasehold.token"),
    }
}

/// Reads the token in `path`, checking that only this user may read it.
pub fn read_token(path: &std::path::Path) -> Result<Secret> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path).with_context(|| format!("reading the API token file {}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!("the API token file {} is readable by others (mode {mode:o}): `chmod 600` it", path.display());
    }
    if meta.uid() != rustix::process::geteuid().as_raw() {
        bail!("the API token file {} belongs to another user (uid {})", path.display(), meta.uid());
    }
    let token = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let token = token.trim();
    if token.len() < 16 {
        bail!("the API token file {} holds no token", path.display());
    }
    Ok(Secret::new(token))
}

/// The token in `path`, or a new random one written there (mode 0600)
/// when the file does not exist yet: the first start of a fresh setup.
fn load_or_create_token(path: &std::path::Path) -> Result<Secret> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if path.exists() {
        return read_token(path);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let token = format!("{:032x}{:032x}", rand::random::<u128>(), rand::random::<u128>());
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing the API token file {}", path.display()))?;
    file.write_all(format!("{token}\n").as_bytes())?;
    Ok(Secret::new(token))
}

/// A duration as `--retention` takes it: `0`, or a whole number with a
/// unit, `s`, `m`, `h` or `d`.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().map_err(|_| anyhow::anyhow!("{text:?}: give a whole number and a unit, e.g. 7d, 12h, 30m, 90s, or 0"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => bail!("{text:?}: the unit must be s, m, h or d (e.g. 7d), or give 0 to keep everything"),
    };
    n.checked_mul(secs).map(Duration::from_secs).ok_or_else(|| anyhow::anyhow!("{text:?} is too long"))
}
