//! A segment's own span (`traces`): what it says of the run and the
//! lease, reported when the segment ends, with a child span for the
//! suspension it ended with.

use super::SegmentOutcome;
use crate::store::{Claimed, StoreError};
use crate::traces::{SegmentTrace, Value};

/// What the span says of the claim, read before the segment takes it.
pub(super) struct Described {
    name: String,
    attributes: Vec<(&'static str, Value)>,
}

pub(super) fn describe(claimed: &Claimed, owner: &str) -> Described {
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

/// Reports the segment's span (and its suspension's) with its outcome.
pub(super) fn finish(trace: &SegmentTrace, described: Described, outcome: &Result<SegmentOutcome, StoreError>) {
    let Described { name, mut attributes } = described;
    if let Ok(SegmentOutcome::Suspended(status)) = outcome {
        trace.suspension(status.as_str(), trace.guest_returned_at());
    }
    let (said, error) = said(outcome);
    attributes.push(("leasehold.outcome", said.into()));
    trace.finish(name, attributes, error.as_deref());
}

/// The outcome as the segment's span and its log record say it, and the
/// error the span's status carries, if any.
pub(super) fn said(outcome: &Result<SegmentOutcome, StoreError>) -> (String, Option<String>) {
    match outcome {
        Ok(SegmentOutcome::Completed) => ("completed".to_string(), None),
        Ok(SegmentOutcome::Failed(kind)) => (format!("failed: {}", kind.as_str()), Some(format!("the turn failed: {}", kind.as_str()))),
        Ok(SegmentOutcome::Suspended(status)) => (format!("suspended: {}", status.as_str()), None),
        Ok(SegmentOutcome::LeaseLost) => ("lease_lost".to_string(), Some("the lease was lost".to_string())),
        Ok(SegmentOutcome::Abandoned(why)) => ("abandoned".to_string(), Some(format!("abandoned: {why}"))),
        Err(e) => ("abandoned".to_string(), Some(format!("abandoned: {e}"))),
    }
}
