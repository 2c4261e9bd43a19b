//! `leasehold serve` as a user starts it: a token is required by default
//! and the CLI finds it; an unreachable database is reported at once,
//! without its password.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use crate::harness::eventually_some;
use crate::serve_proc::{free_port, wait_healthy};

fn leasehold() -> Command {
    Command::new(env!("CARGO_BIN_EXE_leasehold"))
}

fn cache_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache")
}

/// `serve --insecure` on SQLite in `dir` (no plugins, its own cache), on
/// `port`, with `extra` flags.
fn insecure_serve(dir: &Path, port: u16, extra: &[&str]) -> Result<Child> {
    Ok(Child(
        leasehold()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--plugins-dir", "none", "--insecure"])
            .args(extra)
            .arg("--cache-dir")
            .arg(dir.join("cache"))
            .current_dir(dir)
            .env("LEASEHOLD_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    ))
}

/// Kills the child when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `serve` on the embedded default in `dir`, as in the quick start, with no
/// plugins loaded at start and `extra` flags.
fn serve_in(dir: &Path, port: u16, extra: &[&str]) -> Result<Child> {
    Ok(Child(
        leasehold()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--plugins-dir", "none"])
            .args(extra)
            .arg("--cache-dir")
            .arg(cache_dir())
            .current_dir(dir)
            .env("LEASEHOLD_LOG", "warn")
            .env_remove("LEASEHOLD_API_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    ))
}

#[tokio::test]
async fn serve_requires_a_token_by_default_and_the_cli_finds_it() -> Result<()> {
    leasehold::effects::http::install_tls();
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    // As in the quick start: the embedded default, in the current directory.
    let _serve = serve_in(dir.path(), port, &[])?;
    let http = reqwest::Client::new();
    wait_healthy(&http, &base, Duration::from_secs(60)).await?;
    let anonymous = http.get(format!("{base}/v1/runs")).send().await?;
    ensure!(anonymous.status() == 401, "a request without the token got {}", anonymous.status());

    let file = dir.path().join("leasehold.token");
    let token = std::fs::read_to_string(&file).with_context(|| format!("no token file at {}", file.display()))?;
    let token = token.trim();
    ensure!(token.len() >= 32 && token.chars().all(|c| c.is_ascii_hexdigit()), "token {token:?}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file)?.permissions().mode() & 0o777;
    ensure!(mode == 0o600, "the token file is {mode:o}");
    let authorized = http.get(format!("{base}/v1/runs")).bearer_auth(token).send().await?;
    ensure!(authorized.status() == 200, "{}", authorized.status());

    // The CLI, run where the database is, reads the token by itself.
    let out = leasehold()
        .args(["runs", "list", "--server", &base])
        .current_dir(dir.path())
        .env_remove("LEASEHOLD_API_TOKEN")
        .output()?;
    ensure!(out.status.success(), "the CLI failed: {}", String::from_utf8_lossy(&out.stderr));
    // Elsewhere, without the token, it says what is missing.
    let elsewhere = tempfile::tempdir()?;
    let out = leasehold()
        .args(["runs", "list", "--server", &base])
        .current_dir(elsewhere.path())
        .env_remove("LEASEHOLD_API_TOKEN")
        .env("HOME", elsewhere.path())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("token"), "without a token: {err}");
    Ok(())
}

#[tokio::test]
async fn the_cli_submits_a_file_of_runs_once_however_often_it_is_sent() -> Result<()> {
    leasehold::effects::http::install_tls();
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let _serve = serve_in(dir.path(), port, &["--workers", "1"])?;
    wait_healthy(&reqwest::Client::new(), &base, Duration::from_secs(60)).await?;
    let cli = |args: &[&str]| {
        leasehold().args(args).args(["--server", &base]).current_dir(dir.path()).env_remove("LEASEHOLD_API_TOKEN").output()
    };
    let wasm = dir.path().join("testkit.wasm");
    std::fs::write(&wasm, crate::plugins::rust_plugin("testkit")?)?;
    let out = cli(&["plugins", "add", "testkit", wasm.to_str().context("path")?])?;
    ensure!(out.status.success(), "plugins add: {}", String::from_utf8_lossy(&out.stderr));

    let runs = dir.path().join("runs.jsonl");
    let lines: Vec<String> = (0..1_500)
        .map(|i| serde_json::json!({ "plugin": "testkit", "input": { "steps": 0 }, "idempotency_key": format!("k{i}") }).to_string())
        .collect();
    std::fs::write(&runs, lines.join("\n") + "\n")?;
    let file = runs.to_str().context("path")?;
    // 1,500 runs: two requests. Sent again, nothing new.
    for want in ["1500 runs queued, 0 already submitted, 0 refused", "0 runs queued, 1500 already submitted, 0 refused"] {
        let out = cli(&["runs", "submit-batch", file])?;
        let said = String::from_utf8_lossy(&out.stdout);
        ensure!(out.status.success() && said.contains(want), "{said} {}", String::from_utf8_lossy(&out.stderr));
    }
    // A bad line is named, and the command fails.
    std::fs::write(&runs, "{\"plugin\": \"testkit\", \"idempotency_key\": \"x\"}\nnot json\n")?;
    let out = cli(&["runs", "submit-batch", file])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("line 2: not JSON"), "{err}");
    std::fs::write(&runs, "{\"plugin\": \"testkit\"}\n")?;
    let out = cli(&["runs", "submit-batch", file])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("idempotency_key is required"), "{err}");
    Ok(())
}

#[tokio::test]
async fn an_unreachable_database_is_reported_at_once_without_its_password() -> Result<()> {
    let port = free_port()?; // nothing listens there
    let mut serve = Child(
        leasehold()
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port()?), "--plugins-dir", "none"])
            .arg("--database-url")
            .arg(format!("postgres://leasehold:hunter2@127.0.0.1:{port}/db"))
            .arg("--cache-dir")
            .arg(cache_dir())
            .env("LEASEHOLD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    let mut stderr = serve.0.stderr.take().context("stderr")?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 || tx.send(String::from_utf8_lossy(&buf[..n]).into_owned()).is_err() {
                break;
            }
        }
    });
    // Ten seconds at most: a first warning after the pool's 30 s connect
    // timeout is too late.
    let started = Instant::now();
    let mut log = String::new();
    while !log.contains("cannot be reached") {
        let Some(left) = Duration::from_secs(10).checked_sub(started.elapsed()) else { break };
        match rx.recv_timeout(left) {
            Ok(chunk) => log.push_str(&chunk),
            Err(_) => break,
        }
    }
    let took = started.elapsed();
    drop(serve);
    ensure!(log.contains("cannot be reached") && log.to_lowercase().contains("refused"), "after {took:?}: {log}");
    ensure!(!log.contains("hunter2"), "the password is in the log: {log}");
    Ok(())
}

