//! The tenant boundary against hostile input (docs/decisions/0008-bounded-everything.md,
//! docs/decisions/0012-trust-nothing-a-tenant-can-write.md): bytes queued towards a client that
//! never reads are bounded; a connection before its upgrade gets one request and one deadline, and
//! failed tokens are throttled; a duplicated or reserved request id is answered and frees no slot;
//! pings count against the frame rate; codex-fleet raises its own open-files limit; a flood of
//! made-up thread ids is answered and leaves nothing behind. Real TLS, real workers.
//!
//! `a_flood_of_echoed_megabytes_is_bounded_and_another_tenant_is_still_served` and
//! `a_flood_of_made_up_thread_ids_is_answered_and_leaves_nothing_behind` print what they measured
//! (`--nocapture` shows it).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use testkit::{
    contention, http_get, metric_at, read_all, Client, FleetBuilder, FleetFiles, Upgrade,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Generous rates, so a test only meets the limit it is about.
const OPEN_RATES: &str = "tenant_rps = 100000\ntenant_burst = 100000\nconn_fps = 100000\nconn_burst = 100000\nhandshakes_per_sec_per_ip = 1000\nhandshake_burst = 1000";

/// The documented bound on codex-fleet's memory growth under the flood of item 2 with the
/// default limits: `client_queue_bytes` (64 MiB) for the flooding session, its requests in
/// flight on the worker (`max_in_flight_per_worker` × 1 MiB), and the allocator's slack.
const FLOOD_RSS_BOUND_MIB: u64 = 200;

// === helpers ===

/// A TLS connection to codex-fleet, with no HTTP sent yet.
async fn tls_connect(
    tcp: TcpStream,
    ca: &Path,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let connector = tokio_rustls::TlsConnector::from(testkit::client_tls(ca)?);
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    Ok(connector.connect(name, tcp).await?)
}

/// One HTTP answer (head and `Content-Length` body); `None` when the connection ends with
/// nothing received. Fails when the connection stays open and silent for `within`.
async fn read_answer(
    s: &mut (impl AsyncRead + Unpin),
    within: Duration,
) -> anyhow::Result<Option<String>> {
    let deadline = Instant::now() + within;
    let mut buf = Vec::new();
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if body.len() >= len {
                return Ok(Some(text));
            }
        }
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Err(_) => bail!("the connection neither answered nor closed within {within:?}"),
            Ok(Ok(0) | Err(_)) => return Ok((!buf.is_empty()).then_some(text)),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Every response (no `method`) with `id` that arrives within `within`.
async fn responses_to(c: &mut Client, id: &Value, within: Duration) -> Vec<Value> {
    let mut got = Vec::new();
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return got;
        }
        match c.recv_wire(left).await {
            Ok(v) if v["id"] == *id && v.get("method").is_none() => got.push(v),
            Ok(_) => {}
            Err(_) => return got,
        }
    }
}

/// Starts `codex-fleet serve` as a process (optionally under `prlimit` arguments).
async fn spawn_fleet(
    files: &FleetFiles,
    prlimit: Option<String>,
) -> anyhow::Result<(Child, SocketAddr, SocketAddr)> {
    let mut cmd = match prlimit {
        Some(limit) => {
            let mut c = Command::new("prlimit");
            c.arg(limit).arg(testkit::fleet_bin());
            c
        }
        None => Command::new(testkit::fleet_bin()),
    };
    let mut child = cmd
        .args(["serve", "--config"])
        .arg(&files.config)
        .env("CODEX_FLEET_LOG", "warn")
        // Two runtime threads, as on the machines this suite is sized for, whatever this one has:
        // the tests that pit one tenant against another send as many costly requests as that.
        .env("TOKIO_WORKER_THREADS", "2")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let (addr, admin) = testkit::read_addresses(&mut child).await?;
    Ok((child, addr, admin))
}

/// A counter's value summed over the series whose labels include all of `labels`.
async fn metric(admin: SocketAddr, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    let (_, text) = http_get(admin, "/metrics").await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(name))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// Served, not starved: the other tenant's median during a flood within 20 times its quiet
/// median (at least 100 ms, for a machine whose quiet median is tiny).
fn assert_served(latencies: &mut [Duration], quiet_median: Duration) {
    latencies.sort();
    let median = percentile(latencies, 50);
    let bound = (quiet_median * 20).max(Duration::from_millis(100));
    assert!(
        median < bound,
        "the other tenant's median latency during the flood: {median:?} (quiet {quiet_median:?})"
    );
}

