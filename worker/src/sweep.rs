//! Ends every process left under a tenant's uid once the tenant has no worker.
//!
//! A worker's process group is signalled when it stops, but a descendant that called `setsid` (a
//! daemon a model's command started) has left the group and would live on. With per-tenant uids,
//! every process of that uid belongs to the tenant's workers, so when the last one is gone the
//! uid's processes are its leftovers.

use std::fs;

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{debug, warn};

/// Processes whose real, effective, saved or filesystem uid is `uid`, from `/proc`.
pub(crate) fn processes_of(uid: u32) -> Vec<Pid> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let own = std::process::id();
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != own)
        .filter(|&pid| {
            fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|status| status_uids(&status))
                .is_some_and(|uids| uids.contains(&uid))
        })
        .filter_map(|pid| i32::try_from(pid).ok().map(Pid::from_raw))
        .collect()
}

/// The four uids of a `/proc/PID/status` `Uid:` line.
fn status_uids(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace()
        .skip(1)
        .map(|u| u.parse().ok())
        .collect()
}

/// SIGKILLs `pids`; returns how many were still there.
pub(crate) fn kill_all(pids: &[Pid]) -> usize {
    let mut killed = 0;
    for &pid in pids {
        match kill(pid, Signal::SIGKILL) {
            Ok(()) => killed += 1,
            Err(Errno::ESRCH) => {}
            Err(e) => warn!(%pid, error = %e, "cannot kill a leftover process"),
        }
    }
    debug!(killed, "leftover processes killed");
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_all_four_uids() {
        let status = "Name:\tsleep\nUid:\t1000\t1001\t1002\t1003\nGid:\t5\t5\t5\t5\n";
        assert_eq!(status_uids(status), Some(vec![1000, 1001, 1002, 1003]));
        assert_eq!(status_uids("Name: x\n"), None);
    }

    #[test]
    fn finds_this_processes_children_by_uid() {
        let me = nix::unistd::geteuid().as_raw();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        assert!(processes_of(me).contains(&pid));
        assert!(
            !processes_of(me).contains(&Pid::from_raw(i32::try_from(std::process::id()).unwrap()))
        );
        assert_eq!(kill_all(&[pid]), 1);
        child.wait().unwrap();
    }
}