/// The pids of `parent`'s children whose command line contains `needle`.
/// Established connections to `port` whose sockets process `pid` holds:
/// those it has accepted (a connection still in the listen backlog is
/// established too, but no process has its socket yet).
fn accepted(pid: u32, port: u16) -> usize {
    let mut inodes = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1).and_then(|a| a.rsplit_once(':')).and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && f.get(3) == Some(&"01") {
                inodes.extend(f.get(9).map(|i| i.to_string()));
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter(|l| l.to_string_lossy().strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')).is_some_and(|i| inodes.contains(i)))
        .count()
}

fn children_running(parent: u32, needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // pid (comm) state ppid …; comm may hold spaces.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid == Some(parent) && String::from_utf8_lossy(&cmdline).contains(needle) {
            found.push(pid);
        }
    }
    found
}

#[tokio::test]
async fn an_upload_whose_caller_went_away_is_not_left_compiling() -> Result<()> {
    leasehold::effects::http::install_tls();
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let serve = insecure_serve(dir.path(), port, &[])?;
    let http = reqwest::Client::new();
    wait_healthy(&http, &base, Duration::from_secs(60)).await?;
    // The Python agent: seconds to compile, and never compiled in this
    // fresh cache.
    let big = crate::plugins::example_plugin("agent-py")?;
    let size = big.len() as u64;
    let upload = tokio::spawn({
        let (http, base) = (http.clone(), base.clone());
        async move { http.put(format!("{base}/v1/plugins/big")).body(big).send().await }
    });
    let pid = serve.0.id();
    // Compiling: a compiler child that has read the whole component.
    let read = |child: u32| -> u64 {
        let io = std::fs::read_to_string(format!("/proc/{child}/io")).unwrap_or_default();
        io.lines().find_map(|l| l.strip_prefix("rchar: ")).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
    };
    // Some(false): the upload finished first.
    let compiling = eventually_some(Duration::from_secs(60), async || Ok("no compiler child read the component".into()), async || {
        if children_running(pid, "__compile").iter().any(|&c| read(c) >= size) {
            return Ok(Some(true));
        }
        Ok(upload.is_finished().then_some(false))
    })
    .await?;
    ensure!(compiling, "the upload finished before it was seen compiling: {:?}", upload.await);
    // The caller goes away.
    upload.abort();
    let _ = upload.await;
    eventually_some(
        Duration::from_secs(10),
        async || Ok("the compiler was still running 10 s after its caller went away".into()),
        async || Ok(children_running(pid, "__compile").is_empty().then_some(())),
    )
    .await?;
    let listed: serde_json::Value = http.get(format!("{base}/v1/plugins")).send().await?.json().await?;
    ensure!(listed["plugins"].as_array().is_some_and(|p| p.is_empty()), "{listed}");
    let compiled = std::fs::read_dir(dir.path().join("cache"))?.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".cwasm")).count();
    ensure!(compiled == 0, "{compiled} compiled files were written for an abandoned upload");
    Ok(())
}


