use super::output::*;
use super::*;
use crate::id::intern_tenant;
use tokio::io::BufReader;

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

/// The events a test saw: each one's level, message and `lines` field (the count of lines left
/// out of the log).
#[derive(Clone, Default)]
struct Seen(Arc<std::sync::Mutex<Vec<SeenEvent>>>);

/// An event's level, its `line` (or else its message), and its `lines` field.
type SeenEvent = (tracing::Level, String, Option<u64>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Seen {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields {
            message: String,
            line: String,
            lines: Option<u64>,
        }
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                match field.name() {
                    "message" => self.message = format!("{value:?}"),
                    "line" => self.line = format!("{value:?}"),
                    _ => {}
                }
            }
            fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
                if field.name() == "lines" {
                    self.lines = Some(value);
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        let text = if fields.line.is_empty() {
            fields.message
        } else {
            fields.line
        };
        self.0
            .lock()
            .unwrap()
            .push((*event.metadata().level(), text, fields.lines));
    }
}

/// A worker's stderr flooded (every line a warning, then a line of 4 MiB without a newline) is
/// read at its pace and reaches the log within its budget, the lines left out counted exactly,
/// and the tail still ends with the last words. Time is tokio's paused clock: the pace shows as
/// time the forwarder waited, not as time the test takes.
#[tokio::test(start_paused = true)]
async fn a_flooded_stderr_is_read_at_its_pace_and_logged_within_its_budget() {
    use tracing_subscriber::layer::SubscriberExt;
    let seen = Seen::default();
    let _log = tracing::subscriber::set_default(tracing_subscriber::registry().with(seen.clone()));
    let flood_lines = 20_000u64;
    let mut input = Vec::new();
    for n in 0..flood_lines {
        input.extend_from_slice(format!("WARN flood {n}\n").as_bytes());
    }
    input.resize(input.len() + (4 << 20), b'x');
    input.extend_from_slice(b"\nlast words\n");
    let tail = Arc::new(StderrTail::default());
    let started = tokio::time::Instant::now();
    let dropped = prometheus::IntCounter::new("dropped", "lines left out").unwrap();
    forward_stderr(
        &input[..],
        tail.clone(),
        CancellationToken::new(),
        dropped.clone(),
    )
    .await;
    let took = started.elapsed();

    // Each short line costs LINE_COST, the long one its bytes: all of it at OUTPUT_RATE, less
    // the first burst.
    let cost = flood_lines * LINE_COST + (4 << 20) + 2 * LINE_COST;
    let paced = Duration::from_secs_f64((cost - OUTPUT_RATE) as f64 / OUTPUT_RATE as f64);
    assert!(
        took + Duration::from_millis(100) >= paced,
        "read in {took:?}, paced at {paced:?}"
    );
    let seen = seen.0.lock().unwrap().clone();
    let allowed = LOG_BURST + (took.as_secs_f64() * LOG_LINES_PER_SEC as f64).ceil() as u64 + 1;
    eprintln!(
        "measured: {} lines read in {took:?} (paced), {} log events (at most {allowed})",
        flood_lines + 2,
        seen.len()
    );
    assert!(seen.len() as u64 <= allowed, "{} events", seen.len());
    let counted: u64 = seen.iter().filter_map(|(_, _, lines)| *lines).sum();
    let logged = seen.iter().filter(|(_, _, lines)| lines.is_none()).count() as u64;
    assert_eq!(
        logged + counted,
        flood_lines + 2,
        "every line logged or counted"
    );
    assert_eq!(
        dropped.get(),
        counted,
        "the metric counts what the log says"
    );
    assert!(tail.summary().ends_with("last words"), "{}", tail.summary());
}

/// Under its budget nothing is held back: a worker's ordinary lines are logged as they come,
/// without a wait.
#[tokio::test(start_paused = true)]
async fn ordinary_stderr_is_logged_line_for_line_without_a_wait() {
    use tracing_subscriber::layer::SubscriberExt;
    let seen = Seen::default();
    let _log = tracing::subscriber::set_default(tracing_subscriber::registry().with(seen.clone()));
    let input: String = (0..LOG_BURST).map(|n| format!("line {n}\n")).collect();
    let started = tokio::time::Instant::now();
    let dropped = prometheus::IntCounter::new("dropped", "lines left out").unwrap();
    forward_stderr(
        input.as_bytes(),
        Arc::default(),
        CancellationToken::new(),
        dropped.clone(),
    )
    .await;
    assert_eq!(dropped.get(), 0);
    assert_eq!(started.elapsed(), Duration::ZERO);
    let seen = seen.0.lock().unwrap().clone();
    assert_eq!(seen.len() as u64, LOG_BURST);
    assert!(seen.iter().all(|(level, text, lines)| {
        *level == tracing::Level::INFO && text.starts_with("line ") && lines.is_none()
    }));
}
