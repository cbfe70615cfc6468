//! Admission control end to end (docs/decisions/0007-admission-before-work.md): rates and caps
//! answer `-32001` with scope, reason and `retryAfterMs`; refusals at the door are HTTP 429/503
//! with `Retry-After`; bad input gets defined answers; a slow reader harms no one. Real workers,
//! the mock model, small limits.
//!
//! Tests 2, 3 and 6 print what they measured (`--nocapture` shows it).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::{
    agent_text, reply_text, wait_until, wait_until_async, Client, FleetBuilder, Upgrade,
};
use tokio::time::Instant;

/// Generous rates, so a test only meets the limit it is about.
const OPEN_RATES: &str = "tenant_rps = 100000\ntenant_burst = 100000\nconn_fps = 100000\nconn_burst = 100000\nturn_start_per_min = 100000\nturn_start_burst = 1000\nhandshakes_per_sec_per_ip = 1000\nhandshake_burst = 1000";

/// Asserts the documented `-32001` shape and returns its `data`.
fn overloaded(resp: &Value, scope: &str) -> Value {
    let e = &resp["error"];
    assert_eq!(e["code"], -32001, "{resp}");
    assert_eq!(e["message"], "Server overloaded; retry later.", "{resp}");
    assert_eq!(e["data"]["scope"], scope, "{resp}");
    assert!(e["data"]["reason"].is_string(), "{resp}");
    assert!(
        e["data"]["retryAfterMs"].as_u64().is_some_and(|ms| ms >= 1),
        "{resp}"
    );
    e["data"].clone()
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// The next error response.
async fn next_error(c: &mut Client) -> anyhow::Result<Value> {
    c.wait_for(|v| v.get("error").is_some()).await
}

/// Resident set size of this process (the fleet runs in it), in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Reads answers until every id in `ids` has one, then sends one more request and reads up to
/// its answer, so a late second answer to any of `ids` is seen too; returns them by id.
async fn answers(c: &mut Client, ids: &[i64]) -> anyhow::Result<HashMap<i64, Value>> {
    let mut want: std::collections::HashSet<i64> = ids.iter().copied().collect();
    let mut got = HashMap::new();
    while !want.is_empty() {
        let v = c
            .wait_for(|v| v.get("method").is_none() && v["id"].is_i64())
            .await?;
        let id = v["id"].as_i64().unwrap_or_default();
        anyhow::ensure!(want.remove(&id), "unexpected or repeated answer {v}");
        got.insert(id, v);
    }
    // The sentinel's answer (a result or a refusal) comes after anything still on its way.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sentinel = c.send_request("thread/loaded/list", json!({})).await?;
    let v = c
        .wait_for(|v| v.get("method").is_none() && v["id"].is_i64())
        .await?;
    anyhow::ensure!(
        v["id"] == sentinel,
        "an answer after every request was answered: {v}"
    );
    Ok(got)
}

// 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_rate_is_per_connection_and_recovers() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml("conn_fps = 5\nconn_burst = 10\ntenant_rps = 100000\ntenant_burst = 100000")
        .start()
        .await?;
    let mut a = fleet.client("acme").await?; // initialize + initialized: 2 frames
    let mut b = fleet.client("acme").await?;
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(a.send_request("thread/loaded/list", json!({})).await?);
    }
    let got = answers(&mut a, &ids).await?;
    let refused: Vec<&Value> = ids
        .iter()
        .map(|id| &got[id])
        .filter(|v| v.get("error").is_some())
        .collect();
    assert!(
        (8..=12).contains(&refused.len()),
        "about 8 of 20 fit the burst; refused {}",
        refused.len()
    );
    let data = overloaded(refused.last().expect("a refusal"), "connection");
    assert_eq!(data["reason"], "connectionRateLimited");
    // A second connection of the same tenant is unaffected.
    b.request("thread/loaded/list", json!({})).await?;
    // After retryAfterMs the first connection is served again.
    let wait = data["retryAfterMs"].as_u64().unwrap_or(1000);
    assert!(
        wait <= 250,
        "one frame at 5/s is due within 200 ms (+jitter): {wait}"
    );
    tokio::time::sleep(Duration::from_millis(wait)).await;
    a.request("thread/loaded/list", json!({})).await?;
    assert!(
        fleet
            .metric(
                "codex_fleet_admission_rejections_total",
                &[("scope", "connection"), ("reason", "connectionRateLimited")]
            )
            .await?
            >= refused.len() as f64
    );

    // Notifications cannot be answered: flooding them closes the connection, with a reason.
    let mut c = fleet.client("acme").await?;
    for _ in 0..30 {
        c.send(&json!({ "method": "initialized" })).await?;
    }
    let close = c.recv_close_frame(testkit::STEP).await?;
    assert_eq!(
        close,
        Some((1008, "frame rate limit exceeded".to_owned())),
        "a notification flood is closed with 1008"
    );
    // Responses cannot be answered either: a flood of them is closed the same way.
    let mut d = fleet.client("acme").await?;
    for id in 0..30 {
        d.send(&json!({ "id": 1_000_000 + id, "result": {} }))
            .await?;
    }
    let close = d.recv_close_frame(testkit::STEP).await?;
    assert_eq!(
        close,
        Some((1008, "frame rate limit exceeded".to_owned())),
        "a response flood is closed with 1008"
    );
    b.request("thread/loaded/list", json!({})).await?;
    fleet.stop().await
}

