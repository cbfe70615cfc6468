//! What a worker's process group uses, read from `/proc`: resident memory and CPU time of every
//! process in the group (the app-server and the commands it runs), for the capacity metrics.

use std::sync::OnceLock;

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

/// Samples the process group led by `pgid` (the worker runs in its own group).
pub fn group_usage(pgid: u32) -> Usage {
    let (ticks, page) = units();
    let mut own = 0u64;
    let mut rss_pages = 0u64;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Usage::default();
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
        if stat.pgrp != i64::from(pgid) {
            continue;
        }
        own += stat.own_ticks;
        rss_pages += stat.rss_pages;
        if pid == pgid {
            own += stat.children_ticks;
        }
    }
    Usage {
        rss_bytes: rss_pages.saturating_mul(page),
        cpu_secs: own as f64 / ticks,
    }
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
}
