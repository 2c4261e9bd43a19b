//! OpenTelemetry traces (docs/operations.md, "Tracing"), received by a real
//! OTLP/HTTP endpoint in the test that decodes the protobuf with the
//! OpenTelemetry project's own generated types: one span per call a
//! segment performed, none for a call replayed, ids derived from (run,
//! seq, fence), a resumed segment linked to the dead one, the submitter's
//! `traceparent` as the run's parent and on every `http` request, and a
//! collector that is down costing spans, never runs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::store::{NewRun, RunStatus};
use leasehold::traces::{TraceConfig, Tracer, ids};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message;
use serde_json::json;

use crate::harness::{TestDb, both, eventually_some};
use crate::plugins;
use crate::serve_proc::{ServeArgs, ServeProc};
use crate::sink::Sink;

/// A span as the receiver decoded it.
#[derive(Debug, Clone)]
pub struct Got {
    pub service: String,
    pub trace: String,
    pub id: String,
    pub parent: String,
    pub name: String,
    pub kind: i32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: BTreeMap<String, String>,
    pub links: Vec<(String, String)>,
    /// 1 ok, 2 error.
    pub status: i32,
}

impl Got {
    fn attr(&self, k: &str) -> &str {
        self.attributes.get(k).map_or("", String::as_str)
    }
}

/// An OTLP/HTTP traces endpoint: `POST /v1/traces` with protobuf.
pub struct Receiver {
    pub base: String,
    spans: Arc<Mutex<Vec<Got>>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn shown(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

impl Receiver {
    pub async fn start() -> Result<Receiver> {
        let spans: Arc<Mutex<Vec<Got>>> = Arc::default();
        let kept = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let kept = kept.clone();
                async move {
                    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
                    if content_type != "application/x-protobuf" {
                        return (axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE, Vec::new());
                    }
                    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                        return (axum::http::StatusCode::BAD_REQUEST, Vec::new());
                    };
                    let mut got = Vec::new();
                    for rs in request.resource_spans {
                        let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
                        let service = attrs.iter().find(|kv| kv.key == "service.name").map(|kv| shown(&kv.value)).unwrap_or_default();
                        for ss in rs.scope_spans {
                            for s in ss.spans {
                                got.push(Got {
                                    service: service.clone(),
                                    trace: hex::encode(&s.trace_id),
                                    id: hex::encode(&s.span_id),
                                    parent: hex::encode(&s.parent_span_id),
                                    name: s.name,
                                    kind: s.kind,
                                    start_ns: s.start_time_unix_nano,
                                    end_ns: s.end_time_unix_nano,
                                    attributes: s.attributes.iter().map(|kv| (kv.key.clone(), shown(&kv.value))).collect(),
                                    links: s.links.iter().map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id))).collect(),
                                    status: s.status.map_or(0, |st| st.code),
                                });
                            }
                        }
                    }
                    kept.lock().unwrap().extend(got);
                    // An empty ExportTraceServiceResponse.
                    (axum::http::StatusCode::OK, Vec::new())
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver { base, spans, server })
    }

    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until `ready` holds of the spans received.
    pub async fn wait(&self, what: &str, ready: impl Fn(&[Got]) -> bool) -> Result<Vec<Got>> {
        eventually_some(Duration::from_secs(30), async || Ok(format!("{what}: never received; got {:#?}", self.spans())), async || {
            let spans = self.spans();
            Ok(ready(&spans).then_some(spans))
        })
        .await
    }
}

const PARENT_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PARENT_SPAN: &str = "b7ad6b7169203331";

