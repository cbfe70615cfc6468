//! docs/decisions/0016-every-hop-holds-like-serve.md: an edge holds the bounds `serve` holds,
//! itself, on its side of the link — bytes queued per session and per tenant, connection caps
//! before the upgrade, frame rates with pings and pongs counted, and what a session waiting for its
//! tenant's node may hold. Real processes on loopback (edges, nodes, workers, the mock model), real
//! TLS on both hops; each test tries to cross a bound as a hostile tenant would.
//!
//! The edges under test get their own `[limits]` (the nodes keep the defaults), so that what is
//! measured is the edge's own bound, never the node's.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use router::admission::FLOOD_CLOSE_REASON;
use serde_json::json;
use testkit::kube_cluster::{Cluster, Options};
use testkit::{
    agent_text, fleet_bin, metric_at, open_files, read_all, reply_text, rss_kib, wait_until_async,
    Client, FleetBuilder, FleetProcess, LoweredLimit, Split, Upgrade,
};
use tokio::time::Instant;

/// One more edge in front of `s`'s nodes, like edge 0 but with `limits` in its `[limits]`.
async fn edge_with_limits(s: &Split, name: &str, limits: &str) -> anyhow::Result<FleetProcess> {
    let base = std::fs::read_to_string(s.files.dir.path().join("edge0.toml"))?;
    anyhow::ensure!(base.contains("[limits]\n"), "edge0.toml has no [limits]");
    let text = base.replacen("[limits]\n", &format!("[limits]\n{limits}\n"), 1);
    let path = s.files.dir.path().join(format!("{name}.toml"));
    std::fs::write(&path, text)?;
    FleetProcess::spawn_role(&fleet_bin(), "serve", &path, |_| {}).await
}

async fn metric(p: &FleetProcess, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    metric_at(p.admin, name, labels).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_enforces_the_connection_caps_before_the_upgrade() -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let edge = edge_with_limits(
        &s,
        "capped",
        "max_connections_per_tenant = 8\nmax_connections = 10",
    )
    .await?;
    let url = edge.url();
    let (mut open, mut refused) = (Vec::new(), Vec::new());
    for _ in 0..12 {
        match Client::try_connect(&url, &s.files.ca, Some(&s.token("acme"))).await? {
            Upgrade::Open(c) => open.push(*c),
            Upgrade::Refused {
                status,
                retry_after,
                body,
            } => refused.push((status, retry_after, body)),
        }
    }
    eprintln!(
        "measured: 12 sessions of one tenant at an edge with max_connections_per_tenant = 8: {} open, {} refused",
        open.len(),
        refused.len()
    );
    assert_eq!(open.len(), 8, "refused: {refused:?}");
    for (status, retry_after, body) in &refused {
        assert_eq!(*status, 503, "{body}");
        assert!(retry_after.is_some_and(|s| s >= 1), "{body}");
        assert!(
            body.contains("scope tenant") && body.contains("tooManyConnections"),
            "{body}"
        );
    }
    assert_eq!(refused.len(), 4);
    let capped = [("reason", "connection_cap")];
    assert_eq!(
        metric(&edge, "codex_fleet_upgrades_refused_total", &capped).await?,
        4.0
    );
    assert_eq!(
        metric(
            &edge,
            "codex_fleet_admission_rejections_total",
            &[("scope", "tenant"), ("reason", "tooManyConnections")]
        )
        .await?,
        4.0
    );
    // The admitted sessions work.
    open[0].initialize("capped").await?;
    // Another tenant still connects, up to the total cap (10).
    let mut b1 = edge.client(&s.files, &s.token("beta")).await?;
    let _b2 = edge.client(&s.files, &s.token("beta")).await?;
    match Client::try_connect(&url, &s.files.ca, Some(&s.token("beta"))).await? {
        Upgrade::Refused { status, body, .. } => {
            assert_eq!(status, 503, "{body}");
            assert!(body.contains("scope fleet"), "{body}");
        }
        Upgrade::Open(_) => anyhow::bail!("an 11th session was admitted with max_connections = 10"),
    }
    b1.request("thread/list", json!({})).await?;
    // A session that ends gives its slot back.
    open.pop().context("a session")?.close().await;
    let back = wait_until_async(Duration::from_secs(10), || async {
        matches!(
            Client::try_connect(&url, &s.files.ca, Some(&s.token("acme"))).await,
            Ok(Upgrade::Open(_))
        )
    })
    .await;
    assert!(back, "a closed session's slot never came back");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_counts_every_frame_pings_included_against_the_frame_rate() -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1")], 1, "").await?;
    // The edge's default rate (100 frames/s, a burst of 500), as serve has it.
    let edge = &s.edges[0];
    let mut other = s.client(0, "acme").await?;
    let mut flood = Client::connect(&edge.url(), &s.files.ca, Some(&s.token("acme"))).await?;
    let started = Instant::now();
    let (mut sent, mut close) = (0, None);
    'flood: for _ in 0..40 {
        for _ in 0..500 {
            if flood.send_ping(vec![7; 8]).await.is_err() {
                break 'flood;
            }
            sent += 1;
        }
        if let Ok(c) = flood.recv_close_frame(Duration::from_millis(50)).await {
            close = c;
            break;
        }
    }
    if close.is_none() {
        close = flood
            .recv_close_frame(Duration::from_secs(5))
            .await
            .unwrap_or(None);
    }
    eprintln!(
        "measured: ping flood through an edge: {sent} pings sent, closed after {:?} with {close:?}",
        started.elapsed()
    );
    assert_eq!(close, Some((1008, FLOOD_CLOSE_REASON.to_owned())));
    assert!(sent < 20_000);
    assert_eq!(
        metric(
            edge,
            "codex_fleet_sessions_closed_total",
            &[("reason", "flooded")]
        )
        .await?,
        1.0
    );
    // The tenant's other session on the same edge is untouched.
    other.request("thread/list", json!({})).await?;

    // Requests over the rate are answered -32001 by the edge and never reach the node;
    // notifications over it close the session.
    let strict = edge_with_limits(&s, "strict", "conn_fps = 1\nconn_burst = 6").await?;
    let mut c = strict.client(&s.files, &s.token("acme")).await?; // 2 frames
    let mut ids = Vec::new();
    for _ in 0..8 {
        ids.push(c.send_request("thread/list", json!({})).await?);
    }
    let mut refused = 0;
    for id in ids {
        let answer = c.wait_for(|v| v["id"] == id).await?;
        if answer["error"]["code"] == -32001 {
            assert_eq!(answer["error"]["data"]["scope"], "connection", "{answer}");
            assert_eq!(
                answer["error"]["data"]["reason"], "connectionRateLimited",
                "{answer}"
            );
            refused += 1;
        }
    }
    assert!(
        refused >= 3,
        "{refused} requests refused of 8 over a burst of 6"
    );
    c.send(&json!({ "method": "initialized" })).await?;
    let close = c.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(close, Some((1008, FLOOD_CLOSE_REASON.to_owned())));
    Ok(())
}

