use super::*;
use crate::id::intern_tenant;

#[test]
fn worker_id_displays_tenant_slot_generation() {
    let id = WorkerId::new(intern_tenant("acme"), 1, 3);
    assert_eq!(id.to_string(), "acme#1.g3");
    assert_eq!(id.tenant(), "acme");
}

#[test]
fn interning_reuses_the_same_str() {
    let a = intern_tenant("intern-test");
    let b = intern_tenant(&String::from("intern-test"));
    assert!(std::ptr::eq(a, b));
}

#[tokio::test]
async fn lines_are_bounded() {
    let input: &[u8] = b"short\nthis line is much too long\n\nlast-without-newline";
    let mut reader = BufReader::with_capacity(4, input);
    let mut line = Vec::new();
    let mut got = Vec::new();
    while read_line_bounded(&mut reader, &mut line, 8).await.unwrap() {
        got.push(String::from_utf8(line.clone()).unwrap());
    }
    assert_eq!(got, ["short", "this lin", "", "last-wit"]);
}

#[test]
fn ansi_is_stripped_and_levels_detected() {
    let raw = "\u{1b}[2m2026-11-30T08:43:31Z\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m codex_app_server: no bwrap";
    let text = strip_ansi(raw);
    assert_eq!(
        text,
        "2026-11-30T08:43:31Z ERROR codex_app_server: no bwrap"
    );
    assert!(looks_like_warning(&text));
    assert!(looks_like_warning("WARNING: proceeding"));
    assert!(!looks_like_warning(
        "2026-11-30T08:43:31Z  INFO codex: ERROR in message"
    ));
}

#[test]
fn stderr_tail_keeps_the_last_lines() {
    let tail = StderrTail::default();
    assert_eq!(tail.summary(), "(none)");
    for i in 0..20 {
        tail.push(format!("line {i}"));
    }
    tail.push("é".repeat(STDERR_TAIL_LINE));
    let summary = tail.summary();
    assert!(summary.starts_with("line 13 | "), "{summary}");
    assert!(!summary.contains("line 12 "));
}

fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Makes `link` the symlink app-server would make for it: into `<tmp>/codex-daemon-<uid>/`, named
/// by the SHA-256 of the link's path. Returns the target.
fn daemon_link(tmp: &Path, link: &Path, uid: u32) -> PathBuf {
    use sha2::Digest;
    let dir = tmp.join(format!("codex-daemon-{uid}"));
    std::fs::create_dir_all(&dir).unwrap();
    let target = dir.join(hex::encode(sha2::Sha256::digest(
        link.as_os_str().as_encoded_bytes(),
    )));
    std::os::unix::fs::symlink(&target, link).unwrap();
    target
}