// 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_is_refused_while_another_keeps_its_latency() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("flood")
        .tenant("calm")
        .limits_toml(
            "tenant_rps = 50\ntenant_burst = 100\nconn_fps = 100000\nconn_burst = 100000\n\
             turn_start_per_min = 600\nturn_start_burst = 3\nmax_active_turns_per_tenant = 2",
        )
        .start()
        .await?;
    let mut calm = fleet.client("calm").await?;
    let calm_thread = calm.start_thread().await?;
    let mut flood = fleet.client("flood").await?;
    let threads = [
        flood.start_thread().await?,
        flood.start_thread().await?,
        flood.start_thread().await?,
    ];

    async fn latencies(c: &mut Client, n: usize) -> anyhow::Result<Vec<Duration>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            c.request("thread/loaded/list", json!({})).await?;
            out.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(out)
    }
    // Unloaded baseline, in this run.
    latencies(&mut calm, 5).await?; // warm up
    let unloaded = median(latencies(&mut calm, 25).await?);

    // The active-turn cap: two long turns run, a third is refused.
    for t in &threads[..2] {
        flood.start_turn(t, "hold SLOW4").await?;
        flood
            .wait_for(|v| v["method"] == "turn/started" && v["params"]["threadId"] == t.as_str())
            .await?;
    }
    let third = flood
        .call(
            "turn/start",
            json!({ "threadId": threads[2], "input": [{ "type": "text", "text": "x", "text_elements": [] }] }),
        )
        .await?;
    assert_eq!(overloaded(&third, "tenant")["reason"], "activeTurnLimit");

    // The flood: 40x the tenant rate for two seconds, read on the side.
    let flooding = tokio::spawn(async move {
        let mut ids = Vec::new();
        for _ in 0..200 {
            for _ in 0..10 {
                ids.push(flood.send_request("thread/loaded/list", json!({})).await?);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let got = answers(&mut flood, &ids).await?;
        Ok::<_, anyhow::Error>((ids.len(), got))
    });
    let loaded = median(latencies(&mut calm, 25).await?);
    // The calm tenant's turns complete, without errors, under the flood.
    let mut turn_times = Vec::new();
    for i in 0..2 {
        let prompt = format!("calm turn {i}");
        let t = Instant::now();
        calm.start_turn(&calm_thread, &prompt).await?;
        let msgs = calm.until_turn_completed(&calm_thread).await?;
        turn_times.push(t.elapsed());
        assert_eq!(agent_text(&msgs), Some(reply_text(&prompt)));
        assert!(msgs.iter().all(|m| m.get("error").is_none()), "{msgs:?}");
    }
    let (sent, got) = flooding.await??;
    let refused: Vec<&Value> = got
        .values()
        .filter(|v| v["error"]["code"] == -32001)
        .collect();
    let ok = got.values().filter(|v| v.get("result").is_some()).count();
    assert_eq!(ok + refused.len(), sent, "every flood request is answered");
    assert!(refused.len() > sent / 2, "the flood is mostly refused");
    for r in &refused {
        assert_eq!(overloaded(r, "tenant")["reason"], "tenantRateLimited");
    }
    eprintln!(
        "test2: calm tenant median latency unloaded {unloaded:?}, under flood {loaded:?} \
         (ratio {:.2}); flood tenant sent {sent}, {ok} served, {} refused (tenant); \
         calm turns took {turn_times:?}",
        loaded.as_secs_f64() / unloaded.as_secs_f64(),
        refused.len()
    );
    // Measured ratio about 1.0 (3.9 ms both). Medians of a few ms jitter by scheduling alone on a
    // shared 2-core machine, so the bound is 3x, over a 2 ms floor.
    let floor = unloaded.max(Duration::from_millis(2));
    assert!(
        loaded <= floor * 3,
        "calm tenant latency {loaded:?} exceeds three times its unloaded median {unloaded:?}"
    );
    calm.close().await;
    fleet.stop().await
}

// 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_in_flight_cap_answers_every_pipelined_request() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml(&format!(
            "{OPEN_RATES}\nmax_in_flight_per_worker = 8\nin_flight_wait_ms = 250"
        ))
        .start()
        .await?;
    let mut burst = fleet.client("acme").await?;
    let mut other = fleet.client("acme").await?;
    let thread = other.start_thread().await?;
    let mut unloaded = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        other.request("thread/loaded/list", json!({})).await?;
        unloaded.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let unloaded = median(unloaded);
    const N: usize = 5000;
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        let mut ids = Vec::with_capacity(N);
        for _ in 0..N {
            ids.push(burst.send_request("thread/loaded/list", json!({})).await?);
        }
        let got = answers(&mut burst, &ids).await?;
        Ok::<_, anyhow::Error>((burst, ids, got))
    });
    // Another session on the same worker keeps working meanwhile.
    let mut other_lat = Vec::new();
    let mut other_refused = 0;
    for _ in 0..20 {
        let t = Instant::now();
        let r = other.call("thread/loaded/list", json!({})).await?;
        other_lat.push(t.elapsed());
        if r.get("error").is_some() {
            assert_eq!(overloaded(&r, "worker")["reason"], "workerBusy", "{r}");
            other_refused += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut burst, ids, got) = sender.await??;
    let elapsed = started.elapsed();
    assert_eq!(got.len(), N, "every request gets exactly one answer");
    let mut by_scope: HashMap<String, usize> = HashMap::new();
    for id in &ids {
        let v = &got[id];
        let key = if v.get("result").is_some() {
            "result".to_owned()
        } else {
            let data = overloaded(v, "worker");
            format!("-32001 {}", data["reason"].as_str().unwrap_or_default())
        };
        *by_scope.entry(key).or_default() += 1;
    }
    eprintln!(
        "test3: {N} pipelined requests answered in {elapsed:?}: {by_scope:?}; another session \
         on the same worker meanwhile: median {:?} (unloaded {unloaded:?}), max {:?}, \
         {other_refused} refused",
        median(other_lat.clone()),
        other_lat.iter().max().copied().unwrap_or_default()
    );
    // The other session kept working: every request answered (the `?` above), refusals only
    // the documented workerBusy (checked by `overloaded`), most served, and none waited much
    // past `in_flight_wait_ms` (250 ms) for a slot; 5 s leaves room for a loaded machine.
    assert!(
        other_refused <= other_lat.len() / 2,
        "the other session was mostly refused: {other_refused} of {}",
        other_lat.len()
    );
    let slowest = other_lat.iter().max().copied().unwrap_or_default();
    assert!(
        slowest < Duration::from_secs(5),
        "the other session waited {slowest:?} for an answer"
    );
    // The worker never saw more than 8 at once, so it never shed on its own.
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_admission_rejections_total",
                &[("reason", "workerOverloaded")]
            )
            .await?,
        0.0
    );
    // With one slot and a 1 ms wait (applied like a reload), the cap now sheds: still one answer
    // per request, the refusals as -32001 scope worker.
    let cfg = router::admission::AdmissionConfig {
        max_in_flight_per_worker: 1,
        in_flight_wait_ms: 1,
        ..(*fleet.admission.config()).clone()
    };
    fleet.admission.reconfigure(cfg)?;
    // Every worker's one slot is taken (as by a request of another session that the worker is
    // slow to answer): each request of the burst waits its 1 ms and is refused. Measured by
    // timing alone (a worker slower than 1 ms), the shedding was at the machine's mercy: a
    // quiet machine answered all 1000.
    let held: Vec<_> = fleet
        .tenant("acme")
        .pool
        .workers()
        .iter()
        .map(|w| fleet.admission.try_worker_slot(w.id))
        .collect::<Result<_, _>>()
        .map_err(|r| anyhow::anyhow!("a free slot to hold: {r:?}"))?;
    let mut ids = Vec::new();
    for _ in 0..200 {
        ids.push(burst.send_request("thread/loaded/list", json!({})).await?);
    }
    let got = answers(&mut burst, &ids).await?;
    for v in got.values() {
        assert_eq!(overloaded(v, "worker")["reason"], "workerBusy", "{v}");
    }
    drop(held);
    let mut ids = Vec::new();
    for _ in 0..1000 {
        ids.push(burst.send_request("thread/loaded/list", json!({})).await?);
    }
    let got = answers(&mut burst, &ids).await?;
    let busy = got
        .values()
        .filter(|v| v.get("error").is_some())
        .map(|v| assert_eq!(overloaded(v, "worker")["reason"], "workerBusy"))
        .count();
    eprintln!(
        "test3: with 1 slot and a 1 ms wait: 200 pipelined requests while the slot was held, \
         all -32001 workerBusy; then 1000: {} results, {busy} -32001 workerBusy",
        1000 - busy
    );
    assert!(busy < 1000, "a free slot serves requests again");
    // And it is healthy: it answers and runs a turn.
    let w = fleet.tenant("acme").pool.workers();
    assert!(
        w.iter()
            .all(|w| w.state.as_str() == "ready" && w.restarts == 0),
        "{w:?}"
    );
    burst.request("thread/loaded/list", json!({})).await?;
    other.start_turn(&thread, "after the burst").await?;
    let msgs = other.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("after the burst")));
    fleet.stop().await
}

