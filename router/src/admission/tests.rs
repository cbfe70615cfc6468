use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::*;

fn small() -> AdmissionConfig {
    AdmissionConfig {
        tenant_rps: 20,
        tenant_burst: 3,
        conn_fps: 20,
        conn_burst: 2,
        turn_start_per_min: 600, // one per 100 ms
        turn_start_burst: 2,
        handshakes_per_sec_per_ip: 20,
        handshake_burst: 2,
        max_connections_per_tenant: 2,
        max_connections: 3,
        max_active_turns_per_tenant: 2,
        max_in_flight_per_worker: 2,
        max_in_flight_per_connection: 4096,
        in_flight_wait_ms: 30,
        cap_retry_after_ms: 500,
        active_turn_ttl_secs: 3600,
    }
}

fn worker(slot: u32) -> WorkerId {
    WorkerId::new("acme", slot, 0)
}

#[test]
fn defaults_are_valid_and_zero_is_refused() {
    let cfg = AdmissionConfig::default();
    assert_eq!(cfg.validate(), Ok(()));
    assert!(cfg.max_in_flight_per_worker < 128);
    let bad = AdmissionConfig {
        conn_burst: 0,
        ..AdmissionConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().key, "conn_burst");
    assert!(Admission::new(bad).is_err());
    let bad = AdmissionConfig {
        max_in_flight_per_worker: 0,
        ..AdmissionConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().key, "max_in_flight_per_worker");
}

#[test]
fn config_reads_from_toml_with_defaults_and_refuses_unknown_keys() {
    let cfg: AdmissionConfig = toml::from_str("tenant_rps = 5\nin_flight_wait_ms = 100\n").unwrap();
    assert_eq!(cfg.tenant_rps, 5);
    assert_eq!(cfg.in_flight_wait(), Duration::from_millis(100));
    assert_eq!(cfg.conn_fps, AdmissionConfig::default().conn_fps);
    let err = toml::from_str::<AdmissionConfig>("tenant_rsp = 5\n").unwrap_err();
    assert!(err.to_string().contains("tenant_rsp"), "{err}");
}

#[tokio::test]
async fn connection_frames_burst_then_refuse_then_recover() {
    let adm = Admission::new(small()).unwrap();
    let conn = adm.open_connection("acme").unwrap();
    let other = adm.open_connection("acme").unwrap();
    conn.check_frame().unwrap();
    conn.check_frame().unwrap();
    let r = conn.check_frame().unwrap_err();
    assert_eq!(
        (r.scope, r.reason),
        (Scope::Connection, Reason::ConnectionRateLimited)
    );
    assert!(r.retry_after > Duration::ZERO && r.retry_after <= Duration::from_millis(50));
    assert_eq!(r.http_status(), 429);
    // Another connection of the same tenant is not affected.
    other.check_frame().unwrap();
    tokio::time::sleep(Duration::from_millis(r.retry_after_ms_jittered())).await;
    conn.check_frame().unwrap();
}

#[tokio::test]
async fn tenant_rate_is_shared_by_its_connections_only() {
    let adm = Admission::new(small()).unwrap();
    let mut one = adm.open_connection("acme").unwrap();
    let mut two = adm.open_connection("acme").unwrap();
    let mut other = adm.open_connection("other").unwrap();
    adm.check_request(&mut one, "thread/list", None).unwrap();
    adm.check_request(&mut two, "thread/list", None).unwrap();
    adm.check_request(&mut one, "thread/list", None).unwrap();
    let r = adm.check_request(&mut two, "model/list", None).unwrap_err();
    assert_eq!(
        (r.scope, r.reason),
        (Scope::Tenant, Reason::TenantRateLimited)
    );
    assert!(r.retry_after > Duration::ZERO);
    assert!(adm.check_request(&mut one, "thread/list", None).is_err());
    adm.check_request(&mut other, "thread/list", None).unwrap();
    tokio::time::sleep(r.retry_after + Duration::from_millis(2)).await;
    adm.check_request(&mut two, "thread/list", None).unwrap();
}