both! {
    async fn a_run_killed_mid_effect_and_resumed_on_another_host_exports_one_span_per_performed_call(db) {
        leasehold::effects::http::install_tls();
        let receiver = Receiver::start().await?;
        let sink = Sink::start().await?;
        sink.hold(true);
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let host = |owner: &str| -> Result<ServeArgs<'_>> {
            let mut args = ServeArgs::new(db.url(), dir.path(), owner.into())?;
            args.http_allow = vec![sink.allow()];
            args.extra.push(format!("--otlp-endpoint={}", receiver.base));
            args.env = vec![
                ("OTEL_SERVICE_NAME".into(), "agents-under-test".into()),
                ("OTEL_BSP_SCHEDULE_DELAY".into(), "50".into()),
                ("LEASEHOLD_LOG".into(), "warn,leasehold::runtime=info".into()),
            ];
            Ok(args)
        };
        let a = ServeProc::spawn(&host("host-a")?)?;
        a.wait_healthy(&http, Duration::from_secs(60)).await?;
        // A put, a keyed http call the sink holds, another put.
        let input = json!({ "mode": "script", "ops": [
            { "op": "put", "key": "a", "value": 1 },
            { "op": "http", "url": sink.url, "keyed": true },
            { "op": "put", "key": "b", "value": 2 },
        ] });
        let parent = format!("00-{PARENT_TRACE}-{PARENT_SPAN}-01");
        let r: serde_json::Value = http
            .post(format!("{}/v1/runs", a.base))
            .header("traceparent", &parent)
            .json(&json!({ "plugin": "testkit", "input": input }))
            .send()
            .await?
            .json()
            .await?;
        let run = r["id"].as_i64().with_context(|| format!("submit: {r}"))?;
        ensure!(r["trace_parent"] == parent.as_str(), "the run keeps its submitter's traceparent: {r}");
        let database = db.store.database_id().await?;
        let call = |seq: i64, fence: i64| ids::call_span(&database, run, seq, fence).to_string();
        let segment = |fence: i64| ids::segment_span(&database, run, fence).to_string();
        // Host A wrote the first put (with the http call's start) and is
        // in the call: its put's span has gone out. A dies there.
        receiver.wait("host A's put", |s| s.iter().any(|g| g.id == call(0, 1))).await?;
        crate::harness::eventually("host A never made its http call", async || Ok(!sink.hits().is_empty())).await?;
        drop(a);
        sink.hold(false);
        let b_args = host("host-b")?;
        let b = ServeProc::spawn(&b_args)?;
        b.wait_healthy(&http, Duration::from_secs(60)).await?;
        eventually_some(
            Duration::from_secs(60),
            async || Ok(format!("the run never completed: {:?}", db.store.get_run(run).await?.status)),
            async || Ok((db.store.get_run(run).await?.status == RunStatus::Completed).then_some(())),
        )
        .await?;
        let spans = receiver.wait("host B's segment", |s| s.iter().any(|g| g.id == segment(2))).await?;
        // A turn that logs, on B: its line names the segment's trace.
        let r: serde_json::Value = http
            .post(format!("{}/v1/runs", b.base))
            .json(&json!({ "plugin": "testkit", "input": { "mode": "log-flood", "n": 1 } }))
            .send()
            .await?
            .json()
            .await?;
        let logged = r["id"].as_i64().with_context(|| format!("submit: {r}"))?;
        let logged_trace = ids::run_trace(&database, logged).to_string();
        crate::harness::eventually("host B never ran the turn that logs", async || Ok(std::fs::read_to_string(&b_args.log)?.contains("line 0"))).await?;
        drop(b);

        // Every span in the submitter's trace, from the configured service.
        ensure!(spans.iter().all(|g| g.trace == PARENT_TRACE && g.service == "agents-under-test"), "{spans:#?}");
        // Ids are unique: nothing was exported twice.
        let mut seen = std::collections::HashSet::new();
        ensure!(spans.iter().all(|g| seen.insert(g.id.clone())), "a span id twice: {spans:#?}");
        // One span per performed call: A's put; B's re-issued http call and
        // its put. B replayed A's put: no span of B's for call 0.
        let calls: Vec<(&str, &str)> = spans.iter().filter(|g| g.attributes.contains_key("leasehold.seq")).map(|g| (g.name.as_str(), g.id.as_str())).collect();
        let expected = [("kv.put", call(0, 1)), ("http", call(1, 2)), ("kv.put", call(2, 2))];
        ensure!(calls.len() == 3, "calls: {calls:?}");
        for (name, id) in &expected {
            ensure!(calls.contains(&(name, id.as_str())), "no {name} span {id}: {calls:?}");
        }
        // The calls hang under their segments; A's segment never ended, so
        // it has no span, and B's links to it.
        let by_id = |id: &str| spans.iter().find(|g| g.id == id).cloned();
        ensure!(by_id(&call(0, 1)).is_some_and(|g| g.parent == segment(1)));
        ensure!(by_id(&segment(1)).is_none(), "the killed segment reported itself");
        let b_segment = by_id(&segment(2)).context("B's segment")?;
        ensure!(b_segment.parent == PARENT_SPAN, "the run's parent is the submitter's span: {b_segment:?}");
        ensure!(b_segment.links == vec![(PARENT_TRACE.to_string(), segment(1))], "B links to A's segment: {b_segment:?}");
        ensure!(b_segment.attr("leasehold.outcome") == "completed" && b_segment.attr("leasehold.owner") == "host-b", "{b_segment:?}");
        ensure!(b_segment.attr("leasehold.fence") == "2" && b_segment.attr("leasehold.run_id") == run.to_string(), "{b_segment:?}");
        ensure!(b_segment.kind == 5 && b_segment.status == 1 && b_segment.end_ns >= b_segment.start_ns, "{b_segment:?}");
        let reissued = by_id(&call(1, 2)).context("the http span")?;
        ensure!(reissued.parent == segment(2) && reissued.kind == 3 && reissued.status == 1, "{reissued:?}");
        ensure!(reissued.attr("http.request.method") == "POST" && reissued.attr("http.response.status_code") == "200", "{reissued:?}");
        ensure!(reissued.attr("server.address") == "127.0.0.1" && reissued.attr("leasehold.reissue") == "true", "{reissued:?}");
        // Both attempts of the call carried their own span as traceparent.
        let hits = sink.hits();
        ensure!(hits.len() == 2, "{hits:?}");
        for (hit, fence) in hits.iter().zip([1, 2]) {
            let expected = format!("00-{PARENT_TRACE}-{}-01", call(1, fence));
            ensure!(hit.traceparent == expected, "fence {fence}: traceparent {:?}, not {expected:?}", hit.traceparent);
        }
        let log = std::fs::read_to_string(&b_args.log)?;
        let line = log.lines().find(|l| l.contains("line 0")).unwrap_or_default();
        ensure!(line.contains(&format!("trace_id={logged_trace}")) && line.contains(&format!("run_id={logged}")), "{line}");
        // The trace as a waterfall, for docs/operations.md ("Tracing").
        let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/traces");
        std::fs::create_dir_all(&out)?;
        std::fs::write(out.join(format!("killed-and-resumed-{}.html", db.backend.name())), waterfall(&spans))?;
        Ok(())
    }

    async fn a_replayed_segment_exports_no_span_for_what_it_replays_and_a_suspension_has_one(db) {
        let receiver = Receiver::start().await?;
        let tracer = Tracer::start(TraceConfig { delay: Duration::from_millis(20), ..TraceConfig::new(format!("{}/v1/traces", receiver.base)) })
            .map_err(anyhow::Error::msg)?;
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let config = ExecutorConfig { tracer: Some(tracer.clone()), ..crate::harness::worker("w") };
        let exec = Executor::new(db.store.clone(), rt, config);
        let input = json!({ "mode": "script", "ops": [
            { "op": "effect", "name": "kv.get", "request": "{\"key\":\"k\"}" },
            { "op": "wait", "prompt": "go on?" },
            { "op": "effect", "name": "kv.get", "request": "{\"key\":\"k\"}" },
        ] });
        let run = db.store.create_run(&NewRun::new("testkit", input.to_string())).await?.0.id;
        let outcomes = exec.drain().await?;
        ensure!(outcomes == vec![(run, SegmentOutcome::Suspended(RunStatus::WaitingInput))], "{outcomes:?}");
        db.store.deliver_input(run, "\"yes\"").await?;
        let outcomes = exec.drain().await?;
        ensure!(outcomes == vec![(run, SegmentOutcome::Completed)], "{outcomes:?}");
        tracer.shutdown().await;
        let database = db.store.database_id().await?;
        let spans = receiver.wait("both segments", |s| s.len() >= 5).await?;
        let ids: Vec<String> = spans.iter().map(|g| g.id.clone()).collect();
        let mut expected = vec![
            ids::call_span(&database, run, 0, 1).to_string(),
            ids::suspension_span(&database, run, 1).to_string(),
            ids::segment_span(&database, run, 1).to_string(),
            // Call 0 replayed under fence 2: no span. Call 1 (wait-input)
            // took the input; call 2 is new.
            ids::call_span(&database, run, 2, 2).to_string(),
            ids::segment_span(&database, run, 2).to_string(),
        ];
        let mut got = ids.clone();
        got.sort();
        expected.sort();
        ensure!(got == expected, "spans {spans:#?}");
        let suspension = spans.iter().find(|g| g.name.starts_with("suspend")).context("the suspension")?;
        ensure!(suspension.attr("leasehold.status") == "waiting_input", "{suspension:?}");
        // A run submitted without a traceparent has a trace of its own.
        ensure!(spans.iter().all(|g| g.trace == ids::run_trace(&database, run).to_string()), "{spans:#?}");
        Ok(())
    }

    async fn a_model_call_span_names_the_model_and_the_tokens_it_used(db) {
        use crate::fake_model::{FakeModel, USAGE_TOKENS, echo};
        use leasehold::plugins::PluginSettings;
        let (receiver, model) = (Receiver::start().await?, FakeModel::start(echo()).await?);
        let tracer = Tracer::start(TraceConfig { delay: Duration::from_millis(20), ..TraceConfig::new(format!("{}/v1/traces", receiver.base)) })
            .map_err(anyhow::Error::msg)?;
        let rt = plugins::runtime()?;
        let grant = leasehold::store::ModelGrant { models: vec!["*".into()], max_tokens: 20 };
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, PluginSettings { model: grant, ..PluginSettings::default() }).await?;
        let mut chat = leasehold::effects::model::ModelConfig::new(&model.base_url);
        chat.api_key = Some("sk-test".into());
        chat.default_model = "fake-1".into();
        let config = ExecutorConfig { model: Some(Arc::new(chat)), tracer: Some(tracer.clone()), ..crate::harness::worker("w") };
        let exec = Executor::new(db.store.clone(), rt, config);
        // A budget has the call ask for its usage.
        let input = json!({ "mode": "script", "ops": [{ "op": "chat", "prompt": "hi" }] });
        let run = db.store.create_run(&NewRun { budget_tokens: Some(1_000_000), ..NewRun::new("testkit", input.to_string()) }).await?.0.id;
        ensure!(exec.drain().await? == vec![(run, SegmentOutcome::Completed)]);
        tracer.shutdown().await;
        let spans = receiver.wait("the model call", |s| s.iter().any(|g| g.name == "model.chat")).await?;
        let call = spans.iter().find(|g| g.name == "model.chat").context("model.chat")?;
        ensure!(call.kind == 3 && call.attr("gen_ai.request.model") == "fake-1", "{call:?}");
        let half = (USAGE_TOKENS / 2).to_string();
        ensure!(call.attr("gen_ai.usage.input_tokens") == half && call.attr("gen_ai.usage.output_tokens") == half, "{call:?}");
        Ok(())
    }

    async fn a_collector_that_is_down_costs_spans_never_runs(db) {
        // A port nothing listens on, and a queue of one span.
        let port = crate::serve_proc::free_port()?;
        let config = TraceConfig { queue: 1, batch: 1, delay: Duration::from_millis(1), ..TraceConfig::new(format!("http://127.0.0.1:{port}/v1/traces")) };
        let tracer = Tracer::start(config).map_err(anyhow::Error::msg)?;
        let rt = plugins::runtime()?;
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, plugins::test_limits())?;
        let exec = Executor::new(db.store.clone(), rt, ExecutorConfig { tracer: Some(tracer.clone()), ..ExecutorConfig::default() });
        let metrics = leasehold::metrics::global();
        let dropped = || metrics.trace_spans_dropped_full.load(std::sync::atomic::Ordering::Relaxed)
            + metrics.trace_spans_dropped_export.load(std::sync::atomic::Ordering::Relaxed);
        let before = dropped();
        for _ in 0..20 {
            db.store.create_run(&NewRun::new("testkit", json!({ "steps": 2 }).to_string())).await?;
        }
        let outcomes = exec.drain().await?;
        ensure!(outcomes.len() == 20 && outcomes.iter().all(|(_, o)| *o == SegmentOutcome::Completed), "{outcomes:?}");
        tracer.shutdown().await;
        // 20 segments, each with its puts: every span was dropped and counted.
        ensure!(dropped() >= before + 20, "dropped {} spans", dropped() - before);
        Ok(())
    }
}