/// Sockets that send half a request are closed after the header read
/// timeout, and no more than `--max-connections` are open at once: a
/// request on a new connection waits for one of them to close, then is
/// served.
#[tokio::test]
async fn half_sent_requests_are_closed_and_connections_are_capped() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let serve = insecure_serve(dir.path(), port, &["--header-read-timeout-ms", "2000", "--max-connections", "4"])?;
    // No keep-alive: the health check's connection closes, and does not
    // count against the cap below.
    leasehold::effects::http::install_tls();
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
    wait_healthy(&http, &base, Duration::from_secs(60)).await?;
    let opened = Instant::now();
    let mut half = Vec::new();
    for _ in 0..4 {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n").await?;
        half.push(s);
    }
    // The four are accepted (the host holds their sockets), not merely
    // queued in the kernel's backlog behind the fifth.
    let pid = serve.0.id();
    crate::harness::eventually("the host never accepted the four connections", async || Ok(accepted(pid, port) >= 4)).await?;
    let asked = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(20), http.get(format!("{base}/healthz")).send()).await;
    let waited = asked.elapsed();
    let status = answer.map_err(|_| anyhow::anyhow!("a request at the cap was not served within 20 s"))??.status();
    ensure!(status == 200, "{status}");
    ensure!(waited >= Duration::from_millis(1_000), "a fifth connection was served at once ({waited:?}) while four were open; the cap is 4");
    for (i, s) in half.iter_mut().enumerate() {
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await;
        ensure!(read.is_ok(), "half-sent request {i} still open {:?} after it was opened", opened.elapsed());
    }
    Ok(())
}

/// The answer links' route needs no token, so anyone with a link can send
/// it a body one byte at a time: the request timeout bounds that too, and
/// the service stays up for everyone else.
#[tokio::test]
async fn slow_bodies_to_the_public_answer_route_time_out_and_the_service_stays_up() -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let _serve = insecure_serve(dir.path(), port, &["--max-connections", "6", "--request-timeout-ms", "1500"])?;
    leasehold::effects::http::install_tls();
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
    wait_healthy(&http, &base, Duration::from_secs(60)).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let mut stopped = stopped.clone();
        slow.spawn(async move {
            let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else { return };
            let head = "POST /v1/answers/0123456789abcdef HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n";
            if s.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            // A byte every 300 ms until the test ends or the server hangs up.
            loop {
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => return,
                    _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                }
                if s.write_all(b" ").await.is_err() {
                    return;
                }
            }
        });
    }
    // One more slow body, read back: past the request timeout (1.5 s) it
    // is answered 503 with the API's JSON error.
    let timed_out = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let head = "POST /v1/answers/0123456789abcdef HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{";
        s.write_all(head.as_bytes()).await?;
        // Until the JSON body has ended, or the server hung up.
        let mut answer = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&answer).contains("}}") {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
            }
            anyhow::Ok(())
        };
        tokio::time::timeout(Duration::from_secs(15), read).await??;
        anyhow::Ok(String::from_utf8_lossy(&answer).into_owned())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(15), http.get(format!("{base}/healthz")).send()).await;
    let _ = stop.send(true);
    let status = answer.map_err(|_| anyhow::anyhow!("/healthz did not answer within 15 s under slow answer bodies"))??.status();
    ensure!(status == 200, "{status} after {:?}", asked.elapsed());
    let answer = timed_out.await??;
    ensure!(answer.starts_with("HTTP/1.1 503") && answer.contains(r#""code":"timeout""#), "a body slower than the request timeout got: {answer}");
    while slow.join_next().await.is_some() {}
    Ok(())
}

/// `--sqlite-synchronous normal` trades durability for speed: the host
/// says so in its log, on SQLite only, and not without the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_synchronous_normal_warns_of_what_a_crash_may_lose() -> Result<()> {
    crate::harness::init_logs();
    let http = crate::serve_proc::client(reqwest::Client::builder())?;
    for (flag, warned) in [(Some("normal"), true), (Some("full"), false), (None, false)] {
        let dir = tempfile::tempdir()?;
        let url = format!("sqlite://{}", dir.path().join("db.sqlite").display());
        let mut args = crate::serve_proc::ServeArgs::new(&url, dir.path(), "sync".into())?;
        if let Some(mode) = flag {
            args.extra = vec!["--sqlite-synchronous".into(), mode.into()];
        }
        let host = crate::serve_proc::ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let log = std::fs::read_to_string(&args.log)?;
        ensure!(log.contains("a power loss or OS crash may lose the last commits") == warned, "{flag:?}: warned {}: {log}", !warned);
    }
    Ok(())
}

