//! Pool tests against the real `codex app-server` (path in `CODEX_BIN`).

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use futures_util::{SinkExt, StreamExt};
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use prometheus::Registry;
use serde_json::{json, Value};
use tokio::time::{timeout, Duration, Instant};
use tokio_tungstenite::tungstenite::Message;
use worker::{Pool, PoolConfig, PoolError, WorkerHandle, WorkerState};

use support::{codex_bin, init_tracing, metric, metrics, next_exit, short_dir, WAIT};

fn child_env(dir: &Path) -> Vec<(String, String)> {
    vec![
        ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()),
        ("HOME".into(), dir.join("home").display().to_string()),
        ("FLEET_TEST_MARK".into(), "only-this".into()),
    ]
}

/// The pool these tests use: `program` as the worker, fast health checks.
fn pool_config(dir: &Path, program: PathBuf) -> PoolConfig {
    PoolConfig {
        tenant: "t".into(),
        program,
        args: vec!["app-server".into()],
        codex_home: dir.join("h"),
        cwd: dir.join("w"),
        socket_dir: dir.join("s"),
        thread_unload_delay_secs: 5,
        config_overrides: vec![],
        env: child_env(dir),
        min_workers: 1,
        max_workers: 1,
        ready_timeout: Duration::from_secs(10),
        health_interval: Duration::from_millis(200),
        health_timeout: Duration::from_millis(300),
        restart_backoff_initial: Duration::from_millis(50),
        restart_backoff_max: Duration::from_millis(500),
        stop_grace: Duration::from_secs(2),
        ..PoolConfig::default()
    }
}

/// Sum and count of the start histogram.
fn start_seconds(registry: &Registry) -> (f64, u64) {
    let families = registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == "codex_fleet_worker_start_seconds")
        .unwrap();
    let h = family.get_metric()[0].get_histogram();
    (h.get_sample_sum(), h.get_sample_count())
}

/// Opens a leg and initializes it as a client named `name`; returns the initialize result.
async fn initialize(handle: &WorkerHandle, name: &str) -> Value {
    let mut ws = handle.connect(1 << 20).await.unwrap();
    let init = json!({"id": 1, "method": "initialize", "params": {
        "clientInfo": {"name": name, "title": null, "version": "0.0.1"},
        "capabilities": {"experimentalApi": true}}});
    ws.send(Message::text(init.to_string())).await.unwrap();
    loop {
        let frame = timeout(WAIT, ws.next()).await.unwrap().unwrap().unwrap();
        if let Message::Text(text) = frame {
            let v: Value = serde_json::from_str(text.as_str()).unwrap();
            if v["id"] == 1 {
                return v["result"].clone();
            }
        }
    }
}

/// Live (non-zombie) pids whose process group is `pgid` (from /proc/PID/stat). Zombies are dead:
/// app-server's startup `git` children are orphaned to PID 1 and linger until it reaps them.
fn group_members(pgid: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command: state ppid pgrp ...
        let Some(rest) = stat.rsplit_once(") ").map(|(_, rest)| rest) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let zombie = fields.first() == Some(&"Z");
        if !zombie && fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) {
            pids.push(pid);
        }
    }
    pids
}

fn alive(pid: u32) -> bool {
    kill(Pid::from_raw(pid as i32), None) != Err(Errno::ESRCH)
}

