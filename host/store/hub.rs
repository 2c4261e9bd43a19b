//! In-process wake-ups for readers of thread logs (event streams): every
//! write that appends events wakes the streams watching its thread, so an
//! open stream costs no database reads while nothing happens. Events other
//! hosts write are found by one poll per host for all watched threads
//! (`Store::thread_heads`), not by each stream. And a pause made on this
//! host reaches a segment of its run running here at once (`store::pause`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// The threads event streams are watching.
#[derive(Debug, Default)]
pub struct Hub {
    threads: Mutex<HashMap<String, Watched>>,
    /// Streams open: a write skips the lock while there are none.
    open: AtomicUsize,
    /// The pause flags of the segments running on this host, by run.
    segments: Mutex<HashMap<i64, Arc<AtomicBool>>>,
    /// Runs paused on this host while leased (claimed for a local queue,
    /// their segment not started): a segment that starts looks here.
    paused_leased: Mutex<std::collections::HashSet<i64>>,
    /// How many: a segment's start skips the lock while there are none.
    paused_count: AtomicUsize,
}

/// A segment registered with [`Hub::running`]; dropped, it is not.
pub struct Running<'a> {
    hub: &'a Hub,
    run_id: i64,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.hub.segments.lock().expect("hub lock").remove(&self.run_id);
    }
}

#[derive(Debug)]
struct Watched {
    /// Bumped on each wake-up; streams wait for it to change.
    version: watch::Sender<u64>,
    streams: usize,
    /// The thread's last event seq the host poll saw (other hosts' writes).
    seen: Option<i64>,
}

/// One stream's watch on a thread; dropped, it stops watching.
pub struct Watch<'a> {
    hub: &'a Hub,
    thread: String,
    version: watch::Receiver<u64>,
}

impl Hub {
    /// Starts watching `thread`.
    pub fn watch(&self, thread: &str) -> Watch<'_> {
        let mut threads = self.threads.lock().expect("hub lock");
        let entry = threads.entry(thread.to_string()).or_insert_with(|| Watched {
            version: watch::channel(0).0,
            streams: 0,
            seen: None,
        });
        entry.streams += 1;
        self.open.fetch_add(1, Ordering::SeqCst);
        Watch { hub: self, thread: thread.to_string(), version: entry.version.subscribe() }
    }

    /// Wakes the streams watching `thread`: it has new events.
    pub fn wake(&self, thread: &str) {
        if self.open.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(w) = self.threads.lock().expect("hub lock").get(thread) {
            w.version.send_modify(|v| *v += 1);
        }
    }

    /// Registers a segment of run `run_id` running on this host, whose
    /// guest stops at its next slice point once `paused` is set: a pause
    /// made on this host sets it at once ([`Hub::paused`]); one made
    /// elsewhere reaches it with the segment's next renewal.
    pub fn running(&self, run_id: i64, paused: Arc<AtomicBool>) -> Running<'_> {
        self.segments.lock().expect("hub lock").insert(run_id, paused);
        Running { hub: self, run_id }
    }

    /// Run `run_id` was paused (`true`) or resumed on this host: tells its
    /// segment running here, if one is.
    pub(crate) fn paused(&self, run_id: i64, paused: bool) {
        if let Some(flag) = self.segments.lock().expect("hub lock").get(&run_id) {
            flag.store(paused, Ordering::Relaxed);
        }
    }

    /// Run `run_id`, leased, was paused on this host: its segment, if one
    /// starts here, gives it back before its guest starts.
    pub(crate) fn paused_leased(&self, run_id: i64) {
        if self.paused_leased.lock().expect("hub lock").insert(run_id) {
            self.paused_count.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Forgets run `run_id`'s pause (resumed, or given back).
    pub(crate) fn forget_paused(&self, run_id: i64) {
        if self.paused_count.load(Ordering::SeqCst) == 0 {
            return;
        }
        if self.paused_leased.lock().expect("hub lock").remove(&run_id) {
            self.paused_count.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether run `run_id` was paused on this host while leased.
    pub fn was_paused(&self, run_id: i64) -> bool {
        self.paused_count.load(Ordering::SeqCst) > 0 && self.paused_leased.lock().expect("hub lock").contains(&run_id)
    }

    /// The threads watched now.
    pub fn watched(&self) -> Vec<String> {
        if self.open.load(Ordering::SeqCst) == 0 {
            return Vec::new();
        }
        self.threads.lock().expect("hub lock").keys().cloned().collect()
    }

    /// What the host poll read: each thread's last event seq. Wakes the
    /// streams of threads that moved on since it last looked (or that it
    /// had not looked at yet).
    pub fn heads(&self, heads: &[(String, i64)]) {
        let mut threads = self.threads.lock().expect("hub lock");
        for (thread, seq) in heads {
            if let Some(w) = threads.get_mut(thread)
                && w.seen != Some(*seq)
            {
                w.seen = Some(*seq);
                w.version.send_modify(|v| *v += 1);
            }
        }
    }
}

impl Watch<'_> {
    /// Waits until the thread may have new events (a wake-up since the last
    /// call, or since the watch began).
    pub async fn changed(&mut self) {
        if self.version.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let mut threads = self.hub.threads.lock().expect("hub lock");
        if let Some(w) = threads.get_mut(&self.thread) {
            w.streams -= 1;
            if w.streams == 0 {
                threads.remove(&self.thread);
            }
        }
        self.hub.open.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_write_wakes_the_streams_of_its_thread_only() {
        let hub = Hub::default();
        let mut a = hub.watch("a");
        let mut b = hub.watch("b");
        hub.wake("a");
        tokio::time::timeout(std::time::Duration::from_secs(5), a.changed()).await.expect("a woken");
        let woken = tokio::time::timeout(std::time::Duration::from_millis(50), b.changed()).await;
        assert!(woken.is_err(), "b was woken by a's write");
        drop((a, b));
        assert!(hub.watched().is_empty());
    }
}