/// A submitter's malformed `traceparent` is ignored, as the W3C
/// specification asks; a valid one is kept, and child runs go on in their
/// parent's trace under the spawn call's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_and_submitters_pass_their_trace_on() -> Result<()> {
    crate::harness::run_on(leasehold::Backend::Sqlite, async |db: &TestDb| {
        use leasehold::plugins::PluginSettings;
        let rt = plugins::runtime()?;
        leasehold::plugins::register(&db.store, &rt, "testkit", plugins::rust_plugin("testkit")?, PluginSettings::default()).await?;
        let grant = PluginSettings { spawn_allow: vec!["testkit".into()], ..PluginSettings::default() };
        leasehold::plugins::register(&db.store, &rt, "fanout", plugins::rust_plugin("fanout")?, grant).await?;
        let server = crate::harness::Server::on(db, rt.clone(), leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let http = reqwest::Client::new();
        let submit = async |traceparent: &str| -> Result<serde_json::Value> {
            let body = json!({ "plugin": "fanout", "input": { "n": 2, "input": { "steps": 1 } } });
            Ok(http.post(format!("{base}/v1/runs")).header("traceparent", traceparent).json(&body).send().await?.json().await?)
        };
        let bad = submit("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01").await?;
        ensure!(bad.get("trace_parent").is_none(), "a malformed traceparent was kept: {bad}");
        // A batch's runs all go on from the header's span.
        let batch = json!({ "runs": [
            { "plugin": "testkit", "input": { "steps": 1 }, "idempotency_key": "b1" },
            { "plugin": "testkit", "input": { "steps": 1 }, "idempotency_key": "b2" },
        ] });
        let header = format!("00-{PARENT_TRACE}-{PARENT_SPAN}-01");
        let got: serde_json::Value = http.post(format!("{base}/v1/runs:batch")).header("traceparent", &header).json(&batch).send().await?.json().await?;
        let results = got["results"].as_array().context("results")?;
        ensure!(results.len() == 2 && results.iter().all(|r| r["run"]["trace_parent"] == header.as_str()), "{got}");
        let good = submit(&format!("00-{PARENT_TRACE}-{PARENT_SPAN}-00")).await?;
        let parent = good["id"].as_i64().context("the run")?;
        let exec = Executor::new(db.store.clone(), rt, ExecutorConfig::default());
        exec.drain().await?;
        let database = db.store.database_id().await?;
        let kids: Vec<(i64, Option<String>)> = sqlx::query_as("SELECT id, trace_parent FROM runs WHERE parent_id = $1 ORDER BY id")
            .bind(parent)
            .fetch_all(db.store.pool())
            .await?;
        ensure!(kids.len() == 2, "{kids:?}");
        for (i, (_, tp)) in kids.iter().enumerate() {
            // The spawn calls are the turn's first two calls, under fence 1;
            // the submitter's sampled flag (00) goes on.
            let expected = format!("00-{PARENT_TRACE}-{}-00", ids::call_span(&database, parent, i as i64, 1));
            ensure!(tp.as_deref() == Some(expected.as_str()), "child {i}: {tp:?}, not {expected}");
        }
        server.stop().await;
        Ok(())
    })
    .await
}

