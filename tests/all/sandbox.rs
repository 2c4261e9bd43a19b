//! The sandbox against hostile guests, on both backends: sizes a guest
//! controls are capped before the host copies or stores them, memory is
//! counted per instance, WASI random cannot be predicted, the compiled
//! component cache cannot be planted, and `http` reaches only what the
//! allow-list names.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, ensure};
use leasehold::executor::{Executor, ExecutorConfig, GuestErrorKind, SegmentOutcome};
use leasehold::runtime::{Limits, Runtime, RuntimeConfig};
use leasehold::store::{NewRun, Store};
use serde_json::{Value, json};

use crate::harness::{TestDb, both};
use crate::plugins;
use crate::sink::Sink;

fn executor(db: &TestDb, limits: Limits) -> Result<Executor> {
    let rt = plugins::runtime()?;
    rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
    let config = crate::harness::worker("w");
    Ok(Executor::new(db.store.clone(), rt, config))
}

async fn submit(store: &Store, input: Value) -> Result<i64> {
    Ok(store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id)
}

/// Runs one segment of a new run of `input`; returns its outcome and error.
async fn run(db: &TestDb, exec: &Executor, input: Value) -> Result<(i64, Option<SegmentOutcome>, String)> {
    let id = submit(&db.store, input).await?;
    let out = tokio::time::timeout(Duration::from_secs(60), exec.run_once()).await??.map(|(_, o)| o);
    let error = db.store.get_run(id).await?.error.unwrap_or_default();
    Ok((id, out, error))
}

/// Whether a segment failed the run with an error of `kind` (`"limit"`,
/// `"out-of-memory"`…), as the run's error names it.
fn failed_as(out: &Option<SegmentOutcome>, error: &str, kind: &str) -> bool {
    matches!(out, Some(SegmentOutcome::Failed(_))) && error.starts_with(&format!("{kind}: "))
}

/// The bytes the run's ledger and thread log hold.
async fn stored_bytes(store: &Store, id: i64) -> Result<usize> {
    let ledger: usize = store.effects(id).await?.iter().map(|r| r.name.len() + r.result.as_deref().map_or(0, str::len)).sum();
    let events: usize = store.run_events(id).await?.iter().map(|e| e.payload.len()).sum();
    Ok(ledger + events)
}