/// A tenant at its rate cannot start afresh by closing its connections and opening new ones:
/// its rate is kept until it is back at a full burst, and only then forgotten.
#[tokio::test]
async fn a_tenant_does_not_reset_its_rate_by_reconnecting() {
    let cfg = AdmissionConfig {
        tenant_rps: 20, // a full burst of 3 back in 150 ms
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    let mut conn = adm.open_connection("acme").unwrap();
    for _ in 0..3 {
        adm.check_request(&mut conn, "thread/list", None).unwrap();
    }
    drop(conn);
    adm.prune();
    assert_eq!(adm.limiter_keys(), 1, "kept: not back at a full burst");
    let mut conn = adm.open_connection("acme").unwrap();
    let r = adm
        .check_request(&mut conn, "thread/list", None)
        .unwrap_err();
    assert_eq!(r.reason, Reason::TenantRateLimited);
    drop(conn);
    tokio::time::sleep(Duration::from_millis(160)).await;
    adm.prune();
    assert_eq!(adm.limiter_keys(), 0, "back at a full burst: forgotten");
    let mut conn = adm.open_connection("acme").unwrap();
    for _ in 0..3 {
        adm.check_request(&mut conn, "thread/list", None).unwrap();
    }
    // Held by a connection, it is never forgotten, however long it waits.
    tokio::time::sleep(Duration::from_millis(160)).await;
    adm.prune();
    assert_eq!(adm.limiter_keys(), 1);
}

/// A tenant's byte accounts (its clients' queues, its legs, its sockets' read buffers) last as
/// long as a session holds them, and no longer: a tenant a reload removed, or one that stopped
/// connecting, leaves nothing behind; one still connected keeps its totals.
#[test]
fn a_tenants_byte_accounts_go_once_no_session_holds_them() {
    let adm = Admission::new(small()).unwrap();
    let accounts = |adm: &Admission| {
        [
            lock(&adm.queued).len(),
            lock(&adm.leg_bytes).len(),
            lock(&adm.held).len(),
        ]
    };
    let queue = adm.client_queue_bytes("acme", 1000, 5000);
    let legs = adm.leg_budget("acme", 1000, 5000);
    let mut held = adm.held_buffer("acme", 1 << 20);
    assert!(queue.try_add(300));
    legs.add(400);
    assert!(held.read(200 * 1024));
    let held_before = adm.held_bytes("acme");
    assert!(held_before > 0);
    {
        let _gone = (
            adm.client_queue_bytes("globex", 1000, 5000),
            adm.leg_budget("globex", 1000, 5000),
            adm.held_buffer("globex", 1 << 20),
        );
    }
    assert_eq!(accounts(&adm), [2, 2, 2]);
    adm.prune();
    assert_eq!(accounts(&adm), [1, 1, 1], "globex's are gone, acme's held");
    // acme's totals are the ones its sessions still count against.
    let other = adm.client_queue_bytes("acme", 1000, 500);
    assert!(
        !other.try_add(300),
        "acme's 300 still count against its total of 500"
    );
    assert_eq!(adm.held_bytes("acme"), held_before);
    assert_eq!(adm.leg_bytes("acme"), 400);
    drop((queue, other, legs, held));
    adm.prune();
    assert_eq!(accounts(&adm), [0, 0, 0]);
    assert_eq!((adm.held_bytes("acme"), adm.leg_bytes("acme")), (0, 0));
}

/// The turn-start rate is the tenant's, not a connection's: its connections share it, another
/// tenant's is its own, and closing every connection and opening a new one does not reset it,
/// also after the request rate is back at a full burst.
#[tokio::test]
async fn a_tenant_s_turn_rate_is_shared_by_its_connections_and_kept_across_reconnects() {
    let cfg = AdmissionConfig {
        tenant_rps: 1000,
        tenant_burst: 100,      // requests back at a full burst in 100 ms
        turn_start_per_min: 60, // turn starts in 2 s
        max_active_turns_per_tenant: 100,
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    let mut acme = [
        adm.open_connection("acme").unwrap(),
        adm.open_connection("acme").unwrap(),
    ];
    let mut other = adm.open_connection("other").unwrap();
    third_turn_start_refused(&adm, &mut acme);
    adm.check_request(&mut other, "turn/start", Some("t1"))
        .unwrap();
    drop(acme);
    tokio::time::sleep(Duration::from_millis(150)).await;
    adm.prune();
    assert_eq!(adm.limiter_keys(), 2, "acme's kept: its turns are not back");
    let mut again = adm.open_connection("acme").unwrap();
    adm.check_request(&mut again, "thread/list", None).unwrap();
    let r = adm
        .check_request(&mut again, "turn/start", Some("t3"))
        .unwrap_err();
    assert_eq!(r.reason, Reason::TurnRateLimited, "reset by reconnecting");
}

/// Starts `t1` and `t2` on `acme`'s connections in turn, which the turn rate of `small()` (a
/// burst of 2) admits, then `t3` on the first, which it refuses: that refusal.
fn third_turn_start_refused(adm: &Admission, acme: &mut [ConnectionGuard]) -> Rejection {
    let n = acme.len();
    adm.check_request(&mut acme[0], "turn/start", Some("t1"))
        .unwrap();
    adm.check_request(&mut acme[1 % n], "turn/start", Some("t2"))
        .unwrap();
    let r = adm
        .check_request(&mut acme[0], "turn/start", Some("t3"))
        .unwrap_err();
    assert_eq!(
        (r.scope, r.reason),
        (Scope::Tenant, Reason::TurnRateLimited)
    );
    r
}

#[tokio::test]
async fn turn_start_has_its_own_rate() {
    let cfg = AdmissionConfig {
        tenant_burst: 100,
        max_active_turns_per_tenant: 100,
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    let mut conn = [adm.open_connection("acme").unwrap()];
    let r = third_turn_start_refused(&adm, &mut conn);
    let [mut conn] = conn;
    assert!(r.retry_after > Duration::ZERO && r.retry_after <= Duration::from_millis(100));
    // Other methods are still admitted.
    adm.check_request(&mut conn, "thread/read", Some("t1"))
        .unwrap();
    tokio::time::sleep(r.retry_after + Duration::from_millis(2)).await;
    adm.check_request(&mut conn, "turn/start", Some("t3"))
        .unwrap();
}

#[test]
fn active_turn_cap_counts_threads_and_lets_steering_through() {
    let cfg = AdmissionConfig {
        tenant_burst: 100,
        turn_start_burst: 100,
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    let mut acme = adm.open_connection("acme").unwrap();
    let mut other = adm.open_connection("other").unwrap();
    adm.turn_started("acme", "t1");
    adm.turn_started("acme", "t1"); // the same broadcast seen by a second session
    adm.turn_started("acme", "t2");
    assert_eq!(adm.active_turns("acme"), 2);
    let r = adm
        .check_request(&mut acme, "turn/start", Some("t3"))
        .unwrap_err();
    assert_eq!(
        (r.scope, r.reason),
        (Scope::Tenant, Reason::ActiveTurnLimit)
    );
    assert_eq!(r.retry_after, Duration::from_millis(500));
    assert_eq!(r.http_status(), 503);
    // A turn/start on a thread that runs a turn steers it.
    adm.check_request(&mut acme, "turn/start", Some("t1"))
        .unwrap();
    // Another tenant has its own count.
    adm.check_request(&mut other, "turn/start", Some("t9"))
        .unwrap();
    adm.turn_ended("acme", "t2");
    adm.turn_ended("acme", "t2");
    assert_eq!(adm.active_turns("acme"), 1);
    adm.check_request(&mut acme, "turn/start", Some("t3"))
        .unwrap();
}

#[test]
fn connection_caps_release_on_drop() {
    let adm = Admission::new(small()).unwrap();
    let a1 = adm.open_connection("a").unwrap();
    let a2 = adm.open_connection("a").unwrap();
    let r = adm.open_connection("a").err().unwrap();
    assert_eq!(
        (r.scope, r.reason),
        (Scope::Tenant, Reason::TooManyConnections)
    );
    assert_eq!(r.http_status(), 503);
    assert!(r.retry_after_secs() >= 1);
    let b1 = adm.open_connection("b").unwrap();
    let r = adm.open_connection("c").err().unwrap();
    assert_eq!(
        (r.scope, r.reason),
        (Scope::Fleet, Reason::TooManyConnections)
    );
    assert_eq!(adm.connections("a"), (2, 3));
    drop(a1);
    assert_eq!(adm.connections("a"), (1, 2));
    let c1 = adm.open_connection("c").unwrap();
    assert_eq!(c1.tenant(), "c");
    drop((a2, b1, c1));
    assert_eq!(adm.connections("a"), (0, 0));
    // No per-tenant entries are left behind.
    assert!(lock(&adm.counts).tenants.is_empty());
}

#[tokio::test]
async fn handshakes_are_limited_per_source_address() {
    let adm = Admission::new(small()).unwrap();
    let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    adm.check_handshake(ip).unwrap();
    adm.check_handshake(ip).unwrap();
    let r = adm.check_handshake(ip).unwrap_err();
    assert_eq!(r.reason, Reason::HandshakeRateLimited);
    assert_eq!(r.http_status(), 429);
    adm.check_handshake(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2)))
        .unwrap();
    // IPv6 addresses of one /64 share a budget.
    let v6 = |last| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 2, 0, 0, 0, last));
    adm.check_handshake(v6(1)).unwrap();
    adm.check_handshake(v6(2)).unwrap();
    assert!(adm.check_handshake(v6(3)).is_err());
    tokio::time::sleep(r.retry_after + Duration::from_millis(2)).await;
    adm.check_handshake(ip).unwrap();
}

