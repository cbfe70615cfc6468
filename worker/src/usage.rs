//! What a worker's process group uses, read from `/proc`: resident memory and CPU time of every
//! process in the group (the app-server and the commands it runs), for the capacity metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One sample of a process group.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// Resident memory of the group's live processes, in bytes.
    pub rss_bytes: u64,
    /// CPU time of the group's live processes, and of the children its leader has reaped, in
    /// seconds.
    pub cpu_secs: f64,
}

/// Clock ticks per second and page size, read once.
fn units() -> (f64, u64) {
    static UNITS: OnceLock<(f64, u64)> = OnceLock::new();
    *UNITS.get_or_init(|| {
        use nix::unistd::{sysconf, SysconfVar};
        let ticks = sysconf(SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100);
        let page = sysconf(SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .unwrap_or(4096);
        (ticks as f64, u64::try_from(page).unwrap_or(4096))
    })
}

/// The fields of `/proc/<pid>/stat` this module reads.
#[derive(Debug, PartialEq)]
struct Stat {
    pgrp: i64,
    /// utime + stime, in ticks.
    own_ticks: u64,
    /// cutime + cstime (reaped children), in ticks.
    children_ticks: u64,
    /// Resident pages.
    rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`: fields after the command (which may hold spaces and parentheses),
/// numbered as in proc(5).
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state); field n is f[n - 3].
    let num = |n: usize| f.get(n - 3)?.parse::<i64>().ok();
    let tick = |n: usize| num(n).and_then(|v| u64::try_from(v).ok());
    Some(Stat {
        pgrp: num(5)?,
        own_ticks: tick(14)? + tick(15)?,
        children_ticks: tick(16)? + tick(17)?,
        rss_pages: tick(24)?,
    })
}

/// How old a scan of `/proc` may be when a group is sampled from it. Every worker's health probe
/// samples its group, and a scan reads the `stat` of every process on the machine: one scan per
/// sample made the cost grow with the square of the workers (100 workers probed every 10 s took
/// 10 scans a second, each reading every worker's `stat` and more). One scan a second serves
/// them all.
const SCAN_MAX_AGE: Duration = Duration::from_secs(1);

/// What one group's processes used, summed over one scan.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct GroupTicks {
    /// CPU ticks of the live members, and the reaped children's of the leader.
    ticks: u64,
    rss_pages: u64,
}

/// One pass over `/proc`, summed by process group.
struct Scan {
    at: Instant,
    groups: HashMap<i64, GroupTicks>,
}

/// Scans of `/proc` shared by every sample taken within [`SCAN_MAX_AGE`] of one.
struct ProcTable {
    max_age: Duration,
    last: Mutex<Option<Scan>>,
    /// Scans taken, for the tests.
    scans: AtomicU64,
}

// === impl ProcTable ===

impl ProcTable {
    const fn new(max_age: Duration) -> Self {
        Self {
            max_age,
            last: Mutex::new(None),
            scans: AtomicU64::new(0),
        }
    }

    /// The group led by `pgid` as of a scan no older than `max_age` at `now` (taken now if
    /// there is none). Callers meanwhile wait for that scan rather than take their own.
    fn usage(&self, pgid: u32, now: Instant) -> Usage {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = last
            .as_ref()
            .is_some_and(|scan| now.saturating_duration_since(scan.at) < self.max_age);
        if !fresh {
            self.scans.fetch_add(1, Ordering::Relaxed);
            *last = Some(Scan {
                at: now,
                groups: scan_groups(),
            });
        }
        let group = last
            .as_ref()
            .and_then(|scan| scan.groups.get(&i64::from(pgid)).copied())
            .unwrap_or_default();
        let (ticks, page) = units();
        Usage {
            rss_bytes: group.rss_pages.saturating_mul(page),
            cpu_secs: group.ticks as f64 / ticks,
        }
    }
}

/// Every process's `stat`, summed by process group.
fn scan_groups() -> HashMap<i64, GroupTicks> {
    let mut groups: HashMap<i64, GroupTicks> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return groups;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue; // gone meanwhile
        };
        let Some(stat) = parse_stat(&text) else {
            continue;
        };
        let group = groups.entry(stat.pgrp).or_default();
        group.ticks += stat.own_ticks;
        group.rss_pages += stat.rss_pages;
        if i64::from(pid) == stat.pgrp {
            group.ticks += stat.children_ticks;
        }
    }
    groups
}

/// The machine's scans, shared by every pool.
static TABLE: ProcTable = ProcTable::new(SCAN_MAX_AGE);

/// Samples the process group led by `pgid` (the worker runs in its own group), from a scan of
/// `/proc` at most `SCAN_MAX_AGE` old.
pub fn group_usage(pgid: u32) -> Usage {
    TABLE.usage(pgid, Instant::now())
}

/// [`group_usage`] on tokio's blocking pool. A scan reads every process's `stat` (milliseconds on
/// a machine with many processes), and a sample waits for a scan another pool is taking: neither
/// may hold a thread that serves sessions. One sample at a time is handed to the pool; the others
/// wait here, as tasks: every worker of a fleet that started together samples at once, and each
/// would otherwise hold a blocking thread of its own while one of them scans. An error only if
/// the sampling task panicked.
pub async fn sample(pgid: u32) -> Result<Usage, tokio::task::JoinError> {
    static ONE_AT_A_TIME: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let _turn = ONE_AT_A_TIME.acquire().await;
    tokio::task::spawn_blocking(move || group_usage(pgid)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_past_a_command_with_spaces_and_parentheses() {
        let text = "4242 (codex (app) server) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    150 50 7 3 20 0 12 0 5000 1000000 2560 18446744073709551615";
        assert_eq!(
            parse_stat(text),
            Some(Stat {
                pgrp: 4242,
                own_ticks: 200,
                children_ticks: 10,
                rss_pages: 2560,
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_group_uses_memory_and_time() {
        let pgid = nix::unistd::getpgrp().as_raw() as u32;
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        let u = group_usage(pgid);
        assert!(u.rss_bytes > 1 << 20, "{u:?}");
        assert!(u.cpu_secs > 0.0, "{u:?}");
    }

    /// Spins until this process has used `spent` more CPU time (user and system), however
    /// busy the machine is and however the loop is optimized.
    fn burn_cpu(spent: Duration) {
        use nix::sys::resource::{getrusage, UsageWho};
        let used = || {
            let u = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
            let micros = |t: nix::sys::time::TimeVal| {
                Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
            };
            micros(u.user_time()) + micros(u.system_time())
        };
        let start = used();
        let mut x = 0u64;
        while used() - start < spent {
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_add(i * i));
            }
        }
    }

    /// Holds the machine's table on another thread, as a long scan would, until told to release
    /// it; the thread answers whether it was told within 5 s.
    fn hold_the_table() -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<bool>) {
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _scanning = TABLE.last.lock().unwrap_or_else(|e| e.into_inner());
            held_tx.send(()).expect("test alive");
            release_rx.recv_timeout(Duration::from_secs(5)).is_ok()
        });
        held_rx.recv().expect("holder");
        (release_tx, holder)
    }

    /// While a scan holds the table (on another thread here), a sample waits for it off the
    /// runtime: the runtime's only thread goes on running other tasks meanwhile.
    #[tokio::test(flavor = "current_thread")]
    async fn a_sample_waiting_for_a_scan_leaves_the_runtime_thread_free() {
        let pgid = nix::unistd::getpgrp().as_raw() as u32;
        // Released by the test's task, which can only run if the sample left its thread free.
        let (release_tx, holder) = hold_the_table();
        let sampling = tokio::spawn(sample(pgid));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!sampling.is_finished(), "the sample waits for the scan");
        release_tx.send(()).expect("holder waits");
        assert!(
            holder.join().expect("holder"),
            "the runtime's thread was held while the sample waited"
        );
        let usage = sampling.await.expect("sampled").expect("no panic");
        assert!(usage.rss_bytes > 0, "{usage:?}");
    }

    /// Threads of this process, from `/proc/self/status`.
    fn threads() -> usize {
        std::fs::read_to_string("/proc/self/status")
            .expect("status")
            .lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("Threads:")
    }

    /// Many samples waiting for one scan hold one blocking thread between them, not one each.
    #[tokio::test(flavor = "current_thread")]
    async fn samples_waiting_for_a_scan_hold_one_thread_between_them() {
        let pgid = nix::unistd::getpgrp().as_raw() as u32;
        let (release_tx, holder) = hold_the_table();
        let before = threads();
        let waiting: Vec<_> = (0..100).map(|_| tokio::spawn(sample(pgid))).collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let during = threads();
        release_tx.send(()).expect("holder waits");
        holder.join().expect("holder");
        for w in waiting {
            w.await.expect("task").expect("sampled");
        }
        // Other tests of this binary start threads meanwhile: the margin is theirs.
        assert!(
            during < before + 20,
            "{before} threads before, {during} while 100 samples waited"
        );
    }

    /// Samples within the scan's age share it; the first after it takes a new one, which sees
    /// what the group did meanwhile.
    #[test]
    fn samples_within_a_scans_age_share_it() {
        let table = ProcTable::new(Duration::from_secs(1));
        let pgid = nix::unistd::getpgrp().as_raw() as u32;
        let t0 = Instant::now();
        let first = table.usage(pgid, t0);
        assert!(first.rss_bytes > 0, "{first:?}");
        burn_cpu(Duration::from_millis(50));
        let shared = table.usage(pgid, t0 + Duration::from_millis(900));
        assert_eq!(table.scans.load(Ordering::Relaxed), 1);
        assert_eq!(shared, first, "a sample within the age reads the same scan");
        // Another group is read from the same scan, and one with no process is empty.
        table.usage(1, t0 + Duration::from_millis(950));
        assert_eq!(table.usage(u32::MAX, t0), Usage::default());
        assert_eq!(table.scans.load(Ordering::Relaxed), 1);
        let later = table.usage(pgid, t0 + Duration::from_secs(1));
        assert_eq!(table.scans.load(Ordering::Relaxed), 2);
        assert!(later.cpu_secs > first.cpu_secs, "{first:?} then {later:?}");
    }
}
