//! Who holds SQLite's write lock, sampled from `/proc/locks`: the chaos
//! suite's witness when every host waits on the lock at once.
//!
//! In WAL mode a connection holds the write lock as a POSIX lock on one
//! byte of the `-shm` file (byte 120: SQLite's `UNIX_SHM_BASE` plus
//! `WAL_WRITE_LOCK`), taken for the process that owns the connection. So
//! `/proc/locks` names the process, and its threads' state and kernel
//! wait channel say whether it is writing, syncing or idle inside an open
//! transaction. Reading it takes no lock on the database.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The byte of the `-shm` file that SQLite's unix VFS locks for the WAL
/// write lock.
const WAL_WRITE_LOCK_BYTE: &str = "120";

/// One hold of the write lock longer than the threshold.
#[derive(Debug, Clone)]
pub struct Stall {
    pub pid: u32,
    /// Epoch ms (the SQLite hosts' database clock is this machine's) when
    /// the hold was first seen, and how long it lasted.
    pub since_ms: i64,
    pub held_ms: i64,
    /// The holder's threads once the hold passed the threshold (see
    /// [`threads_of`]).
    pub threads: String,
}

pub struct LockWatch {
    stalls: Arc<Mutex<Vec<Stall>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LockWatch {
    /// Samples every 20 ms who holds the write lock of the database at
    /// `db_file`; a hold of one process longer than `threshold` is kept.
    pub fn start(db_file: &Path, threshold: Duration) -> std::io::Result<LockWatch> {
        use std::os::unix::fs::MetadataExt;
        let shm = db_file.with_file_name(format!("{}-shm", db_file.file_name().unwrap_or_default().to_string_lossy()));
        let inode = std::fs::metadata(&shm)?.ino();
        let stalls = Arc::new(Mutex::new(Vec::new()));
        let kept = stalls.clone();
        let task = tokio::spawn(async move {
            // (pid, first seen, threads once past the threshold)
            let mut hold: Option<(u32, i64, Option<String>)> = None;
            loop {
                let holder = std::fs::read_to_string("/proc/locks").ok().and_then(|t| write_holder(&t, inode));
                let now = epoch_ms();
                match (&mut hold, holder) {
                    (Some((pid, _, _)), Some(p)) if *pid == p => {}
                    (current, holder) => {
                        if let Some((pid, since, Some(threads))) = current.take() {
                            kept.lock().unwrap().push(Stall { pid, since_ms: since, held_ms: now - since, threads });
                        }
                        *current = holder.map(|p| (p, now, None));
                    }
                }
                if let Some((pid, since, threads @ None)) = &mut hold {
                    if now - *since >= threshold.as_millis() as i64 {
                        *threads = Some(threads_of(*pid));
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Ok(LockWatch { stalls, task })
    }

    /// The holds seen so far, the one going on included.
    pub fn stalls(&self) -> Vec<Stall> {
        self.stalls.lock().unwrap().clone()
    }
}

impl Drop for LockWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn epoch_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// The pid holding the write lock of the `-shm` file with `inode`, from
/// the text of `/proc/locks` (`1: POSIX ADVISORY WRITE 4242 00:2d:1234 120 120`).
fn write_holder(locks: &str, inode: u64) -> Option<u32> {
    let suffix = format!(":{inode}");
    locks.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // A blocked waiter's line starts `1: ->`; skip it.
        if f.len() < 8 || f[1] != "POSIX" || f[3] != "WRITE" {
            return None;
        }
        (f[5].ends_with(&suffix) && f[6] == WAL_WRITE_LOCK_BYTE && f[7] == WAL_WRITE_LOCK_BYTE)
            .then(|| f[4].parse().ok())
            .flatten()
    })
}

/// The threads of `pid`, grouped by `name state wchan` and counted; a
/// group that is running or in an uninterruptible wait (`R`, `D`) shows
/// one thread's kernel stack. All of SQLite's worker threads parked in a
/// futex wait while the lock is held means the transaction is open and its
/// owner awaits something else; `T` is a stopped process.
fn threads_of(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return "gone".into();
    };
    let me = format!("{}", std::process::id());
    let mut groups: std::collections::BTreeMap<String, (usize, String)> = Default::default();
    for t in tasks.flatten() {
        let dir = t.path();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default().trim().to_string();
        // The state follows the parenthesised name.
        let stat = read("stat");
        let state = stat.rsplit_once(") ").and_then(|(_, r)| r.split_whitespace().next()).unwrap_or("?").to_string();
        let stack = if state == "R" || state == "D" {
            let frames: Vec<String> = read("stack").lines().take(6).map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string()).collect();
            // This watcher reading the test's own stacks.
            if pid.to_string() == me && frames.first().is_some_and(|f| f.starts_with("proc_pid_stack")) {
                continue;
            }
            format!(" [{}]", frames.join(" < "))
        } else {
            String::new()
        };
        let group = groups.entry(format!("{} {state} {}", read("comm"), read("wchan"))).or_default();
        group.0 += 1;
        if group.1.is_empty() {
            group.1 = stack;
        }
    }
    groups.into_iter().map(|(k, (n, stack))| format!("{k} ×{n}{stack}")).collect::<Vec<_>>().join("; ")
}

#[test]
fn write_holder_reads_the_wal_write_lock_line_only() {
    let locks = "1: POSIX  ADVISORY  READ 11 00:2d:77 128 128\n\
                 2: POSIX  ADVISORY  WRITE 12 00:2d:78 120 120\n\
                 2: -> POSIX  ADVISORY  WRITE 14 00:2d:77 120 120\n\
                 3: POSIX  ADVISORY  WRITE 13 00:2d:77 120 120\n";
    assert_eq!(write_holder(locks, 77), Some(13));
    assert_eq!(write_holder(locks, 78), Some(12));
    assert_eq!(write_holder(locks, 79), None);
}