/// The spans of one trace as a waterfall (HTML with inline SVG): a row a
/// span, nested under its parent, a bar from its start to its end. A
/// parent that was never received (a segment whose host died) gets a row
/// saying so.
fn waterfall(spans: &[Got]) -> String {
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let t0 = spans.iter().map(|g| g.start_ns).min().unwrap_or(0);
    let t1 = spans.iter().map(|g| g.end_ns).max().unwrap_or(t0 + 1).max(t0 + 1);
    let known: std::collections::HashSet<&str> = spans.iter().map(|g| g.id.as_str()).collect();
    // Rows: roots (by start), each followed by its children; children of a
    // parent never received follow a stand-in row for it.
    let mut rows: Vec<(usize, Option<&Got>, String)> = Vec::new();
    let mut sorted: Vec<&Got> = spans.iter().collect();
    sorted.sort_by_key(|g| g.start_ns);
    let mut missing: Vec<&str> = sorted.iter().filter(|g| !g.parent.is_empty() && !known.contains(g.parent.as_str()) && g.attributes.contains_key("leasehold.seq")).map(|g| g.parent.as_str()).collect();
    missing.dedup();
    for m in &missing {
        rows.push((0, None, format!("segment {m}: its host died; no span")));
        for g in sorted.iter().filter(|g| g.parent == *m) {
            rows.push((1, Some(g), String::new()));
        }
    }
    for root in sorted.iter().filter(|g| !g.attributes.contains_key("leasehold.seq") && !g.name.starts_with("suspend")) {
        rows.push((0, Some(root), String::new()));
        for g in sorted.iter().filter(|g| g.parent == root.id) {
            rows.push((1, Some(g), String::new()));
        }
    }
    let (label_w, bar_w, row_h) = (520.0, 560.0, 34.0);
    let mut svg = String::new();
    for (i, (depth, span, text)) in rows.iter().enumerate() {
        let y = 40.0 + i as f64 * row_h;
        let (label, bar) = match span {
            None => (text.clone(), None),
            Some(g) => {
                let mut label = format!("{} · {}", g.name, &g.id[..8]);
                for k in ["leasehold.fence", "leasehold.owner", "leasehold.outcome", "http.response.status_code", "leasehold.reissue"] {
                    if let Some(v) = g.attributes.get(k) {
                        label.push_str(&format!(" · {}={v}", k.rsplit('.').next().unwrap_or(k)));
                    }
                }
                if !g.links.is_empty() {
                    label.push_str(&format!(" · resumes {}", &g.links[0].1[..8]));
                }
                (label, Some(g))
            }
        };
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"{}\">{}</text>",
            8.0 + *depth as f64 * 18.0,
            y + 14.0,
            if span.is_some() { "#222" } else { "#a33" },
            esc(&label)
        ));
        if let Some(g) = bar {
            let x = label_w + (g.start_ns - t0) as f64 / (t1 - t0) as f64 * bar_w;
            let w = ((g.end_ns.max(g.start_ns) - g.start_ns) as f64 / (t1 - t0) as f64 * bar_w).max(2.0);
            let colour = match g.kind { 5 => "#4a7bd0", 3 => "#d08a2c", _ => "#5aa469" };
            svg.push_str(&format!("<rect x=\"{x:.1}\" y=\"{}\" width=\"{w:.1}\" height=\"18\" rx=\"3\" fill=\"{colour}\"/>", y + 2.0));
            let ms = (g.end_ns.saturating_sub(g.start_ns)) as f64 / 1e6;
            svg.push_str(&format!("<text x=\"{:.1}\" y=\"{}\" font-size=\"11\" fill=\"#555\">{ms:.1} ms</text>", (x + w + 4.0).min(label_w + bar_w - 40.0), y + 15.0));
        }
    }
    let height = 60.0 + rows.len() as f64 * row_h;
    let trace = spans.first().map_or("", |g| g.trace.as_str());
    format!(
        "<!doctype html><meta charset=\"utf-8\"><title>trace {trace}</title>\
         <body style=\"margin:0;font-family:sans-serif;background:#fff\">\
         <svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\">\
         <text x=\"8\" y=\"22\" font-size=\"14\" font-weight=\"bold\">trace {trace} · service {} · {:.0} ms</text>{svg}</svg></body>",
        label_w + bar_w + 80.0,
        esc(spans.first().map_or("", |g| g.service.as_str())),
        (t1 - t0) as f64 / 1e6
    )
}