// === item 2: bytes queued towards a client are bounded ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_echoed_megabytes_is_bounded_and_another_tenant_is_still_served(
) -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("flood", 1, 1)
        .tenant_pool("calm", 1, 1)
        .prepare()
        .await?;
    let (child, addr, admin) = spawn_fleet(&files, None).await?;
    let pid = child.id().context("pid")?;
    let url = format!("wss://localhost:{}/", addr.port());
    let ready = async {
        loop {
            if http_get(admin, "/readyz")
                .await
                .is_ok_and(|(s, _)| s == 200)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), ready)
        .await
        .context("codex-fleet never became ready")?;
    let mut calm = Client::connect(&url, &files.ca, Some(&files.token("calm"))).await?;
    calm.initialize("calm").await?;
    let mut flood =
        Client::connect_small_window(addr, &url, &files.ca, Some(&files.token("flood")), 4096)
            .await?;
    flood.initialize("flood").await?;
    let quiet_median = contention::quiet_median(&mut calm).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let baseline = testkit::rss_kib(pid).context("rss")?;

    let peak = Arc::new(AtomicU64::new(baseline));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn({
        let (peak, sampling) = (peak.clone(), sampling.clone());
        async move {
            while sampling.load(Ordering::Acquire) {
                if let Some(kib) = testkit::rss_kib(pid) {
                    peak.fetch_max(kib, Ordering::AcqRel);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    // 300 requests whose 1 MiB method the worker echoes in its error; their answers are
    // never read.
    let flooder = tokio::spawn(async move {
        let method = "x".repeat(1 << 20);
        let mut sent = 0;
        for _ in 0..300 {
            if flood.send_request(&method, json!({})).await.is_err() {
                break;
            }
            sent += 1;
        }
        (flood, sent)
    });
    let mut latencies = Vec::new();
    let mut settle_until = None;
    loop {
        let t = Instant::now();
        let resp = calm.call("thread/loaded/list", json!({})).await?;
        latencies.push(t.elapsed());
        assert!(resp.get("error").is_none(), "calm tenant refused: {resp}");
        if settle_until.is_none() && flooder.is_finished() {
            settle_until = Some(Instant::now() + Duration::from_secs(3));
        }
        if settle_until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_flood, sent) = flooder.await?;
    sampling.store(false, Ordering::Release);
    sampler.await?;
    let slow_closed = metric(
        admin,
        "codex_fleet_sessions_closed_total",
        &[("reason", "slow_client")],
    )
    .await?;

    let growth_mib = peak.load(Ordering::Acquire).saturating_sub(baseline) / 1024;
    latencies.sort();
    let (median, p99) = (percentile(&latencies, 50), percentile(&latencies, 99));
    println!(
        "flood: sent {sent} × 1 MiB; codex-fleet RSS {} MiB → peak {} MiB (growth {growth_mib} MiB, bound {FLOOD_RSS_BOUND_MIB} MiB); \
         calm tenant: {} requests, median {median:?}, p99 {p99:?}, max {:?}",
        baseline / 1024,
        peak.load(Ordering::Acquire) / 1024,
        latencies.len(),
        latencies.last().copied().unwrap_or_default(),
    );
    assert!(
        slow_closed >= 1.0,
        "the flooding session is closed as a slow reader"
    );
    assert!(
        growth_mib < FLOOD_RSS_BOUND_MIB,
        "codex-fleet grew by {growth_mib} MiB under the flood"
    );
    assert_served(&mut latencies, quiet_median);
    Ok(())
}

/// Growth allowed while a client floods a stalled worker: the legs' byte budget (8 MiB here)
/// plus socket and TLS buffers, far below the 256 frames × 1 MiB the leg queue held before.
const STALLED_RSS_BOUND_MIB: u64 = 64;

/// The legs are bounded in bytes too: a client that sends megabyte notifications to a worker
/// that does not read (stopped) fills its session's leg budget, then is simply not read any
/// more (TCP backpressure); codex-fleet's memory stays within the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_towards_a_stalled_worker_is_bounded_in_bytes() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("flood", 1, 1)
        // No hang detection while the worker is stopped on purpose.
        .workers_toml("health_interval_secs = 120\nhealth_timeout_secs = 120")
        .limits_toml(OPEN_RATES)
        .limits_toml("max_message_bytes = 2097152\nclient_queue_bytes = 8388608\ntenant_queue_bytes = 8388608")
        .prepare()
        .await?;
    let (child, addr, admin) = spawn_fleet(&files, None).await?;
    let pid = child.id().context("pid")?;
    let url = format!("wss://localhost:{}/", addr.port());
    let ready = async {
        while !http_get(admin, "/readyz")
            .await
            .is_ok_and(|(s, _)| s == 200)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), ready)
        .await
        .context("codex-fleet never became ready")?;
    let mut flood = Client::connect(&url, &files.ca, Some(&files.token("flood"))).await?;
    flood.initialize("flood").await?;
    let workers = testkit::workers_under(&files.dir.path().join("s/tenants/flood"));
    assert_eq!(workers.len(), 1, "{workers:?}");
    let worker = nix::unistd::Pid::from_raw(workers[0]);
    nix::sys::signal::kill(worker, nix::sys::signal::Signal::SIGSTOP)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = testkit::rss_kib(pid).context("rss")?;

    let mut peak = baseline;
    // Not read any more: the session holds no more, and keeps the client
    // (docs/architecture.md, admission).
    let (sent, held) = flood
        .flood_until_held(300, || peak = peak.max(testkit::rss_kib(pid).unwrap_or(0)))
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    peak = peak.max(testkit::rss_kib(pid).unwrap_or(0));
    nix::sys::signal::kill(worker, nix::sys::signal::Signal::SIGCONT)?;
    let growth_mib = peak.saturating_sub(baseline) / 1024;
    println!(
        "stalled worker: sent {sent} × 1 MiB before the client was not read; codex-fleet grew \
         {growth_mib} MiB (bound {STALLED_RSS_BOUND_MIB} MiB)"
    );
    assert!(
        held,
        "the whole flood ({sent} × 1 MiB) was taken in: the client was never held"
    );
    assert!(
        growth_mib < STALLED_RSS_BOUND_MIB,
        "codex-fleet grew by {growth_mib} MiB under a flood towards a stalled worker"
    );
    // Resumed, the worker drains what waited and answers the same session again: the leg's
    // write that waited for room (worker::leg::UnixIo, watched for writability only then) went
    // through.
    let listed = tokio::time::timeout(
        Duration::from_secs(60),
        flood.request("thread/list", json!({})),
    )
    .await
    .context("no answer after the worker resumed")??;
    assert!(listed.get("data").is_some(), "{listed}");
    Ok(())
}

// === item 3: before the upgrade, one request and one deadline ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upgrade_closes_its_connection() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let tcp = TcpStream::connect(fleet.addr).await?;
    let mut tls = tls_connect(tcp, &fleet.files.ca).await?;
    tls.write_all(testkit::upgrade_request("/", "not-a-token").as_bytes())
        .await?;
    let first = read_answer(&mut tls, Duration::from_secs(10))
        .await?
        .context("no answer to the first request")?;
    assert!(first.starts_with("HTTP/1.1 401"), "{first}");
    assert!(
        first
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "a refusal says the connection closes: {first}"
    );
    // A second try on the same connection: not answered, the connection is gone.
    let _written = tls
        .write_all(testkit::upgrade_request("/", &fleet.files.token("acme")).as_bytes())
        .await;
    let second = read_answer(&mut tls, Duration::from_secs(10)).await?;
    assert_eq!(second, None, "a second request after a 401 got an answer");
    fleet.stop().await
}

/// A masked client text frame (RFC 6455 §5.2), as a client writes it.
fn client_text_frame(text: &str) -> Vec<u8> {
    let payload = text.as_bytes();
    assert!(payload.len() < 126, "short frames only");
    let mask = [0x5a, 0x13, 0xc7, 0x88];
    let mut frame = vec![0x81, 0x80 | payload.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_frame_sent_with_the_upgrade_request_is_not_lost() -> anyhow::Result<()> {
    // A client may send its first frame without waiting for the 101: it arrives in the same
    // read as the request, read ahead by the HTTP layer, and must reach the session first.
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let tcp = TcpStream::connect(fleet.addr).await?;
    let mut tls = tls_connect(tcp, &fleet.files.ca).await?;
    let init = r#"{"jsonrpc":"2.0","id":7,"method":"initialize","params":{"clientInfo":{"name":"eager","version":"1"}}}"#;
    let mut bytes = testkit::upgrade_request("/", &fleet.files.token("acme")).into_bytes();
    bytes.extend(client_text_frame(init));
    tls.write_all(&bytes).await?;
    tls.flush().await?;
    // The 101's head, then whatever follows it is WebSocket.
    let mut got = Vec::new();
    let head_end = loop {
        if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut chunk)).await??;
        anyhow::ensure!(
            n > 0,
            "closed before the 101: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&got[..head_end]).into_owned();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let mut ws = tokio_tungstenite::WebSocketStream::from_partially_read(
        tls,
        got[head_end..].to_vec(),
        tokio_tungstenite::tungstenite::protocol::Role::Client,
        None,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, futures_util::StreamExt::next(&mut ws))
            .await
            .context("no answer to the initialize sent with the upgrade request")?
            .context("the connection ended")??;
        let Some(text) = msg.to_text().ok().filter(|t| !t.is_empty()) else {
            continue;
        };
        let v: Value = serde_json::from_str(text)?;
        if v["id"] == json!(7) {
            assert!(v.get("result").is_some(), "initialize answered with {v}");
            break;
        }
    }
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_deadline_covers_tls_and_the_request() -> anyhow::Result<()> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let config = std::fs::read_to_string(&files.config)?;
    let config = config.replace("handshake_timeout_secs = 5", "handshake_timeout_secs = 2");
    std::fs::write(&files.config, config)?;
    let fleet = files.start().await?;
    let deadline = Duration::from_secs(2);
    let accepted = Instant::now();
    let tcp = TcpStream::connect(fleet.addr).await?;
    // Over half the deadline before the TLS handshake, then the request trickled until the
    // deadline is half a second past, its last byte held back until then: each phase is under
    // the deadline, together they are over it, however fast this machine is.
    tokio::time::sleep(deadline * 6 / 10).await;
    let mut tls = tls_connect(tcp, &fleet.files.ca)
        .await
        .context("the TLS handshake fits in the deadline")?;
    let handshaken = Instant::now();
    let req = testkit::upgrade_request("/", "not-a-token");
    let (body, last) = req.as_bytes().split_at(req.len() - 1);
    let mut pieces = body.chunks(body.len() / 10 + 1);
    let past = deadline + Duration::from_millis(500);
    while accepted.elapsed() < past {
        if let Some(piece) = pieces.next() {
            if tls.write_all(piece).await.is_err() || tls.flush().await.is_err() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let request_phase = handshaken.elapsed();
    assert!(
        request_phase < deadline,
        "the request phase alone ({request_phase:?}) must be under the deadline"
    );
    for piece in pieces.chain([last]) {
        if tls.write_all(piece).await.is_err() || tls.flush().await.is_err() {
            break;
        }
    }
    let answer = read_answer(&mut tls, Duration::from_secs(10)).await?;
    assert_eq!(
        answer,
        None,
        "a request completed {:?} after accept was answered",
        accepted.elapsed()
    );
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_tokens_count_against_the_handshake_rate() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml("handshakes_per_sec_per_ip = 1\nhandshake_burst = 10")
        .start()
        .await?;
    let mut statuses = Vec::new();
    for _ in 0..10 {
        let status = match Client::try_connect(&fleet.url(), &fleet.files.ca, Some("guess")).await?
        {
            Upgrade::Open(_) => bail!("a wrong token was accepted"),
            Upgrade::Refused { status, .. } => status,
        };
        statuses.push(status);
    }
    let refused_401 = statuses.iter().take_while(|s| **s == 401).count();
    assert!(
        statuses.contains(&429),
        "ten wrong tokens within the burst of ten are throttled: {statuses:?}"
    );
    assert!(
        refused_401 <= 8,
        "each failed token costs two handshakes: {statuses:?}"
    );
    fleet.stop().await
}

// === item 2b: the read buffers large frames leave are bounded per tenant ===

/// Exactly `n` sessions were counted closed for `large_frames`: waited for (up to 10 s; a
/// session's end is counted as it finishes, after its close frame went out), then no more.
async fn large_frames_closed(fleet: &testkit::Fleet, n: f64) -> anyhow::Result<()> {
    let closed = || {
        metric_at(
            fleet.admin_addr,
            "codex_fleet_sessions_closed_total",
            &[("reason", "large_frames")],
        )
    };
    let counted = testkit::wait_until_async(Duration::from_secs(10), || async {
        closed().await.is_ok_and(|v| v >= n)
    })
    .await;
    anyhow::ensure!(counted, "the closed sessions were not counted");
    assert_eq!(closed().await?, n, "only the closed sessions are counted");
    Ok(())
}

/// Waits until acme's sockets' read buffers count nothing (its sessions are gone); fails after
/// 10 s.
async fn acme_buffers_freed(fleet: &testkit::Fleet) {
    let freed = testkit::wait_until(Duration::from_secs(10), || {
        fleet.admission.held_bytes("acme") == 0
    })
    .await;
    assert!(
        freed,
        "{} bytes still counted",
        fleet.admission.held_bytes("acme")
    );
}

/// A worker's large answer sizes the read buffer of the leg that reads it, and the buffer stays
/// that large for as long as the leg lives (app-server writes each frame whole). Each tenant's
/// such buffers count against `limits.tenant_queue_bytes`: a session whose answer finds no room
/// is closed (1008) and frees its own, and the tenant's other sessions and the other tenants go
/// on. Without the bound, every one of a tenant's sessions could pin an answer this large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_buffers_large_answers_leave_are_bounded_per_tenant() -> anyhow::Result<()> {
    const BOUND: usize = 16 << 20;
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .tenant_pool("beta", 1, 1)
        .limits_toml(&format!(
            "{OPEN_RATES}\nmax_message_bytes = {BOUND}\nclient_queue_bytes = {BOUND}\n\
             tenant_queue_bytes = {BOUND}"
        ))
        .start()
        .await?;
    // A 6.7 MiB answer: the builder's leg holds it, and its socket its 1 MB prompts.
    let mut a = fleet.client("acme").await?;
    let (thread, answer_bytes) = a.large_thread(3, 1_000_000).await?;
    let (mut readers, mut closed) = (Vec::new(), 0);
    for _ in 0..4 {
        let mut c = fleet.client("acme").await?;
        let id = c.send_request("thread/read", read_all(&thread)).await?;
        match c.wait_for(|v| v["id"] == id).await {
            Ok(v) => {
                anyhow::ensure!(v.get("result").is_some(), "thread/read: {v:.300}");
                readers.push(c);
            }
            Err(e) if e.to_string().contains("hold too many large messages") => closed += 1,
            Err(e) => return Err(e),
        }
        let held = fleet.admission.held_bytes("acme");
        anyhow::ensure!(held <= BOUND, "acme's buffers count {held} bytes");
    }
    let held = fleet.admission.held_bytes("acme");
    eprintln!(
        "measured: 4 sessions reading a {:.1} MiB answer with {} MiB for the tenant's buffers: \
         {} answered, {closed} closed; the tenant's buffers count {:.1} MiB",
        answer_bytes as f64 / 1048576.0,
        BOUND >> 20,
        readers.len(),
        held as f64 / 1048576.0
    );
    // The builder (7.7 MiB) and one reader (6.7) fit; every further reader does not.
    assert_eq!((readers.len(), closed), (1, 3));
    large_frames_closed(&fleet, 3.0).await?;
    // The readers that got their answer go on; another tenant has its own room.
    for c in &mut readers {
        c.request("thread/list", json!({})).await?;
    }
    let mut b = fleet.client("beta").await?;
    b.large_thread(3, 1_000_000).await?;
    assert!(fleet.admission.held_bytes("beta") > answer_bytes);
    // Sessions that end give their buffers back.
    drop((a, readers));
    acme_buffers_freed(&fleet).await;
    fleet.stop().await
}

/// What a client's socket has read of a message not yet whole counts against its tenant as it
/// arrives (tungstenite keeps it in memory until the message ends): a tenant that opens
/// connections and sends each most of a large frame, never finishing it, pins no more than
/// `limits.tenant_queue_bytes` in the process every tenant shares. The connections past the
/// bound are closed (1008) and free what they held; another tenant's large messages have their
/// own room. Before, none of it was counted and each connection could pin `max_message_bytes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_messages_are_bounded_per_tenant_as_they_arrive() -> anyhow::Result<()> {
    const BOUND: usize = 8 << 20;
    const SENT: usize = 3 << 20;
    const CONNECTIONS: usize = 4;
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .tenant_pool("beta", 1, 1)
        .limits_toml(&format!(
            "{OPEN_RATES}\nmax_message_bytes = {m}\nclient_queue_bytes = {m}\n\
             tenant_queue_bytes = {BOUND}",
            m = 4 << 20
        ))
        .start()
        .await?;
    let token = fleet.files.token("acme");
    let (closed, hostile) = testkit::Unfinished::open_many(
        CONNECTIONS,
        fleet.addr,
        &fleet.files.ca,
        &token,
        (4 << 20, SENT),
        router::end::LARGE_FRAMES_REASON,
    )
    .await?;
    let held = fleet.admission.held_bytes("acme");
    eprintln!(
        "measured: {CONNECTIONS} connections each sending {} MiB of an unfinished frame, {} MiB \
         for the tenant's buffers: {closed} closed; the tenant's buffers count {:.2} MiB",
        SENT >> 20,
        BOUND >> 20,
        held as f64 / 1048576.0
    );
    // Two unfinished messages fit, each counted at what arrived of it; the others do not.
    assert_eq!(closed, CONNECTIONS - BOUND / SENT);
    assert!(
        (2 * SENT..=BOUND).contains(&held),
        "the tenant's buffers count {held} bytes"
    );
    large_frames_closed(&fleet, closed as f64).await?;
    // Another tenant has its own room: its large message goes through, and it is served.
    let mut b = fleet.client("beta").await?;
    b.large_thread(1, 1_000_000).await?;
    b.request("thread/list", json!({})).await?;
    assert!(fleet.admission.held_bytes("beta") >= 1_000_000);
    // The connections that hold theirs give it back as they go.
    drop(hostile);
    acme_buffers_freed(&fleet).await;
    fleet.stop().await
}

// === item 7: request ids, pings, open files ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicated_request_id_is_refused_and_frees_no_slot() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml(&format!("{OPEN_RATES}\nmax_in_flight_per_worker = 1"))
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    c.send(&json!({ "id": 7, "method": "thread/start", "params": {} }))
        .await?;
    c.send(&json!({ "id": 7, "method": "thread/loaded/list", "params": {} }))
        .await?;
    let got = responses_to(&mut c, &json!(7), Duration::from_secs(10)).await;
    let errors: Vec<&Value> = got.iter().filter(|v| v.get("error").is_some()).collect();
    let results: Vec<&Value> = got.iter().filter(|v| v.get("result").is_some()).collect();
    assert_eq!(errors.len(), 1, "the duplicate is refused once: {got:?}");
    assert_eq!(errors[0]["error"]["code"], -32600, "{got:?}");
    assert!(
        errors[0]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("duplicate request id")),
        "{got:?}"
    );
    assert_eq!(
        results.len(),
        1,
        "the first is answered exactly once: {got:?}"
    );
    assert!(
        results[0]["result"]["thread"]["id"].is_string(),
        "the answer is the first request's (thread/start): {got:?}"
    );
    // The one slot is free again.
    c.request("thread/loaded/list", json!({})).await?;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_the_routers_reserved_id_is_answered() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml(&format!("{OPEN_RATES}\nmax_in_flight_per_worker = 1"))
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    let reserved = json!("codex-fleet:replay-initialize");
    c.send(&json!({ "id": reserved, "method": "thread/loaded/list", "params": {} }))
        .await?;
    let got = responses_to(&mut c, &reserved, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 1, "answered once: {got:?}");
    assert_eq!(got[0]["error"]["code"], -32600, "{got:?}");
    // It holds no slot: the worker's only one serves the next request.
    let next = c.call("thread/loaded/list", json!({})).await?;
    assert!(next.get("result").is_some(), "{next}");
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_flood_is_closed_by_the_frame_rate() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml("conn_fps = 5\nconn_burst = 10\ntenant_rps = 100000\ntenant_burst = 100000")
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    for _ in 0..40 {
        if c.send_ping(b"ping".to_vec()).await.is_err() {
            break;
        }
    }
    let close = c.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(
        close,
        Some((1008, "frame rate limit exceeded".to_owned())),
        "a ping flood is closed like a notification flood"
    );
    // Another connection of the tenant is unaffected.
    let mut other = fleet.client("acme").await?;
    other.request("thread/loaded/list", json!({})).await?;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_fleet_raises_its_open_files_limit() -> anyhow::Result<()> {
    use nix::sys::resource::{getrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    assert!(hard >= 2, "the hard open-files limit is {hard}");
    let soft = (hard / 2).min(1024);
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let (child, _, _) = spawn_fleet(&files, Some(format!("--nofile={soft}:{hard}"))).await?;
    let pid = child.id().context("pid")?;
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open-files line")?;
    let values: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(
        values,
        vec![hard, hard],
        "codex-fleet started with a soft limit of {soft} raises it to the hard limit: {line}"
    );
    Ok(())
}

// === made-up thread ids ===

/// Made-up thread ids in flight at once from the flooding session.
const MADE_UP_WINDOW: usize = 64;

/// A tenant that sends thousands of requests naming threads that do not exist (each a new id)
/// gets an answer to every one, grows nothing in codex-fleet that lives on (no thread owner
/// learnt, no limiter key, no metric series per id), and another tenant is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_made_up_thread_ids_is_answered_and_leaves_nothing_behind() -> anyhow::Result<()>
{
    const IDS: usize = 3_000;
    let fleet = FleetBuilder::new()
        .tenant_pool("flood", 1, 1)
        .tenant_pool("calm", 1, 1)
        .limits_toml(OPEN_RATES)
        .start()
        .await?;
    let mut calm = fleet.client("calm").await?;
    let mut flood = fleet.client("flood").await?;
    let quiet_median = contention::quiet_median(&mut calm).await?;
    let (_, metrics_before) = fleet.admin_get("/metrics").await?;
    let series_before = metrics_before
        .lines()
        .filter(|l| !l.starts_with('#'))
        .count();
    let limiter_keys = fleet.admission.limiter_keys();

    let made_up = |n: usize| format!("0000dead-beef-4000-8000-{n:012x}");
    let flooder = tokio::spawn(async move {
        let mut pending = std::collections::HashSet::new();
        let (mut sent, mut errors, mut results) = (0, 0, 0);
        while sent < IDS || !pending.is_empty() {
            while sent < IDS && pending.len() < MADE_UP_WINDOW {
                let method = if sent % 2 == 0 {
                    "thread/read"
                } else {
                    "thread/resume"
                };
                let id = flood
                    .send_request(method, json!({ "threadId": made_up(sent) }))
                    .await?;
                pending.insert(id);
                sent += 1;
            }
            let answer = flood
                .wait_for_within(
                    |v| v.get("method").is_none() && v["id"].is_i64(),
                    Duration::from_secs(30),
                )
                .await
                .context("an answer to a made-up thread id")?;
            let id = answer["id"].as_i64().context("id")?;
            anyhow::ensure!(
                pending.remove(&id),
                "an answer to {id}, never asked or twice"
            );
            if answer.get("error").is_some() {
                errors += 1;
            } else {
                results += 1;
            }
        }
        anyhow::Ok((flood, errors, results))
    });
    let mut latencies = Vec::new();
    while !flooder.is_finished() {
        let t = Instant::now();
        let resp = calm.call("thread/loaded/list", json!({})).await?;
        latencies.push(t.elapsed());
        assert!(resp.get("error").is_none(), "calm tenant refused: {resp}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut flood, errors, results) = flooder.await??;
    latencies.sort();
    println!(
        "made-up thread ids: {IDS} answered ({errors} errors, {results} results); calm tenant: \
         {} requests, median {:?} (quiet {quiet_median:?})",
        latencies.len(),
        percentile(&latencies, 50)
    );
    assert_eq!(errors, IDS, "every made-up thread id gets an error");
    // Nothing learnt: no owner for any of them, no thread loaded on the flooding tenant's
    // worker.
    let pool = &fleet.tenant("flood").pool;
    for n in (0..IDS).step_by(97) {
        assert_eq!(
            pool.owner(&made_up(n)),
            None,
            "an owner learnt for a made-up id"
        );
    }
    assert!(
        pool.loaded_threads().iter().all(|(_, t)| t.is_empty()),
        "threads loaded by the flood: {:?}",
        pool.loaded_threads()
    );
    assert_eq!(
        fleet.admission.limiter_keys(),
        limiter_keys,
        "limiter keys grew"
    );
    let (_, metrics_after) = fleet.admin_get("/metrics").await?;
    let series_after = metrics_after
        .lines()
        .filter(|l| !l.starts_with('#'))
        .count();
    // A few series may appear for the first time (an error reason, a method's histogram); none
    // may be per thread id.
    assert!(
        series_after < series_before + 50,
        "metric series {series_before} -> {series_after}"
    );
    assert!(
        !metrics_after.contains("0000dead-beef"),
        "a made-up thread id reached /metrics"
    );
    // The flooding session itself still works, and a thread it really starts has its owner
    // learnt (so the check above could have seen one).
    let real = flood.start_thread().await?;
    assert!(
        pool.owner(&real).is_some(),
        "no owner learnt for a real thread"
    );
    assert_served(&mut latencies, quiet_median);
    fleet.stop().await
}

// === a tenant's costly requests ===

/// A fleet of tenants `hog` and `calm`, the calm tenant's client and quiet median, and `hogs`
/// connections of the hog tenant; the fleet lives as long as the child.
async fn hog_and_calm(hogs: usize) -> anyhow::Result<HogAndCalm> {
    hog_and_calm_with(hogs, |_| Ok(())).await
}

/// A fleet of two tenants, `calm` connected and its quiet median taken, and the hog's
/// connections, initialized.
struct HogAndCalm {
    _fleet: Child,
    /// Its state directory lives as long as this.
    _files: FleetFiles,
    admin: SocketAddr,
    calm: Client,
    quiet: Duration,
    hogs: Vec<Client>,
}

/// [`hog_and_calm`], with `setup` given the hog's workspace before the fleet starts.
async fn hog_and_calm_with(
    hogs: usize,
    setup: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<HogAndCalm> {
    let files = FleetBuilder::new()
        .tenant_pool("hog", 1, 1)
        .tenant_pool("calm", 1, 1)
        .limits_toml(OPEN_RATES)
        .prepare()
        .await?;
    let workspace = files.dir.path().join("s/workspaces/hog");
    std::fs::create_dir_all(&workspace)?;
    setup(&workspace)?;
    let (child, addr, admin) = spawn_fleet(&files, None).await?;
    let url = format!("wss://localhost:{}/", addr.port());
    let mut calm = Client::connect(&url, &files.ca, Some(&files.token("calm"))).await?;
    calm.initialize("calm").await?;
    let quiet = contention::quiet_median(&mut calm).await?;
    let mut connected = Vec::new();
    for _ in 0..hogs {
        let mut hog = Client::connect(&url, &files.ca, Some(&files.token("hog"))).await?;
        hog.initialize("hog").await?;
        connected.push(hog);
    }
    Ok(HogAndCalm {
        _fleet: child,
        _files: files,
        admin,
        calm,
        quiet,
        hogs: connected,
    })
}

/// A confined request's check resolves every path it names, about a system call per path
/// component: a `turn/start` of 75,000 file inputs is 3 MB and about a second of checking.
/// Those checks run on the blocking pool, one of a tenant's at a time, so a tenant that sends
/// one on each of 8 connections at once slows only itself: another tenant never waits as long
/// as one check takes. (Before, each check held a runtime thread: with as many checks as threads,
/// nobody else was answered until they ended, and the other tenant waited 1.2 s at a time, twice
/// the hog's quickest answer.) The hog's requests are still answered as before: the last path is
/// outside its workspace, so each is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_costly_host_access_checks_leave_other_tenants_served() -> anyhow::Result<()> {
    let mut input: Vec<Value> = (0..75_000)
        .map(|i| json!({ "type": "localImage", "path": format!("pictures/{i}.png") }))
        .collect();
    input.push(json!({ "type": "localImage", "path": "/etc/passwd" }));
    let request = json!({ "id": 1, "method": "turn/start", "params": { "threadId": "thr_hog", "input": input } });
    let mut f = hog_and_calm(8).await?;
    let (admin, quiet) = (f.admin, f.quiet);
    let mut m = contention::while_hogs_send(&mut f.calm, f.hogs, request.to_string()).await?;
    assert!(m.failed.is_empty(), "{:?}", m.failed);
    for (answer, _) in &m.answers {
        assert_eq!(answer["error"]["code"], -32003, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("`input`"), "{answer}");
    }
    let (quickest, slowest) = (m.answers[0].1, m.answers[m.answers.len() - 1].1);
    let longest = m.longest();
    eprintln!(
        "measured: 8 checks of 75,001 paths answered after {quickest:?} to {slowest:?}; calm's {} \
         requests meanwhile: median {:?}, max {longest:?} (quiet median {quiet:?})",
        m.latencies.len(),
        percentile(&m.latencies, 50),
    );
    assert!(
        longest < quickest,
        "calm waited {longest:?} at once, longer than the hog's quickest check ({quickest:?})"
    );
    assert_served(&mut m.latencies, quiet);
    // Each of the hog's 3 MB frames took two costly steps (the parse, the check), and the metrics
    // say so under its name only; its sessions waited for their turns, as the answers spread.
    let metric = |tenant: &'static str, step: &'static str| async move {
        let labels = [("tenant", tenant), ("step", step)];
        testkit::metric_at(admin, "codex_fleet_costly_steps_total", &labels).await
    };
    let waited = |tenant: &'static str| async move {
        let labels = [("tenant", tenant)];
        testkit::metric_at(admin, "codex_fleet_costly_wait_seconds_total", &labels).await
    };
    let hog_waited = waited("hog").await?;
    eprintln!("measured: the hog's sessions waited {hog_waited:.2} s for their costly steps");
    assert_eq!(metric("hog", "parse").await?, 8.0);
    assert_eq!(metric("hog", "check").await?, 8.0);
    assert_eq!(metric("calm", "parse").await?, 0.0);
    assert_eq!(metric("calm", "check").await?, 0.0);
    assert_eq!(waited("calm").await?, 0.0);
    let labels = [("tenant", "hog")];
    let waiting = testkit::metric_at(admin, "codex_fleet_costly_waiting", &labels).await?;
    assert_eq!(waiting, 0.0, "every wait ended with its answer");
    assert!(
        hog_waited >= (slowest - quickest).as_secs_f64() / 2.0,
        "the hog's sessions waited {hog_waited} s; answers spread over {:?}",
        slowest - quickest
    );
    Ok(())
}

/// A path the client writes as one component can be tens of thousands of lookups: through a
/// chain of 40 symlinks whose targets are long (`d/../` × 800), which the tenant's own commands
/// can make in its workspace. The check is charged every component it walks, so a 0.5 KiB
/// `turn/start` naming 10 such paths is checked off the runtime, and another tenant never waits
/// half as long as one check takes. (Before, it was charged the components as written, 6 a path
/// here: it ran inline and held a runtime thread for the whole check.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_paths_through_long_symlinks_leave_other_tenants_served() -> anyhow::Result<()> {
    let chain = |ws: &Path| -> anyhow::Result<()> {
        std::fs::create_dir_all(ws.join("d"))?;
        let long = "d/../".repeat(800);
        for i in 0..40 {
            let next = if i == 39 {
                "d".to_owned()
            } else {
                format!("l{}", i + 1)
            };
            std::os::unix::fs::symlink(format!("{long}{next}"), ws.join(format!("l{i}")))?;
        }
        Ok(())
    };
    let input: Vec<Value> = (0..10)
        .map(|_| json!({ "type": "localImage", "path": "l0" }))
        .collect();
    let request = json!({ "id": 1, "method": "turn/start", "params": { "threadId": "thr_hog", "input": input } });
    let request = request.to_string();
    assert!(request.len() < 2048, "{}", request.len());
    let mut f = hog_and_calm_with(4, chain).await?;
    let (admin, quiet) = (f.admin, f.quiet);
    let mut m = contention::while_hogs_send(&mut f.calm, f.hogs, request).await?;
    assert!(m.failed.is_empty(), "{:?}", m.failed);
    // Every path resolves inside the workspace: the request goes on, to a thread nobody has.
    for (answer, _) in &m.answers {
        assert!(answer.get("error").is_some(), "a made-up thread: {answer}");
        assert_ne!(answer["error"]["code"], -32003, "{answer}");
    }
    let (quickest, slowest) = (m.answers[0].1, m.answers[m.answers.len() - 1].1);
    let longest = m.longest();
    eprintln!(
        "measured: 4 checks of 10 paths through 40 long symlinks answered after {quickest:?} to \
         {slowest:?}; calm's {} requests meanwhile: median {:?}, max {longest:?} (quiet median \
         {quiet:?})",
        m.latencies.len(),
        percentile(&m.latencies, 50),
    );
    // Inline, a check held a runtime thread for as long as it took: calm waited a whole check.
    assert!(
        longest < quickest / 2,
        "calm waited {longest:?} at once, half the hog's quickest check ({quickest:?}) or more"
    );
    assert_served(&mut m.latencies, quiet);
    let labels = [("tenant", "hog"), ("step", "check")];
    let checks = testkit::metric_at(admin, "codex_fleet_costly_steps_total", &labels).await?;
    assert_eq!(checks, 4.0, "the checks ran off the runtime");
    Ok(())
}

/// Parsing a client frame to route it is a pass over the whole frame, twice (the envelope, then
/// a request's `threadId`): about 0.1 s for the largest frame in a release build, several times
/// that in a debug one. A frame over a MiB is parsed with the runtime thread's other work handed
/// off first, one of a tenant's at a time, so a tenant sending large frames on 6 connections at
/// once takes a core's share, and another tenant never waits half as long as one parse takes.
/// (Before, each parse held a runtime thread: with as many large frames as threads, nobody else
/// was answered until they were parsed, and the other tenant waited 531–608 ms against a parse's
/// 410.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_large_frames_are_parsed_without_stalling_other_tenants() -> anyhow::Result<()> {
    let request = contention::large_frame();
    let one_parse = contention::one_parse(&request)?;
    let mib = request.len() >> 20;
    let mut f = hog_and_calm(6).await?;
    let quiet = f.quiet;
    let mut m = contention::while_hogs_send(&mut f.calm, f.hogs, request).await?;
    assert!(m.failed.is_empty(), "{:?}", m.failed);
    for (answer, _) in &m.answers {
        assert!(answer.get("error").is_some(), "a made-up thread: {answer}");
    }
    let longest = m.longest();
    eprintln!(
        "measured: one parse of the {mib} MiB frame {one_parse:?}; calm's {} requests while 6 \
         were parsed: median {:?}, max {longest:?} (quiet median {quiet:?})",
        m.latencies.len(),
        percentile(&m.latencies, 50),
    );
    // Before, a wait took as long as a parse or more; now a wait is a fraction of one.
    assert!(
        longest < one_parse / 2,
        "calm waited {longest:?} at once, half a parse of the hog's frame or more ({one_parse:?})"
    );
    assert_served(&mut m.latencies, quiet);
    Ok(())
}
