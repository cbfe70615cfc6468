//! The descriptor line (`worker::descriptors`) in a process of its own: the test lowers this
//! process's open-files limit, which would disturb any other test sharing it.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::resource::{getrlimit, setrlimit, Resource};
use worker::descriptors::{check, move_below, prepare, room, RESERVE};

fn open() -> OwnedFd {
    File::open("/dev/null").unwrap().into()
}

fn is_open(fd: RawFd) -> bool {
    std::path::Path::new(&format!("/proc/self/fd/{fd}")).exists()
}

/// A connection accepted onto a reserve descriptor (another thread took the last free one
/// below the line in between) stays where it is while nothing below the line is free, and
/// moves onto the one freed next, closing the reserve's: nothing client-facing is left holding
/// the reserve once there is room.
#[test]
fn a_descriptor_in_the_reserve_moves_below_the_line_once_one_is_free() {
    prepare().unwrap();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    // Two descriptors left below the line: the lowest free one and the next.
    let lowest = open();
    let first = u64::try_from(lowest.as_raw_fd()).unwrap();
    drop(lowest);
    setrlimit(Resource::RLIMIT_NOFILE, first + 2 + RESERVE, hard).unwrap();
    assert!(room().is_ok(), "two free below the line");
    let a = open();
    let b = open();
    assert_eq!(u64::try_from(b.as_raw_fd()).unwrap(), first + 1);
    // Below the line, nothing moves.
    let b = move_below(b).unwrap();
    assert_eq!(u64::try_from(b.as_raw_fd()).unwrap(), first + 1);
    assert!(room().is_err(), "nothing free below the line");
    // The race: a descriptor opened anyway lies in the reserve.
    let raced = open();
    let raced_at = raced.as_raw_fd();
    let lacking = check(&raced).unwrap_err();
    assert!(lacking.to_string().contains("reserve"), "{lacking}");
    // Nothing below the line free: it stays, open, where it was.
    let (raced, why) = move_below(raced).unwrap_err();
    assert_eq!(raced.as_raw_fd(), raced_at);
    assert!(why.to_string().contains("reserve"), "{why}");
    assert!(is_open(raced_at));
    // One freed: it moves there, and the reserve's is closed.
    let freed = a.as_raw_fd();
    drop(a);
    let moved = move_below(raced).unwrap();
    assert_eq!(moved.as_raw_fd(), freed);
    assert!(check(&moved).is_ok());
    assert!(!is_open(raced_at), "the reserve's descriptor was left open");
    assert!(room().is_err(), "the moved one took the free one");
    drop((b, moved));
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
}