// 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_caps_and_handshake_rate_answer_http_with_retry_after() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .tenant("beta")
        .limits_toml(
            "max_connections_per_tenant = 2\nmax_connections = 3\n\
             handshakes_per_sec_per_ip = 1\nhandshake_burst = 6\ncap_retry_after_ms = 1500",
        )
        .start()
        .await?;
    let url = fleet.url();
    let ca = fleet.files.ca.clone();
    let acme = fleet.files.token("acme");
    let beta = fleet.files.token("beta");
    let attempt = |token: Option<String>| {
        let (url, ca) = (url.clone(), ca.clone());
        async move { Client::try_connect(&url, &ca, token.as_deref()).await }
    };
    let open = |u: Upgrade| match u {
        Upgrade::Open(c) => *c,
        Upgrade::Refused { status, body, .. } => panic!("refused {status}: {body}"),
    };
    let refused = |u: Upgrade| match u {
        Upgrade::Open(_) => panic!("should be refused"),
        Upgrade::Refused {
            status,
            retry_after,
            body,
        } => (status, retry_after, body),
    };
    let a1 = open(attempt(Some(acme.clone())).await?);
    let _a2 = open(attempt(Some(acme.clone())).await?);
    let (status, retry, body) = refused(attempt(Some(acme.clone())).await?);
    assert_eq!((status, retry), (503, Some(2)), "tenant cap: {body}");
    assert!(
        body.contains("tenant") && body.contains("tooManyConnections"),
        "{body}"
    );
    let _b1 = open(attempt(Some(beta.clone())).await?);
    let (status, retry, body) = refused(attempt(Some(beta.clone())).await?);
    assert_eq!((status, retry), (503, Some(2)), "fleet cap: {body}");
    assert!(body.contains("fleet"), "{body}");
    // A closed connection gives its slot back.
    a1.close().await;
    assert!(
        wait_until(Duration::from_secs(5), || fleet
            .admission
            .connections("acme")
            .0
            == 1)
        .await
    );
    let _a3 = open(attempt(Some(acme.clone())).await?); // the 6th handshake: the burst is spent
                                                        // The 7th, and even one without a token, hits the per-address rate before authentication.
    for token in [Some(acme.clone()), None] {
        let (status, retry, body) = refused(attempt(token).await?);
        assert_eq!(status, 429, "{body}");
        assert!(retry.is_some_and(|s| s >= 1), "{body}");
        assert!(body.contains("handshakeRateLimited"), "{body}");
    }
    // The 429 also says `Connection: close` (and Retry-After). The rate refills at 1/s, so on a
    // slow machine one attempt may be admitted; the header is what this checks.
    let mut head = String::new();
    for _ in 0..3 {
        let raw = testkit::https_raw(
            fleet.addr,
            &ca,
            "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n",
        )
        .await?;
        head = raw
            .split("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        if head.starts_with("http/1.1 429") {
            break;
        }
    }
    assert!(head.starts_with("http/1.1 429"), "{head}");
    assert!(head.contains("\r\nconnection: close"), "{head}");
    assert!(head.contains("\r\nretry-after: "), "{head}");
    for (reason, at_least) in [("handshake_rate", 2.0), ("connection_cap", 2.0)] {
        let n = fleet
            .metric("codex_fleet_upgrades_refused_total", &[("reason", reason)])
            .await?;
        assert!(n >= at_least, "{reason}: {n}");
    }
    fleet.stop().await
}

