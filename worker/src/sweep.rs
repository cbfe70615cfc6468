//! Ends every process left under a tenant's uid once the tenant has no worker.
//!
//! A worker's process group is signalled when it stops, but a descendant that called `setsid` (a
//! daemon a model's command started) has left the group and would live on. With per-tenant uids,
//! every process of that uid belongs to the tenant's workers, so when the last one is gone the
//! uid's processes are its leftovers.
//!
//! The pids are read from `/proc` first and killed later, and in between a listed process can
//! exit and its pid go to an unrelated process (another tenant's worker, a host daemon). So each
//! kill opens a pidfd for the pid, then reads the uid again, then signals through the pidfd. The
//! pidfd pins one process, and the uid read after it is that process's unless it has exited
//! (and the pid been reused), in which case the signal fails with `ESRCH`: nobody else is hit.
//! One pidfd is open at a time, as a tenant can leave thousands of processes and the fd limit is
//! shared with the router's connections. Without pidfds (Linux before 5.3) the kill goes by pid
//! after the same uid check, which narrows the window but cannot close it.

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{debug, warn};

/// The processes found under one uid: killed only if they still have it ([`kill_all`]).
#[derive(Debug)]
pub(crate) struct Leftovers {
    uid: u32,
    pids: Vec<Pid>,
}

// === impl Leftovers ===

impl Leftovers {
    /// Whether no process of the uid was found.
    pub(crate) fn is_empty(&self) -> bool {
        self.pids.is_empty()
    }
}

/// Processes whose real, effective, saved or filesystem uid is `uid`, from `/proc`.
pub(crate) fn processes_of(uid: u32) -> Leftovers {
    let own = std::process::id();
    let pids = match fs::read_dir("/proc") {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| pid != own)
            .filter_map(|pid| i32::try_from(pid).ok().map(Pid::from_raw))
            .filter(|&pid| has_uid(pid, uid))
            .collect(),
        Err(_) => Vec::new(),
    };
    Leftovers { uid, pids }
}

/// Whether `pid`'s real, effective, saved or filesystem uid is `uid` now; `false` once it is gone.
fn has_uid(pid: Pid, uid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| status_uids(&status))
        .is_some_and(|uids| uids.contains(&uid))
}

/// The four uids of a `/proc/PID/status` `Uid:` line.
fn status_uids(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace()
        .skip(1)
        .map(|u| u.parse().ok())
        .collect()
}

/// SIGKILLs those of `leftovers` that still have its uid; returns how many were still there and
/// killed.
pub(crate) fn kill_all(leftovers: &Leftovers) -> usize {
    let mut killed = 0;
    for &pid in &leftovers.pids {
        match kill_leftover(pid, leftovers.uid) {
            Ok(true) => killed += 1,
            Ok(false) => {}
            Err(e) => warn!(%pid, error = %e, "cannot kill a leftover process"),
        }
    }
    debug!(killed, "leftover processes killed");
    killed
}

