//! `leasehold serve` as a child process, for the tests that run several
//! hosts on one database and kill them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};

use crate::harness::eventually_some;

/// How one host is started. Lease timings are short so a killed host's runs
/// come back within seconds.
pub struct ServeArgs<'a> {
    pub db_url: &'a str,
    pub plugins_dir: &'a Path,
    /// stderr goes here (appended, so a restarted host keeps its history).
    pub log: PathBuf,
    pub owner: String,
    /// The API's address (default 127.0.0.1) and port.
    pub listen_ip: String,
    pub port: u16,
    /// A command the host runs under (e.g. `ip netns exec <ns>`); none by
    /// default.
    pub wrap: Vec<String>,
    pub workers: usize,
    pub lease_ttl_ms: u64,
    pub reaper_interval_ms: u64,
    pub poll_ms: u64,
    /// `--http-allow` entries, e.g. a sink's `127.0.0.1:<port>`.
    pub http_allow: Vec<String>,
    pub extra: Vec<String>,
    /// Environment variables set for the host (after the harness's own).
    pub env: Vec<(String, String)>,
    /// Another `leasehold` binary to run (a previous release's); default:
    /// this build's.
    pub binary: Option<PathBuf>,
}

impl ServeArgs<'_> {
    pub fn new<'a>(db_url: &'a str, plugins_dir: &'a Path, owner: String) -> Result<ServeArgs<'a>> {
        Ok(ServeArgs {
            db_url,
            plugins_dir,
            log: plugins_dir.join(format!("{owner}.log")),
            owner,
            listen_ip: "127.0.0.1".into(),
            port: free_port()?,
            wrap: Vec::new(),
            workers: 4,
            lease_ttl_ms: 3000,
            reaper_interval_ms: 500,
            poll_ms: 200,
            http_allow: Vec::new(),
            extra: Vec::new(),
            env: Vec::new(),
            binary: None,
        })
    }
}

pub struct ServeProc {
    pub child: Child,
    pub base: String,
    /// Its stderr.
    log: PathBuf,
}

impl ServeProc {
    pub fn spawn(a: &ServeArgs<'_>) -> Result<ServeProc> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&a.log)?;
        let bin = a.binary.as_deref().unwrap_or(Path::new(env!("CARGO_BIN_EXE_leasehold")));
        let mut command = match a.wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let child = command
            .args(["serve", "--database-url", a.db_url, "--listen", &format!("{}:{}", a.listen_ip, a.port)])
            .arg("--plugins-dir")
            .arg(a.plugins_dir)
            .args(["--http-allow", &a.http_allow.join(","), "--workers", &a.workers.to_string()])
            .args(["--lease-ttl-ms", &a.lease_ttl_ms.to_string()])
            .args(["--reaper-interval-ms", &a.reaper_interval_ms.to_string()])
            .args(["--poll-ms", &a.poll_ms.to_string(), "--owner", &a.owner])
            .args(["--api-token", TEST_TOKEN])
            .arg("--cache-dir")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"))
            .args(&a.extra)
            // `LEASEHOLD_TEST_HOST_LOG` (default `warn`) sets the hosts' log
            // filter, e.g. `warn,leasehold::pool=debug` to follow a queue.
            .env("LEASEHOLD_LOG", std::env::var("LEASEHOLD_TEST_HOST_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(a.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting leasehold serve")?;
        Ok(ServeProc { child, base: format!("http://{}:{}", a.listen_ip, a.port), log: a.log.clone() })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `/healthz` until it answers 200; fails at once, with the
    /// host's log, if the host exits first.
    pub async fn wait_healthy(&self, http: &reqwest::Client, timeout: Duration) -> Result<()> {
        let log = || std::fs::read_to_string(&self.log).unwrap_or_default();
        let never = async || Ok(format!("{} never became healthy; its log:\n{}", self.base, log()));
        eventually_some(timeout, never, async || {
            if let Ok(r) = http.get(format!("{}/healthz", self.base)).send().await
                && r.status() == 200
            {
                return Ok(Some(()));
            }
            ensure!(!exited(self.pid()), "the host at {} exited before it was healthy; its log:\n{}", self.base, log());
            Ok(None)
        })
        .await
    }
}

impl Drop for ServeProc {
    fn drop(&mut self) {
        // SIGKILL (a stopped process dies too).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `{base}/healthz` until it answers 200.
pub async fn wait_healthy(http: &reqwest::Client, base: &str, timeout: Duration) -> Result<()> {
    eventually_some(timeout, async || Ok(format!("{base} never became healthy")), async || {
        let healthy = http.get(format!("{base}/healthz")).send().await.is_ok_and(|r| r.status() == 200);
        Ok(healthy.then_some(()))
    })
    .await
}

/// The API token the test hosts are started with.
pub const TEST_TOKEN: &str = "leasehold-test-token-0123456789";

/// An HTTP client that sends [`TEST_TOKEN`], with `builder`'s settings.
pub fn client(builder: reqwest::ClientBuilder) -> Result<reqwest::Client> {
    leasehold::effects::http::install_tls();
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {TEST_TOKEN}").parse()?);
    Ok(builder.default_headers(headers).build()?)
}

/// Whether process `pid` (a child not yet waited for) has exited: gone,
/// or a zombie.
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's closing parenthesis.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// A port free on 127.0.0.1 now, below the kernel's ephemeral range
/// (32768 on): no outgoing connection is given it between this check and
/// the host's bind. Each test process starts at its own place in the
/// range, so processes side by side rarely try the same port.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(u32::MAX, (std::process::id().wrapping_mul(7919)) % SPAN, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port in {LOW}..{}", LOW + SPAN)
}
