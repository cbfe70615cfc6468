//! Processes a test runs and watches: the binaries under test, whether a pid lives, which pids
//! belong to a fleet, stopping one, its memory, and the tests that need root.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::wait::wait_until;

/// The pinned native codex binary; the test command installs it and sets `CODEX_BIN`.
pub fn codex_bin() -> PathBuf {
    match std::env::var_os("CODEX_BIN") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "CODEX_BIN is not set: run the suite with `bash ops/test.sh`, which installs the pinned \
             @openai/codex and exports the native binary's path"
        ),
    }
}

/// The `codex-fleet` binary built next to this test (the test command builds it first).
pub fn fleet_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CODEX_FLEET_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> → target/<profile>/codex-fleet
    let candidate = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("codex-fleet"))
        .expect("target dir");
    assert!(
        candidate.is_file(),
        "{} is missing: run `cargo build --bins` first (ops/test.sh does)",
        candidate.display()
    );
    candidate
}

/// Sends SIGSTOP to `pid` and waits (up to 5 s) until the kernel reports it stopped: the signal
/// is delivered asynchronously, and a process may still answer a request or two after `kill`
/// returns.
pub async fn stop_process(pid: i32) -> anyhow::Result<()> {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid), Signal::SIGSTOP)?;
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
            .unwrap_or(false)
    };
    anyhow::ensure!(
        wait_until(Duration::from_secs(5), stopped).await,
        "process {pid} never showed as stopped"
    );
    Ok(())
}

/// Whether a process exists (and is not a zombie).
pub fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // state is the field after the parenthesised command name
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            state != Some("Z")
        }
        Err(_) => false,
    }
}

/// Pids of processes whose executable is `exe`.
pub fn processes_running(exe: &Path) -> Vec<i32> {
    let Ok(target) = std::fs::canonicalize(exe) else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == target)
                && process_alive(*pid)
        })
        .collect()
}

/// Pids of every live process whose CODEX_HOME lies under `dir`: the workers of one test fleet
/// and whatever they started (the check that nothing of a fleet outlived it).
pub fn processes_under(dir: &Path) -> Vec<i32> {
    let needle = format!("CODEX_HOME={}", dir.display());
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|b| *b == 0)
                    .any(|kv| kv.starts_with(needle.as_bytes()))
            }) && process_alive(*pid)
        })
        .collect()
}

/// Pids of the workers of one test fleet: of [`processes_under`], the process-group leaders whose
/// parent is not one of them. A worker runs in its own group, started by the fleet; what a worker
/// starts (app-server's helpers, a command's shell) inherits CODEX_HOME but has a worker as its
/// parent, and is not a worker.
pub fn workers_under(dir: &Path) -> Vec<i32> {
    let all = processes_under(dir);
    all.iter()
        .copied()
        .filter(|&pid| {
            let Some((ppid, pgid)) = parent_and_group(pid) else {
                return false;
            };
            pgid == pid && !all.contains(&ppid)
        })
        .collect()
}

/// The parent pid and the process group of `pid`, from `/proc/<pid>/stat`.
fn parent_and_group(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let _state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some((ppid, pgid))
}

/// Resident memory of a process in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The variable that lets a non-root run skip the tests that need root, explicitly.
pub const SKIP_ROOT_TESTS: &str = "CODEX_FLEET_SKIP_ROOT_TESTS";

/// Whether a test that needs root should run: true as root; without root it panics (so the test
/// fails instead of passing unchecked) unless `CODEX_FLEET_SKIP_ROOT_TESTS=1` asks to skip it.
pub fn root_or_explicit_skip(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var(SKIP_ROOT_TESTS).as_deref() == Ok("1") {
        eprintln!("skipped ({SKIP_ROOT_TESTS}=1): {what} needs root");
        return false;
    }
    panic!(
        "{what} needs root and this run is not root: run the suite as root (e.g. `sudo -E bash \
         ops/test.sh`), or set {SKIP_ROOT_TESTS}=1 to skip the root-only tests knowingly"
    );
}

/// A process's open files: the entries of `/proc/<pid>/fd`.
pub fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Waits (up to 20 s) until `pid` holds at most `settled` open files again: what a hog's
/// closed sessions held is released before the next measurement starts from it.
pub async fn until_open_files_at_most(pid: u32, settled: usize) -> anyhow::Result<()> {
    let quiet = crate::wait_until(Duration::from_secs(20), || open_files(pid) <= settled).await;
    anyhow::ensure!(
        quiet,
        "the process still holds {} descriptors",
        open_files(pid)
    );
    Ok(())
}