/// SIGKILLs `pid` if it still has `uid`; returns whether it did (`false`: gone, or not the uid's).
fn kill_leftover(pid: Pid, uid: u32) -> Result<bool, Errno> {
    let sent = match PidFd::open(pid) {
        // The uid read now is the pinned process's, unless that one has exited and the pid been
        // reused: then the signal fails with ESRCH.
        Ok(pidfd) => {
            if !has_uid(pid, uid) {
                return Ok(false);
            }
            match pidfd.kill() {
                // A seccomp filter that lets pidfd_open through but not the signal.
                Err(Errno::EPERM | Errno::ENOSYS) => kill_by_pid(pid, uid),
                sent => sent,
            }
        }
        // Gone, or (EINVAL) the pid is now a thread's, not a process's.
        Err(Errno::ESRCH | Errno::EINVAL) => return Ok(false),
        // No pidfds: ENOSYS before Linux 5.3; EPERM from a seccomp filter that predates them
        // (pidfd_open itself never fails with EPERM). No fd to spare: EMFILE, ENFILE, ENOMEM
        // near the fd limit. Kill by pid, as before pidfds.
        Err(Errno::ENOSYS | Errno::EPERM | Errno::EMFILE | Errno::ENFILE | Errno::ENOMEM) => {
            kill_by_pid(pid, uid)
        }
        Err(e) => return Err(e),
    };
    match sent {
        Ok(()) => Ok(true),
        Err(Errno::ESRCH) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `kill(pid, SIGKILL)` after the same uid check: a pid reused between the check and the kill is
/// still hit, in a far narrower window than since the scan. `ESRCH` when it no longer has `uid`.
fn kill_by_pid(pid: Pid, uid: u32) -> Result<(), Errno> {
    if !has_uid(pid, uid) {
        return Err(Errno::ESRCH);
    }
    kill(pid, Signal::SIGKILL)
}

/// A process pinned by a pidfd: its pid may be reused once it exits, the pidfd's target not.
/// Closed on drop.
struct PidFd(OwnedFd);

// === impl PidFd ===

impl PidFd {
    /// `pidfd_open(pid, 0)`; the fd is close-on-exec, so a worker spawned meanwhile gets none.
    fn open(pid: Pid) -> Result<Self, Errno> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is passed.
        #[allow(unsafe_code)]
        let fd = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_pidfd_open,
                pid.as_raw(),
                0 as nix::libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(Errno::last());
        }
        let fd = RawFd::try_from(fd).map_err(|_| Errno::EBADF)?;
        // SAFETY: `fd` was just returned by pidfd_open, is open, and is owned by nothing else.
        #[allow(unsafe_code)]
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self(fd))
    }

    /// `pidfd_send_signal(fd, SIGKILL, NULL, 0)`: `ESRCH` once the pinned process has exited.
    fn kill(&self) -> Result<(), Errno> {
        // SAFETY: the fd is open for the call's length (borrowed from `self`); a null siginfo
        // asks the kernel to fill it in as kill(2) would; no other memory is passed.
        #[allow(unsafe_code)]
        let sent = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                nix::libc::SIGKILL,
                std::ptr::null::<nix::libc::siginfo_t>(),
                0 as nix::libc::c_uint,
            )
        };
        if sent < 0 {
            return Err(Errno::last());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Child, Command};

    use super::*;

    fn sleeper() -> (Child, Pid) {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        (child, pid)
    }

    fn me() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn reads_all_four_uids() {
        let status = "Name:\tsleep\nUid:\t1000\t1001\t1002\t1003\nGid:\t5\t5\t5\t5\n";
        assert_eq!(status_uids(status), Some(vec![1000, 1001, 1002, 1003]));
        assert_eq!(status_uids("Name: x\n"), None);
    }

    #[test]
    fn finds_this_processes_children_by_uid() {
        let (mut child, pid) = sleeper();
        let found = processes_of(me());
        assert!(found.pids.contains(&pid));
        let own = Pid::from_raw(i32::try_from(std::process::id()).unwrap());
        assert!(!found.pids.contains(&own));
        let leftovers = Leftovers {
            uid: me(),
            pids: vec![pid],
        };
        assert_eq!(kill_all(&leftovers), 1);
        assert_eq!(child.wait().unwrap().signal(), Some(Signal::SIGKILL as i32));
    }

    /// The check at kill time: a pid whose process no longer has the uid (as after reuse by
    /// another's process) is left alone.
    #[test]
    fn spares_a_process_without_the_uid() {
        let (mut child, pid) = sleeper();
        let leftovers = Leftovers {
            uid: me().wrapping_add(1),
            pids: vec![pid],
        };
        assert_eq!(kill_all(&leftovers), 0);
        // Had the sweep SIGKILLed it, that signal would be the one it died of.
        kill(pid, Signal::SIGTERM).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(Signal::SIGTERM as i32));
    }

    #[test]
    fn a_pid_nobody_holds_is_not_counted() {
        // `pid_max` itself is never given to a process: a pid nobody holds, unlike a reaped
        // child's, which another process of this uid could be given meanwhile.
        let pid_max: i32 = fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let pid = Pid::from_raw(pid_max);
        let leftovers = Leftovers {
            uid: me(),
            pids: vec![pid],
        };
        assert_eq!(kill_all(&leftovers), 0);
        assert_eq!(kill_leftover(pid, me()), Ok(false));
    }

    /// What makes the check-then-kill race-free: a pidfd's signal never reaches the pid's next
    /// holder, it fails once the pinned process is gone.
    #[test]
    fn a_pidfd_does_not_follow_its_pid() {
        let (mut child, pid) = sleeper();
        let pidfd = match PidFd::open(pid) {
            Ok(pidfd) => pidfd,
            Err(Errno::ENOSYS | Errno::EPERM) => {
                eprintln!("no pidfds here; skipped");
                kill(pid, Signal::SIGKILL).unwrap();
                child.wait().unwrap();
                return;
            }
            Err(e) => panic!("pidfd_open: {e}"),
        };
        kill(pid, Signal::SIGKILL).unwrap();
        child.wait().unwrap();
        assert_eq!(pidfd.kill(), Err(Errno::ESRCH));
    }
}