both! {
    async fn sizes_a_guest_controls_are_capped_before_they_are_stored(db) {
        let exec = executor(db, plugins::test_limits())?;
        // An 8 MiB effect name: more than one host call may carry.
        let (id, out, error) = run(db, &exec, json!({ "mode": "big-name" })).await?;
        ensure!(failed_as(&out, &error, "limit"), "big-name: {out:?} {:.200}", error);
        ensure!(error.len() < 1000 && stored_bytes(&db.store, id).await? < 10_000, "big-name: {} bytes stored", stored_bytes(&db.store, id).await?);

        // A long name and a malformed one are refused, recorded short.
        for (mode, says) in [("long-name", "1 to 128 bytes"), ("bad-name", "a-z")] {
            let (id, out, _) = run(db, &exec, json!({ "mode": mode })).await?;
            ensure!(out == Some(SegmentOutcome::Completed), "{mode}: {out:?}");
            let output = db.store.get_run(id).await?.output.unwrap_or_default();
            ensure!(output.starts_with("denied:") && output.contains(says) && output.len() < 300, "{mode}: {output:?}");
            let ledger = db.store.effects(id).await?;
            ensure!(ledger.len() == 1 && ledger[0].name.len() <= 140, "{mode}: {:?}", ledger[0].name);
        }

        // A 1 MiB prompt for wait-input.
        let (id, out, error) = run(db, &exec, json!({ "mode": "big-prompt" })).await?;
        ensure!(failed_as(&out, &error, "limit") && error.contains("prompt"), "big-prompt: {out:?} {error:.200}");
        ensure!(stored_bytes(&db.store, id).await? < 10_000);

        // 1 GiB of WASI random, and pollables kept without bound.
        for mode in ["random-bomb", "table-bomb"] {
            let (_, out, error) = run(db, &exec, json!({ "mode": mode })).await?;
            ensure!(failed_as(&out, &error, "limit"), "{mode}: {out:?} {error:.300}");
        }

        // A kv value over the cap is refused before it is written.
        let (_, out, error) = run(db, &exec, json!({ "mode": "kv-big", "bytes": 1 << 17 })).await?;
        ensure!(failed_as(&out, &error, "turn-error") && error.contains("cap"), "kv-big: {out:?} {error}");
        let big: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM kv WHERE key = 'big'").fetch_one(db.store.pool()).await?;
        ensure!(big == 0);
        Ok(())
    }

    async fn log_lines_are_capped_per_segment_and_escaped(db) {
        let exec = executor(db, plugins::test_limits())?;
        let dropped = async || -> Result<u64> {
            let text = leasehold::metrics::global().render_counters();
            Ok(text.lines().find_map(|l| l.strip_prefix("leasehold_guest_log_lines_dropped_total ")).and_then(|v| v.parse().ok()).unwrap_or(0))
        };
        let before = dropped().await?;
        let (_, out, _) = run(db, &exec, json!({ "mode": "log-flood", "n": 5000 })).await?;
        ensure!(out == Some(SegmentOutcome::Completed), "{out:?}");
        let after = dropped().await?;
        ensure!(after >= before + 4000, "{} log lines dropped of 5000", after - before);
        Ok(())
    }

    async fn a_runs_ledger_is_capped_in_rows(db) {
        let exec = executor(db, Limits { max_ledger_rows: 50, ..plugins::test_limits() })?;
        let (id, out, error) = run(db, &exec, json!({ "mode": "gets", "n": 100 })).await?;
        ensure!(out == Some(SegmentOutcome::Failed(GuestErrorKind::LedgerTooLarge)), "{out:?} {error}");
        ensure!(error.starts_with("ledger-too-large") && db.store.effects(id).await?.len() <= 50, "{error}");
        Ok(())
    }

    async fn the_memory_cap_counts_every_memory_of_an_instance(db) {
        // 15 memories of 4 MiB: each under the 32 MiB cap, 60 MiB together.
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::hostile_wat("many-memories.wat")?, plugins::test_limits())?;
        let config = crate::harness::worker("w");
        let exec = Executor::new(db.store.clone(), rt, config);
        let (_, out, error) = run(db, &exec, json!({})).await?;
        ensure!(failed_as(&out, &error, "out-of-memory"), "{out:?} {error}");
        Ok(())
    }

    async fn wasi_random_cannot_be_predicted_from_the_run_id_and_replays_the_same(db) {
        // Run 1 in two databases: the same id, different secrets. Each run
        // draws again after a suspension: a replay that drew other bytes
        // would put another value and fail as non-deterministic.
        let other = TestDb::new(db.backend).await?;
        let mut drawn = Vec::new();
        for d in [db, &other] {
            let exec = executor(d, plugins::test_limits())?;
            let ops = json!([{ "op": "put-random", "key": "r" }, { "op": "sleep", "ms": 0 }]);
            let id = submit(&d.store, json!({ "mode": "script", "ops": ops })).await?;
            let outcomes = exec.drain().await?;
            ensure!(outcomes.last() == Some(&(id, SegmentOutcome::Completed)), "{outcomes:?}: {:?}", d.store.get_run(id).await?.error);
            let output: Value = serde_json::from_str(&d.store.get_run(id).await?.output.unwrap_or_default())?;
            drawn.push((id, output[0].as_str().unwrap_or_default().to_string()));
        }
        other.cleanup().await?;
        ensure!(drawn[0].0 == drawn[1].0, "{drawn:?}");
        ensure!(drawn[0].1 != drawn[1].1 && drawn[0].1.len() == 32, "the same run id drew the same secure random: {drawn:?}");
        Ok(())
    }

    async fn http_reaches_only_what_the_allow_list_names(db) {
        let sink = Sink::start().await?;
        let cases: Vec<(Vec<String>, Value, bool)> = vec![
            // A bare host means its scheme's default port only.
            (vec!["127.0.0.1".into()], json!({}), false),
            (vec![sink.allow()], json!({}), true),
            (vec![format!("http://127.0.0.1:{}", sink.port)], json!({}), true),
            (vec![format!("https://127.0.0.1:{}", sink.port)], json!({}), false),
            // A name that resolves to a loopback address is not that address.
            (vec![format!("localhost:{}", sink.port)], json!({}), false),
            // Headers the host sets, framing and hop-by-hop headers.
            (vec![sink.allow()], json!({ "Host": "elsewhere" }), false),
            (vec![sink.allow()], json!({ "idempotency-key": "mine" }), false),
            (vec![sink.allow()], json!({ "Leasehold-Fence": "99" }), false),
            (vec![sink.allow()], json!({ "Transfer-Encoding": "chunked" }), false),
            (vec![sink.allow()], json!({ "Connection": "close" }), false),
            (vec![sink.allow()], json!({ "x-trace": "ok" }), true),
        ];
        for (i, (allow, headers, reached)) in cases.into_iter().enumerate() {
            let exec = executor(db, Limits { http_allow: allow.clone(), ..plugins::test_limits() })?;
            let host = if allow[0].starts_with("localhost") { "localhost" } else { "127.0.0.1" };
            let url = format!("http://{host}:{}/effect", sink.port);
            let request = json!({ "method": "POST", "url": url, "headers": headers }).to_string();
            let ops = json!([{ "op": "effect", "name": "http", "request": request }]);
            let before = sink.hits().len();
            let (id, out, _) = run(db, &exec, json!({ "mode": "script", "ops": ops })).await?;
            ensure!(out == Some(SegmentOutcome::Completed), "case {i}: {out:?}");
            let output = db.store.get_run(id).await?.output.unwrap_or_default();
            let got = sink.hits().len() > before;
            ensure!(got == reached, "case {i} ({allow:?}, {headers}): reached {got}, want {reached}: {output}");
            if !reached {
                ensure!(output.contains("denied"), "case {i}: {output}");
            }
        }
        Ok(())
    }

    async fn the_services_own_api_is_not_reachable_unless_listed_with_its_port(db) {
        // A service on the default port: the entry `127.0.0.1` names that
        // port without saying so, and must not open the service's own API.
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, Limits { http_allow: vec!["127.0.0.1".into()], ..plugins::test_limits() })?;
        let own = std::net::SocketAddr::from(([0, 0, 0, 0], 80));
        let config = ExecutorConfig { reserved: vec![own], ..crate::harness::worker("w") };
        let exec = Executor::new(db.store.clone(), rt, config);
        let ops = json!([{ "op": "http", "url": "http://127.0.0.1/v1/plugins/testkit", "keyed": true }]);
        let (id, out, _) = run(db, &exec, json!({ "mode": "script", "ops": ops })).await?;
        ensure!(out == Some(SegmentOutcome::Completed), "{out:?}");
        let output = db.store.get_run(id).await?.output.unwrap_or_default();
        ensure!(output.contains("denied") && output.contains("own API"), "{output}");
        Ok(())
    }
}