#[tokio::test]
async fn leftover_paths_are_cleaned() {
    let dir = tempfile::Builder::new()
        .prefix("cf")
        .tempdir_in("/tmp")
        .unwrap();
    let uid = own_uid();
    // Regular file.
    let file = dir.path().join("f.sock");
    std::fs::write(&file, b"x").unwrap();
    clean_socket_path(&file, uid).await.unwrap();
    assert!(!file.exists());
    // Dangling symlink.
    let link = dir.path().join("l.sock");
    std::os::unix::fs::symlink(dir.path().join("missing"), &link).unwrap();
    clean_socket_path(&link, uid).await.unwrap();
    assert!(std::fs::symlink_metadata(&link).is_err());
    // Dead socket: bound, then the listener dropped.
    let dead = dir.path().join("d.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    clean_socket_path(&dead, uid).await.unwrap();
    assert!(std::fs::symlink_metadata(&dead).is_err());
    // This slot's own live socket (through the symlink app-server makes).
    let via = dir.path().join("v.sock");
    let live = daemon_link(dir.path(), &via, uid);
    let _listener = tokio::net::UnixListener::bind(&live).unwrap();
    let err = clean_socket_path(&via, uid).await.unwrap_err();
    assert!(matches!(err, StartError::SocketInUse { .. }), "{err}");
    // Directory.
    let sub = dir.path().join("s.sock");
    std::fs::create_dir(&sub).unwrap();
    assert!(matches!(
        clean_socket_path(&sub, uid).await.unwrap_err(),
        StartError::SocketInUse { .. }
    ));
    // Nothing there.
    clean_socket_path(&dir.path().join("none"), uid)
        .await
        .unwrap();
}

/// A tenant points its socket path at a live listener that is not its slot's (another tenant's
/// worker): the link is removed, the listener and its file are left alone, and the slot can start.
#[tokio::test]
async fn a_link_to_someone_elses_live_socket_is_removed_not_followed() {
    let dir = tempfile::Builder::new()
        .prefix("cf")
        .tempdir_in("/tmp")
        .unwrap();
    let uid = own_uid();
    let other = dir.path().join("other.sock");
    let _listener = tokio::net::UnixListener::bind(&other).unwrap();
    let path = dir.path().join("0.sock");
    std::os::unix::fs::symlink(&other, &path).unwrap();
    clean_socket_path(&path, uid).await.unwrap();
    assert!(std::fs::symlink_metadata(&path).is_err());
    assert!(std::fs::symlink_metadata(&other)
        .unwrap()
        .file_type()
        .is_socket());
}

#[tokio::test]
async fn leftovers_are_removed_in_the_daemon_folder_only() {
    let dir = tempfile::Builder::new()
        .prefix("cf")
        .tempdir_in("/tmp")
        .unwrap();
    let uid = own_uid();
    // What a killed worker leaves: the link, a dead socket and its lock.
    let path = dir.path().join("0.sock");
    let target = daemon_link(dir.path(), &path, uid);
    drop(std::os::unix::net::UnixListener::bind(&target).unwrap());
    let mut lock = target.clone().into_os_string();
    lock.push(".lock");
    std::fs::write(&lock, b"").unwrap();
    remove_socket_leftovers(&path, uid).await;
    assert!(std::fs::symlink_metadata(&path).is_err());
    assert!(std::fs::symlink_metadata(&target).is_err());
    assert!(std::fs::symlink_metadata(&lock).is_err());

    // A link to any other file (say, another tenant's auth.json): only the link goes.
    let precious = dir.path().join("auth.json");
    std::fs::write(&precious, b"secret").unwrap();
    let mut precious_lock = precious.clone().into_os_string();
    precious_lock.push(".lock");
    std::fs::write(&precious_lock, b"").unwrap();
    std::os::unix::fs::symlink(&precious, &path).unwrap();
    remove_socket_leftovers(&path, uid).await;
    assert!(std::fs::symlink_metadata(&path).is_err());
    assert_eq!(std::fs::read(&precious).unwrap(), b"secret");
    assert!(Path::new(&precious_lock).exists());

    // The right name, but the daemon folder itself replaced by a link to elsewhere: nothing
    // behind the link is touched.
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let path2 = dir.path().join("1.sock");
    let name = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        path2.as_os_str().as_encoded_bytes(),
    ));
    std::fs::write(elsewhere.join(&name), b"keep").unwrap();
    let fake = dir.path().join("fake");
    std::fs::create_dir(&fake).unwrap();
    let daemon = fake.join(format!("codex-daemon-{uid}"));
    std::os::unix::fs::symlink(&elsewhere, &daemon).unwrap();
    std::os::unix::fs::symlink(daemon.join(&name), &path2).unwrap();
    remove_socket_leftovers(&path2, uid).await;
    assert!(std::fs::symlink_metadata(&path2).is_err());
    assert_eq!(std::fs::read(elsewhere.join(&name)).unwrap(), b"keep");

    // A daemon folder named for this uid but owned by someone else is left alone.
    if nix::unistd::geteuid().is_root() {
        let path3 = dir.path().join("2.sock");
        let target3 = daemon_link(&dir.path().join("t3"), &path3, uid);
        std::fs::write(&target3, b"keep").unwrap();
        let owner = nix::unistd::Uid::from_raw(uid + 4242);
        nix::unistd::chown(target3.parent().unwrap(), Some(owner), None).unwrap();
        remove_socket_leftovers(&path3, uid).await;
        assert_eq!(std::fs::read(&target3).unwrap(), b"keep");
    }
}

#[test]
fn listen_arg_is_a_unix_url() {
    assert_eq!(
        listen_arg(Path::new("/s/a-0.sock")),
        OsString::from("unix:///s/a-0.sock")
    );
    assert_eq!(
        socket_path(Path::new("/s"), "a", 2),
        PathBuf::from("/s/a/2.sock")
    );
}

#[test]
fn parses_vm_rss() {
    let status = "Name:\tcodex\nVmPeak:\t  1 kB\nVmRSS:\t   94208 kB\nThreads:\t9\n";
    assert_eq!(parse_vm_rss(status), Some(94208 * 1024));
    assert_eq!(parse_vm_rss("Name:\tx\n"), None);
    assert!(rss_bytes(std::process::id()).unwrap() > 0);
}
