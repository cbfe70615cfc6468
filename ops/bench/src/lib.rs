//! What every bench tool shares: finding the built binaries, running `codex-fleet` as a process,
//! reading a process's CPU time and memory, the sessions' client and the simulated fleet.

pub mod floor;
pub mod latency;
pub mod rpc;
pub mod sim;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context};
use testkit::FleetFiles;
use tokio::process::{Child, Command};

/// The binary `name` built beside the running bench binary, or the path in `env` when set.
pub fn built_bin(name: &str, env: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let candidate = std::env::current_exe()?.with_file_name(name);
    if !candidate.is_file() {
        bail!(
            "{} is missing: build it first (cargo build --release --bins), or set {env}",
            candidate.display()
        );
    }
    Ok(candidate)
}

/// `CODEX_FLEET_BIN`, or the `codex-fleet` built beside the running bench binary.
pub fn fleet_bin() -> anyhow::Result<PathBuf> {
    built_bin("codex-fleet", "CODEX_FLEET_BIN")
}

/// `CODEX_SIM_BIN`, or the `codex-app-server-sim` built beside the running bench binary.
pub fn sim_bin() -> anyhow::Result<PathBuf> {
    built_bin("codex-app-server-sim", "CODEX_SIM_BIN")
}

/// The `--fleet-bin` and `--sim-bin` flags of the tools that run codex-fleet on simulators.
#[derive(clap::Args, Debug, Clone)]
pub struct Binaries {
    /// codex-fleet binary (default: beside this tool).
    #[arg(long, env = "CODEX_FLEET_BIN")]
    fleet_bin: Option<PathBuf>,
    /// Simulator binary (default: beside this tool).
    #[arg(long, env = "CODEX_SIM_BIN")]
    sim_bin: Option<PathBuf>,
}

// === impl Binaries ===

impl Binaries {
    /// The codex-fleet binary: the flag's, or [`fleet_bin`].
    pub fn fleet(&self) -> anyhow::Result<PathBuf> {
        self.fleet_bin.clone().map_or_else(fleet_bin, Ok)
    }

    /// The simulator binary: the flag's, or [`sim_bin`].
    pub fn sim(&self) -> anyhow::Result<PathBuf> {
        self.sim_bin.clone().map_or_else(sim_bin, Ok)
    }
}

/// `codex-fleet serve` on `files`, quiet, killed on drop; with its wss and admin addresses.
pub async fn spawn_fleet(files: &FleetFiles) -> anyhow::Result<(Child, SocketAddr, SocketAddr)> {
    spawn_fleet_config(&fleet_bin()?, &files.config, "error", Stdio::inherit()).await
}

/// `bin serve --config config` at log level `log` with its stderr to `stderr`, killed on drop;
/// with its wss and admin addresses.
pub async fn spawn_fleet_config(
    bin: &Path,
    config: &Path,
    log: &str,
    stderr: Stdio,
) -> anyhow::Result<(Child, SocketAddr, SocketAddr)> {
    spawn_role_config(bin, "serve", config, log, stderr).await
}

/// The same, running `bin role --config config` (`serve`, or `node` behind an edge).
pub async fn spawn_role_config(
    bin: &Path,
    role: &str,
    config: &Path,
    log: &str,
    stderr: Stdio,
) -> anyhow::Result<(Child, SocketAddr, SocketAddr)> {
    let mut child = Command::new(bin)
        .args([role, "--config"])
        .arg(config)
        .env("CODEX_FLEET_LOG", log)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawning {}", bin.display()))?;
    let (wss, admin) = testkit::read_addresses(&mut child).await?;
    Ok((child, wss, admin))
}

/// Stops a child as an operator does: SIGTERM, up to `grace` for it to exit (a
/// profile-instrumented build writes its profile then), and SIGKILL after that. Its exit status,
/// or `None` when it had to be killed.
pub async fn terminate(
    child: &mut Child,
    grace: std::time::Duration,
) -> anyhow::Result<Option<std::process::ExitStatus>> {
    if let Some(pid) = child.id() {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(status) => Ok(Some(status?)),
        Err(_) => {
            child.kill().await?;
            Ok(None)
        }
    }
}

pub use testkit::process::{cpu_secs, cpu_split};