#[tokio::test]
async fn the_component_cache_is_private_and_never_runs_a_file_it_did_not_write() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    // Not under the shared temporary directory.
    let default = RuntimeConfig::default().cache_dir;
    ensure!(!default.starts_with(std::env::temp_dir()), "default cache dir {default:?}");

    let dir = tempfile::tempdir()?;
    let cache = dir.path().join("cache");
    let config = || RuntimeConfig { cache_dir: cache.clone(), max_instances: 2, pool_max_memory_bytes: 64 << 20, ..Default::default() };
    let testkit = plugins::rust_plugin("testkit")?;
    let v2 = plugins::hostile_wat("returns-v2.wat")?;
    {
        let rt = Runtime::new(config())?;
        rt.add_plugin("a", &testkit, plugins::test_limits())?;
    }
    let mode = std::fs::metadata(&cache)?.permissions().mode() & 0o777;
    ensure!(mode == 0o700, "the cache directory is {mode:o}");
    // Plant testkit's compiled code under the name v2's would have.
    let compiled: Vec<_> = std::fs::read_dir(&cache)?.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "cwasm")).collect();
    ensure!(compiled.len() == 1, "{compiled:?}");
    let v2_hex = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&v2))
    };
    let testkit_hex = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&testkit))
    };
    let planted = compiled[0].to_string_lossy().replace(&testkit_hex, &v2_hex);
    std::fs::copy(&compiled[0], &planted)?;
    for side in std::fs::read_dir(&cache)?.flatten().map(|e| e.path()) {
        let name = side.to_string_lossy().to_string();
        if name.contains(&testkit_hex) && !name.ends_with(".cwasm") {
            std::fs::copy(&side, name.replace(&testkit_hex, &v2_hex))?;
        }
    }
    let rt = Arc::new(Runtime::new(config())?);
    let plugin = rt.add_plugin("v2", &v2, plugins::test_limits())?;
    let db = TestDb::new(leasehold::Backend::Sqlite).await?;
    let id = db.store.create_run(&NewRun::new("v2", "{}")).await?.0.id;
    let exec = Executor::new(db.store.clone(), rt.clone(), crate::harness::worker("w"));
    let out = exec.run_once().await?;
    let run = db.store.get_run(id).await?;
    db.cleanup().await?;
    ensure!(out == Some((id, SegmentOutcome::Completed)) && run.output.as_deref() == Some("v2"), "the planted code ran for {}: {run:?}", plugin.digest);

    // A directory others may write to is refused.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777))?;
    let err = Runtime::new(config()).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(err.contains("writable"), "a world-writable cache directory was accepted: {err:?}");
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700))?;
    // One owned by another user too (only root can make one).
    if std::process::Command::new("id").arg("-u").output()?.stdout.starts_with(b"0\n") {
        let status = std::process::Command::new("chown").arg("nobody").arg(&cache).status()?;
        if status.success() {
            let err = Runtime::new(config()).err().map(|e| e.to_string()).unwrap_or_default();
            ensure!(err.contains("owned by"), "a cache directory owned by another user was accepted: {err:?}");
        }
    }
    Ok(())
}

