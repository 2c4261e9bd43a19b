//! Trace and span ids, derived, never drawn at random, and W3C
//! `traceparent` headers.
//!
//! A run's trace id is its submitter's (a `traceparent` given on submit,
//! or its parent run's), else a hash of (database, run). A segment's span
//! id is a hash of (database, run, fence), and a call's of (database, run,
//! seq, fence): the fence is the call's attempt. So two hosts that export
//! the same segment's spans give them the same ids, and a segment that
//! resumes a dead one (a higher fence) never repeats the ids the dead one
//! exported. The database id keeps runs of two deployments apart.

use sha2::{Digest, Sha256};

/// A 16-byte trace id, never all zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// An 8-byte span id, never all zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl std::fmt::Display for SpanId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// A W3C trace context: a trace and the span in it that is the parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace: TraceId,
    pub span: SpanId,
    /// The `sampled` flag. Spans are exported either way: the flag is
    /// passed on, not obeyed (a collector samples).
    pub sampled: bool,
}

impl Parent {
    /// Reads a `traceparent` header: `00-<32 hex>-<16 hex>-<2 hex>`, lower
    /// case, ids not all zeros. A later version's header is read by its
    /// first four fields, as the spec asks. `None` for anything else: the
    /// spec says to start a new trace then, not to refuse the request.
    pub fn parse(header: &str) -> Option<Parent> {
        let header = header.trim();
        let mut parts = header.splitn(5, '-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let rest = parts.next();
        let lower_hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !lower_hex(version, 2) || version == "ff" || !lower_hex(trace, 32) || !lower_hex(span, 16) || !lower_hex(flags, 2) {
            return None;
        }
        // Version 00 has exactly four fields.
        if version == "00" && rest.is_some() {
            return None;
        }
        let mut t = [0u8; 16];
        let mut s = [0u8; 8];
        hex::decode_to_slice(trace, &mut t).ok()?;
        hex::decode_to_slice(span, &mut s).ok()?;
        if t == [0; 16] || s == [0; 8] {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Parent { trace: TraceId(t), span: SpanId(s), sampled: flags & 1 == 1 })
    }

    /// The header, version 00.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{:02x}", self.trace, self.span, u8::from(self.sampled))
    }
}

fn hash(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        // Length-prefixed, so no two part lists hash alike.
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// The trace of a run that was given none: from (database, run).
pub fn run_trace(database: &str, run: i64) -> TraceId {
    let h = hash(&[b"leasehold/trace", database.as_bytes(), &run.to_le_bytes()]);
    let mut id = [0u8; 16];
    id.copy_from_slice(&h[..16]);
    if id == [0; 16] {
        id[15] = 1;
    }
    TraceId(id)
}

/// The span of a run's segment under `fence`.
pub fn segment_span(database: &str, run: i64, fence: i64) -> SpanId {
    span(hash(&[b"leasehold/segment", database.as_bytes(), &run.to_le_bytes(), &fence.to_le_bytes()]))
}

/// The span of a run's call `seq`, performed by the segment under `fence`.
pub fn call_span(database: &str, run: i64, seq: i64, fence: i64) -> SpanId {
    span(hash(&[b"leasehold/call", database.as_bytes(), &run.to_le_bytes(), &seq.to_le_bytes(), &fence.to_le_bytes()]))
}

/// The span of the suspension a segment under `fence` ended with.
pub fn suspension_span(database: &str, run: i64, fence: i64) -> SpanId {
    span(hash(&[b"leasehold/suspend", database.as_bytes(), &run.to_le_bytes(), &fence.to_le_bytes()]))
}

fn span(h: [u8; 32]) -> SpanId {
    let mut id = [0u8; 8];
    id.copy_from_slice(&h[..8]);
    if id == [0; 8] {
        id[7] = 1;
    }
    SpanId(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_reads_back_as_it_was_written() {
        let h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = Parent::parse(h).expect("valid");
        assert!(p.sampled);
        assert_eq!(p.header(), h);
        let later = Parent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra").expect("a later version");
        assert_eq!(later.header(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
    }

    #[test]
    fn a_malformed_traceparent_is_no_parent() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1x",
        ] {
            assert_eq!(Parent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ids_depend_on_every_part_and_on_nothing_else() {
        assert_eq!(call_span("db", 7, 3, 2), call_span("db", 7, 3, 2));
        let all = [
            call_span("db", 7, 3, 2),
            call_span("db", 7, 3, 3),
            call_span("db", 7, 4, 2),
            call_span("db", 8, 3, 2),
            call_span("dc", 7, 3, 2),
            segment_span("db", 7, 2),
            suspension_span("db", 7, 2),
        ];
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len());
        assert_ne!(run_trace("db", 7), run_trace("db", 8));
        assert_ne!(run_trace("db", 7), run_trace("dc", 7));
    }
}