/// The trace config's `Debug` (which a settings dump or a log line may
/// show) holds no header and no credential of the collector's URL.
#[test]
fn the_trace_config_shows_no_header_and_no_credentials() {
    let env = |k: &str| match k {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" => Some("https://u:pw9@c.example/v1/traces?key=k3y".to_string()),
        "OTEL_EXPORTER_OTLP_HEADERS" => Some("x-api-key=s3cret".to_string()),
        _ => None,
    };
    let config = TraceConfig::from_env(None, None, env).expect("a config").expect("an endpoint");
    let shown = format!("{config:?}");
    for secret in ["s3cret", "x-api-key", "pw9", "k3y"] {
        assert!(!shown.contains(secret), "{secret} shows in {shown}");
    }
    assert!(shown.contains("c.example/v1/traces"), "{shown}");
}

/// A submit's log line names the trace its run goes on in: the
/// submitter's, or the run's own.
#[tokio::test]
async fn a_submit_logs_the_trace_its_run_goes_on_in() -> Result<()> {
    crate::harness::run_on(leasehold::store::Backend::Sqlite, async |db| {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), plugins::rust_plugin("testkit")?)?;
        let mut args = ServeArgs::new(db.url(), dir.path(), "logger".into())?;
        args.env = vec![("LEASEHOLD_LOG".into(), "warn,leasehold::api=info".into())];
        let host = ServeProc::spawn(&args)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        host.wait_healthy(&http, Duration::from_secs(60)).await?;
        let submit = async |traceparent: Option<String>| -> Result<i64> {
            let mut req = http.post(format!("{}/v1/runs", host.base)).json(&json!({ "plugin": "testkit", "input": { "steps": 1 } }));
            if let Some(t) = traceparent {
                req = req.header("traceparent", t);
            }
            let run: serde_json::Value = req.send().await?.json().await?;
            run["id"].as_i64().context("a run id")
        };
        let under = submit(Some(format!("00-{PARENT_TRACE}-{PARENT_SPAN}-01"))).await?;
        let own = submit(None).await?;
        let database = db.store.database_id().await?;
        let want = [(under, PARENT_TRACE.to_string()), (own, ids::run_trace(&database, own).to_string())];
        let log = || std::fs::read_to_string(&args.log).unwrap_or_default();
        let line = |log: &str, id: i64| log.lines().find(|l| l.contains("run submitted") && l.contains(&format!("run_id={id} "))).map(str::to_string);
        let lines = eventually_some(Duration::from_secs(10), async || Ok(format!("no submit lines in the log:\n{}", log())), async || {
            let log = log();
            Ok(want.iter().map(|(id, _)| line(&log, *id)).collect::<Option<Vec<String>>>())
        })
        .await?;
        for ((id, trace), l) in want.iter().zip(lines) {
            ensure!(l.contains(&format!("trace_id={trace}")), "run {id}'s submit line lacks trace {trace}: {l}");
        }
        Ok(())
    })
    .await
}

both! {
    async fn an_http_call_carries_traceparent_only_when_the_host_sends_it(db) {
        let sink = Sink::start().await?;
        let rt = plugins::runtime()?;
        let mut limits = plugins::test_limits();
        limits.http_allow = vec![sink.allow()];
        rt.add_plugin("testkit", &plugins::rust_plugin("testkit")?, limits)?;
        let input = json!({ "mode": "script", "ops": [{ "op": "http", "url": sink.url }] }).to_string();
        for sends in [false, true] {
            db.store.create_run(&NewRun::new("testkit", input.clone())).await?;
            let config = ExecutorConfig { http_traceparent: sends, ..crate::harness::worker("h") };
            Executor::new(db.store.clone(), rt.clone(), config).drain().await?;
        }
        let hits = sink.hits();
        ensure!(hits.len() == 2, "{} calls", hits.len());
        ensure!(hits[0].traceparent.is_empty(), "a host exporting nothing sent traceparent {}", hits[0].traceparent);
        ensure!(hits[1].traceparent.starts_with("00-"), "a host asked to send it sent {:?}", hits[1].traceparent);
        Ok(())
    }
}