/// A listener on loopback that counts who connects and answers nothing:
/// its `http://` address, the count, and its task.
async fn counting_listener() -> Result<(String, Arc<std::sync::atomic::AtomicUsize>, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let connects = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = connects.clone();
    let task = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(socket);
        }
    });
    Ok((url, connects, task))
}

/// A proxy named by the environment would resolve guests' names itself, so
/// the public-address rule would never run: guests' `http` ignores
/// `HTTP_PROXY`, `HTTPS_PROXY` and `ALL_PROXY`. `leasehold run` is the
/// host in a process of its own, with those variables pointing at a
/// listener that counts who connects.
#[tokio::test]
async fn guests_http_ignores_a_proxy_named_by_the_environment() -> Result<()> {
    let (proxy_url, connects, listener) = counting_listener().await?;
    let dir = tempfile::tempdir()?;
    let wasm = dir.path().join("testkit.wasm");
    std::fs::write(&wasm, plugins::rust_plugin("testkit")?)?;
    // A name that resolves nowhere: only a proxy could take the request.
    let request = json!({ "method": "POST", "url": "http://through-a-proxy.invalid/effect" }).to_string();
    let input = json!({ "mode": "script", "ops": [{ "op": "effect", "name": "http", "request": request }] });
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .arg("run")
        .arg(&wasm)
        .args(["--input", &input.to_string(), "--http-allow", "through-a-proxy.invalid", "--json"])
        .arg("--cache-dir")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"))
        .env("HTTP_PROXY", &proxy_url)
        .env("http_proxy", &proxy_url)
        .env("HTTPS_PROXY", &proxy_url)
        .env("ALL_PROXY", &proxy_url)
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out).await??;
    listener.abort();
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(connects.load(std::sync::atomic::Ordering::SeqCst) == 0, "the guest's request went to the proxy: {stdout}");
    ensure!(stdout.contains("through-a-proxy.invalid"), "the run did not report the failed request: {stdout}");
    Ok(())
}

/// A proxy for guests is the operator's explicit setting: with
/// `--guest-http-proxy` every guest request goes to it (in absolute form,
/// the proxy resolving the name), while one named by the environment is
/// still ignored; a setting that is not a proxy URL stops the host with a
/// clear message.
#[tokio::test]
async fn guests_http_goes_through_the_proxy_the_operator_set_and_no_other() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let set = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let set_url = format!("http://{}", set.local_addr()?);
    let heads = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = heads.clone();
    let proxy = tokio::spawn(async move {
        while let Ok((mut socket, _)) = set.accept().await {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            seen.lock().unwrap().push(String::from_utf8_lossy(&head).into_owned());
            let _ = socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\nconnection: close\r\n\r\nvia proxy").await;
        }
    });
    let (env_url, env_connects, env_listener) = counting_listener().await?;
    let dir = tempfile::tempdir()?;
    let wasm = dir.path().join("testkit.wasm");
    std::fs::write(&wasm, plugins::rust_plugin("testkit")?)?;
    let request = json!({ "method": "POST", "url": "http://through-a-proxy.invalid/effect" }).to_string();
    let input = json!({ "mode": "script", "ops": [{ "op": "effect", "name": "http", "request": request }] });
    let run = |proxy: &str| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .arg("run")
            .arg(&wasm)
            .args(["--input", &input.to_string(), "--http-allow", "through-a-proxy.invalid", "--json"])
            .args(["--guest-http-proxy", proxy])
            .arg("--cache-dir")
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/component-cache"))
            .env("HTTP_PROXY", &env_url)
            .env("http_proxy", &env_url)
            .env("ALL_PROXY", &env_url)
            .kill_on_drop(true)
            .output()
    };
    let out = tokio::time::timeout(Duration::from_secs(120), run(&set_url)).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    ensure!(stdout.contains("via proxy"), "the proxy's answer did not reach the guest: {stdout}");
    let heads = heads.lock().unwrap().clone();
    ensure!(heads.len() == 1, "the proxy saw {} requests: {heads:?}", heads.len());
    ensure!(heads[0].starts_with("POST http://through-a-proxy.invalid/effect HTTP/1.1"), "{:?}", heads[0]);
    ensure!(heads[0].to_ascii_lowercase().contains("idempotency-key:"), "{:?}", heads[0]);
    ensure!(env_connects.load(std::sync::atomic::Ordering::SeqCst) == 0, "a proxy from the environment was used");

    let bad = tokio::time::timeout(Duration::from_secs(120), run("ftp://proxy.example:21")).await??;
    let stderr = String::from_utf8_lossy(&bad.stderr);
    ensure!(!bad.status.success() && stderr.contains("http:// or https://"), "a bad proxy setting: {stderr}");
    proxy.abort();
    env_listener.abort();
    Ok(())
}
