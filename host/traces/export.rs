//! The exporter: a bounded queue of finished spans and one task that sends
//! them in batches to an OTLP/HTTP collector (`application/x-protobuf`).
//!
//! A segment never waits for it: a span that finds the queue full is
//! dropped and counted (`leasehold_trace_spans_dropped_total{reason="queue_full"}`),
//! and so is a batch the collector refused or did not answer in time
//! (`reason="export_failed"`). Nothing is retried: a collector that is down
//! costs spans, never runs.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{Span, Value};

/// Where and how spans are exported. Read by [`TraceConfig::from_env`].
/// `Debug` shows the endpoint without credentials or query, and no header.
#[derive(Clone)]
pub struct TraceConfig {
    /// The collector's traces URL, e.g. `http://127.0.0.1:4318/v1/traces`.
    pub endpoint: String,
    /// Extra request headers (`OTEL_EXPORTER_OTLP_HEADERS`), e.g. a
    /// collector's API key. Never logged.
    pub headers: Vec<(String, String)>,
    /// The resource: `service.name` first. Default `service.name=leasehold`.
    pub resource: Vec<(String, Value)>,
    /// Spans held for export at most. Default 2,048.
    pub queue: usize,
    /// Spans in one request at most. Default 512.
    pub batch: usize,
    /// How long a span waits for others to share its request. Default 1 s.
    pub delay: Duration,
    /// One request's timeout. Default 10 s.
    pub timeout: Duration,
}

impl std::fmt::Debug for TraceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceConfig")
            .field("endpoint", &crate::redact::url_shown(&self.endpoint))
            .field("headers", &format_args!("<{} set, not shown>", self.headers.len()))
            .field("resource", &self.resource)
            .field("queue", &self.queue)
            .field("batch", &self.batch)
            .field("delay", &self.delay)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl TraceConfig {
    /// Defaults for `endpoint` (a full traces URL).
    pub fn new(endpoint: impl Into<String>) -> TraceConfig {
        TraceConfig {
            endpoint: endpoint.into(),
            headers: Vec::new(),
            resource: vec![("service.name".into(), Value::Str("leasehold".into()))],
            queue: 2048,
            batch: 512,
            delay: Duration::from_secs(1),
            timeout: Duration::from_secs(10),
        }
    }

    /// The standard OpenTelemetry variables, with `serve`'s flags:
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (taken as it is), else
    /// `endpoint` (`--otlp-endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`, to
    /// which `/v1/traces` is added), `service` (`--otel-service-name`, else
    /// `OTEL_SERVICE_NAME`), `OTEL_RESOURCE_ATTRIBUTES`,
    /// `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_PROTOCOL` (only
    /// `http/protobuf`), `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_BSP_*` and
    /// `OTEL_SDK_DISABLED` / `OTEL_TRACES_EXPORTER=none`. `Ok(None)`: no
    /// endpoint, so no export.
    pub fn from_env(
        endpoint: Option<&str>,
        service: Option<&str>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TraceConfig>, String> {
        let env = |k: &str| env(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
        {
            return Ok(None);
        }
        // The traces-only variable first, as the specification orders them.
        let url = match (env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), endpoint.map(str::trim).filter(|e| !e.is_empty())) {
            (Some(full), _) => full,
            (None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
            (None, None) => return Ok(None),
        };
        match url::Url::parse(&url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
            _ => return Err(format!("the OTLP endpoint {:?} is not an http:// or https:// URL", crate::redact::url_shown(&url))),
        }
        for var in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Some(p) = env(var) {
                if p != "http/protobuf" {
                    return Err(format!("{var}={p}: leasehold exports OTLP over http/protobuf only (point it at the collector's port 4318)"));
                }
                break;
            }
        }
        let mut config = TraceConfig::new(url);
        let pairs = |var: &str| -> Result<Vec<(String, String)>, String> {
            let Some(list) = env(var) else { return Ok(Vec::new()) };
            list.split(',')
                .filter(|p| !p.trim().is_empty())
                .map(|p| match p.split_once('=') {
                    Some((k, v)) if !k.trim().is_empty() => Ok((decode(k.trim()), decode(v.trim()))),
                    _ => Err(format!("{var}: {p:?} is not key=value")),
                })
                .collect()
        };
        config.headers = pairs("OTEL_EXPORTER_OTLP_HEADERS")?;
        config.headers.extend(pairs("OTEL_EXPORTER_OTLP_TRACES_HEADERS")?);
        let mut resource: Vec<(String, Value)> = pairs("OTEL_RESOURCE_ATTRIBUTES")?.into_iter().map(|(k, v)| (k, Value::Str(v))).collect();
        // The name: the flag, then OTEL_SERVICE_NAME, then the attributes', then ours.
        let named = service.map(str::to_string).or_else(|| env("OTEL_SERVICE_NAME"));
        let from_attributes = resource.iter().position(|(k, _)| k == "service.name");
        match (named, from_attributes) {
            (Some(name), Some(i)) => resource[i].1 = Value::Str(name),
            (Some(name), None) => resource.insert(0, ("service.name".into(), Value::Str(name))),
            (None, Some(_)) => {}
            (None, None) => resource.insert(0, ("service.name".into(), Value::Str("leasehold".into()))),
        }
        config.resource = resource;
        let number = |var: &str, default: u64| -> Result<u64, String> {
            match env(var) {
                None => Ok(default),
                Some(v) => v.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| format!("{var}={v}: not a positive whole number")),
            }
        };
        config.queue = number("OTEL_BSP_MAX_QUEUE_SIZE", config.queue as u64)? as usize;
        config.batch = number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", config.batch as u64)?.min(config.queue as u64) as usize;
        config.delay = Duration::from_millis(number("OTEL_BSP_SCHEDULE_DELAY", config.delay.as_millis() as u64)?);
        let timeout = env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT").map_or("OTEL_EXPORTER_OTLP_TIMEOUT", |_| "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT");
        config.timeout = Duration::from_millis(number(timeout, config.timeout.as_millis() as u64)?);
        Ok(Some(config))
    }
}