// 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_defined_answer() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml("max_message_bytes = 65536")
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    let bad_request = |v: &Value, code: i64| {
        assert!(v["id"].is_null(), "{v}");
        assert_eq!(v["error"]["code"], code, "{v}");
    };
    // An id is kept until its request is answered: one over 1 KiB is refused, not kept.
    for (frame, code, id) in testkit::bad_frames() {
        c.send_text(&frame).await?;
        let v = next_error(&mut c).await?;
        assert_eq!(v["id"], id, "{frame:.80}: {v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        eprintln!("{frame:.80} -> {}", v["error"]["message"]);
    }
    c.send_binary(b"{\"id\":1}".to_vec()).await?;
    let v = next_error(&mut c).await?;
    bad_request(&v, -32600);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("binary"));
    // A response to a server-request id never sent: dropped (no answer) and counted.
    c.send(&json!({ "id": 424242, "result": {} })).await?;
    c.send(&json!({ "id": "nope", "result": {} })).await?;
    // The session still works, and nothing else arrived in between.
    let r = c.call("thread/loaded/list", json!({})).await?;
    assert!(r.get("result").is_some(), "{r}");
    assert!(c.backlog_errors().is_empty(), "{:?}", c.backlog);
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_client_errors_total",
                &[("reason", "unknown_response")]
            )
            .await?,
        2.0
    );
    // Too big: 1009.
    let mut big = fleet.client("acme").await?;
    let huge = format!(
        r#"{{"id":1,"method":"thread/loaded/list","params":{{"pad":"{}"}}}}"#,
        "x".repeat(70_000)
    );
    big.send_text(&huge).await?;
    assert_eq!(big.recv_close(testkit::STEP).await?, Some(1009));
    // A run of protocol errors: 1008.
    let mut noisy = fleet.client("acme").await?;
    for _ in 0..32 {
        noisy.send_text("nope").await?;
    }
    let close = noisy.recv_close_frame(testkit::STEP).await?;
    assert_eq!(close.map(|c| c.0), Some(1008));
    assert_eq!(
        noisy
            .backlog
            .iter()
            .filter(|v| v["error"]["code"] == -32700)
            .count(),
        32,
        "each bad frame is answered -32700, then the run closes the connection"
    );
    // The first session is unaffected by the others.
    c.request("thread/loaded/list", json!({})).await?;
    fleet.stop().await
}

