//! OTLP's protobuf encoding of an `ExportTraceServiceRequest`, written by
//! hand: the few messages a span needs are a page of wire format, where
//! a generated crate would bring a protobuf runtime into the service. The
//! suite decodes what this writes with `opentelemetry-proto`.
//!
//! Field numbers from `opentelemetry/proto/trace/v1/trace.proto`,
//! `common/v1/common.proto` and `resource/v1/resource.proto`.

use super::{Kind, Span, Value};

/// Protobuf writer: tags, varints, fixed64 and length-delimited fields.
#[derive(Default)]
struct Buf(Vec<u8>);

impl Buf {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn tag(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }

    fn uint(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.tag(field, 0);
            self.varint(v);
        }
    }

    fn fixed64(&mut self, field: u32, v: u64) {
        self.tag(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.tag(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn string(&mut self, field: u32, s: &str) {
        if !s.is_empty() {
            self.bytes(field, s.as_bytes());
        }
    }

    /// A nested message, written by `f`.
    fn message(&mut self, field: u32, f: impl FnOnce(&mut Buf)) {
        let mut inner = Buf::default();
        f(&mut inner);
        self.bytes(field, &inner.0);
    }
}

/// `KeyValue { key = 1; AnyValue value = 2 }`, `AnyValue { string = 1;
/// bool = 2; int = 3 }`.
fn key_value(b: &mut Buf, field: u32, key: &str, value: &Value) {
    b.message(field, |kv| {
        kv.string(1, key);
        kv.message(2, |v| match value {
            Value::Str(s) => v.bytes(1, s.as_bytes()),
            Value::Bool(x) => {
                v.tag(2, 0);
                v.varint(u64::from(*x));
            }
            Value::Int(i) => {
                v.tag(3, 0);
                v.varint(*i as u64);
            }
        });
    });
}

/// The request for `spans`, from one service (`resource`).
pub fn encode(resource: &[(String, Value)], scope_version: &str, spans: &[Span]) -> Vec<u8> {
    let mut req = Buf::default();
    // ExportTraceServiceRequest.resource_spans = 1
    req.message(1, |rs| {
        // ResourceSpans.resource = 1: Resource.attributes = 1
        rs.message(1, |r| {
            for (k, v) in resource {
                key_value(r, 1, k, v);
            }
        });
        // ResourceSpans.scope_spans = 2
        rs.message(2, |ss| {
            // ScopeSpans.scope = 1: InstrumentationScope { name = 1; version = 2 }
            ss.message(1, |scope| {
                scope.string(1, "leasehold");
                scope.string(2, scope_version);
            });
            for span in spans {
                ss.message(2, |s| encode_span(s, span));
            }
        });
    });
    req.0
}

fn encode_span(b: &mut Buf, span: &Span) {
    b.bytes(1, &span.trace.0);
    b.bytes(2, &span.id.0);
    if let Some(parent) = span.parent {
        b.bytes(4, &parent.0);
    }
    b.string(5, &span.name);
    let kind = match span.kind {
        Kind::Internal => 1,
        Kind::Client => 3,
        Kind::Consumer => 5,
    };
    b.uint(6, kind);
    b.fixed64(7, span.start_ns);
    b.fixed64(8, span.end_ns.max(span.start_ns));
    for (k, v) in &span.attributes {
        key_value(b, 9, k, v);
    }
    for link in &span.links {
        // Link { trace_id = 1; span_id = 2; attributes = 4 }
        b.message(13, |l| {
            l.bytes(1, &link.trace.0);
            l.bytes(2, &link.span.0);
            key_value(l, 4, "leasehold.link", &Value::Str(link.why.to_string()));
        });
    }
    // Status { message = 2; code = 3 } (1 ok, 2 error)
    b.message(15, |s| match &span.error {
        Some(message) => {
            s.string(2, message);
            s.uint(3, 2);
        }
        None => s.uint(3, 1),
    });
    // flags = 16 (fixed32): the parent is remote when it came from outside.
    // Left unset: an older receiver reads nothing of it.
}

#[cfg(test)]
mod tests {
    use super::Buf;

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let mut b = Buf::default();
        b.varint(1);
        b.varint(300);
        b.varint(u64::MAX);
        assert_eq!(&b.0[..3], &[1, 0xac, 0x02]);
        assert_eq!(b.0.len(), 3 + 10);
    }
}
