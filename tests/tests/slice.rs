//! The first end-to-end slice: real wss clients through codex-fleet to real app-server workers.

use std::time::Duration;

use serde_json::{json, Value};
use testkit::{agent_text, reply_text, upgrade_request, Client, FleetBuilder};

fn methods(msgs: &[Value]) -> Vec<String> {
    msgs.iter()
        .filter_map(|m| m["method"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_streams_through_the_fleet() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    let prompt = "hello through the fleet";
    c.start_turn(&thread, prompt).await?;
    let msgs = c.until_turn_completed(&thread).await?;
    let seen = methods(&msgs);
    for m in [
        "item/started",
        "item/agentMessage/delta",
        "item/completed",
        "turn/completed",
    ] {
        assert!(seen.iter().any(|s| s == m), "missing {m} in {seen:?}");
    }
    let deltas: String = msgs
        .iter()
        .filter(|m| m["method"] == "item/agentMessage/delta")
        .filter_map(|m| m["params"]["delta"].as_str())
        .collect();
    assert_eq!(deltas, reply_text(prompt));
    assert_eq!(
        agent_text(&msgs).as_deref(),
        Some(reply_text(prompt).as_str())
    );
    let done = msgs.last().expect("turn/completed");
    assert_eq!(done["params"]["turn"]["status"], "completed", "{done}");
    c.close().await;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_round_trips_with_the_routers_id() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    // A request of our own first, so the router's and the worker's id spaces visibly differ.
    c.request("thread/loaded/list", json!({})).await?;
    c.start_turn(&thread, "please RUNSHELL").await?;
    let approval = c
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    let id = approval["id"].clone();
    assert!(
        id.is_i64(),
        "server request id must be an integer: {approval}"
    );
    assert_eq!(approval["params"]["threadId"], thread.as_str());
    c.send(&json!({ "id": id, "result": { "decision": "accept" } }))
        .await?;
    let resolved = c.notification("serverRequest/resolved").await?;
    assert_eq!(resolved["params"]["requestId"], id, "{resolved}");
    // The whole turn, its idle too, so that nothing of it is left to arrive below.
    let msgs = c.until_turn_over(&thread).await?;
    let done = msgs
        .iter()
        .find(|m| m["method"] == "turn/completed")
        .expect("turn/completed");
    assert_eq!(done["params"]["turn"]["status"], "completed", "{done}");
    assert_eq!(
        agent_text(&msgs).as_deref(),
        Some(reply_text("please RUNSHELL").as_str())
    );
    // A second answer to the same id is dropped and counted, not forwarded; the session carries on.
    let unknown = [("reason", "unknown_response")];
    let before = fleet
        .metric("codex_fleet_client_errors_total", &unknown)
        .await?;
    c.send(&json!({ "id": id, "result": { "decision": "decline" } }))
        .await?;
    c.request("thread/loaded/list", json!({})).await?;
    let counted = testkit::wait_until_async(Duration::from_secs(10), || async {
        fleet
            .metric("codex_fleet_client_errors_total", &unknown)
            .await
            .is_ok_and(|n| n == before + 1.0)
    })
    .await;
    assert!(
        counted,
        "the stale answer is counted once as unknown_response"
    );
    assert!(
        c.backlog.is_empty(),
        "nothing reached the client for the stale answer: {:?}",
        c.backlog
    );
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_exec_remote_runs_a_prompt() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let prompt = "exec through the fleet";
    let out = testkit::codex_exec_remote(
        &fleet.url(),
        &fleet.files.ca,
        &fleet.files.token("acme"),
        prompt,
    )
    .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "codex exec failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(&reply_text(prompt)),
        "stdout lacks the mock's answer:\n{stdout}\nstderr:\n{stderr}"
    );
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_and_plaintext_are_refused_while_others_work() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let mut good = fleet.client("acme").await?;
    let thread = good.start_thread().await?;

    let missing = Client::connect(&fleet.url(), &fleet.files.ca, None).await;
    let err = missing.err().expect("no token must be refused").to_string();
    assert!(err.contains("401"), "{err}");
    let wrong = Client::connect(&fleet.url(), &fleet.files.ca, Some("not-the-token")).await;
    let err = wrong
        .err()
        .expect("a wrong token must be refused")
        .to_string();
    assert!(err.contains("401"), "{err}");
    let plain =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{}/", fleet.addr.port())).await;
    assert!(plain.is_err(), "plaintext ws to the TLS port must fail");

    // The good client is unaffected.
    good.start_turn(&thread, "still here").await?;
    let msgs = good.until_turn_completed(&thread).await?;
    assert_eq!(
        agent_text(&msgs).as_deref(),
        Some(reply_text("still here").as_str())
    );
    let (_, metrics) = fleet.admin_get("/metrics").await?;
    assert!(
        metrics.contains("codex_fleet_upgrades_refused_total{reason=\"auth_missing\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("codex_fleet_upgrades_refused_total{reason=\"auth_invalid\"} 1"));
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_before_initialize_and_bad_json_get_answers() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let mut c = fleet.connect("acme").await?;
    let r = c.call("thread/start", json!({})).await?;
    assert_eq!(r["error"]["code"], -32600, "{r}");
    assert_eq!(r["error"]["message"], "Not initialized");
    c.send_text("{this is not json").await?;
    let r = c
        .wait_for(|v| v["id"].is_null() && v.get("error").is_some())
        .await?;
    assert_eq!(r["error"]["code"], -32700, "{r}");
    c.initialize("late").await?;
    let again = c
        .call(
            "initialize",
            json!({ "clientInfo": { "name": "again", "version": "1" } }),
        )
        .await?;
    assert_eq!(again["error"]["message"], "Already initialized", "{again}");
    c.request("thread/loaded/list", json!({})).await?;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_get_404_plain_requests_426_and_healthz_answers() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let token = fleet.files.token("acme");
    let status_of = |resp: &str| resp.split_whitespace().nth(1).map(str::to_owned);
    let refused = |reason: &'static str| {
        let fleet = &fleet;
        async move {
            fleet
                .metric("codex_fleet_upgrades_refused_total", &[("reason", reason)])
                .await
        }
    };
    // The control: the same upgrade on `/` is accepted.
    let ok = testkit::https_raw(fleet.addr, &fleet.files.ca, &upgrade_request("/", &token)).await?;
    assert_eq!(status_of(&ok).as_deref(), Some("101"), "{ok}");
    let path_before = refused("path").await?;
    let other = testkit::https_raw(
        fleet.addr,
        &fleet.files.ca,
        &upgrade_request("/other", &token),
    )
    .await?;
    assert_eq!(status_of(&other).as_deref(), Some("404"), "{other}");
    assert_eq!(refused("path").await?, path_before + 1.0);
    let plain_before = refused("not_websocket").await?;
    let plain = testkit::https_raw(
        fleet.addr,
        &fleet.files.ca,
        &format!("GET / HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n\r\n"),
    )
    .await?;
    assert_eq!(status_of(&plain).as_deref(), Some("426"), "{plain}");
    assert_eq!(refused("not_websocket").await?, plain_before + 1.0);
    // Liveness on the admin port.
    let (status, _) = fleet.admin_get("/healthz").await?;
    assert_eq!(status, 200);
    // And a client still works.
    fleet
        .client("acme")
        .await?
        .request("thread/loaded/list", json!({}))
        .await?;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_silent_in_its_handshake_is_closed_at_the_deadline() -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    // The fixture sets listen.handshake_timeout_secs = 5.
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let deadline = Duration::from_secs(5);
    // Silent before TLS, and silent after TLS before any HTTP.
    let mut tcp = tokio::net::TcpStream::connect(fleet.addr).await?;
    let connector = tokio_rustls::TlsConnector::from(testkit::client_tls(&fleet.files.ca)?);
    let tls_tcp = tokio::net::TcpStream::connect(fleet.addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut tls = connector.connect(name, tls_tcp).await?;
    let opened = tokio::time::Instant::now();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(deadline * 4, tcp.read(&mut buf)).await;
    let raw_after = opened.elapsed();
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "a silent TCP connection must be closed: {closed:?}"
    );
    let closed = tokio::time::timeout(deadline * 4, tls.read(&mut buf)).await;
    let tls_after = opened.elapsed();
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "a silent TLS connection must be closed: {closed:?}"
    );
    eprintln!("silent connections closed after {raw_after:?} (TCP) and {tls_after:?} (TLS)");
    // Not before the deadline (a little slack for clocks), and not much after it.
    for after in [raw_after, tls_after] {
        assert!(after >= deadline - Duration::from_millis(500), "{after:?}");
        assert!(after < deadline * 3, "{after:?}");
    }
    fleet
        .client("acme")
        .await?
        .request("thread/loaded/list", json!({}))
        .await?;
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_handshake_headroom_wait_for_a_free_slot() -> anyhow::Result<()> {
    // max_connections = 1: at most 1 + 1024 TCP connections are open at once (sessions plus
    // handshakes in progress); the fixture's handshake deadline (5 s) frees the silent ones.
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .limits_toml(
            "max_connections = 1\nhandshakes_per_sec_per_ip = 100000\nhandshake_burst = 100000",
        )
        .start()
        .await?;
    let tls_handshake = || async {
        let connector = tokio_rustls::TlsConnector::from(testkit::client_tls(&fleet.files.ca)?);
        let tcp = tokio::net::TcpStream::connect(fleet.addr).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        let t = tokio::time::Instant::now();
        let tls = tokio::time::timeout(testkit::STEP, connector.connect(name, tcp)).await??;
        Ok::<_, anyhow::Error>((t.elapsed(), tls))
    };
    // The control: with nothing else open the handshake is immediate.
    let (alone, tls) = tls_handshake().await?;
    drop(tls);
    let first_opened = tokio::time::Instant::now();
    let mut silent = Vec::new();
    for _ in 0..1025 {
        silent.push(tokio::net::TcpStream::connect(fleet.addr).await?);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (waited, _tls) = tls_handshake().await?;
    // It can only have been served once the first silent connection hit its 5 s deadline.
    let served_after = first_opened.elapsed();
    eprintln!(
        "TLS handshake alone {alone:?}; beyond 1025 open connections {waited:?}, \
         {served_after:?} after the first of them"
    );
    assert!(alone < Duration::from_secs(2), "{alone:?}");
    assert!(
        served_after >= Duration::from_millis(4500),
        "the 1026th connection was served after {served_after:?}, before any slot was free"
    );
    drop(silent);
    fleet
        .client("acme")
        .await?
        .request("thread/loaded/list", json!({}))
        .await?;
    fleet.stop().await
}
