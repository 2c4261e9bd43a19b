//! `leasehold new`: a project in each language builds with its own
//! `build.sh`, passes its own `test.sh` (which runs a turn with `leasehold
//! run`), and its component, registered on each backend, completes a run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use leasehold::executor::{Executor, GuestErrorKind, SegmentOutcome};
use leasehold::plugins::PluginSettings;
use leasehold::store::{NewRun, RunStatus};

use crate::harness::{both, eventually_some};
use crate::plugins;

const LANGS: [&str; 4] = ["rust", "python", "js", "c"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Generates, builds and self-tests the project for `lang` once per run of
/// the suite (`LEASEHOLD_TEST_RUN`, set by `scripts/test`; without it, once
/// per test process) and build of `leasehold` (whose binary holds the
/// templates): the first test process to ask does it, under a lock, and
/// keeps the component and the time it took in `target/templates-test/`;
/// the others (nextest runs each test as a process) read them. Returns the component and how long `new`
/// to a passed test took. The Rust project builds into `target/plugins`,
/// so its compiled dependencies are the example plugins' and are kept
/// across runs.
fn project(lang: &str) -> Result<(Vec<u8>, Duration)> {
    let dir = root().join("target/templates-test");
    std::fs::create_dir_all(&dir)?;
    let bin = std::fs::metadata(env!("CARGO_BIN_EXE_leasehold"))?;
    let run = std::env::var("LEASEHOLD_TEST_RUN").unwrap_or_else(|_| format!("pid{}", std::process::id()));
    let stamp = format!("{run}-{}-{}", bin.len(), bin.modified()?.duration_since(std::time::UNIX_EPOCH)?.as_nanos());
    let lock = std::fs::File::create(dir.join(format!("{lang}.lock")))?;
    lock.lock()?;
    let (done, took_file) = (dir.join(format!("{lang}-{stamp}.wasm")), dir.join(format!("{lang}-{stamp}.took-ms")));
    if let (Ok(bytes), Ok(ms)) = (std::fs::read(&done), std::fs::read_to_string(&took_file)) {
        return Ok((bytes, Duration::from_millis(ms.trim().parse()?)));
    }
    // Earlier runs' components.
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let file = path.file_name().and_then(|f| f.to_str()).unwrap_or_default();
        if file.starts_with(&format!("{lang}-")) && !file.starts_with(&format!("{lang}-{stamp}")) {
            let _ = std::fs::remove_file(&path);
        }
    }
    let name = format!("hello-{lang}");
    let project: PathBuf = dir.join(std::process::id().to_string()).join(&name);
    let _ = std::fs::remove_dir_all(&project);
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["new", &name, "--lang", lang, "--dir"])
        .arg(&project)
        .output()?;
    ensure!(out.status.success(), "leasehold new --lang {lang}: {}", String::from_utf8_lossy(&out.stderr));
    // At the lowest priority: four toolchains' builds must not starve the
    // timing of the crash and chaos tests running beside this one.
    let out = Command::new("nice")
        .args(["-n", "19"])
        .arg(project.join("test.sh"))
        .env("LEASEHOLD", env!("CARGO_BIN_EXE_leasehold"))
        .env("LEASEHOLD_TOOLCHAINS", root().join("target/toolchains"))
        .env("LEASEHOLD_NODE_MODULES", root().join("plugins/agent-js/node_modules"))
        .env("LEASEHOLD_CACHE_DIR", root().join("target/component-cache"))
        .env("LEASEHOLD_LOG", "error")
        .env("CARGO_TARGET_DIR", root().join("target/plugins"))
        .output()
        .with_context(|| format!("running {}/test.sh", project.display()))?;
    let took = started.elapsed();
    ensure!(
        out.status.success(),
        "{lang}: test.sh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(project.join(format!("{name}.wasm")))?;
    let _ = std::fs::remove_dir_all(project.parent().unwrap_or(&project));
    eprintln!("templates: {lang}: new -> passed test in {took:?}, component {} bytes", bytes.len());
    std::fs::write(&took_file, took.as_millis().to_string())?;
    let tmp = dir.join(format!("{lang}-{stamp}.wasm.{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, &done)?;
    Ok((bytes, took))
}

both! {
    async fn a_new_project_in_each_language_builds_passes_its_test_and_completes_a_run(db) {
        let app = axum::Router::new().route("/hello.txt", axum::routing::get(|| async { "hello from the test server\n" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let rt = plugins::runtime()?;
        let settings = PluginSettings { http_allow: vec![format!("127.0.0.1:{port}")], ..PluginSettings::default() };
        let exec = Executor::new(db.store.clone(), rt.clone(), crate::harness::worker("w"));
        // The two backends' tests walk the languages in opposite orders:
        // each builds half the projects while the other builds the rest,
        // rather than waiting behind it for the same one.
        let mut langs = LANGS;
        if db.backend == leasehold::Backend::Postgres {
            langs.reverse();
        }
        for lang in langs {
            let (bytes, _) = tokio::task::spawn_blocking(move || project(lang)).await??;
            let name = format!("hello-{lang}");
            leasehold::plugins::register(&db.store, &rt, &name, bytes, settings.clone()).await?;
            let input = serde_json::json!({ "url": format!("http://127.0.0.1:{port}/hello.txt") });
            let id = db.store.create_run(&NewRun::new(name.as_str(), input.to_string())).await?.0.id;
            ensure!(exec.run_once().await? == Some((id, SegmentOutcome::Completed)), "{lang}");
            let run = db.store.get_run(id).await?;
            ensure!(run.status == RunStatus::Completed, "{lang}: {run:?}");
            ensure!(run.output.as_deref() == Some("fetched 27 bytes (HTTP 200); visit 1"), "{lang}: {run:?}");
            ensure!(run.partial.starts_with("fetched http://127.0.0.1:"), "{lang}: {run:?}");
            // An effect the helpers report failed ends the run with its
            // message (a turn error, not a trap), in every language.
            let denied = serde_json::json!({ "url": "http://127.0.0.1:1/hello.txt" });
            let id = db.store.create_run(&NewRun::new(name.as_str(), denied.to_string())).await?.0.id;
            let out = exec.run_once().await?;
            let error = db.store.get_run(id).await?.error.unwrap_or_default();
            ensure!(out == Some((id, SegmentOutcome::Failed(GuestErrorKind::TurnError))), "{lang}: {out:?} {error}");
            ensure!(error.contains("http") && error.contains("allow-list"), "{lang}: {error}");
        }
        server.abort();
        Ok(())
    }

    async fn a_python_turn_that_raises_fails_with_its_traceback(db) {
        let (bytes, _) = tokio::task::spawn_blocking(|| project("python")).await??;
        let rt = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &rt, "hello-python", bytes, PluginSettings::default()).await?;
        let exec = Executor::new(db.store.clone(), rt, crate::harness::worker("w"));
        // No "url": app.py's data["url"] raises KeyError.
        let id = db.store.create_run(&NewRun::new("hello-python", "{}")).await?.0.id;
        exec.run_once().await?;
        let error = db.store.get_run(id).await?.error.unwrap_or_default();
        ensure!(error.contains("Traceback (most recent call last)") && error.contains("KeyError: 'url'") && error.contains("app.py"), "{error}");
        Ok(())
    }
}

/// `leasehold dev`: a change to the project is rebuilt and registered, and
/// the next run takes it; each run is printed as it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_rebuilds_and_reregisters_a_project_when_it_changes() -> Result<()> {
    let (_, _) = tokio::task::spawn_blocking(|| project("c")).await??;
    let dir = tempfile::tempdir()?;
    let proj = dir.path().join("dev-c");
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold")).args(["new", "dev-c", "--lang", "c", "--dir"]).arg(&proj).output()?;
    ensure!(out.status.success());
    let app = axum::Router::new().route("/hello.txt", axum::routing::get(|| async { "hello from the test server\n" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http_port = listener.local_addr()?.port();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let port = crate::serve_proc::free_port()?;
    let log = dir.path().join("dev.log");
    let mut dev = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .arg("dev")
        .arg(&proj)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--http-allow", &format!("127.0.0.1:{http_port}")])
        .arg("--cache-dir")
        .arg(root().join("target/component-cache"))
        .env("LEASEHOLD_LOG", "warn")
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let result = async {
        let printed = || std::fs::read_to_string(&log).unwrap_or_default();
        let wait_for = |what: String, n: usize| {
            let printed = &printed;
            async move {
                let seen = async || Ok((printed().matches(what.as_str()).count() >= n).then_some(()));
                eventually_some(Duration::from_secs(60), async || Ok(format!("no {what:?} (x{n}) in:\n{}", printed())), seen).await
            }
        };
        wait_for("dev: registered dev-c sha256:".into(), 1).await?;
        let token = std::fs::read_to_string(proj.join("target/leasehold-dev.token"))?;
        leasehold::effects::http::install_tls();
        let http = reqwest::Client::new();
        let submit = async || -> Result<i64> {
            let body = serde_json::json!({ "plugin": "dev-c", "input": { "url": format!("http://127.0.0.1:{http_port}/hello.txt") } });
            let run: serde_json::Value = http
                .post(format!("http://127.0.0.1:{port}/v1/runs"))
                .bearer_auth(token.trim())
                .json(&body)
                .send()
                .await?
                .json()
                .await?;
            run["id"].as_i64().context("run id")
        };
        let first = submit().await?;
        wait_for(format!("run {first} completed: fetched 27 bytes (HTTP 200); visit 1"), 1).await?;
        let source = std::fs::read_to_string(proj.join("turn.c"))?;
        std::fs::write(proj.join("turn.c"), source.replace("\"fetched \", \" bytes", "\"got \", \" bytes"))?;
        wait_for("dev: registered dev-c sha256:".into(), 2).await?;
        let second = submit().await?;
        wait_for(format!("run {second} completed: got 27 bytes (HTTP 200); visit 2"), 1).await?;
        ensure!(printed().contains(&format!("run {second} | fetched http://127.0.0.1:{http_port}/hello.txt")), "{}", printed());
        Ok(())
    }
    .await;
    let _ = dev.kill();
    let _ = dev.wait();
    server.abort();
    result
}
