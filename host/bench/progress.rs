//! A progress bar for long CLI work (bench loads), on stderr.
//!
//! On a terminal it redraws one line five times a second:
//! `claim round 1 [########------------]  8000/20000  3512/s  2.3s`.
//! When stderr is not a terminal (CI logs, pipes) it prints the same text as
//! a plain line every 5 s instead, so logs stay readable.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const WIDTH: usize = 24;

/// A running bar; [`Progress::finish`] (or drop) stops it and ends the line.
pub struct Progress {
    task: Option<tokio::task::JoinHandle<()>>,
    tty: bool,
}

impl Progress {
    /// Draws `label` with `done` out of `total`, until finished. Must be
    /// called inside a Tokio runtime.
    pub fn start(label: impl Into<String>, total: u64, done: Arc<AtomicU64>) -> Progress {
        let label = label.into();
        let tty = std::io::stderr().is_terminal();
        let started = Instant::now();
        let task = tokio::spawn(async move {
            let every = if tty { Duration::from_millis(200) } else { Duration::from_secs(5) };
            loop {
                tokio::time::sleep(every).await;
                let line = render(&label, done.load(Ordering::Relaxed), total, started.elapsed());
                let mut err = std::io::stderr().lock();
                let _ = if tty { write!(err, "\r{line}\x1b[K") } else { writeln!(err, "{line}") };
                let _ = err.flush();
            }
        });
        Progress { task: Some(task), tty }
    }

    /// Stops drawing; on a terminal, clears the bar's line.
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            if self.tty {
                let _ = write!(std::io::stderr(), "\r\x1b[K");
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One line of progress: label, bar, count, rate, elapsed.
pub fn render(label: &str, done: u64, total: u64, elapsed: Duration) -> String {
    let filled = if total == 0 { WIDTH } else { (done.min(total) as usize * WIDTH) / total as usize };
    let rate = done as f64 / elapsed.as_secs_f64().max(1e-9);
    format!(
        "{label} [{}{}] {done:>w$}/{total} {rate:>6.0}/s {:>5.1}s",
        "#".repeat(filled),
        "-".repeat(WIDTH - filled),
        elapsed.as_secs_f64(),
        w = total.to_string().len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_fills_the_bar_in_proportion() {
        let line = render("claim", 5_000, 20_000, Duration::from_secs(2));
        assert_eq!(line, "claim [######------------------]  5000/20000   2500/s   2.0s");
        let full = render("claim", 20_000, 20_000, Duration::from_secs(4));
        assert!(full.contains(&"#".repeat(WIDTH)), "{full}");
        let over = render("e2e", 30, 20, Duration::from_secs(1));
        assert!(over.contains(&"#".repeat(WIDTH)), "{over}");
    }
}
