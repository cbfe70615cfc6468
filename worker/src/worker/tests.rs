use super::*;

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

#[tokio::test]
async fn leftover_paths_are_cleaned() {
    let dir = tempfile::Builder::new()
        .prefix("cf")
        .tempdir_in("/tmp")
        .unwrap();
    // Regular file.
    let file = dir.path().join("f.sock");
    std::fs::write(&file, b"x").unwrap();
    clean_socket_path(&file).await.unwrap();
    assert!(!file.exists());
    // Dangling symlink.
    let link = dir.path().join("l.sock");
    std::os::unix::fs::symlink(dir.path().join("missing"), &link).unwrap();
    clean_socket_path(&link).await.unwrap();
    assert!(std::fs::symlink_metadata(&link).is_err());
    // Dead socket: bound, then the listener dropped.
    let dead = dir.path().join("d.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    clean_socket_path(&dead).await.unwrap();
    assert!(std::fs::symlink_metadata(&dead).is_err());
    // Live socket (through a symlink, as app-server makes it).
    let live = dir.path().join("live");
    let _listener = tokio::net::UnixListener::bind(&live).unwrap();
    let via = dir.path().join("v.sock");
    std::os::unix::fs::symlink(&live, &via).unwrap();
    let err = clean_socket_path(&via).await.unwrap_err();
    assert!(matches!(err, StartError::SocketInUse { .. }), "{err}");
    // Directory.
    let sub = dir.path().join("s.sock");
    std::fs::create_dir(&sub).unwrap();
    assert!(matches!(
        clean_socket_path(&sub).await.unwrap_err(),
        StartError::SocketInUse { .. }
    ));
    // Nothing there.
    clean_socket_path(&dir.path().join("none")).await.unwrap();
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