/// `%XX` escapes, as the spec allows in these lists.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A handle on the export queue; cheap to clone.
#[derive(Clone)]
pub struct Tracer {
    inner: Arc<Inner>,
}

struct Inner {
    queue: mpsc::Sender<Span>,
    /// Ends the export task after one last batch.
    stop: tokio::sync::watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tracer")
    }
}

impl Tracer {
    /// Starts the export task (on the current Tokio runtime).
    pub fn start(config: TraceConfig) -> Result<Tracer, String> {
        // rustls' provider, as `effects::http` installs it: Err means one is.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("the OTLP client: {e}"))?;
        let (queue, rx) = mpsc::channel(config.queue.max(1));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(export_loop(config, client, rx, stopped));
        Ok(Tracer { inner: Arc::new(Inner { queue, stop, task: std::sync::Mutex::new(Some(task)) }) })
    }

    /// Queues `span` for export, or drops and counts it if the queue is
    /// full. Never waits.
    pub fn send(&self, span: Span) {
        if self.inner.queue.try_send(span).is_err() {
            crate::metrics::global().trace_spans_dropped_full.fetch_add(1, Relaxed);
        }
    }

    /// Sends what is queued (within the request timeout) and stops the
    /// task. Spans sent after this are dropped and counted.
    pub async fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
        let task = self.inner.task.lock().expect("tracer lock").take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

async fn export_loop(config: TraceConfig, client: reqwest::Client, mut rx: mpsc::Receiver<Span>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let version = env!("CARGO_PKG_VERSION");
    let mut batch = Vec::with_capacity(config.batch);
    // Set once `stop` fires (or its sender is gone): from then on each
    // pass sends what is queued without waiting, until nothing is.
    let mut stopping = false;
    loop {
        if !stopping {
            // Wait for a first span, then up to `delay` for the batch to fill.
            tokio::select! {
                got = rx.recv() => match got {
                    Some(span) => batch.push(span),
                    None => return,
                },
                _ = stop.changed() => stopping = true,
            }
            let until = tokio::time::Instant::now() + config.delay;
            while !stopping && batch.len() < config.batch {
                tokio::select! {
                    got = rx.recv() => match got {
                        Some(span) => batch.push(span),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(until) => break,
                    _ = stop.changed() => stopping = true,
                }
            }
        }
        if stopping {
            while batch.len() < config.batch
                && let Ok(span) = rx.try_recv()
            {
                batch.push(span);
            }
        }
        if batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        let body = super::otlp::encode(&config.resource, version, &batch);
        batch.clear();
        let mut request = client.post(&config.endpoint).header("Content-Type", "application/x-protobuf").body(body);
        for (k, v) in &config.headers {
            request = request.header(k, v);
        }
        let metrics = crate::metrics::global();
        match request.send().await {
            Ok(r) if r.status().is_success() => {
                metrics.trace_spans_exported.fetch_add(n, Relaxed);
            }
            Ok(r) => {
                metrics.trace_spans_dropped_export.fetch_add(n, Relaxed);
                tracing::warn!(status = r.status().as_u16(), spans = n, "the OTLP collector refused a batch of spans; they are dropped");
            }
            Err(e) => {
                metrics.trace_spans_dropped_export.fetch_add(n, Relaxed);
                tracing::warn!(error = %e.without_url(), spans = n, "could not send a batch of spans to the OTLP collector; they are dropped");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn no_endpoint_means_no_export() {
        assert!(TraceConfig::from_env(None, None, env(&[])).unwrap().is_none());
        let off = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), ("OTEL_SDK_DISABLED", "true")];
        assert!(TraceConfig::from_env(Some("http://c:4318"), None, env(&off)).unwrap().is_none());
    }

    #[test]
    fn the_standard_variables_configure_the_export() {
        let vars = [
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,team=a%2Cb"),
            ("OTEL_SERVICE_NAME", "agents"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=s3cret"),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ];
        let c = TraceConfig::from_env(Some("http://collector:4318/"), None, env(&vars)).unwrap().unwrap();
        assert_eq!(c.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(c.resource[0], ("service.name".to_string(), Value::Str("agents".into())));
        assert!(c.resource.contains(&("team".to_string(), Value::Str("a,b".into()))));
        assert_eq!(c.headers, vec![("x-api-key".to_string(), "s3cret".to_string())]);
        assert_eq!(c.delay, Duration::from_millis(200));
        let full = [("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://c.example/otlp/traces")];
        let c = TraceConfig::from_env(None, Some("mine"), env(&full)).unwrap().unwrap();
        assert_eq!(c.endpoint, "https://c.example/otlp/traces");
        assert_eq!(c.resource[0].1, Value::Str("mine".into()));
    }

    #[test]
    fn a_setting_it_cannot_honour_is_an_error_that_names_it() {
        let grpc = [("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")];
        let e = TraceConfig::from_env(Some("http://c:4317"), None, env(&grpc)).unwrap_err();
        assert!(e.contains("OTEL_EXPORTER_OTLP_PROTOCOL=grpc"), "{e}");
        let e = TraceConfig::from_env(Some("collector:4318"), None, env(&[])).unwrap_err();
        assert!(e.contains("not an http"), "{e}");
        let e = TraceConfig::from_env(Some("http://c:4318"), None, env(&[("OTEL_BSP_MAX_QUEUE_SIZE", "0")])).unwrap_err();
        assert!(e.contains("OTEL_BSP_MAX_QUEUE_SIZE"), "{e}");
    }
}
