//! The process's file descriptors, in two parts: connections that anyone can multiply (client
//! connections, sessions' legs to workers, an edge's links to nodes, a leg's second descriptor
//! while a write waits) open only descriptors below a line [`RESERVE`] under the open-files
//! limit; the descriptors above the line stay for what the whole process shares: the admin port
//! (the kubelet's probes, Prometheus's scrapes and the reading of `/proc` they need), worker
//! starts and their control legs, reloads, log files. (Here, in the worker library, because a
//! leg's socket lives here; the router uses it as `router::descriptors`.)
//!
//! Without it, one tenant (or anyone, with bare TCP connections before any token) holding every
//! descriptor also took the liveness probe's, and the kubelet restarted the pod under every
//! other tenant's sessions.
//!
//! Linux gives every new descriptor the lowest number free, so a descriptor numbered at or above
//! the line means every one below it is in use. A connection checks before it opens
//! ([`room`]: the lowest free number, by duplicating a descriptor kept for that) and again after
//! ([`check`]: another thread may have taken the free one in between), and is refused with the
//! answer of its kind: a client connection waits in the listen queue (or, in that race, waits
//! accepted, unserved, until [`move_below`] can move it below the line), a leg is answered
//! `-32001` `workerUnreachable` with a `retryAfterMs`, an edge's link 503 or `-32001` scope
//! `fleet` `tooManyConnections` (the edge is full). The limit is read each time: `prlimit` can
//! change it under a running process.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::OnceLock;

/// Descriptors kept under the open-files limit for what the process shares.
pub const RESERVE: u64 = 64;

/// The first descriptor number connections may not take: the open-files limit (the soft one,
/// which the process raised to the hard one at start) less [`RESERVE`]; none when the limit is
/// unknown or infinite.
pub fn line() -> Option<u64> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) if soft != RLIM_INFINITY => Some(soft.saturating_sub(RESERVE)),
        _ => None,
    }
}

/// Fails when a connection may not open a descriptor now: the lowest free one is in the reserve
/// (or none is free at all).
pub fn room() -> io::Result<()> {
    let Some(line) = line() else { return Ok(()) };
    let probe = match probe() {
        Ok(p) => p,
        Err(e) => return Err(exhausted(line, Some(e))),
    };
    match nix::unistd::dup(probe.as_fd()) {
        Ok(free) if below(&free, line) => Ok(()),
        Ok(_) => Err(exhausted(line, None)),
        Err(e) => Err(exhausted(line, Some(e.into()))),
    }
}

/// Fails when `fd`, just opened for a connection, lies in the reserve: the caller refuses the
/// connection and closes it, or, for a client's, holds it unserved until [`move_below`] can
/// move it out of the reserve.
pub fn check(fd: impl AsFd) -> io::Result<()> {
    match line() {
        Some(line) if !below(&fd, line) => Err(exhausted(line, None)),
        _ => Ok(()),
    }
}

/// Moves `fd`, opened in the reserve, onto the lowest free descriptor when that one lies below
/// the line, closing the one it had; otherwise hands it back, unmoved, with why. What holds a
/// connection accepted in the race [`check`] names can wait for room and then keep it, where
/// closing it would refuse a client without a word.
pub fn move_below(fd: OwnedFd) -> Result<OwnedFd, (OwnedFd, io::Error)> {
    let Some(line) = line() else { return Ok(fd) };
    if below(&fd, line) {
        return Ok(fd);
    }
    match fd.try_clone() {
        Ok(moved) if below(&moved, line) => Ok(moved),
        Ok(_) => Err((fd, exhausted(line, None))),
        Err(e) => Err((fd, exhausted(line, Some(e)))),
    }
}

fn below(fd: impl AsFd, line: u64) -> bool {
    u64::try_from(fd.as_fd().as_raw_fd()).is_ok_and(|n| n < line)
}

/// Descriptors a worker holds in this process: its control leg and its output pipes, with
/// room for its start.
pub const PER_WORKER: usize = 4;

/// A warning when the caps let connections need more descriptors than the open-files limit
/// leaves them: `per_connection` each (a client's socket and a leg, or an edge's link) for
/// `max_connections`, [`PER_WORKER`] for each of `max_workers`, and the [`RESERVE`]. Connections
/// would then stop at the line before the connection caps, with no cap naming why.
pub fn sizing_warning(
    max_connections: usize,
    per_connection: usize,
    max_workers: usize,
) -> Option<String> {
    let limit = usize::try_from(line()? + RESERVE).ok()?;
    let needed = max_connections
        .saturating_mul(per_connection)
        .saturating_add(max_workers.saturating_mul(PER_WORKER))
        .saturating_add(usize::try_from(RESERVE).ok()?);
    (needed > limit).then(|| {
        format!(
            "the open-files limit ({limit}) is below what the caps may need (about {needed}: \
             {per_connection} per connection for limits.max_connections = {max_connections}, \
             {PER_WORKER} per worker for {max_workers} workers, {RESERVE} reserved): connections \
             would stop at the descriptor limit before the connection caps; raise the hard \
             limit (nofile) or lower limits.max_connections"
        )
    })
}

/// Opens the descriptor [`room`] duplicates, while the process is far from its limit (the
/// router's `Server::build` does).
pub fn prepare() -> io::Result<()> {
    probe().map(|_| ())
}

/// A descriptor kept open to duplicate: `/dev/null`, opened by [`prepare`].
fn probe() -> io::Result<&'static OwnedFd> {
    static PROBE: OnceLock<OwnedFd> = OnceLock::new();
    if let Some(p) = PROBE.get() {
        return Ok(p);
    }
    let file = std::fs::File::open("/dev/null")?;
    Ok(PROBE.get_or_init(|| file.into()))
}

fn exhausted(line: u64, cause: Option<io::Error>) -> io::Error {
    let cause = cause.map(|e| format!(" ({e})")).unwrap_or_default();
    io::Error::other(format!(
        "every file descriptor below the open-files limit's reserve is in use: {line} \
         descriptors, {RESERVE} more kept for the admin port and workers{cause}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_the_limit_less_the_reserve() {
        let (soft, _) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(line(), Some(soft - RESERVE));
    }

    #[test]
    fn the_caps_are_sized_against_the_limit() {
        let limit = usize::try_from(line().unwrap() + RESERVE).unwrap();
        let reserve = usize::try_from(RESERVE).unwrap();
        // Exactly what fits: no warning; one connection more: a warning that names the numbers.
        let fits = (limit - reserve - 2 * PER_WORKER) / 2;
        assert_eq!(sizing_warning(fits, 2, 2), None);
        let over = sizing_warning(fits + 1, 2, 2).unwrap();
        assert!(
            over.contains(&format!("limits.max_connections = {}", fits + 1))
                && over.contains(&format!("open-files limit ({limit})")),
            "{over}"
        );
    }

    #[test]
    fn a_descriptor_below_the_line_passes_and_one_above_does_not() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let n = u64::try_from(file.as_raw_fd()).unwrap();
        assert!(below(&file, n + 1));
        assert!(!below(&file, n));
        // This test process is far from its limit.
        check(&file).unwrap();
        room().unwrap();
        let refused = exhausted(10, None).to_string();
        assert!(refused.contains("reserve") && refused.contains("10 descriptors"));
    }
}