// 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_is_cut_off_without_slowing_a_subscriber_of_the_same_thread(
) -> anyhow::Result<()> {
    const DELTAS: usize = 5000;
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml(&format!("{OPEN_RATES}\nclient_queue = 256"))
        .start()
        .await?;
    let mut fast = fleet.client("acme").await?;
    let thread = fast.start_thread().await?;

    /// Runs a turn; returns how long it took and how many deltas arrived.
    async fn timed_turn(
        c: &mut Client,
        thread: &str,
        prompt: &str,
    ) -> anyhow::Result<(Duration, usize)> {
        let t = Instant::now();
        c.start_turn(thread, prompt).await?;
        let msgs = c.until_turn_completed(thread).await?;
        let elapsed = t.elapsed();
        anyhow::ensure!(
            agent_text(&msgs) == Some(reply_text(prompt)),
            "item/completed carries the whole message"
        );
        let done = msgs.last().expect("turn/completed");
        anyhow::ensure!(done["params"]["turn"]["status"] == "completed", "{done}");
        c.backlog.clear();
        let deltas = msgs
            .iter()
            .filter(|m| m["method"] == "item/agentMessage/delta")
            .count();
        Ok((elapsed, deltas))
    }
    let (baseline, alone_deltas) =
        timed_turn(&mut fast, &thread, &format!("MANY{DELTAS} alone")).await?;
    let rss_before = rss_bytes();

    // The slow client subscribes to the same thread, then stops reading.
    let mut slow = Client::connect_small_window(
        fleet.addr,
        &fleet.url(),
        &fleet.files.ca,
        Some(&fleet.files.token("acme")),
        4096,
    )
    .await?;
    slow.initialize("slow-reader").await?;
    slow.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    // It asks for the thread's history (hundreds of KiB per answer) and reads nothing, until
    // the kernel's socket buffers are full and codex-fleet's queue for it starts to grow.
    for _ in 0..16 {
        slow.send_request(
            "thread/read",
            json!({ "threadId": thread, "includeTurns": true }),
        )
        .await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dropped_before = fleet
        .metric("codex_fleet_client_deltas_dropped_total", &[])
        .await?;
    let (loaded, fast_deltas) =
        timed_turn(&mut fast, &thread, &format!("MANY{DELTAS} shared")).await?;
    let sent = reply_text(&format!("MANY{DELTAS} shared"))
        .split_inclusive(' ')
        .count();
    // The counter is the fleet's: deltas the fast subscriber missed may be in it too, so only
    // drops beyond those are the slow client's. The slow session counts its drops as it takes
    // the relayed deltas, which may be after the fast one saw its turn end: waited for.
    let fast_missed = (sent - fast_deltas) as f64;
    let dropped_now = || async {
        fleet
            .metric("codex_fleet_client_deltas_dropped_total", &[])
            .await
            .map_or(0.0, |v| v - dropped_before)
    };
    wait_until_async(Duration::from_secs(10), || async {
        dropped_now().await > fast_missed
    })
    .await;
    let dropped = dropped_now().await;
    let rss_after = rss_bytes();
    // Small answers now fill its queue to the hard mark.
    for _ in 0..600 {
        slow.send_request("thread/loaded/list", json!({})).await?;
    }
    let close = slow.recv_close_frame(testkit::STEP).await?;
    eprintln!(
        "test6: fast subscriber's {DELTAS}-delta turn took {baseline:?} alone ({alone_deltas} deltas received) and {loaded:?} with \
         a stalled subscriber on the thread; of its {sent} deltas the fast one got {fast_deltas} \
         (a debug-build test client lags too), {} were dropped for the slow one; slow one \
         closed with {close:?} after reading {} frames; RSS {} MiB before, {} MiB after \
         (growth {} KiB)",
        dropped - (sent - fast_deltas) as f64,
        slow.backlog.len(),
        rss_before >> 20,
        rss_after >> 20,
        (rss_after.saturating_sub(rss_before)) >> 10
    );
    assert_eq!(
        close,
        Some((1008, "client is not reading fast enough".to_owned()))
    );
    assert!(
        dropped > fast_missed,
        "deltas above the soft mark are dropped for the slow client: {dropped} dropped, of which \
         up to {fast_missed} may be the fast subscriber's"
    );
    assert!(
        loaded <= baseline * 2 + Duration::from_secs(1),
        "the fast subscriber was slowed: {loaded:?} vs {baseline:?}"
    );
    assert!(
        rss_after.saturating_sub(rss_before) < 64 << 20,
        "memory grew by {} MiB",
        (rss_after - rss_before) >> 20
    );
    // The fast client carries on.
    timed_turn(&mut fast, &thread, "after the slow one").await?;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_worker_cap_answers_with_scope_fleet() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .workers_toml("max_workers = 1")
        .tenant_pool("a", 1, 1)
        .tenant("b")
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || testkit::ready_workers(
            &fleet, "a"
        ) == 1)
        .await
    );
    let mut b = fleet.connect("b").await?;
    let r = b
        .call(
            "initialize",
            json!({ "clientInfo": { "name": "b", "version": "1" } }),
        )
        .await?;
    assert_eq!(r["error"]["code"], -32001, "{r}");
    assert_eq!(r["error"]["data"]["scope"], "fleet", "{r}");
    assert_eq!(r["error"]["data"]["reason"], "fleetWorkerLimit", "{r}");
    assert!(
        r["error"]["data"]["retryAfterMs"].as_u64().unwrap_or(0) > 0,
        "{r}"
    );
    // The tenant holding the fleet's only worker is unaffected.
    let mut a = fleet.client("a").await?;
    a.request("thread/loaded/list", json!({})).await?;
    fleet.stop().await
}

