//! OpenTelemetry traces: a trace per run, a span per segment, a child span
//! per effect the segment performed and per suspension (docs/operations.md,
//! "Tracing").
//!
//! A replayed call emits no span: only the code that performs an effect
//! reports one ([`SegmentTrace::call`]). Ids are derived ([`ids`]), so a
//! segment resumed after a death never repeats its predecessor's spans,
//! and links to it. Spans are exported over OTLP/HTTP ([`export`]) when
//! an endpoint is configured; the trace context is kept and passed on
//! (`traceparent` on `http` effects and to child runs) either way.
//!
//! Span times are this host's wall clock, as every OpenTelemetry SDK's:
//! they order nothing in the protocol.
//!
//! This module owns what a span says: a segment's ([`segment`]) and an
//! effect's ([`call`]); the executor and the runtime only report them.

pub mod call;
pub mod export;
pub mod ids;
mod otlp;
pub mod segment;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

pub use export::{TraceConfig, Tracer};
pub use ids::{Parent, SpanId, TraceId};

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Bool(bool),
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::Str(s.to_string())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::Str(s)
    }
}

impl From<i64> for Value {
    fn from(i: i64) -> Value {
        Value::Int(i)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Value {
        Value::Bool(b)
    }
}

/// OTLP's span kinds that leasehold uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Internal,
    /// A call out of the host (`http`, `model.chat`).
    Client,
    /// A segment: the host taking work from its queue.
    Consumer,
}

/// A link to another span, and why (`leasehold.link`).
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    pub trace: TraceId,
    pub span: SpanId,
    pub why: &'static str,
}

/// A finished span.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace: TraceId,
    pub id: SpanId,
    pub parent: Option<SpanId>,
    pub name: String,
    pub kind: Kind,
    /// Unix time, ns.
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: Vec<(&'static str, Value)>,
    pub links: Vec<Link>,
    /// `Some`: the span's status is error, with this message.
    pub error: Option<String>,
}

/// Now, in Unix ns.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Status messages are cut to this many bytes: an effect's error can hold
/// the start of a response body.
const MAX_MESSAGE: usize = 256;

/// One segment's place in its run's trace, and where its spans go.
#[derive(Debug)]
pub struct SegmentTrace {
    tracer: Option<Tracer>,
    database: Arc<str>,
    pub run: i64,
    pub fence: i64,
    /// The trace id and this segment's span id, derived on first use: a
    /// segment that logs nothing, calls out to nothing and exports nothing
    /// (most no-op turns) hashes neither.
    ids: std::sync::OnceLock<(TraceId, SpanId)>,
    /// The stored `traceparent`'s trace id, if it had one.
    given: Option<TraceId>,
    /// The span the run was started under: its submitter's or its parent
    /// run's segment's.
    pub parent: Option<SpanId>,
    sampled: bool,
    pub start_ns: u64,
    /// When the guest returned (Unix ns; 0: not yet): where a suspension's
    /// span starts.
    returned_ns: AtomicU64,
    links: Mutex<Vec<Link>>,
    /// Whether its `http` calls send `traceparent` (see [`SegmentTrace::new`]).
    http_header: bool,
}

impl SegmentTrace {
    /// The segment under `fence` of `run`, whose stored `traceparent` is
    /// `parent`. `tracer`: where its spans go; none, none are exported.
    /// `http_header`: whether its `http` calls send a `traceparent` (their
    /// call's span), so a service they reach joins the trace; without it
    /// no outside service learns the run's trace and span ids.
    pub fn new(tracer: Option<Tracer>, database: Arc<str>, run: i64, fence: i64, parent: Option<&str>, http_header: bool) -> SegmentTrace {
        let parent = parent.and_then(Parent::parse);
        SegmentTrace {
            tracer,
            ids: std::sync::OnceLock::new(),
            given: parent.map(|p| p.trace),
            parent: parent.map(|p| p.span),
            sampled: parent.is_none_or(|p| p.sampled),
            database,
            run,
            fence,
            start_ns: now_ns(),
            returned_ns: AtomicU64::new(0),
            links: Mutex::new(Vec::new()),
            http_header,
        }
    }

    /// The run's trace id.
    pub fn trace(&self) -> TraceId {
        self.ids().0
    }

    /// This segment's span id.
    pub fn span(&self) -> SpanId {
        self.ids().1
    }

    fn ids(&self) -> (TraceId, SpanId) {
        *self.ids.get_or_init(|| {
            let trace = self.given.unwrap_or_else(|| ids::run_trace(&self.database, self.run));
            (trace, ids::segment_span(&self.database, self.run, self.fence))
        })
    }