#[tokio::test]
async fn idle_keyed_state_is_pruned() {
    let cfg = AdmissionConfig {
        tenant_rps: 1000,
        tenant_burst: 1,
        handshakes_per_sec_per_ip: 1000,
        handshake_burst: 1,
        max_connections: 1000,
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    for i in 0..200_u8 {
        let mut conn = adm.open_connection(&format!("t{i}")).unwrap();
        adm.check_request(&mut conn, "thread/list", None).unwrap();
        adm.check_handshake(IpAddr::V4(Ipv4Addr::new(10, 0, 0, i)))
            .unwrap();
    }
    assert_eq!(adm.limiter_keys(), 400);
    tokio::time::sleep(Duration::from_millis(20)).await;
    adm.prune();
    assert_eq!(adm.limiter_keys(), 0);
}

#[tokio::test]
async fn stale_active_turns_expire() {
    let cfg = AdmissionConfig {
        active_turn_ttl_secs: 0,
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    adm.turn_started("acme", "t1");
    adm.prune();
    assert_eq!(adm.active_turns("acme"), 0);
    assert!(lock(&adm.counts).tenants.is_empty());
}

#[tokio::test]
async fn worker_slots_are_bounded_with_a_short_wait() {
    let adm = Admission::new(small()).unwrap();
    let p1 = adm.worker_slot(worker(0)).await.unwrap();
    let _p2 = adm.try_worker_slot(worker(0)).unwrap();
    let started = Instant::now();
    let r = adm.worker_slot(worker(0)).await.unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(30));
    assert_eq!((r.scope, r.reason), (Scope::Worker, Reason::WorkerBusy));
    assert!(r.retry_after_ms_jittered() >= 30);
    assert_eq!(
        adm.try_worker_slot(worker(0)).unwrap_err().reason,
        Reason::WorkerBusy
    );
    // Another worker has its own slots.
    let _q = adm.try_worker_slot(worker(1)).unwrap();
    // A slot freed during the wait is taken (a long wait, so a loaded machine cannot flake it).
    adm.reconfigure(AdmissionConfig {
        in_flight_wait_ms: 10_000,
        ..small()
    })
    .unwrap();
    let adm2 = Arc::clone(&adm);
    let waiter = tokio::spawn(async move { adm2.worker_slot(worker(0)).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(5)).await;
    drop(p1);
    waiter.await.unwrap().unwrap();
}

#[tokio::test]
async fn idle_worker_semaphores_are_pruned() {
    let adm = Admission::new(small()).unwrap();
    let held = adm.try_worker_slot(worker(0)).unwrap();
    drop(adm.try_worker_slot(worker(1)).unwrap());
    adm.prune();
    assert_eq!(lock(&adm.workers).len(), 1);
    drop(held);
    adm.prune();
    assert!(lock(&adm.workers).is_empty());
    adm.try_worker_slot(worker(2)).unwrap();
    adm.forget_worker(worker(2));
    assert!(lock(&adm.workers).is_empty());
}

#[tokio::test]
async fn slots_a_leg_keeps_are_the_workers_and_follow_a_new_cap() {
    let adm = Admission::new(AdmissionConfig {
        max_in_flight_per_worker: 2,
        ..small()
    })
    .unwrap();
    let mut kept = adm.worker_slots(worker(0));
    let a = adm.try_slot(&mut kept).unwrap();
    // The same slots as a lookup takes: two in all, whichever way they are taken.
    let b = adm.try_worker_slot(worker(0)).unwrap();
    assert!(adm.try_slot(&mut kept).is_err());
    assert!(adm.try_worker_slot(worker(0)).is_err());
    // Kept slots are not pruned while a leg holds them, even with none taken.
    drop((a, b));
    adm.prune();
    assert_eq!(lock(&adm.workers).len(), 1);
    let taken = adm.try_slot(&mut kept).unwrap();
    assert!(adm.try_worker_slot(worker(0)).is_ok());
    drop(taken);
    // A reload's new cap applies to kept slots too, from their next request on.
    adm.reconfigure(AdmissionConfig {
        max_in_flight_per_worker: 1,
        ..small()
    })
    .unwrap();
    let one = adm.try_slot(&mut kept).unwrap();
    assert!(adm.try_slot(&mut kept).is_err());
    assert!(adm.try_worker_slot(worker(0)).is_err());
    drop(one);
    assert!(adm.try_worker_slot(worker(0)).is_ok());
}

#[tokio::test]
async fn reconfigure_keeps_counts_and_applies_new_limits() {
    let adm = Admission::new(small()).unwrap();
    let mut c = adm.open_connection("a").unwrap();
    adm.turn_started("a", "t1");
    for _ in 0..3 {
        adm.check_request(&mut c, "thread/list", None).unwrap();
    }
    assert!(adm.check_request(&mut c, "thread/list", None).is_err());
    let wider = AdmissionConfig {
        tenant_burst: 10,
        max_connections_per_tenant: 1,
        ..small()
    };
    adm.reconfigure(wider).unwrap();
    assert_eq!(adm.connections("a"), (1, 1));
    assert_eq!(adm.active_turns("a"), 1);
    // The open connection takes the new quota: a full burst of 10, shared as before.
    for _ in 0..10 {
        adm.check_request(&mut c, "thread/list", None).unwrap();
    }
    assert!(adm.check_request(&mut c, "thread/list", None).is_err());
    assert!(adm.open_connection("a").is_err());
    assert!(adm
        .reconfigure(AdmissionConfig {
            tenant_rps: 0,
            ..small()
        })
        .is_err());
    assert_eq!(adm.config().tenant_burst, 10);
}

#[tokio::test]
async fn the_pruner_runs_and_stops_when_dropped() {
    let cfg = AdmissionConfig {
        tenant_rps: 1000,
        tenant_burst: 1,
        ..small()
    };
    let adm = Admission::new(cfg).unwrap();
    let mut conn = adm.open_connection("a").unwrap();
    adm.check_request(&mut conn, "thread/list", None).unwrap();
    drop(conn);
    let pruner = adm.spawn_pruner(Duration::from_millis(10));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(adm.limiter_keys(), 0);
    drop(pruner);
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut conn = adm.open_connection("a").unwrap();
    adm.check_request(&mut conn, "thread/list", None).unwrap();
    drop(conn);
    tokio::time::sleep(Duration::from_millis(40)).await;
    assert_eq!(adm.limiter_keys(), 1, "a dropped pruner must not run");
}

#[test]
fn worker_overload_is_rewritten_with_the_configured_wait() {
    let adm = Admission::new(small()).unwrap();
    let text = r#"{"id":3,"error":{"code":-32001,"message":"Server overloaded; retry later.","data":null}}"#;
    let v: serde_json::Value =
        serde_json::from_str(&adm.rewrite_worker_overload(text).unwrap()).unwrap();
    assert_eq!(v["error"]["data"]["scope"], "worker");
    let ms = v["error"]["data"]["retryAfterMs"].as_u64().unwrap();
    assert!((30..=37).contains(&ms), "{ms}");
    assert_eq!(adm.rewrite_worker_overload(r#"{"id":3,"result":{}}"#), None);
}

#[tokio::test]
async fn tracked_turns_are_corrected_by_the_workers_count_once_settled() {
    let adm = Admission::new(small()).unwrap();
    let settled = Duration::from_millis(50);
    adm.turn_started("acme", "t1");
    tokio::time::sleep(Duration::from_millis(60)).await;
    adm.turn_started("acme", "t2");
    let mut conn = adm.open_connection("acme").unwrap();
    assert!(adm
        .check_request(&mut conn, "turn/start", Some("t3"))
        .is_err());
    // The workers say none runs: only t1 is old enough to be dropped (t2 may just not have
    // reached the workers' count yet).
    adm.reconcile_turns("acme", 0, settled);
    assert_eq!(adm.active_turns("acme"), 1);
    adm.turn_ended("acme", "t2");
    assert_eq!(adm.active_turns("acme"), 0, "t2 was the one kept");
    adm.reconcile_turns("nobody", 0, settled);
    adm.turn_started("acme", "t4");
    adm.reconcile_turns("acme", 5, Duration::ZERO);
    assert_eq!(adm.active_turns("acme"), 1);
}

/// A relayed turn start or end counts once for the tenant, however many of its sessions report
/// it; and sessions reporting a thread's start and then its end, at once on two threads, never
/// leave the turn counted as running (the end is applied after the start, whoever took it).
#[test]
fn a_relayed_turn_mark_counts_once_and_in_the_relay_s_order() {
    let adm = Admission::new(small()).unwrap();
    let start = TurnMark::new(Arc::from("t1"), true);
    adm.turn_marked("acme", &start);
    adm.turn_ended("acme", "t1"); // the leg's turn/completed
    adm.turn_marked("acme", &start); // the same start, seen late by a second session
    assert_eq!(adm.active_turns("acme"), 0, "taken once: not counted again");
    let adm = Arc::new(adm);
    for round in 0..2_000 {
        let thread: Arc<str> = Arc::from(format!("t{round}"));
        let marks = [TurnMark::new(thread.clone(), true), TurnMark::ended(thread)];
        let go = Arc::new(std::sync::Barrier::new(2));
        let sessions: Vec<_> = (0..2)
            .map(|_| {
                let (adm, marks, go) = (adm.clone(), marks.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    for mark in &marks {
                        adm.turn_marked("acme", mark);
                    }
                })
            })
            .collect();
        for s in sessions {
            s.join().unwrap();
        }
        assert_eq!(adm.active_turns("acme"), 0, "round {round}: the turn ended");
    }
}
