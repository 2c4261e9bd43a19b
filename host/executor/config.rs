//! The executor's settings.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Monotonic;
use crate::effects::model::ModelConfig;

/// Executor settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// This worker's lease owner id. Default: `<hostname-or-"host">-<pid>`.
    pub owner: String,
    /// Lease length: how long one segment may go without a renewal before
    /// another worker may take the run. Default: 30 s.
    pub lease_ttl: Duration,
    /// How often the lease is renewed during a segment. Default: a third of
    /// `lease_ttl`.
    pub renew_every: Option<Duration>,
    /// Where `model.chat` goes. Default: from the environment
    /// ([`ModelConfig::from_env`]); none (so `model.chat` is `denied`) when
    /// `LEASEHOLD_MODEL_BASE_URL` is unset.
    pub model: Option<Arc<ModelConfig>>,
    /// Addresses guests' `http` reaches only through an allow-list entry
    /// that names them with their port: the service's own listeners.
    /// Default: none.
    pub reserved: Vec<std::net::SocketAddr>,
    /// Where guests' `http` goes. Default: direct, to public addresses
    /// only ([`crate::effects::http::Egress`]).
    pub egress: crate::effects::http::Egress,
    /// The clock a segment measures its lease deadline and budget on.
    /// Default: the process's monotonic clock; tests move it forward to
    /// simulate a pause.
    pub clock: Monotonic,
    /// The base of the answer links guests make (`serve --public-url`,
    /// e.g. `https://leasehold.example.com`). Default: none, so
    /// `answer-link` is denied.
    pub answer_base: Option<Arc<str>>,
    /// Where segments' spans go (`serve`: `OTEL_EXPORTER_OTLP_ENDPOINT`).
    /// Default: none, so none are exported; trace ids are still derived,
    /// logged and passed on.
    pub tracer: Option<crate::traces::Tracer>,
    /// Whether guests' `http` calls carry a `traceparent` header.
    /// Default: false (`serve`: only while spans are exported, unless
    /// `--http-traceparent` says otherwise).
    pub http_traceparent: bool,
    /// How long a segment's record waits for others to share the segment
    /// log's write (`segment_log`). Default: 1 s.
    pub segment_log_every: Duration,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_string());
        ExecutorConfig {
            owner: format!("{host}-{}", std::process::id()),
            lease_ttl: Duration::from_secs(30),
            renew_every: None,
            model: ModelConfig::from_env().map(Arc::new),
            reserved: Vec::new(),
            egress: Default::default(),
            clock: Monotonic::default(),
            answer_base: None,
            tracer: None,
            http_traceparent: false,
            segment_log_every: crate::maintenance::segment_log::EVERY,
        }
    }
}