/// A connection with `max_in_flight_per_connection` requests unanswered (its worker is stopped)
/// gets `-32001` scope `connection`, reason `tooManyRequestsInFlight`, for the next one, at once;
/// the ones in flight are answered once the worker runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_at_its_in_flight_cap_is_refused_until_answers_come() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .workers_toml("health_interval_secs = 120\nhealth_timeout_secs = 120")
        .limits_toml(OPEN_RATES)
        .limits_toml("max_in_flight_per_connection = 3")
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    c.request("thread/loaded/list", json!({})).await?;
    let workers = testkit::workers_under(&fleet.home("acme"));
    anyhow::ensure!(workers.len() == 1, "{workers:?}");
    let worker = nix::unistd::Pid::from_raw(workers[0]);
    // Stopped for sure before the requests go out, or one may still be answered in between.
    testkit::stop_process(workers[0]).await?;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(c.send_request("thread/loaded/list", json!({})).await?);
    }
    let refused = c.send_request("thread/loaded/list", json!({})).await?;
    let resp =
        tokio::time::timeout(Duration::from_secs(5), c.wait_for(|v| v["id"] == refused)).await??;
    let data = overloaded(&resp, "connection");
    assert_eq!(data["reason"], "tooManyRequestsInFlight", "{resp}");
    nix::sys::signal::kill(worker, nix::sys::signal::Signal::SIGCONT)?;
    let got = answers(&mut c, &ids).await?;
    for (id, v) in &got {
        assert!(v.get("result").is_some(), "request {id}: {v}");
    }
    fleet.stop().await
}

