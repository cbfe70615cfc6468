//! Who a worker runs as (a per-tenant Unix uid) and its resource limits, against the real binary.

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use tokio::time::{Duration, Instant};
use worker::{Pool, Rlimits, WorkerUser};

use support::*;

const UID: u32 = 64001;
/// Another test's tenant uid: a uid belongs to one tenant, and a pool whose last worker ends kills
/// every process left under its uid, so tests running at once never share one.
const OTHER_UID: u32 = 64002;

fn proc_line(pid: u32, file: &str, prefix: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap();
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in /proc/{pid}/{file}"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn owner_and_mode(path: &Path) -> (u32, u32, u32) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    (meta.uid(), meta.gid(), meta.mode() & 0o777)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_runs_as_the_tenant_uid() {
    init_tracing();
    if !root_or_explicit_skip("switching the worker's uid") {
        return;
    }
    let dir = short_dir();
    // The worker must be able to pass through the test's own folder.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let (_registry, metrics) = metrics();
    let mut cfg = config(dir.path(), "uid");
    cfg.user = Some(WorkerUser { uid: UID, gid: UID });
    cfg.rlimits = Rlimits {
        nofile: Some(4096),
        ..Rlimits::default()
    };
    let pool = Pool::new(cfg.clone(), metrics);
    let t0 = Instant::now();
    let handle = pool.acquire().await.unwrap();
    println!("uid {UID} worker ready in {:?}", t0.elapsed());

    let pid = handle.pid;
    assert_eq!(
        proc_line(pid, "status", "Uid:"),
        "Uid: 64001 64001 64001 64001"
    );
    assert_eq!(
        proc_line(pid, "status", "Gid:"),
        "Gid: 64001 64001 64001 64001"
    );
    assert_eq!(proc_line(pid, "status", "Groups:"), "Groups:");
    assert_eq!(proc_line(pid, "status", "Umask:"), "Umask: 0077");
    assert_eq!(
        proc_line(pid, "limits", "Max open files"),
        "Max open files 4096 4096 files"
    );
    for dir in [
        &cfg.codex_home,
        &cfg.cwd,
        &cfg.socket_path(0).parent().unwrap().to_path_buf(),
    ] {
        assert_eq!(owner_and_mode(dir), (UID, UID, 0o700), "{}", dir.display());
    }
    assert_eq!(owner_and_mode(&cfg.socket_dir), (0, 0, 0o711));
    // app-server's real socket lives in /tmp/codex-daemon-<uid>/; root connects through the link.
    let target = std::fs::read_link(&handle.socket_path).unwrap();
    println!(
        "socket {} -> {}",
        handle.socket_path.display(),
        target.display()
    );
    assert!(
        target.starts_with(format!("/tmp/codex-daemon-{UID}")),
        "{}",
        target.display()
    );
    assert_eq!(owner_and_mode(&target).0, UID);

    let mut client = Client::connect(&handle, "uid_client").await;
    let thread = client.start_thread().await;
    assert_eq!(pool.reconcile().await, vec![(handle.id, vec![thread])]);
    // Files it writes are its own and private.
    let db = cfg.codex_home.join("state_5.sqlite");
    assert_eq!(owner_and_mode(&db), (UID, UID, 0o600));
    pool.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_home_fails_the_start_clearly() {
    init_tracing();
    if !root_or_explicit_skip("switching the worker's uid") {
        return;
    }
    // A 0700 folder on the way keeps uid 64002 out.
    let dir = short_dir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let (_registry, metrics) = metrics();
    let mut cfg = config(dir.path(), "nox");
    cfg.min_workers = 0;
    cfg.ready_timeout = Duration::from_secs(1);
    cfg.user = Some(WorkerUser {
        uid: OTHER_UID,
        gid: OTHER_UID,
    });
    let pool = Pool::new(cfg, metrics);
    let err = pool.acquire().await.unwrap_err().to_string();
    println!("{err}");
    assert!(
        err.contains("not traversable by the worker's uid 64002"),
        "{err}"
    );
    pool.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlimits_apply_without_a_uid() {
    init_tracing();
    let dir = short_dir();
    let (_registry, metrics) = metrics();
    let mut cfg = config(dir.path(), "rl");
    cfg.rlimits = Rlimits {
        nofile: Some(1000),
        cpu_secs: Some(3600),
        processes: Some(5000),
        ..Rlimits::default()
    };
    let pool = Pool::new(cfg, metrics);
    let handle = pool.acquire().await.unwrap();
    assert_eq!(
        proc_line(handle.pid, "limits", "Max open files"),
        "Max open files 1000 1000 files"
    );
    assert_eq!(
        proc_line(handle.pid, "limits", "Max processes"),
        "Max processes 5000 5000 processes"
    );
    assert_eq!(
        proc_line(handle.pid, "limits", "Max cpu time"),
        "Max cpu time 3600 3600 seconds"
    );
    Client::connect(&handle, "rl_client").await;
    pool.shutdown(Duration::from_secs(2)).await;
}