/// What a process has done so far: CPU seconds in its own code and in the kernel on its behalf
/// (`utime` and `stime` of `/proc/<pid>/stat`, 10 ms steps), and context switches of its live
/// threads, voluntary (it waited: a socket with nothing to read, an idle runtime thread parking)
/// and not (preempted while it could still run) from `/proc/<pid>/task/*/status`. Two samples'
/// difference says where a proxy's time per turn goes: its own work, the kernel's, or being
/// switched out and back.
#[derive(Debug, Clone, Copy, Default)]
pub struct Work {
    pub user_secs: f64,
    pub kernel_secs: f64,
    pub voluntary: u64,
    pub preempted: u64,
}

impl Work {
    /// `pid`'s counts now; `None` once it is gone (or `/proc` is not readable).
    pub fn of(pid: u32) -> Option<Self> {
        let (user_secs, kernel_secs) = cpu_split(pid)?;
        let (mut voluntary, mut preempted) = (0, 0);
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
            let status = std::fs::read_to_string(task.ok()?.path().join("status")).ok()?;
            voluntary += status_field(&status, "voluntary_ctxt_switches:")?;
            preempted += status_field(&status, "nonvoluntary_ctxt_switches:")?;
        }
        Some(Self {
            user_secs,
            kernel_secs,
            voluntary,
            preempted,
        })
    }

    /// CPU seconds, user and kernel.
    pub fn cpu_secs(&self) -> f64 {
        self.user_secs + self.kernel_secs
    }

    /// What was done between `earlier` and `self`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            user_secs: self.user_secs - earlier.user_secs,
            kernel_secs: self.kernel_secs - earlier.kernel_secs,
            voluntary: self.voluntary.saturating_sub(earlier.voluntary),
            preempted: self.preempted.saturating_sub(earlier.preempted),
        }
    }
}

/// CPU seconds every core of the machine has been busy so far (`/proc/stat`: user, nice, system,
/// irq, softirq and steal; not idle or iowait), in clock ticks' 10 ms steps. Over a phase, less
/// what the client and the proxy used, it is what everything else (here the simulators) cost.
pub fn machine_busy_secs() -> Option<f64> {
    let f = machine_ticks()?;
    // user nice system idle iowait irq softirq steal …
    ticks_secs(f.get(..3)?.iter().sum::<u64>() + f.get(5..8)?.iter().sum::<u64>())
}

/// Of [`machine_busy_secs`], what the machine spent in interrupts so far (`/proc/stat`: irq and
/// softirq, where the kernel moves packets between sockets): a kernel that accounts interrupt
/// time apart charges it to no process.
pub fn machine_irq_secs() -> Option<f64> {
    ticks_secs(machine_ticks()?.get(5..7)?.iter().sum::<u64>())
}

/// CPU seconds so far of every live process named `name` (`/proc/<pid>/comm`, which the kernel
/// cuts to 15 bytes): all the simulators, whichever path started them. From the scheduler's own
/// counts ([`cpu_micros`]): `/proc/<pid>/stat`'s times lag a process that runs in short bursts by
/// up to seconds (seen: 100 simulators' summed times standing still through a half-second phase
/// of turns, then catching up in the next).
pub fn cpu_secs_named(name: &str) -> f64 {
    let name = &name.as_bytes()[..name.len().min(15)];
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.strip_suffix(b"\n").unwrap_or(&c) == name)
        })
        .filter_map(cpu_micros)
        .sum::<f64>()
        / 1e6
}

/// The first line of `/proc/stat`: the machine's clock ticks by kind.
fn machine_ticks() -> Option<Vec<u64>> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    s.lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|v| v.parse().ok())
        .collect()
}

fn ticks_secs(ticks: u64) -> Option<f64> {
    let per_sec = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()? as f64;
    Some(ticks as f64 / per_sec)
}

/// On-CPU time of a process's live threads so far, in µs: the scheduler's own nanosecond
/// counts (`/proc/<pid>/task/*/schedstat`), precise where [`cpu_secs`] moves in 10 ms steps. A
/// thread that already ended is not counted: a proxy that ends threads during a run (tokio's
/// blocking pool lets idle ones go after 10 s) is undercounted by their time.
pub fn cpu_micros(pid: u32) -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let s = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e3)
}

/// Peak resident memory of a process in KiB (`VmHWM`; `testkit::rss_kib` reads the current one).
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&s, "VmHWM:")
}

/// The number after `name` in a `/proc/…/status` text (`VmHWM:   1234 kB` gives 1234).
fn status_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Raises this process's open-files limit to the hard limit; the hard limit.
pub fn raise_nofile() -> anyhow::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    Ok(hard)
}
