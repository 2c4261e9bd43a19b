//! Child runs (`leasehold:turn/children@0.2.0`, docs/concepts.md): a turn
//! spawns runs, waits for them without holding a worker, and gets their
//! outcomes; a cancel takes a whole subtree; a failed parent's open
//! children are cancelled unless detached. Every test runs on both
//! backends, with the `fanout` example plugin over `testkit`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::plugins::PluginSettings;
use leasehold::pool::{PoolConfig, WorkerPool};
use leasehold::store::{NewRun, Run, RunFilter, RunStatus, Store};
use serde_json::{Value, json};

use crate::harness::{TestDb, both, eventually_some};
use crate::plugins;

/// A runtime with `testkit` and `fanout` registered, fanout granted to
/// spawn the plugins in `spawn_allow`.
async fn registered(db: &TestDb, spawn_allow: &[&str]) -> Result<Arc<leasehold::runtime::Runtime>> {
    let runtime = plugins::runtime()?;
    leasehold::plugins::register(&db.store, &runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
    let grant = PluginSettings { spawn_allow: spawn_allow.iter().map(|p| p.to_string()).collect(), ..PluginSettings::default() };
    leasehold::plugins::register(&db.store, &runtime, "fanout", plugins::rust_plugin("fanout")?, grant).await?;
    Ok(runtime)
}

/// A worker of `owner` on `runtime`.
fn host(db: &TestDb, runtime: &Arc<leasehold::runtime::Runtime>, owner: &str) -> Executor {
    crate::harness::executor(db, runtime, owner)
}

/// Registers `testkit` and `fanout` (which may spawn both) and starts a
/// pool of `workers` for `owner`.
async fn pool(db: &TestDb, owner: &str, workers: usize, lease_ttl: Duration) -> Result<WorkerPool> {
    let runtime = registered(db, &["testkit", "fanout"]).await?;
    let config = ExecutorConfig { lease_ttl, ..crate::harness::worker(owner) };
    let exec = Arc::new(Executor::new(db.store.clone(), runtime, config));
    Ok(WorkerPool::start(db.store.clone(), exec, PoolConfig { workers, poll: Duration::from_millis(50), claim_batch: 4, prefetch: 0 }))
}

async fn submit(store: &Store, plugin: &str, input: Value) -> Result<i64> {
    Ok(store.create_run(&NewRun::new(plugin, input.to_string())).await?.0.id)
}

/// Waits (up to `within`) until `run` is finished and returns it.
async fn finished(store: &Store, run: i64, within: Duration) -> Result<Run> {
    let what = async || {
        let r = store.get_run(run).await?;
        Ok(format!("run {run} is still {:?} (waiting for {:?})", r.status, r.waiting_for))
    };
    eventually_some(within, what, async || {
        let r = store.get_run(run).await?;
        Ok(r.status.is_terminal().then_some(r))
    })
    .await
}

/// Waits until `check` holds of `run`.
async fn until(store: &Store, run: i64, what: &str, check: impl Fn(&Run) -> bool) -> Result<Run> {
    let never = async || Ok(format!("run {run} never became {what}: {:?}", store.get_run(run).await?.status));
    eventually_some(Duration::from_secs(30), never, async || {
        let r = store.get_run(run).await?;
        Ok(check(&r).then_some(r))
    })
    .await
}

async fn children(store: &Store, parent: i64) -> Result<Vec<Run>> {
    let filter = RunFilter { parent: Some(parent), ..RunFilter::default() };
    let (mut runs, _) = store.runs_page(&filter, None, 1000, i64::MAX).await?;
    runs.sort_by_key(|r| r.id);
    Ok(runs)
}

/// How the parent's first host dies at its spawn.
#[derive(Debug, Clone, Copy)]
enum Death {
    /// Before the spawn's transaction commits: nothing of it exists.
    BeforeCommit,
    /// After it commits, before the host hears back.
    AfterCommit,
}

/// Host A dies at the parent's spawn as `death` says; host B takes the
/// run over once its lease has run out. Exactly one child either way.
async fn spawn_death(db: &TestDb, death: Death) -> Result<()> {
    let runtime = registered(db, &["testkit"]).await?;
    let host = |owner: &str| host(db, &runtime, owner);
    let parent = submit(&db.store, "fanout", json!({ "n": 1, "input": { "mode": "steps", "steps": 1 } })).await?;
    match death {
        Death::BeforeCommit => db.store.faults().roll_back_spawns(1),
        Death::AfterCommit => db.store.faults().lose_spawn_replies(1),
    }
    let first = host("host-a").run_once().await?;
    ensure!(
        matches!(first, Some((id, leasehold::executor::SegmentOutcome::Abandoned(_))) if id == parent),
        "{death:?}: host A's segment ended {first:?}"
    );
    let made = children(&db.store, parent).await?.len();
    let expected = match death {
        Death::BeforeCommit => 0,
        Death::AfterCommit => 1,
    };
    ensure!(made == expected, "{death:?}: {made} children after host A died");
    db.backdate_lease(parent, 60_000).await?;
    host("host-b").drain().await?;
    let done = db.store.get_run(parent).await?;
    ensure!(done.status == RunStatus::Completed, "{death:?}: the parent is {:?}: {:?}", done.status, done.error);
    ensure!(done.output.as_deref() == Some(r#"["did 1 steps"]"#), "{death:?}: output {:?}", done.output);
    let kids = children(&db.store, parent).await?;
    ensure!(kids.len() == 1, "{death:?}: {} children", kids.len());
    Ok(())
}

/// A `leasehold serve` host that pauses every spawn at `at` is SIGKILLed
/// there; a second host takes the parent over once its lease runs out.
async fn sigkill_at_spawn(db: &TestDb, at: &str) -> Result<()> {
    use crate::serve_proc::{ServeArgs, ServeProc};
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
    std::fs::write(dir.path().join("fanout.wasm"), plugins::rust_plugin("fanout")?)?;
    let host = |owner: &str, pause: Option<&str>| -> Result<ServeArgs<'_>> {
        let mut args = ServeArgs::new(db.url(), dir.path(), owner.into())?;
        args.extra.push("--spawn-allow=fanout=testkit".into());
        args.extra.extend(pause.map(|p| format!("--test-pause-spawns={p}")));
        Ok(args)
    };
    leasehold::effects::http::install_tls();
    let http = crate::serve_proc::client(reqwest::Client::builder())?;
    let a_args = host("host-a", Some(at))?;
    let a = ServeProc::spawn(&a_args)?;
    a.wait_healthy(&http, Duration::from_secs(60)).await?;
    let parent = submit(&db.store, "fanout", json!({ "n": 1, "input": { "mode": "steps", "steps": 1 } })).await?;
    let paused = async || Ok(std::fs::read_to_string(&a_args.log).unwrap_or_default().contains("pausing a spawn"));
    crate::harness::eventually(&format!("{at}: host A never reached its spawn"), paused).await?;
    drop(a); // SIGKILL
    let made = children(&db.store, parent).await?.len();
    let expected = if at == "before" { 0 } else { 1 };
    ensure!(made == expected, "{at}: {made} children right after the kill");
    let b = ServeProc::spawn(&host("host-b", None)?)?;
    b.wait_healthy(&http, Duration::from_secs(60)).await?;
    let done = finished(&db.store, parent, Duration::from_secs(60)).await?;
    ensure!(done.status == RunStatus::Completed, "{at}: the parent is {:?}: {:?}", done.status, done.error);
    ensure!(done.output.as_deref() == Some(r#"["did 1 steps"]"#), "{at}: output {:?}", done.output);
    let kids = children(&db.store, parent).await?;
    ensure!(kids.len() == 1, "{at}: {} children", kids.len());
    Ok(())
}

both! {
    async fn a_host_sigkilled_before_its_spawn_commits_leaves_exactly_one_child(db) {
        sigkill_at_spawn(db, "before").await
    }

    async fn a_host_sigkilled_after_its_spawn_commits_leaves_exactly_one_child(db) {
        sigkill_at_spawn(db, "after").await
    }

    async fn a_spawn_rolled_back_by_a_dying_host_is_made_once_by_the_host_that_resumes(db) {
        spawn_death(db, Death::BeforeCommit).await
    }

    async fn a_spawn_whose_reply_was_lost_is_found_in_the_ledger_and_not_made_again(db) {
        spawn_death(db, Death::AfterCommit).await
    }

    async fn a_child_killed_mid_turn_is_resumed_and_its_parent_still_gets_its_result(db) {
        let runtime = registered(db, &["testkit"]).await?;
        let host = |owner: &str| host(db, &runtime, owner);
        // The child puts, then computes for a while: host A dies there.
        let parent = submit(&db.store, "fanout", json!({ "n": 1, "input": { "mode": "put-then-spin", "spins": 1u64 << 28 } })).await?;
        let a = host("host-a");
        ensure!(a.run_once().await?.is_some_and(|(id, _)| id == parent), "host A did not run the parent first");
        let kid = children(&db.store, parent).await?.first().map(|r| r.id).context("no child")?;
        // Killed once the child holds its put.
        let put = async || {
            let puts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM kv WHERE namespace = 'testkit' AND key = 'early'").fetch_one(db.store.pool()).await?;
            Ok(puts > 0 && db.store.get_run(kid).await?.status == RunStatus::Running)
        };
        crate::harness::kill_when(db, a, kid, put).await?;
        ensure!(db.store.get_run(parent).await?.waiting_for.as_deref() == Some("children"), "the parent stopped waiting");
        host("host-b").drain().await?;
        let kid = db.store.get_run(kid).await?;
        ensure!(kid.status == RunStatus::Completed && kid.fence == 2, "the child is {:?} at fence {}", kid.status, kid.fence);
        let done = db.store.get_run(parent).await?;
        ensure!(done.output.as_deref() == Some(r#"["spun"]"#), "the parent's output {:?}", done.output);
        ensure!(done.fence == 2, "the parent was woken {} times", done.fence - 1);
        Ok(())
    }

    async fn a_parent_gets_its_childrens_outputs_in_spawn_order(db) {
        let pool = pool(db, "h1", 2, crate::harness::TTL).await?;
        // The first child takes the longest: outputs come back in spawn
        // order, not in the order the children end.
        let inputs: Vec<Value> = [4, 1, 2].iter().map(|n| json!({ "mode": "steps", "steps": n })).collect();
        let parent = submit(&db.store, "fanout", json!({ "inputs": inputs })).await?;
        let done = finished(&db.store, parent, Duration::from_secs(60)).await?;
        ensure!(done.status == RunStatus::Completed, "the parent ended {:?}: {:?}", done.status, done.error);
        ensure!(done.output.as_deref() == Some(r#"["did 4 steps","did 1 steps","did 2 steps"]"#), "output {:?}", done.output);
        let kids = children(&db.store, parent).await?;
        ensure!(kids.len() == 3, "{} children", kids.len());
        for kid in &kids {
            ensure!(kid.parent_id == Some(parent) && kid.root_id == parent, "child {} has parent {:?} root {}", kid.id, kid.parent_id, kid.root_id);
            ensure!(kid.status == RunStatus::Completed, "child {} is {:?}", kid.id, kid.status);
        }
        ensure!(done.parent_id.is_none() && done.root_id == parent, "the root shows parent {:?} root {}", done.parent_id, done.root_id);
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn a_tree_of_depth_3_and_width_10_completes_on_two_workers_with_each_parent_woken_once(db) {
        // Three levels, 1 + 10 + 100 runs, 11 of them parents awaiting 10
        // children each, on 2 workers: a waiting parent holds none.
        let pool = pool(db, "h1", 2, crate::harness::TTL).await?;
        let root = submit(&db.store, "fanout", json!({ "n": 10, "depth": 2, "input": { "mode": "steps", "steps": 1 } })).await?;
        let done = finished(&db.store, root, Duration::from_secs(120)).await?;
        ensure!(done.status == RunStatus::Completed, "the root ended {:?}: {:?}", done.status, done.error);
        let outputs: Vec<Vec<String>> = serde_json::from_str(done.output.as_deref().unwrap_or("null")).context("the root's output")?;
        ensure!(outputs.len() == 10 && outputs.iter().all(|o| o.len() == 10 && o.iter().all(|s| s == "did 1 steps")), "output {outputs:?}");
        let mut parents = vec![done.clone()];
        let mut runs = 1;
        for mid in children(&db.store, root).await? {
            let leaves = children(&db.store, mid.id).await?;
            ensure!(leaves.len() == 10, "run {} has {} children", mid.id, leaves.len());
            ensure!(leaves.iter().all(|l| l.root_id == root && l.status == RunStatus::Completed), "leaves of {}", mid.id);
            runs += 1 + leaves.len();
            parents.push(mid);
        }
        ensure!(runs == 111, "{runs} runs in the tree");
        // Claimed once to start and once when woken: fence 2, one wait.
        for p in &parents {
            ensure!(p.fence == 2, "parent {} has fence {}: woken more than once", p.id, p.fence);
        }
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn cancelling_a_root_cancels_every_descendant_and_none_writes_after(db) {
        let pool = pool(db, "h1", 2, Duration::from_secs(3)).await?;
        // Two children that keep computing and writing, two that wait for
        // input (open, holding no worker), under a mid-level parent.
        let busy = json!({ "mode": "steps", "steps": 1_000_000, "spin": 20_000 });
        let waits = json!({ "mode": "wait" });
        let mid = json!({ "inputs": [busy, waits] });
        let root = submit(&db.store, "fanout", json!({ "plugin": "fanout", "inputs": [mid.clone(), mid] })).await?;
        let metrics = leasehold::metrics::global();
        let tree = async || {
            let mut all = Vec::new();
            for m in children(&db.store, root).await? {
                all.extend(children(&db.store, m.id).await?);
                all.push(m);
            }
            anyhow::Ok(all)
        };
        let statuses = async || Ok(format!("the tree never had two busy children running: {:?}", tree().await?.iter().map(|r| r.status).collect::<Vec<_>>()));
        let (all, running, ended) = eventually_some(Duration::from_secs(30), statuses, async || {
            // Segments ended so far, read before the statuses: each segment
            // seen running below ends after this count.
            let ended = metrics.segment_duration.count();
            let all = tree().await?;
            let running = all.iter().filter(|r| r.status == RunStatus::Running).count();
            Ok((all.len() == 6 && running >= 2).then_some((all, running as u64, ended)))
        })
        .await?;
        let cancelled = db.store.cancel(root).await?;
        ensure!(cancelled.status == RunStatus::Cancelled);
        let fences: Vec<(i64, i64)> = all.iter().map(|r| (r.id, r.fence)).collect();
        for (id, fence) in &fences {
            let r = db.store.get_run(*id).await?;
            ensure!(r.status == RunStatus::Cancelled, "descendant {id} is {:?}", r.status);
            ensure!(r.fence > *fence, "descendant {id}'s fence did not move ({fence} -> {})", r.fence);
        }
        // The busy children stop (their next write fails its guard); their
        // ledgers and kv stop growing.
        let ledger = |db: &TestDb| {
            let store = db.store.clone();
            async move {
                let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects").fetch_one(store.pool()).await?;
                anyhow::Ok(n)
            }
        };
        let stopped = async || Ok(metrics.segment_duration.count() >= ended + running);
        crate::harness::eventually("the running segments never stopped after the cancel", stopped).await?;
        let before = ledger(db).await?;
        // Nothing of this process writes after its pool has stopped.
        pool.shutdown(Duration::from_secs(5)).await;
        ensure!(ledger(db).await? == before, "ledger rows were written after the cancel");
        for (id, _) in &fences {
            ensure!(db.store.get_run(*id).await?.status == RunStatus::Cancelled, "run {id} left cancelled");
        }
        Ok(())
    }

    async fn a_parent_that_fails_has_its_open_children_cancelled_unless_spawned_detached(db) {
        let pool = pool(db, "h1", 2, crate::harness::TTL).await?;
        let waits = json!({ "mode": "wait" });
        let attached = submit(&db.store, "fanout", json!({ "n": 2, "input": waits, "then": "fail" })).await?;
        let detached = submit(&db.store, "fanout", json!({ "n": 2, "input": waits, "then": "fail", "options": { "detached": true } })).await?;
        for parent in [attached, detached] {
            let done = finished(&db.store, parent, Duration::from_secs(30)).await?;
            ensure!(done.status == RunStatus::Failed, "parent {parent} ended {:?}", done.status);
        }
        for kid in children(&db.store, attached).await?.iter().chain(children(&db.store, detached).await?.iter()) {
            until(&db.store, kid.id, "waiting for input", |r| r.status == RunStatus::WaitingInput).await?;
        }
        let report = leasehold::maintenance::reaper::tick(&db.store, &leasehold::maintenance::reaper::ReaperConfig::default()).await?;
        ensure!(report.orphans_cancelled == 2, "the reaper cancelled {} runs", report.orphans_cancelled);
        for kid in children(&db.store, attached).await? {
            ensure!(kid.status == RunStatus::Cancelled, "attached child {} is {:?}", kid.id, kid.status);
        }
        for kid in children(&db.store, detached).await? {
            ensure!(kid.status == RunStatus::WaitingInput, "detached child {} is {:?}", kid.id, kid.status);
        }
        let again = leasehold::maintenance::reaper::tick(&db.store, &leasehold::maintenance::reaper::ReaperConfig::default()).await?;
        ensure!(again.orphans_cancelled == 0, "a second tick cancelled {}", again.orphans_cancelled);
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn a_tree_stops_growing_at_its_depth_cap(db) {
        // fanout spawning itself 40 levels deep, one child a level.
        let pool = pool(db, "h1", 2, crate::harness::TTL).await?;
        let root = submit(&db.store, "fanout", json!({ "n": 1, "depth": 40 })).await?;
        let done = finished(&db.store, root, Duration::from_secs(120)).await?;
        ensure!(done.status == RunStatus::Completed, "the root ended {:?}: {:?}", done.status, done.error);
        let output = done.output.unwrap_or_default();
        ensure!(output.contains("a tree may be at most 32 deep"), "output {output}");
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE id = $1 OR root_id = $1").bind(root).fetch_one(db.store.pool()).await?;
        ensure!(n == 33, "{n} runs in the tree");
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }

    async fn a_spawn_without_a_grant_is_denied_and_the_parent_sees_why(db) {
        let runtime = registered(db, &[]).await?;
        let exec = host(db, &runtime, "h1");
        let parent = submit(&db.store, "fanout", json!({ "n": 1 })).await?;
        exec.run_once().await?.context("nothing claimed")?;
        let done = db.store.get_run(parent).await?;
        ensure!(done.status == RunStatus::Failed, "the parent is {:?}", done.status);
        let error = done.error.unwrap_or_default();
        ensure!(error.contains("denied: spawn: plugin \"testkit\" is not on this plugin's spawn_allow list"), "error {error:?}");
        ensure!(children(&db.store, parent).await?.is_empty(), "a child was made");
        Ok(())
    }

    async fn a_wait_with_a_deadline_returns_pending_children_once_it_passes(db) {
        let pool = pool(db, "h1", 2, crate::harness::TTL).await?;
        let parent = submit(&db.store, "fanout", json!({ "n": 2, "input": { "mode": "wait" }, "timeout_ms": 300 })).await?;
        let done = finished(&db.store, parent, Duration::from_secs(30)).await?;
        ensure!(done.status == RunStatus::Completed, "the parent ended {:?}: {:?}", done.status, done.error);
        ensure!(done.output.as_deref() == Some(r#"[{"pending":true},{"pending":true}]"#), "output {:?}", done.output);
        pool.shutdown(Duration::from_secs(5)).await;
        Ok(())
    }
}

#[test]
fn components_built_against_0_1_0_import_its_host_interface() -> Result<()> {
    // testkit is built against wit/0.1.0: every test that runs it runs a
    // 0.1.0 component on this host.
    let runtime = plugins::runtime()?;
    let component = wasmtime::component::Component::new(runtime.engine(), plugins::rust_plugin("testkit")?)?;
    let imports: Vec<String> = component.component_type().imports(runtime.engine()).map(|(name, _)| name.to_string()).collect();
    ensure!(imports.iter().any(|i| i == "leasehold:turn/host@0.1.0"), "testkit imports {imports:?}");
    let fanout = wasmtime::component::Component::new(runtime.engine(), plugins::rust_plugin("fanout")?)?;
    let imports: Vec<String> = fanout.component_type().imports(runtime.engine()).map(|(name, _)| name.to_string()).collect();
    ensure!(imports.iter().any(|i| i == "leasehold:turn/children@0.2.0"), "fanout imports {imports:?}");
    Ok(())
}

/// `testkit` and `fanout` registered on `runtime`, fanout granted `spawn_allow`.
async fn registered_on(db: &TestDb, runtime: &Arc<leasehold::runtime::Runtime>, spawn_allow: &[&str]) -> Result<()> {
    leasehold::plugins::register(&db.store, runtime, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
    let grant = PluginSettings { spawn_allow: spawn_allow.iter().map(|p| p.to_string()).collect(), ..PluginSettings::default() };
    leasehold::plugins::register(&db.store, runtime, "fanout", plugins::rust_plugin("fanout")?, grant).await?;
    Ok(())
}

both! {
    async fn a_tree_is_refused_spawns_past_its_caps_with_the_reason(db) {
        use leasehold::runtime::Limits;
        let narrow = plugins::runtime_with(Limits { tree_max_open: 3, ..Limits::default() })?;
        registered_on(db, &narrow, &["testkit"]).await?;
        let parent = submit(&db.store, "fanout", json!({ "n": 4, "input": { "mode": "wait" } })).await?;
        host(db, &narrow, "h1").run_once().await?.context("nothing claimed")?;
        let done = db.store.get_run(parent).await?;
        let error = done.error.clone().unwrap_or_default();
        ensure!(done.status == RunStatus::Failed && error.contains("at most 3 at once (--tree-max-open)"), "{:?}: {error}", done.status);
        ensure!(children(&db.store, parent).await?.len() == 3, "the open cap let more through");
        for kid in children(&db.store, parent).await? {
            db.store.cancel(kid.id).await?;
        }
        let few = plugins::runtime_with(Limits { tree_max_runs: 5, tree_max_open: 100, ..Limits::default() })?;
        registered_on(db, &few, &["testkit"]).await?;
        let parent = submit(&db.store, "fanout", json!({ "n": 6, "then": "leave" })).await?;
        host(db, &few, "h2").run_once().await?.context("nothing claimed")?;
        let done = db.store.get_run(parent).await?;
        let error = done.error.clone().unwrap_or_default();
        ensure!(done.status == RunStatus::Failed && error.contains("at most 5 (--tree-max-runs)"), "{:?}: {error}", done.status);
        ensure!(children(&db.store, parent).await?.len() == 5);
        Ok(())
    }

    async fn a_child_keeps_its_parents_priority_at_most_and_its_key_unless_granted_another(db) {
        let runtime = registered(db, &["testkit"]).await?;
        let exec = host(db, &runtime, "h1");
        let keyed = |input: Value| NewRun { priority: 5, concurrency_key: Some("tenant-a".into()), ..NewRun::new("fanout", input.to_string()) };
        let parent = db.store.create_run(&keyed(json!({ "n": 2, "options": { "priority": 9 }, "then": "leave" }))).await?.0.id;
        exec.run_once().await?.context("nothing claimed")?;
        let kids = children(&db.store, parent).await?;
        ensure!(kids.len() == 2, "{} children", kids.len());
        for kid in &kids {
            ensure!(kid.priority == 5 && kid.concurrency_key.as_deref() == Some("tenant-a"), "child {}: priority {}, key {:?}", kid.id, kid.priority, kid.concurrency_key);
            db.store.cancel(kid.id).await?;
        }
        let other = json!({ "n": 1, "options": { "concurrency_key": "other" }, "then": "leave" });
        let parent = db.store.create_run(&keyed(other.clone())).await?.0.id;
        exec.run_once().await?.context("nothing claimed")?;
        let done = db.store.get_run(parent).await?;
        let error = done.error.clone().unwrap_or_default();
        ensure!(done.status == RunStatus::Failed && error.contains("concurrency key \"other\" is not this run's"), "{:?}: {error}", done.status);
        ensure!(children(&db.store, parent).await?.is_empty());
        // Granted keys starting "oth".
        registered_on(db, &runtime, &["testkit", "key:oth"]).await?;
        let parent = db.store.create_run(&keyed(other)).await?.0.id;
        exec.run_once().await?.context("nothing claimed")?;
        let kids = children(&db.store, parent).await?;
        ensure!(kids.len() == 1 && kids[0].concurrency_key.as_deref() == Some("other"), "{kids:?}");
        Ok(())
    }

    async fn a_rerun_of_a_child_under_a_budget_is_refused(db) {
        let runtime = registered(db, &["testkit"]).await?;
        let exec = host(db, &runtime, "h1");
        let input = json!({ "n": 1, "input": { "mode": "steps", "steps": 1 } }).to_string();
        let root = db.store.create_run(&NewRun { budget_tokens: Some(1_000), ..NewRun::new("fanout", input.clone()) }).await?.0.id;
        let free = db.store.create_run(&NewRun::new("fanout", input)).await?.0.id;
        exec.drain().await?;
        let child = children(&db.store, root).await?.pop().context("no child")?;
        match db.store.rerun_prefix(child.id, 0).await {
            Err(leasehold::store::StoreError::Refused(m)) => ensure!(m.contains("budget"), "{m}"),
            other => bail!("a rerun of a child under a budget: {:?}", other.map(|(r, _)| r.id)),
        }
        let child = children(&db.store, free).await?.pop().context("no child")?;
        db.store.rerun_prefix(child.id, 0).await?;
        Ok(())
    }

    async fn a_cancel_racing_a_spawn_cancels_the_child_the_spawn_commits(db) {
        let runtime = registered(db, &["testkit"]).await?;
        let exec = host(db, &runtime, "h1");
        let root = submit(&db.store, "fanout", json!({ "n": 1, "input": { "mode": "wait" } })).await?;
        db.store.faults().hold_spawn_commits(Duration::from_millis(1000));
        let held = db.store.faults().spawn_held();
        let turn = tokio::spawn(async move { exec.run_once().await });
        tokio::time::timeout(Duration::from_secs(20), held).await.context("the spawn was never held")?;
        // The spawn holds the parent's row and commits its child in a moment.
        db.store.cancel(root).await?;
        db.store.faults().hold_spawn_commits(Duration::ZERO);
        let kids = children(&db.store, root).await?;
        ensure!(kids.len() <= 1);
        for kid in &kids {
            ensure!(kid.status == RunStatus::Cancelled, "child {} spawned as its parent was cancelled is {:?}", kid.id, kid.status);
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), turn).await;
        let kids = children(&db.store, root).await?;
        ensure!(kids.iter().all(|k| k.status == RunStatus::Cancelled), "{:?}", kids.iter().map(|k| k.status).collect::<Vec<_>>());
        Ok(())
    }
}

/// `serve --spawn-allow` grants each plugin of `--plugins-dir` its own
/// entries (`PLUGIN=GRANT`, `*=GRANT` for all), and refuses a bare one.
#[tokio::test]
async fn serve_spawn_allow_grants_each_plugin_its_own_and_refuses_a_bare_entry() -> Result<()> {
    crate::harness::run_on(leasehold::store::Backend::Sqlite, async |db| {
        use crate::serve_proc::{ServeArgs, ServeProc};
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        std::fs::write(dir.path().join("fanout.wasm"), plugins::rust_plugin("fanout")?)?;
        let mut args = ServeArgs::new(db.url(), dir.path(), "h1".into())?;
        args.extra.push("--spawn-allow=fanout=testkit,*=key:t-".into());
        let _serve = ServeProc::spawn(&args)?;
        leasehold::effects::http::install_tls();
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        crate::serve_proc::wait_healthy(&http, &_serve.base, Duration::from_secs(60)).await?;
        let (_, fanout) = db.store.plugin_settings("fanout").await?.context("fanout")?;
        let (_, testkit) = db.store.plugin_settings("testkit").await?.context("testkit")?;
        ensure!(fanout.spawn_allow == ["testkit", "key:t-"], "fanout: {:?}", fanout.spawn_allow);
        ensure!(testkit.spawn_allow == ["key:t-"], "testkit: {:?}", testkit.spawn_allow);
        let bare = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(["serve", "--database-url", "sqlite::memory:", "--plugins-dir", "none", "--insecure", "--spawn-allow", "testkit"])
            .output()?;
        let said = String::from_utf8_lossy(&bare.stderr);
        ensure!(!bare.status.success() && said.contains("PLUGIN=testkit"), "a bare grant: {:?} {said}", bare.status);
        Ok(())
    })
    .await
}
