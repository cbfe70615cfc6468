//! docs/decisions/0014-two-roles-one-binary.md: edges in front of nodes. Real processes on
//! loopback: `codex-fleet node` holding tenants with real workers, `codex-fleet serve` with
//! `[nodes]` as edges, real TLS on both hops (mutual TLS on the link).

use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use testkit::link::{straight_to_node, Straight};
use testkit::{agent_text, reply_text, wait_until_async, Client, Split, Upgrade};
use tokio::time::Instant;

async fn first_turn(c: &mut Client, prompt: &str) -> anyhow::Result<String> {
    let thread = c.start_thread().await?;
    c.start_turn(&thread, prompt).await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(thread)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_share_a_thread_and_a_node_s_death_touches_only_its_tenants() -> anyhow::Result<()>
{
    let mut s = Split::start(&[("acme", "n1"), ("beta", "n2")], 2, "").await?;
    // Test 1: A through edge 0 and edge 1 share one thread; the second answers the approval.
    let mut a0 = s.client(0, "acme").await?;
    let thread = first_turn(&mut a0, "first through edge 0").await?;
    let mut a1 = s.client(1, "acme").await?;
    a1.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    a0.start_turn(&thread, "shared RUNSHELL").await?;
    let approval = |v: &Value| v["method"] == "item/commandExecution/requestApproval";
    let _ask0 = a0.wait_for(approval).await?;
    let ask1 = a1.wait_for(approval).await?;
    a1.send(&json!({ "id": ask1["id"], "result": { "decision": "accept" } }))
        .await?;
    for c in [&mut a0, &mut a1] {
        let msgs = c.until_turn_completed(&thread).await?;
        assert_eq!(agent_text(&msgs), Some(reply_text("shared RUNSHELL")));
    }
    let mut b = s.client(0, "beta").await?;
    let b_thread = first_turn(&mut b, "beta on node 2").await?;
    if nix::unistd::geteuid().is_root() {
        // Two node processes on one host allocated from one range: never one uid for both.
        let uid_of = |node: &str, tenant: &str| -> anyhow::Result<u32> {
            let path = s.files.dir.path().join(node).join("tenant-uids");
            let uids = router::tenants::uids::read_uid_file(&path)?;
            uids.get(tenant)
                .copied()
                .ok_or_else(|| anyhow::anyhow!("{node} has no uid for {tenant}: {uids:?}"))
        };
        assert_ne!(uid_of("n1", "acme")?, uid_of("n2", "beta")?);
    }

    // Test 5: a node's port refuses a client without an edge certificate, and one whose
    // certificate is from another CA.
    let other = router::cli::dev::generate_link_pki(&["localhost"])?;
    let other_dir = s.files.dir.path().join("other");
    std::fs::create_dir(&other_dir)?;
    router::fsutil::write_private(&other_dir.join("edge.crt"), &other.edge_cert_pem)?;
    router::fsutil::write_private(&other_dir.join("edge.key"), &other.edge_key_pem)?;
    let node_port = s.nodes[0].port;
    let ca = s.link.join("ca.pem");
    // The positive control: the edges' own certificate gets an answer on the same port, so the
    // refusals below are the node's, not a dead port's.
    let genuine = straight_to_node(
        node_port,
        &ca,
        Some((&s.link.join("edge.crt"), &s.link.join("edge.key"))),
    )
    .await?;
    assert!(matches!(genuine, Straight::Answered), "{genuine:?}");
    let no_cert = straight_to_node(node_port, &ca, None).await?;
    assert!(
        matches!(no_cert, Straight::CertificateRefused(_)),
        "a client without a certificate: {no_cert:?}"
    );
    let foreign = straight_to_node(
        node_port,
        &ca,
        Some((&other_dir.join("edge.crt"), &other_dir.join("edge.key"))),
    )
    .await?;
    assert!(
        matches!(foreign, Straight::CertificateRefused(_)),
        "another CA's certificate: {foreign:?}"
    );
    for (who, answer) in [("no certificate", &no_cert), ("another CA", &foreign)] {
        if let Straight::CertificateRefused(alert) = answer {
            eprintln!("measured: {who} refused by the node's TLS: {alert}");
        }
    }
    // A client token at the node's port is no credential either.
    let token_only = Client::connect(
        &format!("wss://localhost:{node_port}/"),
        &ca,
        Some(&s.token("acme")),
    )
    .await;
    assert!(token_only.is_err(), "a bearer token opened a node's port");

    // Test 2: node 1 dies. A's clients are told at once; B sees nothing. "At once" is measured
    // against this machine now: the slowest of a few round trips through the same edge and node.
    let mut slowest = Duration::ZERO;
    for _ in 0..10 {
        let t = Instant::now();
        a0.request("thread/loaded/list", json!({})).await?;
        slowest = slowest.max(t.elapsed());
    }
    let killed = Instant::now();
    s.nodes[0]
        .process
        .as_ref()
        .context("n1")?
        .signal(Signal::SIGKILL)?;
    for c in [&mut a0, &mut a1] {
        let close = c.recv_close_frame(Duration::from_secs(5)).await?;
        let (code, reason) = close.context("a close frame")?;
        assert_eq!(code, router::edge::NODE_LOST_CODE, "{reason}");
    }
    let told = killed.elapsed();
    eprintln!(
        "measured: node SIGKILL to its tenant's clients closed (1012): {told:?} (slowest round \
         trip before: {slowest:?})"
    );
    // Sooner than the edge's probe could have noticed (probe_interval_secs = 1 plus the 1 s
    // connect timeout), with room for a machine whose round trips are slow today.
    let probe = Duration::from_secs(2);
    assert!(told < probe + slowest * 20, "{told:?}");
    b.start_turn(&b_thread, "beta carries on").await?;
    let msgs = b.until_turn_completed(&b_thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("beta carries on")));
    let named = wait_until_async(Duration::from_secs(10), || async {
        s.edge_readyz(1)
            .await
            .is_ok_and(|r| r["edge"]["unreachableTenants"] == json!(["acme"]))
    })
    .await;
    assert!(
        named,
        "edge /readyz names acme: {}",
        s.edge_readyz(1).await?
    );
    match Client::try_connect(&s.edges[0].url(), &s.files.ca, Some(&s.token("acme"))).await? {
        Upgrade::Refused { status, body, .. } => {
            assert_eq!(status, 503, "{body}");
            assert!(body.contains("nodeUnavailable"), "{body}");
        }
        Upgrade::Open(_) => panic!("a session opened for a tenant whose node is down"),
    }
    let metrics = testkit::http_get(s.edges[0].admin, "/metrics").await?.1;
    assert!(
        testkit::metric_in(
            &metrics,
            "codex_fleet_link_errors_total",
            &[("node", "n1"), ("reason", "lost")]
        ) >= 1.0,
        "{metrics}"
    );
    // Node 1 comes back: A resumes its thread from disk, through either edge.
    s.start_node(0).await?;
    let mut again = None;
    for _ in 0..50 {
        if let Ok(c) = s.client(1, "acme").await {
            again = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut a2 = again.context("acme through edge 1 after node 1 restarted")?;
    let read = a2
        .request("thread/resume", json!({ "threadId": thread }))
        .await?;
    let turns = read["thread"]["turns"].as_array().map_or(0, Vec::len);
    let read = a2
        .request(
            "thread/read",
            json!({ "threadId": thread, "includeTurns": true }),
        )
        .await?;
    let on_disk = read["thread"]["turns"].as_array().map_or(0, Vec::len);
    assert!(on_disk >= 2, "both turns are back from disk: {read}");
    let _ = turns;
    a2.start_turn(&thread, "after node 1 returned").await?;
    let msgs = a2.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("after node 1 returned")));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_request_rate_is_exact_across_edges() -> anyhow::Result<()> {
    // 10 requests at once, then 1 per second, for the tenant as a whole.
    let s = Split::start(&[("acme", "n1")], 2, "tenant_rps = 1\ntenant_burst = 10").await?;
    let mut c0 = s.client(0, "acme").await?;
    let mut c1 = s.client(1, "acme").await?;
    let (mut ok, mut limited) = (0, 0);
    let began = Instant::now();
    for i in 0..16 {
        let c = if i % 2 == 0 { &mut c0 } else { &mut c1 };
        let r = c.call("thread/loaded/list", json!({})).await?;
        if r.get("result").is_some() {
            ok += 1;
        } else {
            assert_eq!(r["error"]["data"]["reason"], "tenantRateLimited", "{r}");
            limited += 1;
        }
    }
    // The burst less the two clients' `initialize`, plus at most what the rate refilled
    // meanwhile (1 a second, however slow this machine is today): one tenant-wide limit, not
    // one per edge (that would admit all 16).
    let refilled = began.elapsed().as_secs() as usize + 1;
    assert!(
        (8..=8 + refilled).contains(&ok) && ok < 16,
        "{ok} admitted, {limited} limited, {refilled} refilled"
    );
    assert_eq!(ok + limited, 16);
    Ok(())
}

/// Malformed input through an edge gets the answer `serve` gives it (tests/tests/admission.rs,
/// `bad_input_gets_its_defined_answer`): the JSON-RPC error with a null id, the session going on.
/// The long id matters most here: an edge keeps the id of each request in flight to route its
/// answer, and one over 1 KiB is refused (and not kept) before any worker sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_through_an_edge_gets_the_answer_serve_gives() -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1")], 1, "").await?;
    let mut c = s.client(0, "acme").await?;
    for (frame, code, id) in testkit::bad_frames() {
        c.send_text(&frame).await?;
        let v = c.wait_for(|v| v.get("error").is_some()).await?;
        assert_eq!(v["id"], id, "{frame}: {v}");
        assert_eq!(v["error"]["code"], code, "{frame}: {v}");
    }
    let r = c.call("thread/loaded/list", json!({})).await?;
    assert!(r.get("result").is_some(), "{r}");
    // Nothing else arrived in between: one answer each.
    assert!(c.backlog_errors().is_empty(), "{:?}", c.backlog);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_edge_closes_with_1001_while_the_node_finishes_the_turn() -> anyhow::Result<()> {
    let mut s = Split::start(&[("acme", "n1")], 2, "").await?;
    let mut c = s.client(0, "acme").await?;
    let thread = first_turn(&mut c, "before the drain").await?;
    c.start_turn(&thread, "SLOW2 outlives its edge").await?;
    c.notification("turn/started").await?;
    s.edges[0].signal(Signal::SIGTERM)?;
    let code = c.recv_close(Duration::from_secs(10)).await?;
    assert_eq!(code, Some(1001));
    let exited = s.edges[0].wait(Duration::from_secs(10)).await?;
    assert!(exited.success(), "{exited:?}");
    // The turn goes on on the node; the client reconnects through the other edge.
    let mut again = s.client(1, "acme").await?;
    // The drained turn is the thread's second: one completed turn more than before the drain,
    // whose agent message is the reply to the drained turn's prompt.
    let want = reply_text("SLOW2 outlives its edge");
    let agent_says = |turn: &Value| {
        turn["items"].as_array().is_some_and(|items| {
            items
                .iter()
                .any(|i| i["type"] == "agentMessage" && i["text"] == want.as_str())
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = Value::Null;
    let mut done = false;
    while !done && Instant::now() < deadline {
        last = again
            .request(
                "thread/read",
                json!({ "threadId": thread, "includeTurns": true }),
            )
            .await?;
        done = last["thread"]["turns"].as_array().is_some_and(|turns| {
            turns.len() == 2
                && turns[1]["status"] == "completed"
                && agent_says(&turns[1])
                && !agent_says(&turns[0])
        });
        if !done {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert!(
        done,
        "the drained turn completed on the node after its edge drained: {last}"
    );
    again
        .request("thread/resume", json!({ "threadId": thread }))
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_exec_and_the_tui_work_through_an_edge() -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1")], 1, "").await?;
    let home = tempfile::tempdir()?;
    let prompt = "exec through an edge";
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(testkit::codex_bin())
            .args(["exec", "--remote", &s.edges[0].url()])
            .args([
                "--remote-auth-token-env",
                "FLEET_TOKEN",
                "--skip-git-repo-check",
            ])
            .arg(prompt)
            .env("SSL_CERT_FILE", &s.files.ca)
            .env("FLEET_TOKEN", s.token("acme"))
            .env("CODEX_HOME", home.path())
            .current_dir(home.path())
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&reply_text(prompt)),
        "codex exec: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut tmux = testkit::Tmux::new("edge-tui");
    tmux.start_tui(&s.edges[0].url(), &s.files.ca, &s.token("acme"))
        .await?;
    tmux.type_line("hello through an edge")?;
    tmux.until_screen_has(
        &reply_text("hello through an edge"),
        Duration::from_secs(60),
    )
    .await?;
    Ok(())
}