async fn wait_gone(pgid: u32) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !group_members(pgid).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_worker_and_serves_a_second_connection() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let cfg = pool_config(dir.path(), codex_bin());
    let t0 = Instant::now();
    let pool = Pool::new(cfg.clone(), metrics);
    let handle = pool.acquire().await.unwrap();
    let acquired = t0.elapsed();
    let (sum, count) = start_seconds(&registry);
    println!(
        "fresh CODEX_HOME: spawn->ready {:.1} ms (metric), Pool::new->acquire {:.1} ms",
        sum * 1e3,
        acquired.as_secs_f64() * 1e3
    );
    assert_eq!(count, 1);
    assert_eq!(handle.id.to_string(), "t#0.g1");
    assert_eq!(handle.socket_path, cfg.socket_path(0));

    let result = initialize(&handle, "fleet_test").await;
    assert_eq!(
        result["codexHome"],
        json!(cfg.codex_home.display().to_string())
    );
    // The control leg initialized first, but as codex_app_server_daemon it must not own the prefix.
    let ua = result["userAgent"].as_str().unwrap();
    println!("second connection userAgent: {ua}");
    assert!(ua.starts_with("fleet_test/"), "{ua}");

    let info = &pool.workers()[0];
    assert_eq!(info.state, WorkerState::Ready);
    assert_eq!(info.pid, Some(handle.pid));
    assert_eq!(info.handles, 1);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&cfg.socket_dir).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o700);

    // Warm start: same CODEX_HOME, after a graceful stop.
    pool.shutdown(Duration::from_secs(2)).await;
    let (registry, metrics) = self::metrics();
    let pool = Pool::new(cfg, metrics);
    pool.acquire().await.unwrap();
    let (sum, _) = start_seconds(&registry);
    println!("existing CODEX_HOME: spawn->ready {:.1} ms", sum * 1e3);
    pool.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_is_reported_and_replaced() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let pool = Pool::new(pool_config(dir.path(), codex_bin()), metrics);
    let handle = pool.acquire().await.unwrap();
    let mut events = pool.subscribe();
    let (first_start, _) = start_seconds(&registry);

    kill(Pid::from_raw(handle.pid as i32), Signal::SIGKILL).unwrap();
    let status = timeout(WAIT, next_exit(&mut events, handle.id))
        .await
        .unwrap();
    assert!(status.contains("SIGKILL"), "{status}");
    timeout(WAIT, handle.exited()).await.unwrap();
    assert_eq!(handle.exit_status().as_deref(), Some(status.as_str()));

    let fresh = pool.acquire().await.unwrap();
    assert_ne!(fresh.pid, handle.pid);
    assert_eq!(fresh.id.slot(), handle.id.slot());
    assert_eq!(fresh.id.generation(), handle.id.generation() + 1);
    initialize(&fresh, "after_crash").await;
    let info = &pool.workers()[0];
    assert_eq!(info.restarts, 1);
    assert!(
        info.last_error.as_deref().unwrap().contains("SIGKILL"),
        "{info:?}"
    );
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "crash")
        ),
        1.0
    );
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_restarts_total",
            ("tenant", "t")
        ),
        1.0
    );
    let (sum, count) = start_seconds(&registry);
    assert_eq!(count, 2);
    println!(
        "restart (existing CODEX_HOME) spawn->ready {:.1} ms",
        (sum - first_start) * 1e3
    );
    pool.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_worker_is_killed_and_replaced() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let cfg = pool_config(dir.path(), codex_bin());
    let budget = cfg.health_interval + cfg.health_timeout;
    let pool = Pool::new(cfg, metrics);
    let handle = pool.acquire().await.unwrap();
    let mut events = pool.subscribe();

    let stopped_at = Instant::now();
    kill(Pid::from_raw(handle.pid as i32), Signal::SIGSTOP).unwrap();
    let status = timeout(WAIT, next_exit(&mut events, handle.id))
        .await
        .unwrap();
    let detected = stopped_at.elapsed();
    println!(
        "SIGSTOP detected and killed after {detected:?} (interval+timeout = {budget:?}): {status}"
    );
    // Detection takes at most interval + timeout (500 ms here) plus scheduling; other tests'
    // real workers may be starting on the same 2 cores, so the margin is 2 s, still far below
    // the 10 s a missed detection would take to show.
    assert!(detected <= budget + Duration::from_secs(2), "{detected:?}");
    assert!(!alive(handle.pid));
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "hang")
        ),
        1.0
    );

    let fresh = pool.acquire().await.unwrap();
    assert_ne!(fresh.pid, handle.pid);
    initialize(&fresh, "after_hang").await;
    pool.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_no_process() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let cfg = pool_config(dir.path(), codex_bin());
    let pool = Pool::new(cfg.clone(), metrics);
    let handle = pool.acquire().await.unwrap();
    assert!(group_members(handle.pid).contains(&handle.pid));

    let t0 = Instant::now();
    pool.shutdown(Duration::from_secs(3)).await;
    println!("graceful shutdown took {:?}", t0.elapsed());
    assert!(group_members(handle.pid).is_empty());
    assert!(!alive(handle.pid));
    assert!(handle.exit_status().is_some());
    assert!(pool
        .workers()
        .iter()
        .all(|w| w.state == WorkerState::Stopped));
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "stopped")
        ),
        1.0
    );
    // app-server removes its socket symlink on a graceful exit.
    assert!(std::fs::symlink_metadata(cfg.socket_path(0)).is_err());
    // Idempotent.
    pool.shutdown(Duration::from_secs(1)).await;
    assert!(matches!(
        pool.acquire().await,
        Err(PoolError::ShuttingDown { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_pool_kills_the_group() {
    init_tracing();
    let dir = short_dir();
    let (_registry, metrics) = metrics();
    let pool = Pool::new(pool_config(dir.path(), codex_bin()), metrics);
    let handle = pool.acquire().await.unwrap();
    drop(pool);
    timeout(WAIT, handle.exited()).await.unwrap();
    wait_gone(handle.pid).await;
    assert!(group_members(handle.pid).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn program_that_exits_at_once_fails_clearly_then_quarantines() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let mut cfg = pool_config(dir.path(), PathBuf::from("/bin/false"));
    cfg.min_workers = 0;
    cfg.ready_timeout = Duration::from_secs(3);
    cfg.restart_backoff_initial = Duration::from_millis(20);
    cfg.restart_backoff_max = Duration::from_millis(100);
    let pool = Pool::new(cfg, metrics);
    assert!(pool.workers().is_empty(), "min_workers 0 starts nothing");

    let t0 = Instant::now();
    let err = pool.acquire().await.unwrap_err();
    println!("acquire failed after {:?}: {err}", t0.elapsed());
    let text = err.to_string();
    assert!(text.contains("exit status: 1"), "{text}");
    assert!(matches!(err, PoolError::Quarantined { .. }), "{err:?}");
    let info = &pool.workers()[0];
    assert_eq!(info.state, WorkerState::Quarantined);
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "startfail")
        ),
        5.0
    );

    // While quarantined, acquire fails at once.
    let t1 = Instant::now();
    assert!(matches!(
        pool.acquire().await,
        Err(PoolError::Quarantined { .. })
    ));
    assert!(t1.elapsed() < Duration::from_millis(100));
    pool.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_sees_only_the_given_environment() {
    init_tracing();
    let dir = short_dir();
    let (_registry, metrics) = metrics();
    let cfg = pool_config(dir.path(), codex_bin());
    let pool = Pool::new(cfg.clone(), metrics);
    let handle = pool.acquire().await.unwrap();

    let raw = std::fs::read(format!("/proc/{}/environ", handle.pid)).unwrap();
    let got: BTreeSet<String> = raw
        .split(|&b| b == 0)
        .filter(|kv| !kv.is_empty())
        .map(|kv| String::from_utf8_lossy(kv).into_owned())
        .collect();
    let mut want: BTreeSet<String> = cfg.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    want.insert(format!("CODEX_HOME={}", cfg.codex_home.display()));
    assert_eq!(got, want);

    // The child also runs in cwd, with umask 077.
    let cwd = std::fs::read_link(format!("/proc/{}/cwd", handle.pid)).unwrap();
    assert_eq!(cwd, cfg.cwd);
    let status = std::fs::read_to_string(format!("/proc/{}/status", handle.pid)).unwrap();
    assert!(status.lines().any(|l| l == "Umask:\t0077"), "{status}");
    pool.shutdown(Duration::from_secs(2)).await;
}

const PDEATHSIG_CHILD: &str = "FLEET_PDEATHSIG_CHILD";

/// Runs a pool in a child copy of this test binary, SIGKILLs that child, and checks the worker dies
/// with it (PR_SET_PDEATHSIG), though nobody ran any cleanup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_supervisor_leaves_no_worker() {
    init_tracing();
    if std::env::var_os(PDEATHSIG_CHILD).is_some() {
        return run_pool_until_killed().await;
    }
    let dir = short_dir();
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigkilled_supervisor_leaves_no_worker",
            "--nocapture",
        ])
        .env(PDEATHSIG_CHILD, dir.path())
        .env("CODEX_BIN", codex_bin())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let worker_pid = timeout(WAIT, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(pid) = line.strip_prefix("WORKER_PID=") {
                return pid.parse::<u32>().unwrap();
            }
        }
        panic!("child exited without starting a worker");
    })
    .await
    .unwrap();
    assert!(alive(worker_pid));

    child.start_kill().unwrap();
    child.wait().await.unwrap();
    wait_gone(worker_pid).await;
    assert!(
        group_members(worker_pid).is_empty(),
        "worker {worker_pid} outlived its supervisor"
    );
}

async fn run_pool_until_killed() {
    let dir = PathBuf::from(std::env::var_os(PDEATHSIG_CHILD).unwrap());
    let (_registry, metrics) = metrics();
    let pool = Pool::new(pool_config(&dir, codex_bin()), metrics);
    let handle = pool.acquire().await.unwrap();
    println!("WORKER_PID={}", handle.pid);
    tokio::time::sleep(WAIT).await;
    panic!("supervisor child was not killed");
}
