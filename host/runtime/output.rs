//! The guest's stdout and stderr, kept for a failed run's error.

use super::text::storable;

/// The guest's stdout and stderr, together: only the last
/// [`OUTPUT_TAIL`] bytes are kept, the rest is dropped without the guest
/// seeing an error, so a chatty guest runs as it would with a terminal.
/// A failed run's error ends with it: a Rust panic's message, a Python
/// traceback. Not recorded and not replayed.
#[derive(Clone, Default)]
pub(crate) struct GuestOutput(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

/// How much of the guest's output a failed run's error shows: 4 KiB.
pub const OUTPUT_TAIL: usize = 4096;

impl GuestOutput {
    /// The kept output, as text (`None` when the guest wrote nothing).
    pub(crate) fn tail(&self) -> Option<String> {
        let buf = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let start = buf.len().saturating_sub(OUTPUT_TAIL);
        let text = String::from_utf8_lossy(&buf[start..]).trim_end().to_string();
        (!text.is_empty()).then(|| storable(text))
    }
}

impl wasmtime_wasi::cli::IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for GuestOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl tokio::io::AsyncWrite for GuestOutput {
    fn poll_write(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>, data: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let mut buf = self.0.lock().unwrap_or_else(|e| e.into_inner());
        buf.extend_from_slice(data);
        // Bounded: keep twice the tail at most, so trimming is rare.
        if buf.len() > 2 * OUTPUT_TAIL {
            let cut = buf.len() - OUTPUT_TAIL;
            buf.drain(..cut);
        }
        std::task::Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}