/// A codex-fleet process's open-files limit lowered under it (`prlimit`), so that its
/// connections have `room` descriptors left above what it holds now, and the reserve
/// ([`router::descriptors::RESERVE`]) stays above those.
#[derive(Debug, Clone, Copy)]
pub struct LoweredLimit {
    /// The open-files limit, soft and hard.
    pub limit: usize,
    /// The first descriptor connections may not take.
    pub line: usize,
}

impl LoweredLimit {
    /// Lowers `pid`'s limit ([`LoweredLimit`]).
    pub fn set(pid: u32, room: usize) -> anyhow::Result<LoweredLimit> {
        let reserve = usize::try_from(router::descriptors::RESERVE)?;
        let limit = open_files(pid) + room + reserve;
        let status = std::process::Command::new("prlimit")
            .arg(format!("--pid={pid}"))
            .arg(format!("--nofile={limit}:{limit}"))
            .status()?;
        anyhow::ensure!(status.success(), "prlimit: {status}");
        Ok(LoweredLimit {
            limit,
            line: limit - reserve,
        })
    }

    /// A hog's sessions, opened one after another by `attempt` until 3 are refused, at most
    /// [`Self::limit`]: the open ones, and each refusal's text ("no answer within 3 s" when the
    /// connection waits in the listen queue). `attempt` answers `Ok(Err(text))` for a refusal;
    /// its own `Err` is a failure of the test.
    pub async fn fill<C, F, Fut>(&self, mut attempt: F) -> anyhow::Result<(Vec<C>, Vec<String>)>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<Result<C, String>>>,
    {
        let (mut open, mut refused) = (Vec::new(), Vec::new());
        for _ in 0..self.limit {
            match tokio::time::timeout(Duration::from_secs(3), attempt()).await {
                Ok(Ok(Ok(c))) => open.push(c),
                Ok(Ok(Err(answer))) => refused.push(answer),
                Ok(Err(e)) => anyhow::bail!("hog session {}: {e:#}", open.len()),
                Err(_) => refused.push("no answer within 3 s".to_owned()),
            }
            if refused.len() == 3 {
                break;
            }
        }
        Ok((open, refused))
    }

    /// With connections holding every descriptor below the line: the admin port at `admin`
    /// answers 5 liveness probes of 5 from the reserve, a scrape whose descriptor values say
    /// the process holds the line but not the whole reserve, and a readiness probe that says
    /// not ready for that reason. Returns the open descriptors the scrape read.
    pub async fn admin_answers(&self, admin: std::net::SocketAddr) -> anyhow::Result<f64> {
        for probe in 0..5 {
            let answer = tokio::time::timeout(
                Duration::from_secs(1),
                crate::client::http_get(admin, "/healthz"),
            )
            .await;
            anyhow::ensure!(
                matches!(answer, Ok(Ok((200, _)))),
                "liveness probe {probe} at the line: {answer:?}"
            );
        }
        let (status, body) = tokio::time::timeout(
            Duration::from_secs(1),
            crate::client::http_get(admin, "/metrics"),
        )
        .await??;
        anyhow::ensure!(status == 200, "/metrics at the line: {status}");
        // Not ready: new connections would wait in the listen queue.
        let (ready, detail) = tokio::time::timeout(
            Duration::from_secs(1),
            crate::client::http_get(admin, "/readyz"),
        )
        .await??;
        anyhow::ensure!(
            ready == 503 && detail.contains("no descriptors for new connections"),
            "/readyz at the line: {ready} {detail}"
        );
        let value = |name: &str| {
            body.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        };
        let open = value("process_open_fds").ok_or_else(|| anyhow::anyhow!("process_open_fds"))?;
        let max = value("process_max_fds").ok_or_else(|| anyhow::anyhow!("process_max_fds"))?;
        anyhow::ensure!(
            max == self.limit as f64,
            "process_max_fds {max}, limit {self:?}"
        );
        anyhow::ensure!(
            open >= self.line as f64 && open < self.limit as f64,
            "{open} descriptors open at {self:?}"
        );
        Ok(open)
    }
}

/// CPU time (utime + stime) a process has used so far, in seconds (`/proc/<pid>/stat`; clock
/// ticks, so 10 ms steps).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    cpu_split(pid).map(|(user, kernel)| user + kernel)
}

/// `utime` and `stime` of `/proc/<pid>/stat`, in seconds.
pub fn cpu_split(pid: u32) -> Option<(f64, f64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3; utime and stime are fields 14 and 15.
    let tick = |i: usize| f.get(i)?.parse::<u64>().ok();
    let per_sec = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()? as f64;
    Some((tick(11)? as f64 / per_sec, tick(12)? as f64 / per_sec))
}
