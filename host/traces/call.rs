//! What the span of an effect a segment performs says: its kind and
//! attributes, read from the checked request before the call and from its
//! outcome after. Only the runtime's `perform_timed` reports one, so a
//! replayed or refused call has none.

use crate::effects::{Effect, EffectError, Remote};
use crate::store::LocalOp;
use super::{Kind, SegmentTrace, Value, bounded, now_ns};

/// A span begun: the call's start and what its request says.
pub struct Begun {
    start_ns: u64,
    kind: Kind,
    attributes: Vec<(&'static str, Value)>,
    chat: bool,
}

impl Begun {
    /// `None` for a `kv.put`: it is held, and reported when written.
    pub fn of(effect: &Effect, reissue: bool) -> Option<Begun> {
        let mut attributes = vec![("leasehold.reissue", reissue.into())];
        let (kind, chat) = match effect {
            Effect::Local(op) => {
                let op = match op {
                    LocalOp::KvGet { .. } => "get",
                    LocalOp::KvPut { .. } => return None,
                    LocalOp::Record { .. } => "record",
                    LocalOp::TakeInput { .. } => "take-input",
                };
                attributes.push(("leasehold.op", op.into()));
                (Kind::Internal, false)
            }
            Effect::Remote(Remote::Http { request, .. }) => {
                attributes.push(("http.request.method", request.method().into()));
                if let Ok(url) = url::Url::parse(request.url()) {
                    attributes.push(("server.address", url.host_str().unwrap_or_default().into()));
                    if let Some(port) = url.port_or_known_default() {
                        attributes.push(("server.port", i64::from(port).into()));
                    }
                    attributes.push(("url.scheme", url.scheme().into()));
                }
                (Kind::Client, false)
            }
            Effect::Remote(Remote::Chat { request }) => {
                attributes.push(("gen_ai.operation.name", "chat".into()));
                attributes.push(("gen_ai.request.model", bounded(request.model()).into()));
                (Kind::Client, true)
            }
        };
        Some(Begun { start_ns: now_ns(), kind, attributes, chat })
    }

    /// Reports call `seq` with its outcome. A `denied` outcome was refused
    /// before it was performed (a budget, a quota, a policy): no span.
    pub fn report(mut self, trace: &SegmentTrace, seq: i64, name: &str, outcome: &Result<String, EffectError>) {
        let error = match outcome {
            Err(EffectError::Denied(_)) => return,
            Err(EffectError::Failed(m) | EffectError::InDoubt(m)) => Some(m.as_str()),
            Ok(_) => None,
        };
        match outcome {
            Ok(result) => {
                let v = serde_json::from_str::<serde_json::Value>(result).unwrap_or_default();
                if let Some(status) = v.get("status").and_then(|s| s.as_i64()).filter(|_| !self.chat) {
                    self.attributes.push(("http.response.status_code", status.into()));
                }
                if self.chat {
                    if let Some(model) = v.get("model").and_then(|m| m.as_str()) {
                        self.attributes.push(("gen_ai.response.model", bounded(model).into()));
                    }
                    let usage = &v["usage"];
                    let tokens = |keys: [&str; 2]| keys.iter().find_map(|k| usage.get(*k).and_then(|t| t.as_i64()));
                    if let Some(n) = tokens(["prompt_tokens", "input_tokens"]) {
                        self.attributes.push(("gen_ai.usage.input_tokens", n.into()));
                    }
                    if let Some(n) = tokens(["completion_tokens", "output_tokens"]) {
                        self.attributes.push(("gen_ai.usage.output_tokens", n.into()));
                    }
                }
            }
            // "http: HTTP 503: …": the status, where the error gives one.
            Err(e) => {
                let m = match e {
                    EffectError::Failed(m) | EffectError::InDoubt(m) | EffectError::Denied(m) => m,
                };
                if let Some(status) = m.split("HTTP ").nth(1).and_then(|r| r.get(..3)).and_then(|s| s.parse::<i64>().ok()) {
                    self.attributes.push(("http.response.status_code", status.into()));
                }
            }
        }
        trace.call(seq, name, self.kind, self.start_ns, self.attributes, error);
    }
}
