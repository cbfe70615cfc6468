//! Idle stop (docs/decisions/0006-idle-unloading.md) against the real binary.

mod support;

use tokio::time::{sleep, timeout, Duration, Instant};
use worker::{Pool, WorkerState};

use support::*;

const IDLE: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_worker_is_stopped_then_started_again() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let mut cfg = config(dir.path(), "id");
    cfg.min_workers = 0;
    cfg.worker_idle = IDLE;
    let pool = Pool::new(cfg, metrics);
    let handle = pool.acquire().await.unwrap();
    let (first, pid) = (handle.id, handle.pid);
    let mut events = pool.subscribe();
    sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        info(&pool, 0).state,
        WorkerState::Ready,
        "a handle keeps it"
    );

    let t0 = Instant::now();
    drop(handle);
    let status = timeout(WAIT, next_exit(&mut events, first)).await.unwrap();
    let took = t0.elapsed();
    println!("idle worker exited {took:?} after its last handle dropped ({status})");
    assert!(
        took >= IDLE && took < IDLE + Duration::from_millis(1500),
        "{took:?}"
    );
    assert_eq!(status, "exit status: 0", "SIGTERM drains and exits 0");
    let w = info(&pool, 0);
    assert_eq!(
        (w.state, w.pid, w.last_error),
        (WorkerState::Stopped, None, None)
    );
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "idle")
        ),
        1.0
    );
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "crash")
        ),
        0.0
    );
    assert_eq!(
        metric(&registry, "codex_fleet_workers", ("state", "stopped")),
        1.0
    );

    let t1 = Instant::now();
    let again = pool.acquire().await.unwrap();
    println!(
        "acquire after the idle stop started a worker in {:?}",
        t1.elapsed()
    );
    assert_eq!((again.id.slot(), again.id.generation()), (0, 2));
    assert_ne!(again.pid, pid);
    Client::connect(&again, "after_idle").await;
    pool.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_workers_are_never_stopped_for_idleness() {
    init_tracing();
    let dir = short_dir();
    let (_registry, metrics) = metrics();
    let mut cfg = config(dir.path(), "im");
    cfg.min_workers = 1;
    cfg.worker_idle = IDLE;
    let pool = Pool::new(cfg, metrics);
    let pid = pool.acquire().await.unwrap().pid;
    sleep(IDLE * 3).await;
    let w = info(&pool, 0);
    assert_eq!((w.state, w.pid), (WorkerState::Ready, Some(pid)));
    pool.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_thread_keeps_the_worker() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let mut cfg = config(dir.path(), "il");
    cfg.min_workers = 0;
    cfg.worker_idle = IDLE;
    cfg.thread_unload_delay_secs = 2;
    let pool = Pool::new(cfg, metrics);
    let handle = pool.acquire().await.unwrap();
    let (id, pid) = (handle.id, handle.pid);
    let mut events = pool.subscribe();
    let mut client = Client::connect(&handle, "il_client").await;
    client.start_thread().await;
    drop(handle);
    sleep(IDLE * 2).await;
    let w = info(&pool, 0);
    assert_eq!(
        (w.state, w.pid, w.loaded_threads),
        (WorkerState::Ready, Some(pid), 1)
    );

    // Once the client leaves, app-server unloads the thread after 2 s; then the worker is idle.
    let t0 = Instant::now();
    client.close().await;
    let status = timeout(WAIT, next_exit(&mut events, id)).await.unwrap();
    let took = t0.elapsed();
    println!("worker exited {took:?} after its last client left (unload 2 s + idle 1 s): {status}");
    assert!(took >= Duration::from_secs(3), "{took:?}");
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "idle")
        ),
        1.0
    );
    pool.shutdown(Duration::from_secs(2)).await;
}