    /// The `traceparent` an `http` call `seq` sends, if the segment sends one.
    pub fn http_header(&self, seq: i64) -> Option<String> {
        self.http_header.then(|| self.call_header(seq))
    }

    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.tracer.is_some()
    }

    /// The span of call `seq` performed in this segment.
    pub fn call_span(&self, seq: i64) -> SpanId {
        ids::call_span(&self.database, self.run, seq, self.fence)
    }

    /// The `traceparent` an `http` effect (call `seq`) sends: its own span.
    pub fn call_header(&self, seq: i64) -> String {
        Parent { trace: self.trace(), span: self.call_span(seq), sampled: self.sampled }.header()
    }

    /// The `traceparent` a child run is started under: this segment.
    pub fn child_header(&self) -> String {
        Parent { trace: self.trace(), span: self.span(), sampled: self.sampled }.header()
    }

    /// Notes that the guest has returned (or was stopped).
    pub fn guest_returned(&self) {
        self.returned_ns.store(now_ns(), Relaxed);
    }

    /// When the guest returned; the segment's start if it never ran.
    pub fn guest_returned_at(&self) -> u64 {
        match self.returned_ns.load(Relaxed) {
            0 => self.start_ns,
            at => at,
        }
    }

    /// Links this segment to the segment under `fence` that it resumes.
    pub fn resumes(&self, fence: i64) {
        let span = ids::segment_span(&self.database, self.run, fence);
        self.links.lock().expect("trace lock").push(Link { trace: self.trace(), span, why: "resumes" });
    }

    /// Reports call `seq` (an effect performed, not replayed) from
    /// `start_ns` to now; `error` its failure.
    pub fn call(&self, seq: i64, name: &str, kind: Kind, start_ns: u64, mut attributes: Vec<(&'static str, Value)>, error: Option<&str>) {
        let Some(tracer) = &self.tracer else { return };
        attributes.push(("leasehold.seq", seq.into()));
        tracer.send(Span {
            trace: self.trace(),
            id: self.call_span(seq),
            parent: Some(self.span()),
            name: name.to_string(),
            kind,
            start_ns,
            end_ns: now_ns(),
            attributes,
            links: Vec::new(),
            error: error.map(cut),
        });
    }

    /// Reports the `kv.put`s at `seqs` as written by a write that began
    /// at `start_ns`: a put is held for the segment's next write
    /// (`runtime::stream`), and only that write performs it, so its span
    /// is the write's.
    pub fn puts_written(&self, start_ns: u64, seqs: impl IntoIterator<Item = i64>) {
        for seq in seqs {
            let attributes = vec![("leasehold.reissue", false.into()), ("leasehold.op", "put".into())];
            self.call(seq, "kv.put", Kind::Internal, start_ns, attributes, None);
        }
    }

    /// Reports the suspension the segment ended with (`status`, e.g.
    /// `waiting_input`), from `start_ns` (the guest's stop) to now.
    pub fn suspension(&self, status: &str, start_ns: u64) {
        let Some(tracer) = &self.tracer else { return };
        tracer.send(Span {
            trace: self.trace(),
            id: ids::suspension_span(&self.database, self.run, self.fence),
            parent: Some(self.span()),
            name: format!("suspend {status}"),
            kind: Kind::Internal,
            start_ns,
            end_ns: now_ns(),
            attributes: vec![("leasehold.status", status.into())],
            links: Vec::new(),
            error: None,
        });
    }

    /// Reports the segment itself, from its claim to now.
    pub fn finish(&self, name: String, attributes: Vec<(&'static str, Value)>, error: Option<&str>) {
        let Some(tracer) = &self.tracer else { return };
        tracer.send(Span {
            trace: self.trace(),
            id: self.span(),
            parent: self.parent,
            name,
            kind: Kind::Consumer,
            start_ns: self.start_ns,
            end_ns: now_ns(),
            attributes,
            links: std::mem::take(&mut *self.links.lock().expect("trace lock")),
            error: error.map(cut),
        });
    }
}

/// A span's error message: URLs without their queries or credentials
/// (`redact::urls`), at most [`MAX_MESSAGE`] bytes.
fn cut(s: &str) -> String {
    cut_at(&crate::redact::urls(s), MAX_MESSAGE)
}

/// Attribute values a guest chooses (a model's name) are cut to this many
/// bytes.
pub const MAX_ATTRIBUTE: usize = 128;

/// `s` cut to [`MAX_ATTRIBUTE`] bytes, at a character boundary.
pub fn bounded(s: &str) -> String {
    cut_at(s, MAX_ATTRIBUTE)
}

fn cut_at(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_span_error_keeps_no_url_query_and_a_chosen_name_is_bounded() {
        let said = super::cut("http: request failed: error sending request for url (http://127.0.0.1:9/x?token=s3cret)");
        assert!(!said.contains("s3cret") && said.contains("127.0.0.1:9/x"), "{said}");
        let long = "m".repeat(5000);
        assert_eq!(super::bounded(&long).len(), super::MAX_ATTRIBUTE);
        assert_eq!(super::bounded("é".repeat(100).as_str()).len(), 128, "cut at a character boundary");
    }
}
