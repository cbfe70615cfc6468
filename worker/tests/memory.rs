//! The memory guard, against the real binary.

mod support;

use tokio::time::{timeout, Duration, Instant};
use worker::{Pool, WorkerState};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_over_its_memory_cap_drains_after_its_turn() {
    init_tracing();
    let dir = short_dir();
    let (registry, metrics) = metrics();
    let model = HangModel::start().await;
    let mut cfg = config(dir.path(), "mem");
    cfg.min_workers = 0;
    cfg.max_workers = 2;
    // Every worker is over 1 byte. The first ping (which samples RSS) comes after connecting,
    // starting a thread and a turn below: 5 s leaves a loaded machine room for those three steps,
    // and the test checks that they did fit.
    cfg.max_worker_rss = Some(1);
    cfg.health_interval = Duration::from_secs(5);
    cfg.config_overrides = model.overrides();
    let pool = Pool::new(cfg, metrics);
    let handle = pool.acquire().await.unwrap();
    let mut events = pool.subscribe();
    let mut client = Client::connect(&handle, "mem_client").await;
    let thread = client.start_thread().await;
    client.start_turn(&thread).await;
    eventually("the turn counted", || info(&pool, 0).active_turns == 1).await;
    assert_eq!(
        info(&pool, 0).state,
        WorkerState::Ready,
        "the turn must start before the first RSS sample for this test to mean anything"
    );

    eventually("memory drain", || {
        info(&pool, 0).state == WorkerState::Draining
    })
    .await;
    let w = info(&pool, 0);
    let rss = w.rss_bytes.unwrap();
    println!("worker RSS at the first ping: {:.1} MB", rss as f64 / 1e6);
    assert!(rss > 10_000_000, "{rss}");
    assert_eq!(w.active_turns, 1);
    assert_eq!(w.pid, Some(handle.pid), "not stopped during a turn");
    // It still owns its thread, but new threads go elsewhere.
    assert!(pool.get(handle.id).is_some());
    let other = pool.acquire().await.unwrap();
    assert_eq!(other.id.slot(), 1);
    drop(other);

    // The turn ends (the model connection drops): now it is stopped, not restarted.
    let t0 = Instant::now();
    model.release();
    let status = timeout(WAIT, next_exit(&mut events, handle.id))
        .await
        .unwrap();
    println!(
        "drained worker exited {:?} after its turn ended: {status}",
        t0.elapsed()
    );
    assert_eq!(status, "exit status: 0");
    eventually("slot stopped", || {
        info(&pool, 0).state == WorkerState::Stopped
    })
    .await;
    assert_eq!(info(&pool, 0).last_error, None);
    assert!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "memory")
        ) >= 1.0
    );
    assert_eq!(
        metric(
            &registry,
            "codex_fleet_worker_exits_total",
            ("reason", "crash")
        ),
        0.0
    );
    pool.shutdown(Duration::from_secs(2)).await;
}