/// Every request that starts a turn, not only `turn/start`, is held to the tenant's active-turn
/// cap and its turn rate: a review, a compaction, a shell command run as a turn, a goal (which
/// runs turns on its own) and the queue's start. Before, only `turn/start` was checked, and a
/// tenant at its cap started as many reviews or compactions as it had threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_that_starts_a_turn_is_held_to_the_active_turn_cap() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .limits_toml(
            "turn_start_per_min = 600\nturn_start_burst = 100\nmax_active_turns_per_tenant = 1",
        )
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    let running = c.start_thread().await?;
    let other = c.start_thread().await?;
    c.start_turn(&running, "hold SLOW4").await?;
    c.wait_for(|v| v["method"] == "turn/started" && v["params"]["threadId"] == running.as_str())
        .await?;
    for (method, params) in [
        (
            "review/start",
            json!({ "threadId": other, "target": { "type": "custom", "instructions": "look" } }),
        ),
        // On the thread that runs the turn: a review is a turn of its own, not a steer.
        (
            "review/start",
            json!({ "threadId": running, "target": { "type": "custom", "instructions": "look" } }),
        ),
        ("thread/compact/start", json!({ "threadId": other })),
        (
            "thread/shellCommand",
            json!({ "threadId": other, "command": "true" }),
        ),
        (
            "thread/goal/set",
            json!({ "threadId": other, "objective": "finish" }),
        ),
        ("thread/queue/start", json!({ "threadId": other })),
    ] {
        let answer = c.call(method, params).await?;
        eprintln!("{method}: {answer:.300}");
        assert_eq!(
            overloaded(&answer, "tenant")["reason"],
            "activeTurnLimit",
            "{method}"
        );
    }
    // Once the running turn ends, the next one is admitted.
    c.until_turn_completed(&running).await?;
    let review = c
        .request(
            "review/start",
            json!({ "threadId": other, "target": { "type": "custom", "instructions": "look" } }),
        )
        .await?;
    assert_eq!(review["turn"]["status"], "inProgress", "{review:.300}");
    fleet.stop().await
}
