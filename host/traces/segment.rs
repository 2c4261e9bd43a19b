//! A segment's own span: what it says of the run and the lease, reported
//! when the segment ends, with a child span for the suspension it ended
//! with.

use super::{SegmentTrace, Value};
use crate::store::Claimed;

/// What the span says of the claim, read before the segment takes it.
pub struct Described {
    name: String,
    attributes: Vec<(&'static str, Value)>,
}

pub fn describe(claimed: &Claimed, owner: &str) -> Described {
    let run = &claimed.run;
    let mut attributes = vec![
        ("leasehold.run_id", run.id.into()),
        ("leasehold.plugin", run.plugin.as_str().into()),
        ("leasehold.plugin_digest", run.plugin_digest.as_str().into()),
        ("leasehold.fence", claimed.lease.fence.into()),
        ("leasehold.attempt", run.attempt.into()),
        ("leasehold.owner", owner.into()),
        ("leasehold.thread_id", run.thread_id.as_str().into()),
    ];
    if let Some(parent) = run.parent_id {
        attributes.push(("leasehold.parent_run_id", parent.into()));
    }
    Described { name: format!("segment {}", run.plugin), attributes }
}

/// Reports the segment's span with its outcome as the executor says it
/// (`said`, and the error its status carries), and the span of the
/// suspension it ended with (`suspended`: the run's status), if it did.
pub fn finish(trace: &SegmentTrace, described: Described, suspended: Option<&str>, said: &str, error: Option<&str>) {
    let Described { name, mut attributes } = described;
    if let Some(status) = suspended {
        trace.suspension(status, trace.guest_returned_at());
    }
    attributes.push(("leasehold.outcome", said.into()));
    trace.finish(name, attributes, error);
}