/// Opens `n` sessions of `tenant` with a 4 KiB receive window, each sending `reads` requests
/// for the whole thread and never reading their answers.
async fn unread_flood(
    target: &FleetProcess,
    ca: &Path,
    token: &str,
    thread: &str,
    n: usize,
    reads: usize,
) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::new();
    for _ in 0..n {
        let mut c =
            Client::connect_small_window(target.addr, &target.url(), ca, Some(token), 4096).await?;
        // The node's worker may still be busy with an earlier wave (its own in-flight cap).
        let mut tries = 0;
        loop {
            match c.initialize("unread").await {
                Ok(_) => break,
                Err(e) if e.to_string().contains("-32001") && tries < 100 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => return Err(e),
            }
        }
        clients.push(c);
    }
    for c in &mut clients {
        for _ in 0..reads {
            c.send_request("thread/read", read_all(thread)).await?;
        }
    }
    Ok(clients)
}

/// Polls the edge's RSS until `done` (or `within`: an error, unless `by_hand`); fails as soon as
/// it grows past `limit_kib` over `base_kib`. Returns the peak growth in KiB.
async fn watch_rss<F, Fut>(
    pid: u32,
    base_kib: u64,
    limit_kib: u64,
    within: Duration,
    by_hand: bool,
    mut done: F,
) -> anyhow::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    let mut peak = 0;
    loop {
        let grown = rss_kib(pid).context("edge RSS")?.saturating_sub(base_kib);
        peak = peak.max(grown);
        anyhow::ensure!(
            grown <= limit_kib,
            "the edge grew by {} MiB (bound {} MiB)",
            grown / 1024,
            limit_kib / 1024
        );
        if done().await {
            return Ok(peak);
        }
        if by_hand && Instant::now() >= deadline {
            return Ok(peak);
        }
        anyhow::ensure!(Instant::now() < deadline, "the flood did not end in time");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_flood_through_the_edge_stays_within_its_byte_bounds() -> anyhow::Result<()> {
    let turns: usize = std::env::var("EDGE_FLOOD_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let prompt_bytes: usize = 1_000_000;
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    // Bytes queued per session and per tenant, at the edge; one answer of the whole thread fits.
    // (`EDGE_FLOOD_LIMITS=""` measures the defaults, `EDGE_FLOOD_TURNS=6` a 12 MiB thread.)
    let limits = std::env::var("EDGE_FLOOD_LIMITS").unwrap_or_else(|_| {
        "max_message_bytes = 16777216\nclient_queue_bytes = 16777216\ntenant_queue_bytes = 33554432"
            .into()
    });
    let edge = edge_with_limits(&s, "bounded", &limits).await?;
    let pid = edge.pid().context("edge pid")?;

    // Tenant A builds a large thread: turns with 1 MB prompts (the mock model echoes them).
    let mut a = edge.client(&s.files, &s.token("acme")).await?;
    let (thread, answer_bytes) = a.large_thread(turns, prompt_bytes).await?;

    // Tenant B works on the same edge throughout, its round trips measured.
    let mut b = edge.client(&s.files, &s.token("beta")).await?;
    let base = rss_kib(pid).context("edge RSS")?;
    // What the old edge queued from one wave: every answer, held in memory.
    let unbounded_kib = (12 * 40 * answer_bytes / 1024) as u64;
    // The bound: the tenant's queued bytes, one answer more per session (the message it is
    // reading from the link, counted once queued), and 32 MiB for everything else.
    // `EDGE_FLOOD_BOUND_MIB` lets a by-hand measurement see past it.
    let tenant_queue_kib = limits
        .lines()
        .find_map(|l| l.strip_prefix("tenant_queue_bytes = "))
        .map_or(256 << 10, |v| {
            v.trim().parse::<u64>().unwrap_or(256 << 20) / 1024
        });
    let limit_kib = std::env::var("EDGE_FLOOD_BOUND_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(
            tenant_queue_kib + 12 * (answer_bytes as u64 / 1024) + (32 << 10),
            |mib| mib * 1024,
        );
    let slow = [("reason", "slow_client")];
    let stop = tokio_util::sync::CancellationToken::new();
    let b_stop = stop.clone();
    let b_task = tokio::spawn(async move {
        let mut rtts = Vec::new();
        while !b_stop.is_cancelled() {
            let t = Instant::now();
            let r = b.request("thread/list", json!({})).await;
            rtts.push(t.elapsed());
            r?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(rtts)
    });

    // By hand, `EDGE_FLOOD_WINDOW_SECS` watches each wave for that long, closed or not.
    let by_hand = std::env::var("EDGE_FLOOD_WINDOW_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let mut held = Vec::new();
    let mut peaks = Vec::new();
    for wave in 1..=2u32 {
        let before = metric(&edge, "codex_fleet_sessions_closed_total", &slow).await?;
        let relayed_before = metric(&edge, "codex_fleet_link_sessions", &[("node", "n1")]).await?;
        let started = Instant::now();
        held.extend(unread_flood(&edge, &s.files.ca, &s.token("acme"), &thread, 12, 40).await?);
        let edge_ref = &edge;
        let peak = watch_rss(
            pid,
            base,
            limit_kib,
            Duration::from_secs(by_hand.unwrap_or(240)),
            by_hand.is_some(),
            || async move {
                metric_at(edge_ref.admin, "codex_fleet_sessions_closed_total", &slow)
                    .await
                    .is_ok_and(|n| n >= before + 12.0)
            },
        )
        .await?;
        let closed = metric(&edge, "codex_fleet_sessions_closed_total", &slow).await? - before;
        eprintln!(
            "measured: wave {wave}: 12 unread sessions x 40 thread/read ({:.0} MiB of answers): \
             {closed} closed as slow clients within {:?}; edge RSS peak growth {} MiB (bound {} MiB), \
             now {} MiB",
            unbounded_kib as f64 / 1024.0,
            started.elapsed(),
            peak / 1024,
            limit_kib / 1024,
            rss_kib(pid).unwrap_or(0).saturating_sub(base) / 1024
        );
        peaks.push(peak);
        // Every relay of the wave ended although its client still holds its socket: no more
        // sessions relayed to n1 than before the wave (tenant A's builder session, idle and
        // unread, may itself have been closed for its tenant's queued bytes, which the count
        // of slow clients above would include).
        let ended = wait_until_async(Duration::from_secs(10), || async {
            metric(&edge, "codex_fleet_link_sessions", &[("node", "n1")])
                .await
                .is_ok_and(|n| n <= relayed_before)
        })
        .await;
        assert!(
            ended || by_hand.is_some(),
            "relays outlived their sessions: {:?} relayed to n1, {relayed_before} before the wave",
            metric(&edge, "codex_fleet_link_sessions", &[("node", "n1")]).await
        );
    }
    stop.cancel();
    let mut rtts = b_task.await??;
    rtts.sort();
    eprintln!(
        "measured: tenant B's thread/list round trip through the same edge during the floods: \
         {} requests, median {:?}, max {:?}",
        rtts.len(),
        rtts[rtts.len() / 2],
        rtts[rtts.len() - 1]
    );
    assert!(!rtts.is_empty());
    // The second wave found the first one's memory freed: it grew no further than the first.
    assert!(
        by_hand.is_some() || peaks[1] <= peaks[0] + 64 * 1024,
        "wave 2 grew the edge by {} MiB more than wave 1",
        (peaks[1] - peaks[0]) / 1024
    );

    // A session that stops reading learns why it was closed, as from serve.
    let mut one = unread_flood(&edge, &s.files.ca, &s.token("acme"), &thread, 1, 40).await?;
    let before = metric(&edge, "codex_fleet_sessions_closed_total", &slow).await?;
    let closed = wait_until_async(Duration::from_secs(60), || async {
        metric(&edge, "codex_fleet_sessions_closed_total", &slow)
            .await
            .is_ok_and(|n| n > before)
    })
    .await;
    assert!(closed, "the unread session was not closed");
    let close = one[0].recv_close_frame(Duration::from_secs(30)).await?;
    assert_eq!(
        close.map(|(code, _)| code),
        Some(1008),
        "an unread session is closed with 1008"
    );
    drop(held);
    Ok(())
}

/// A tenant's sessions that each read one large answer and then sit idle: each crossed the edge
/// whole, and what the edge keeps for them afterwards does not grow with its size. (tungstenite
/// keeps a socket's read and write buffers at the largest frame they held; written whole, every
/// such session kept two copies of the answer at the edge until it closed, outside every byte
/// bound. The edge and the node write large frames in fragments.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_that_read_a_large_answer_keep_no_copy_of_it_at_the_edge(
) -> anyhow::Result<()> {
    const SESSIONS: usize = 12;
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let edge = &s.edges[0];
    let pid = edge.pid().context("edge pid")?;
    let node_pid = s.nodes[0]
        .process
        .as_ref()
        .and_then(FleetProcess::pid)
        .context("node pid")?;
    let mut a = edge.client(&s.files, &s.token("acme")).await?;
    let (thread, answer_bytes) = a.large_thread(3, 1_000_000).await?;
    let mut sessions = Vec::new();
    for _ in 0..SESSIONS {
        sessions.push(edge.client(&s.files, &s.token("acme")).await?);
    }
    let (base, node_base) = (
        rss_kib(pid).context("edge RSS")?,
        rss_kib(node_pid).context("node RSS")?,
    );
    for c in &mut sessions {
        let answer = c.request("thread/read", read_all(&thread)).await?;
        anyhow::ensure!(
            answer.to_string().len() >= answer_bytes * 9 / 10,
            "a short answer"
        );
    }
    // Every answer was read whole; whatever the sessions hold now, they hold idle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = rss_kib(pid).context("edge RSS")?.saturating_sub(base);
    let node_grown = rss_kib(node_pid)
        .context("node RSS")?
        .saturating_sub(node_base);
    let answer_kib = (answer_bytes / 1024) as u64;
    eprintln!(
        "measured: {SESSIONS} idle sessions after a {:.1} MiB answer each: edge RSS +{} MiB \
         ({:.2} answers a session), node +{} MiB ({:.2})",
        answer_bytes as f64 / 1048576.0,
        grown / 1024,
        grown as f64 / answer_kib as f64 / SESSIONS as f64,
        node_grown / 1024,
        node_grown as f64 / answer_kib as f64 / SESSIONS as f64,
    );
    // Kept whole, the answer would cost each session two copies (its read and write buffers):
    // a quarter of one answer a session leaves room for what a session holds anyway.
    assert!(
        grown < SESSIONS as u64 * answer_kib / 4,
        "the edge keeps {} MiB for {SESSIONS} idle sessions after a {} MiB answer each",
        grown / 1024,
        answer_kib / 1024
    );
    drop(sessions);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_waiting_for_its_pod_is_bounded_and_ends_with_its_credential(
) -> anyhow::Result<()> {
    let mut c = Cluster::start(Options {
        edges: 0,
        start_timeout_secs: 60,
        ..Options::default()
    })
    .await?;
    // The edge's own bounds: 2 MiB held per session, 3 MiB over the tenant's sessions.
    let mut text = std::fs::read_to_string(&c.edge_config)?;
    anyhow::ensure!(!text.contains("[limits]"), "the edge config has [limits]");
    text += "\n[limits]\nmax_message_bytes = 1048576\nclient_queue_bytes = 2097152\ntenant_queue_bytes = 3145728\n";
    std::fs::write(&c.edge_config, &text)?;
    c.add_edge().await?;
    assert!(c.synced(0).await, "the edge's watch never synced");
    // A full cluster: the tenant's pod stays Pending and every session waits.
    c.fake.hold_pods(true);
    let url = c.edges[0].url();
    let token = c.files.token("acme");
    let connect = || Client::connect(&url, &c.files.ca, Some(&token));
    let note = |pad: usize| json!({ "method": "x/held", "params": { "pad": "x".repeat(pad) } });
    let big = 900 << 10;

    // One session over its own bound (3 × 900 KiB > 2 MiB): closed at once, not at the start
    // timeout.
    let mut one = connect().await?;
    for _ in 0..3 {
        one.send(&note(big)).await?;
    }
    let close = one.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(
        close,
        Some((1008, router::edge::PENDING_CLOSE_REASON.to_owned()))
    );
    // Two sessions within their own bound, over the tenant's together: whichever of them the
    // edge reads last tips the tenant over and is closed; the other waits on.
    let mut two = connect().await?;
    let mut three = connect().await?;
    for _ in 0..2 {
        two.send(&note(big)).await?;
    }
    for _ in 0..2 {
        three.send(&note(big)).await?;
    }
    let (close, three_closed) = tokio::select! {
        c = three.recv_close_frame(Duration::from_secs(10)) => (c?, true),
        c = two.recv_close_frame(Duration::from_secs(10)) => (c?, false),
    };
    assert_eq!(
        close,
        Some((1008, router::edge::PENDING_CLOSE_REASON.to_owned()))
    );
    let mut two = if three_closed { two } else { three };

    // The session within its bound still waits.
    assert!(
        two.recv_close_frame(Duration::from_millis(300))
            .await
            .is_err(),
        "a session within its bound was closed"
    );

    // A waiting session whose credential is revoked is closed while it waits.
    let mut four = connect().await?;
    four.send(&json!({ "id": 1, "method": "initialize", "params": { "clientInfo": { "name": "t", "title": null, "version": "0" } } }))
        .await?;
    let digest = router::auth::token_digest_hex(&c.files.token("acme"));
    let other = router::auth::token_digest_hex(&router::cli::dev::random_token());
    let text = std::fs::read_to_string(&c.edge_config)?.replace(&digest, &other);
    std::fs::write(&c.edge_config, text)?;
    c.edges[0].signal(nix::sys::signal::Signal::SIGHUP)?;
    let close = four.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(
        close,
        Some((1008, router::end::REVOKED_REASON.to_owned())),
        "the revoked session kept waiting"
    );
    // Every waiting session of the tenant ends with it.
    let close = two.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(close, Some((1008, router::end::REVOKED_REASON.to_owned())));
    Ok(())
}

/// The issue-22 flood against `target`: tenant A builds a thread of `turns` 1 MB prompts, then
/// 12 sessions with a 4 KiB receive window send 40 `thread/read includeTurns` each and never
/// read, while tenant B's `thread/list` round trips are timed for `window`. Returns the peak RSS
/// growth (KiB) and a line of what was measured.
async fn unread_flood_rss(
    target: &FleetProcess,
    ca: &Path,
    token_a: &str,
    token_b: &str,
    turns: usize,
    window: Duration,
) -> anyhow::Result<(u64, String)> {
    let pid = target.pid().context("pid")?;
    let mut a = Client::connect(&target.url(), ca, Some(token_a)).await?;
    a.initialize("builder").await?;
    let thread = a.start_thread().await?;
    let prompt = "x".repeat(1_000_000);
    for _ in 0..turns {
        a.start_turn(&thread, &prompt).await?;
        a.until_turn_completed(&thread).await?;
    }
    let id = a
        .send_request(
            "thread/read",
            json!({ "threadId": thread, "includeTurns": true }),
        )
        .await?;
    let answer = a.wait_for(|v| v["id"] == id).await?;
    let answer_mib = answer.to_string().len() as f64 / 1048576.0;
    let mut b = Client::connect(&target.url(), ca, Some(token_b)).await?;
    b.initialize("calm").await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let base = rss_kib(pid).context("rss")?;
    let held = unread_flood(target, ca, token_a, &thread, 12, 40).await?;
    let started = Instant::now();
    let mut peak = 0;
    let mut rtts = Vec::new();
    while started.elapsed() < window {
        peak = peak.max(rss_kib(pid).unwrap_or(0).saturating_sub(base));
        let t = Instant::now();
        b.request("thread/list", json!({})).await?;
        rtts.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rtts.sort();
    let after = rss_kib(pid).unwrap_or(0).saturating_sub(base);
    drop(held);
    let text = format!(
        "answer {answer_mib:.1} MiB; RSS peak +{} MiB, at the end +{} MiB; calm tenant median {:?} max {:?}",
        peak / 1024,
        after / 1024,
        rtts[rtts.len() / 2],
        rtts[rtts.len() - 1]
    );
    Ok((peak, text))
}

/// docs/decisions/0016-every-hop-holds-like-serve.md, measured side by side: the same unread flood
/// (a 12 MiB thread, 12 unread sessions x 40 reads), with the default bounds, costs an
/// edge about what it costs `serve` — not the gigabytes of the old relay, which queued every
/// answer. Both stay bounded by the same keys; the calm tenant is served throughout on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_flood_costs_an_edge_what_it_costs_serve() -> anyhow::Result<()> {
    let window = Duration::from_secs(30);
    let files = FleetBuilder::new()
        .tenant("acme")
        .tenant("beta")
        .prepare()
        .await?;
    let serve = FleetProcess::spawn(&files).await?;
    let (serve_peak, serve_out) = unread_flood_rss(
        &serve,
        &files.ca,
        &files.token("acme"),
        &files.token("beta"),
        6,
        window,
    )
    .await?;
    drop(serve);
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let (edge_peak, edge_out) = unread_flood_rss(
        &s.edges[0],
        &s.files.ca,
        &s.token("acme"),
        &s.token("beta"),
        6,
        window,
    )
    .await?;
    eprintln!("measured: serve: {serve_out}");
    eprintln!("measured: edge:  {edge_out}");
    eprintln!(
        "measured: edge / serve peak growth: {:.2}",
        edge_peak as f64 / serve_peak.max(1) as f64
    );
    assert!(
        edge_peak <= 2 * serve_peak + 64 * 1024,
        "the edge grew {} MiB under the flood, serve {} MiB",
        edge_peak / 1024,
        serve_peak / 1024
    );
    Ok(())
}

/// One tenant takes every descriptor an edge lets connections open (the edge's open-files
/// limit lowered under it with `prlimit`): each of its sessions holds a client connection and a
/// link. Its new sessions are refused — 503 with `Retry-After`, scope `fleet`, reason
/// `tooManyConnections` (the edge is full; the node is not at fault) when the link cannot open,
/// or left waiting (in the listen queue, or accepted but unserved when the last session's link
/// took the last descriptor after the accept loop looked; never closed without a word) — and
/// those refusals are the edge's, never counted against the node nor its readiness. Meanwhile
/// the edge's admin port answers from the reserve, and another tenant's session through the
/// edge runs a turn; once the hog lets go, a new session of the other tenant gets in. Twice, at
/// limits one apart, so that both endings are exercised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_takes_every_descriptor_of_an_edge_does_not_stop_another(
) -> anyhow::Result<()> {
    let s = Split::start(
        &[("acme", "n1"), ("hog", "n2")],
        1,
        "handshakes_per_sec_per_ip = 100000\nhandshake_burst = 100000\nmax_connections_per_tenant = 10000",
    )
    .await?;
    let edge = &s.edges[0];
    let pid = edge.pid().context("edge pid")?;
    let mut acme = s.client(0, "acme").await?;
    let thread = acme.start_thread().await?;
    acme.start_turn(&thread, "before the hog").await?;
    acme.until_turn_completed(&thread).await?;
    let rejections = "codex_fleet_admission_rejections_total";
    let settled = open_files(pid);
    let mut forms = std::collections::BTreeSet::new();
    // Two rooms of either parity: a session takes two descriptors (its client's and its link),
    // so one ends with a link that cannot open (503), the other with a link that took the last
    // descriptor after the accept loop looked (the next connection waits, accepted); which is
    // which depends on what the edge held before.
    for room in [25, 24] {
        testkit::until_open_files_at_most(pid, settled).await?;
        let full_before = metric_at(
            edge.admin,
            rejections,
            &[("scope", "fleet"), ("reason", "tooManyConnections")],
        )
        .await?;
        let lowered = LoweredLimit::set(pid, room)?;
        let (hog, refused) = lowered
            .fill(|| async {
                match Client::try_connect(&edge.url(), &s.files.ca, Some(&s.token("hog"))).await? {
                    Upgrade::Open(mut c) => {
                        c.initialize("hog").await?;
                        anyhow::Ok(Ok(c))
                    }
                    Upgrade::Refused {
                        status,
                        retry_after,
                        body,
                    } => Ok(Err(format!("{status} {retry_after:?} {body}"))),
                }
            })
            .await?;
        eprintln!(
            "measured: the hog holds {} sessions through the edge, which holds {} descriptors ({lowered:?}); refused: {refused:?}",
            hog.len(),
            open_files(pid)
        );
        assert_eq!(refused.len(), 3, "{} hog sessions", hog.len());
        for r in &refused {
            assert!(
                r.starts_with("503 Some(") && r.contains("scope fleet, reason tooManyConnections")
                    || r == "no answer within 3 s",
                "{r}"
            );
        }
        let open = lowered.admin_answers(edge.admin).await?;
        eprintln!("measured: at the line the edge's /metrics says {open} descriptors open");
        // Each 503 counted once as the edge's own refusal (the fleet is full here), a wait in the
        // listen queue not at all, and nothing as the node's.
        let answered = refused.iter().filter(|r| r.starts_with("503")).count();
        let full = metric_at(
            edge.admin,
            rejections,
            &[("scope", "fleet"), ("reason", "tooManyConnections")],
        )
        .await?;
        assert_eq!(
            full - full_before,
            answered as f64,
            "counted against {refused:?}"
        );
        let unavailable = metric_at(
            edge.admin,
            rejections,
            &[("scope", "worker"), ("reason", "nodeUnavailable")],
        )
        .await?;
        assert_eq!(unavailable, 0.0, "the edge blamed a node for its own limit");
        // Not the node's failure: no link error counted, and the edge still reaches both nodes.
        for node in ["n1", "n2"] {
            let errors = metric_at(
                edge.admin,
                "codex_fleet_link_errors_total",
                &[("node", node), ("reason", "unreachable")],
            )
            .await?;
            assert_eq!(errors, 0.0, "link errors counted against {node}");
        }
        let ready = s.edge_readyz(0).await?;
        assert_eq!(ready["edge"]["unreachableTenants"], json!([]), "{ready}");
        // The other tenant's session through the edge keeps working: a request and a whole turn.
        acme.request("thread/read", json!({"threadId": thread}))
            .await?;
        acme.start_turn(&thread, "while the hog holds the edge")
            .await?;
        let msgs = acme.until_turn_completed(&thread).await?;
        assert_eq!(
            agent_text(&msgs).as_deref(),
            Some(reply_text("while the hog holds the edge").as_str())
        );
        for c in hog {
            c.close().await;
        }
        let back = wait_until_async(Duration::from_secs(20), || async {
            let attempt = tokio::time::timeout(Duration::from_secs(3), async {
                let mut c = s.client(0, "acme").await?;
                c.request("thread/read", json!({"threadId": thread})).await
            })
            .await;
            matches!(attempt, Ok(Ok(_)))
        })
        .await;
        assert!(
            back,
            "no new session after the hog let go: {}",
            edge.stderr()
        );
        let ready = s.edge_readyz(0).await?;
        assert_eq!(
            ready["ready"], true,
            "ready again once the hog let go: {ready}"
        );
        forms.extend(refused.iter().map(|r| {
            if r.starts_with("503") {
                "503"
            } else {
                "waited"
            }
        }));
    }
    eprintln!("measured: the refusals' forms over both rooms: {forms:?}");
    assert!(testkit::process_alive(i32::try_from(pid)?));
    Ok(())
}

/// An edge serves every tenant, and reads each client frame (for its request id) and each node
/// frame (for an answer's id): a pass over the whole frame, 0.4 s for 8 MiB of small values in a
/// debug build. A frame over a MiB is parsed with the edge's runtime thread's other relays handed
/// to another thread first, so a tenant sending such frames on 6 connections at once through the
/// edge does not stop another tenant's round trips through it: the other tenant never waits half
/// as long as one parse takes. (Before, each parse held one of the edge's runtime threads, and
/// with as many large frames as threads the other tenant waited a whole parse: 393–419 ms against
/// 390–398.) The tenants have nodes of their own, so the edge is the only process they share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_large_frames_do_not_stall_an_edge_for_another() -> anyhow::Result<()> {
    use testkit::contention;
    let s = Split::start(
        &[("calm", "n1"), ("hog", "n2")],
        1,
        "tenant_rps = 100000\ntenant_burst = 100000\nconn_fps = 100000\nconn_burst = 100000\n\
         handshakes_per_sec_per_ip = 1000\nhandshake_burst = 1000",
    )
    .await?;
    // Two runtime threads, as on the machines this suite is sized for, whatever this one has.
    let edge = FleetProcess::spawn_role(
        &fleet_bin(),
        "serve",
        &s.files.dir.path().join("edge0.toml"),
        |cmd| {
            cmd.env("TOKIO_WORKER_THREADS", "2");
        },
    )
    .await?;
    let request = contention::large_frame();
    let one_parse = contention::one_parse(&request)?;
    let mut calm = edge
        .client(&s.files, &s.token("calm"))
        .await
        .context("calm's session")?;
    let quiet = contention::quiet_median(&mut calm)
        .await
        .context("calm's quiet round trips")?;
    let mut hogs = Vec::new();
    for _ in 0..6 {
        hogs.push(
            edge.client(&s.files, &s.token("hog"))
                .await
                .context("a hog's session")?,
        );
    }
    let m = contention::while_hogs_send(&mut calm, hogs, request)
        .await
        .context("calm's round trips while the hogs send")?;
    for (answer, _) in &m.answers {
        assert!(answer.get("error").is_some(), "a made-up thread: {answer}");
    }
    let longest = m.longest();
    // A hog's node, busy with the hog's checks, may be found gone by the edge's probe, which
    // ends the hog's sessions there: the hog's own lot, counted, not this test's subject.
    eprintln!(
        "measured: one parse {one_parse:?}; calm's {} requests through the edge while 6 large \
         frames passed: median {:?}, max {longest:?} (quiet median {quiet:?}); hogs without an \
         answer: {:?}",
        m.latencies.len(),
        m.latencies[m.latencies.len() / 2],
        m.failed,
    );
    // Before, a wait took as long as a parse or more; now a wait is a fraction of one.
    assert!(
        longest < one_parse / 2,
        "calm waited {longest:?} at once, half a parse of the hog's frame or more ({one_parse:?})"
    );
    Ok(())
}

/// An edge counts what a client's socket has read of an unfinished message against the tenant
/// as it arrives, as `serve` does (`boundary_input::unfinished_messages_are_bounded_per_tenant_as_they_arrive`):
/// a tenant sending most of a large frame on each of its connections and never finishing it
/// pins at most its `tenant_queue_bytes` on the edge every tenant shares; the connections past it
/// are closed (1008), and another tenant's large messages go through the same edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_bounds_unfinished_messages_per_tenant_as_they_arrive() -> anyhow::Result<()> {
    const BOUND: usize = 8 << 20;
    const SENT: usize = 3 << 20;
    const CONNECTIONS: usize = 4;
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let limits = format!(
        "max_message_bytes = {m}\nclient_queue_bytes = {m}\ntenant_queue_bytes = {BOUND}",
        m = 4 << 20
    );
    let edge = edge_with_limits(&s, "bounded", &limits).await?;
    let pid = edge.pid().context("edge pid")?;
    let base = rss_kib(pid).context("edge RSS")?;
    let token = s.token("acme");
    let (closed, hostile) = testkit::Unfinished::open_many(
        CONNECTIONS,
        edge.addr,
        &s.files.ca,
        &token,
        (4 << 20, SENT),
        router::end::LARGE_FRAMES_REASON,
    )
    .await?;
    let grown = rss_kib(pid).context("edge RSS")?.saturating_sub(base);
    eprintln!(
        "measured: {CONNECTIONS} connections each sending {} MiB of an unfinished frame through \
         an edge with {} MiB for the tenant's buffers: {closed} closed; edge RSS +{:.1} MiB",
        SENT >> 20,
        BOUND >> 20,
        grown as f64 / 1024.0
    );
    assert_eq!(closed, CONNECTIONS - BOUND / SENT);
    let counted = wait_until_async(Duration::from_secs(10), || async {
        metric(
            &edge,
            "codex_fleet_sessions_closed_total",
            &[("reason", "large_frames")],
        )
        .await
        .is_ok_and(|v| v == closed as f64)
    })
    .await;
    assert!(counted, "the closed sessions were not counted");
    let mut b = edge.client(&s.files, &s.token("beta")).await?;
    b.large_thread(1, 1_000_000).await?;
    b.request("thread/list", json!({})).await?;
    drop(hostile);
    Ok(())
}

/// docs/architecture.md ("Faults across the link"): a worker that stops reading (stopped by its
/// tenant's own agent) makes its node stop reading the session's link, as `serve` stops reading
/// a client whose worker does not read. The edge holds the client as `serve` does: what its link
/// holds is bounded, the client is not read beyond it, and the held link is not taken for a lost
/// node (no 1012, no `lost` counted, which the node-lost alert watches) however long it lasts.
/// Meanwhile another tenant on the same edge sends as large messages and is answered: the bound
/// is the held tenant's own. Once the worker resumes, the same session is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_reading_holds_its_session_through_an_edge_as_serve_does(
) -> anyhow::Result<()> {
    let b = FleetBuilder::new()
        // No hang detection while the worker is stopped on purpose.
        .workers_toml("health_interval_secs = 120\nhealth_timeout_secs = 120")
        .limits_toml(
            "tenant_rps = 100000\ntenant_burst = 100000\nconn_fps = 100000\nconn_burst = 100000\n\
             max_message_bytes = 2097152\nclient_queue_bytes = 8388608\ntenant_queue_bytes = 8388608",
        );
    let s = Split::start_built(&fleet_bin(), b, &[("flood", "n1"), ("calm", "n2")], 1).await?;
    let edge = &s.edges[0];
    let edge_pid = edge.pid().context("edge pid")?;
    let mut flood = s.client(0, "flood").await?;
    let mut calm = s.client(0, "calm").await?;
    let quiet = testkit::contention::quiet_median(&mut calm).await?;
    let workers = testkit::workers_under(&s.files.dir.path().join("n1/tenants/flood"));
    anyhow::ensure!(workers.len() == 1, "{workers:?}");
    let worker = nix::unistd::Pid::from_raw(workers[0]);
    nix::sys::signal::kill(worker, nix::sys::signal::Signal::SIGSTOP)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = rss_kib(edge_pid).context("rss")?;

    let mut peak = baseline;
    let (sent, held) = flood
        .flood_until_held(300, || peak = peak.max(rss_kib(edge_pid).unwrap_or(0)))
        .await?;
    anyhow::ensure!(held, "the whole flood ({sent} × 1 MiB) was taken in");
    // The other tenant sends 6 MiB through the same edge (its own link budget is 8 MiB) and
    // its round trips are measured.
    let since = Instant::now();
    let pad = "x".repeat(1 << 20);
    let mut waits = Vec::new();
    for _ in 0..6 {
        calm.send(&json!({"method": "x/large", "params": {"pad": pad}}))
            .await?;
        let t = Instant::now();
        let listed = tokio::time::timeout(
            Duration::from_secs(10),
            calm.request("thread/list", json!({})),
        )
        .await
        .context("the other tenant got no answer")??;
        waits.push(t.elapsed());
        assert!(listed.get("data").is_some(), "{listed}");
    }
    waits.sort();
    // Past the link's silence deadline (10 s) and two of its ping intervals.
    while since.elapsed() < Duration::from_secs(16) {
        peak = peak.max(rss_kib(edge_pid).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let lost = metric(edge, "codex_fleet_link_errors_total", &[("reason", "lost")]).await?;
    nix::sys::signal::kill(worker, nix::sys::signal::Signal::SIGCONT)?;
    let growth_mib = peak.saturating_sub(baseline) / 1024;
    eprintln!(
        "measured: a stopped worker behind an edge: {sent} × 1 MiB sent before the client was \
         held; the edge grew {growth_mib} MiB; held 16 s, `lost` counted {lost}; the other \
         tenant's round trips after 1 MiB each: {waits:?} (quiet median {quiet:?})"
    );
    assert_eq!(lost, 0.0, "a held link was taken for a lost node");
    assert!(
        growth_mib < 64,
        "the edge grew by {growth_mib} MiB holding a client for a stopped worker"
    );
    let listed = tokio::time::timeout(
        Duration::from_secs(60),
        flood.request("thread/list", json!({})),
    )
    .await
    .context("no answer after the worker resumed")??;
    assert!(listed.get("data").is_some(), "{listed}");
    let lost = metric(edge, "codex_fleet_link_errors_total", &[("reason", "lost")]).await?;
    assert_eq!(
        lost, 0.0,
        "the link was taken for lost once the worker resumed"
    );
    Ok(())
}

/// A node that answers every upgrade with `answers` in turn, as a hostile (or broken) node would:
/// on `port`, behind the link's node certificate, checking the edge's as a node does.
async fn answering_node(
    link: &Path,
    port: u16,
    answers: Vec<Vec<u8>>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    use tokio::io::AsyncWriteExt;
    let (config, _watched) = router::tls::server_config_mutual(
        &link.join("node.crt"),
        &link.join("node.key"),
        &link.join("ca.pem"),
    )?;
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    Ok(tokio::spawn(async move {
        let mut answers = answers.iter().cycle();
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let Ok(mut tls) = acceptor.accept(tcp).await else {
                continue;
            };
            // The edge's upgrade request, to its end; then the next answer, and the end. (The
            // edge's prober only shakes hands: it sends no request and takes no answer.)
            let head = testkit::read_request_head(&mut tls).await;
            if !head.is_some_and(|h| h.starts_with(b"GET ")) {
                continue;
            }
            let answer = answers.next().expect("a cycle");
            let _ = tls.write_all(answer).await;
            let _ = tls.shutdown().await;
        }
    }))
}

/// A tenant's node is on the far side of a boundary from the edge every tenant shares (on
/// Kubernetes it runs in the tenant's own pod): whatever its answer to an upgrade says, a static
/// edge passes on no wait longer than an hour (in `Retry-After`, the refusal header or the body),
/// one `Retry-After` and one refusal header (the first), none of the node's other headers, and a
/// node that sends headers without end gets the edge's own refusal. Meanwhile another tenant is
/// served through the same edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_refusal_reaches_the_client_with_its_waits_bounded_and_headers_once(
) -> anyhow::Result<()> {
    let mut s = Split::start(&[("acme", "n1"), ("calm", "n2")], 1, "").await?;
    // acme's node is replaced by one that answers as no codex-fleet node does.
    let mut n1 = s.nodes[0].process.take().context("n1")?;
    n1.child.kill().await?;
    let body = format!(
        "{} (scope tenant, reason tooManyConnections); retry after 99999999999 ms",
        router::admission::OVERLOADED_MESSAGE
    );
    let absurd = format!(
        "HTTP/1.1 503 Service Unavailable\r\n\
         Retry-After: 99999999999999999999\r\n\
         Retry-After: 1\r\n\
         codex-fleet-refusal: overloaded; scope=tenant; reason=tooManyConnections; \
         retry-after-ms=99999999999; since=1\r\n\
         codex-fleet-refusal: overloaded; scope=tenant; reason=tooManyConnections; \
         retry-after-ms=1\r\n\
         X-Node-Secret: the node's own\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let endless = format!(
        "HTTP/1.1 503 Service Unavailable\r\n{}\r\n",
        "X-Pad: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n"
            .repeat(16 * 1024)
    );
    let _node = answering_node(
        &s.link,
        s.nodes[0].port,
        vec![absurd.into_bytes(), endless.into_bytes()],
    )
    .await?;
    let edge = &s.edges[0];
    let mut calm = s.client(0, "calm").await?;
    let upgrade = testkit::upgrade_request("/", &s.token("acme"));

    let text = testkit::https_raw(edge.addr, &s.files.ca, &upgrade).await?;
    let (head, passed) = text.split_once("\r\n\r\n").context("no HTTP answer")?;
    let mut lines = head.lines();
    assert!(lines.next().is_some_and(|l| l.contains(" 503 ")), "{text}");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let all = |name: &str| -> Vec<&str> {
        headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    assert_eq!(all("retry-after"), ["3600"], "{text}");
    assert_eq!(
        all("codex-fleet-refusal"),
        ["overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=3600000; since=1"],
        "{text}"
    );
    assert!(all("x-node-secret").is_empty(), "{text}");
    assert_eq!(passed.trim(), body.replace("99999999999", "3600000"));
    // The other tenant, through the same edge.
    let listed = calm.request("thread/list", json!({})).await?;
    assert!(listed.get("data").is_some(), "{listed}");

    // Headers without end: the edge reads a bounded amount and refuses with its own answer.
    let text = testkit::https_raw(edge.addr, &s.files.ca, &upgrade).await?;
    let head = text.split_once("\r\n\r\n").context("no HTTP answer")?.0;
    assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
    assert!(
        head.contains("scope=worker; reason=nodeUnavailable") && !head.contains("x-pad"),
        "{head}"
    );
    let listed = calm.request("thread/list", json!({})).await?;
    assert!(listed.get("data").is_some(), "{listed}");
    Ok(())
}