/// `--public-url`: the answer links guests make start with it, the API
/// takes requests addressed to its host (and still refuses others), and a
/// URL that is not http(s) stops the host with a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_url_makes_the_answer_links_and_is_an_allowed_host() -> Result<()> {
    crate::harness::run_on(leasehold::Backend::Sqlite, async |db| {
        let sink = crate::sink::Sink::start().await?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("approval.wasm"), crate::plugins::rust_plugin("approval")?)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let mut args = crate::serve_proc::ServeArgs::new(db.url(), dir.path(), "public".into())?;
        args.http_allow = vec![sink.allow()];
        let public = "https://leasehold.example.test:8443";
        args.extra = vec!["--public-url".into(), format!("{public}/")];
        let host = crate::serve_proc::ServeProc::spawn(&args)?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let run: serde_json::Value = http
            .post(format!("{}/v1/runs", host.base))
            .json(&serde_json::json!({ "plugin": "approval", "input": { "notify_url": sink.url } }))
            .send()
            .await?
            .json()
            .await?;
        let id = run["id"].as_i64().with_context(|| format!("{run}"))?;
        let link = eventually_some(Duration::from_secs(30), async || Ok("no link reached the sink".into()), async || {
            let Some(hit) = sink.hits().first().cloned() else { return Ok(None) };
            let body: serde_json::Value = serde_json::from_str(&hit.body)?;
            Ok(Some(body["link"].as_str().context("a link")?.to_string()))
        })
        .await?;
        ensure!(link.starts_with(&format!("{public}/v1/answers/")), "the link {link} is not under {public}");
        // Answered through the host's own address, as a proxy in front of
        // it would forward it, with the public host in the Host header.
        let path = link.strip_prefix(public).unwrap_or_default();
        let answered = reqwest::Client::new()
            .post(format!("{}{path}", host.base))
            .header("Host", "leasehold.example.test:8443")
            .json(&serde_json::json!({ "input": "yes" }))
            .send()
            .await?;
        ensure!(answered.status().is_success(), "{}: {}", answered.status(), answered.text().await?);
        let other = reqwest::Client::new().get(format!("{}/healthz", host.base)).header("Host", "elsewhere.example").send().await?;
        ensure!(other.status() == 421, "a request for another host: {}", other.status());
        let get = async || -> Result<serde_json::Value> { Ok(http.get(format!("{}/v1/runs/{id}", host.base)).send().await?.json().await?) };
        let run = eventually_some(Duration::from_secs(30), async || Ok(format!("the answered run did not complete: {}", get().await?)), async || {
            let run = get().await?;
            Ok((run["status"] == "completed").then_some(run))
        })
        .await?;
        ensure!(run["output"].as_str().is_some_and(|o| o.contains("yes")), "{run}");
        // Not http(s): the host does not start.
        let dir = tempfile::tempdir()?;
        let out = leasehold()
            .args(["serve", "--database-url", &format!("sqlite://{}", dir.path().join("x.db").display()), "--insecure"])
            .args(["--listen", &format!("127.0.0.1:{}", free_port()?), "--plugins-dir", "none", "--public-url", "ftp://leasehold.example.test"])
            .arg("--cache-dir")
            .arg(cache_dir())
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success() && err.contains("--public-url must be an http or https URL"), "{:?}: {err}", out.status);
        Ok(())
    })
    .await
}
