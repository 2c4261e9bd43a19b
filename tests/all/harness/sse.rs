//! One reader of server-sent events, for every test that streams.

use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::Value;

/// One event: its `id:` line, if any, and its `data:` as JSON.
pub struct SseEvent {
    pub id: Option<String>,
    pub data: Value,
}

/// Reads `resp`'s events until `until` holds for one's data (that one
/// included), up to 30 s; an error if the stream ends or times out first.
/// Frames without data (comments, keep-alives) are skipped.
pub async fn read(resp: reqwest::Response, mut until: impl FnMut(&Value) -> bool) -> Result<Vec<SseEvent>> {
    let mut body = resp.bytes_stream();
    let (mut buf, mut events) = (String::new(), Vec::new());
    let read = async {
        while let Some(chunk) = body.next().await {
            buf.push_str(&String::from_utf8_lossy(&chunk?));
            while let Some(end) = buf.find("\n\n") {
                let frame: String = buf.drain(..end + 2).collect();
                let id = frame.lines().find_map(|l| l.strip_prefix("id:")).map(|s| s.trim().to_string());
                let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data:")) else { continue };
                let data: Value = serde_json::from_str(data.trim()).with_context(|| format!("an event's data: {data:?}"))?;
                let done = until(&data);
                events.push(SseEvent { id, data });
                if done {
                    return Ok(());
                }
            }
        }
        anyhow::bail!("the stream ended first")
    };
    match tokio::time::timeout(Duration::from_secs(30), read).await {
        Ok(read) => read.map(|()| events),
        Err(_) => {
            let kinds: Vec<_> = events.iter().map(|e| e.data["kind"].to_string()).collect();
            anyhow::bail!("the stream's last event did not come within 30 s; it sent {kinds:?}")
        }
    }
}
