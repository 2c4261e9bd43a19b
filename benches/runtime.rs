//! Criterion: the guest path, on the Rust test plugin (`plugins/testkit`)
//! and the example agents.
//!
//! * `instantiate_call`: instantiate from the plugin's `InstancePre` (pooling
//!   allocator) and call `run` on a turn that makes no host call.
//! * `host_calls/n`: the same with `n` `log` calls; the per-call overhead is
//!   the slope between `n = 0` and `n = 1000`.
//! * `replay_1000`: a resumed segment replaying 1,000 recorded `kv.put`
//!   effects (and 1,000 emits below the stream position) to the end,
//!   performing nothing; `replay_1000_with_ledger` adds loading the rows.
//! * `load_cached/<lang>`: registering a Python or JavaScript component whose
//!   compiled form is in the on-disk cache; the cold compile is timed once
//!   and printed beside it. Skipped, with a note, when `scripts/build-plugins`
//!   has not built them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::runtime::host::SegmentInit;
use leasehold::runtime::replay::Recorded;
use leasehold::runtime::{Limits, Plugin, Runtime, RuntimeConfig};
use leasehold::store::{EffectRow, Lease, NewRun, Store};

/// The service's allocator (see `host/main.rs`), so these figures are the
/// service's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn testkit() -> Vec<u8> {
    let target = root().join("target/plugins");
    // Built already for this run of the suite (`scripts/test`).
    if std::env::var_os("LEASEHOLD_TEST_PLUGINS_BUILT").is_some_and(|v| v == "1") {
        return std::fs::read(target.join("wasm32-wasip2/release/testkit.wasm")).expect("reading testkit.wasm");
    }
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--target", "wasm32-wasip2", "--manifest-path"])
        .arg(root().join("plugins/testkit/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("running cargo");
    assert!(status.success(), "building plugins/testkit failed");
    std::fs::read(target.join("wasm32-wasip2/release/testkit.wasm")).expect("reading testkit.wasm")
}

fn init(store: &Store, run_id: i64, recorded: Vec<EffectRow>, emit_pos: i64) -> SegmentInit {
    SegmentInit {
        db: store.clone(),
        lease: Lease { run_id, owner: "bench".into(), fence: 1 },
        namespace: "testkit".into(),
        limits: Limits::default(),
        model: None,
        recorded: Recorded::from_rows(recorded),
        pending_input: None,
        recorded_emit_pos: emit_pos,
        created_at_ms: 0,
        secret: None,
        reserved: Vec::new().into(),
        egress: Default::default(),
        answer_base: None,
        offline: false,
        trace: None,
        lease_live: None,
    }
}

async fn call(rt: &Runtime, plugin: &Plugin, init: SegmentInit, input: &str) -> String {
    let (result, _) = rt.call_bare(plugin, init, input).await;
    result.expect("guest trapped").expect("turn failed")
}

fn benches(c: &mut Criterion) {
    let tokio = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let store = tokio.block_on(Store::connect(&url)).unwrap();
    let rt = Arc::new(
        Runtime::new(RuntimeConfig {
            cache_dir: root().join("target/component-cache"),
            max_instances: 16,
            ..RuntimeConfig::default()
        })
        .unwrap(),
    );
    let plugin = rt.add_plugin("testkit", &testkit(), Limits::default()).unwrap();

    let mut group = c.benchmark_group("guest");
    group.measurement_time(Duration::from_secs(4));
    group.bench_function("instantiate_call", |b| {
        b.to_async(&tokio).iter(|| async {
            assert_eq!(call(&rt, &plugin, init(&store, 1, vec![], 0), r#"{"steps":0}"#).await, "did 0 steps");
        })
    });
    for n in [0u32, 1000] {
        let input = format!(r#"{{"mode":"calls","n":{n}}}"#);
        group.bench_function(format!("host_calls/{n}"), |b| {
            b.to_async(&tokio).iter(|| async { call(&rt, &plugin, init(&store, 1, vec![], 0), &input).await })
        });
    }

    // A finished run with 1,000 committed effects, then replayed.
    let input = r#"{"steps":1000}"#;
    let run_id = tokio.block_on(async {
        let id = store.create_run(&NewRun::new("testkit", input)).await.unwrap().0.id;
        let config = ExecutorConfig { owner: "bench".into(), model: None, ..ExecutorConfig::default() };
        let exec = Executor::new(store.clone(), rt.clone(), config);
        assert_eq!(exec.run_once().await.unwrap(), Some((id, SegmentOutcome::Completed)));
        id
    });
    let rows = tokio.block_on(store.effects(run_id)).unwrap();
    assert_eq!(rows.len(), 1000);
    group.bench_function("replay_1000", |b| {
        b.to_async(&tokio).iter(|| async {
            assert_eq!(call(&rt, &plugin, init(&store, run_id, rows.clone(), 1000), input).await, "did 1000 steps");
        })
    });
    group.bench_function("replay_1000_with_ledger", |b| {
        b.to_async(&tokio).iter(|| async {
            let rows = store.effects(run_id).await.unwrap();
            call(&rt, &plugin, init(&store, run_id, rows, 1000), input).await
        })
    });
    group.finish();

    let mut group = c.benchmark_group("load_cached");
    group.sample_size(20);
    for lang in ["agent-py", "agent-js"] {
        let path: PathBuf = root().join("target/plugins").join(format!("{lang}.wasm"));
        let Ok(bytes) = std::fs::read(&path) else {
            eprintln!("load_cached/{lang}: skipped, {} is missing (run ./scripts/build-plugins)", path.display());
            continue;
        };
        // The cold compile beside it, when measuring (`cargo bench`): in
        // test mode (`scripts/test`, each bench a process of its own) it
        // would cost each bench half a minute.
        if std::env::args().any(|a| a == "--bench") {
            let start = Instant::now();
            rt.compile_uncached(&bytes).expect("compiling");
            eprintln!("load_cached/{lang}: cold compile took {:?} ({} bytes)", start.elapsed(), bytes.len());
        }
        rt.add_plugin(lang, &bytes, Limits::default()).expect("first load");
        group.bench_function(lang, |b| b.iter(|| rt.add_plugin(lang, &bytes, Limits::default()).unwrap()));
    }
    group.finish();
}

criterion_group!(guest, benches);
criterion_main!(guest);
