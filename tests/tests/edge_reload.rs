//! What docs/architecture.md promises of an edge and its nodes that only a running pair can show: a
//! SIGHUP on an edge puts new tokens and tenant→node assignments in force and closes the relayed
//! sessions whose token it removed (1008), while other tenants' relayed sessions go on; a node's
//! refusal reaches the client through the edge as the same HTTP answer; a refusal for an
//! unreachable node carries `Retry-After`, and the edge's `/readyz` names the node and its tenants;
//! a link client certificate renewed in place is what the edge presents next. Real processes on
//! loopback: `codex-fleet node` with real workers, `codex-fleet serve` with `[nodes]`, mutual TLS
//! on the link.

use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::Signal;
use serde_json::json;
use testkit::{
    agent_text, fleet_bin, metric_at, reply_text, wait_until_async, Client, FleetProcess, Split,
    Upgrade,
};

/// A turn on a new thread; the thread.
async fn a_turn(c: &mut Client, prompt: &str) -> anyhow::Result<String> {
    let thread = c.start_thread().await?;
    c.start_turn(&thread, prompt).await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(thread)
}

/// Rewrites `path` with `edit`, then sends SIGHUP to `process`.
fn edit_and_reload(
    path: &std::path::Path,
    process: &testkit::FleetProcess,
    edit: impl FnOnce(String) -> String,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)?;
    let changed = edit(text.clone());
    anyhow::ensure!(
        changed != text,
        "the edit changed nothing in {}",
        path.display()
    );
    std::fs::write(path, changed)?;
    process.signal(Signal::SIGHUP)
}

/// Opens sessions of `tenant` through edge 0 with `token` until one is refused or opens; the
/// first answer that is not the old state (`want_open`) within 15 s.
async fn until_upgrade(s: &Split, token: &str, want_open: bool) -> anyhow::Result<Upgrade> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let u = Client::try_connect(&s.edges[0].url(), &s.files.ca, Some(token)).await?;
        let open = matches!(u, Upgrade::Open(_));
        if open == want_open || tokio::time::Instant::now() >= deadline {
            return Ok(u);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_on_an_edge_rotates_tokens_and_closes_the_sessions_of_a_removed_one(
) -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let mut acme = s.client(0, "acme").await?;
    let mut beta = s.client(0, "beta").await?;
    a_turn(&mut acme, "acme before the reload").await?;
    let beta_thread = a_turn(&mut beta, "beta before the reload").await?;

    // acme's token is replaced by a new one in the edges' file (the nodes never see tokens).
    let old = s.token("acme");
    let new = "acme-rotated-token-0123456789abcdef";
    let edge_file = s.files.dir.path().join("edge0.toml");
    edit_and_reload(&edge_file, &s.edges[0], |t| {
        t.replace(
            &router::auth::token_digest_hex(&old),
            &router::auth::token_digest_hex(new),
        )
    })?;

    // The relayed session of the removed token is closed as `serve` closes it.
    let close = acme
        .recv_close_frame(Duration::from_secs(15))
        .await?
        .context("a close frame for the revoked session")?;
    assert_eq!(
        close,
        (1008, router::end::REVOKED_REASON.to_owned()),
        "the relayed session of a removed token"
    );
    // The old token no longer opens a session; the new one does, on the same node.
    match until_upgrade(&s, &old, false).await? {
        Upgrade::Refused { status, body, .. } => assert_eq!(status, 401, "{body}"),
        Upgrade::Open(_) => panic!("the removed token still opens sessions after SIGHUP"),
    }
    let mut rotated = match until_upgrade(&s, new, true).await? {
        Upgrade::Open(c) => *c,
        Upgrade::Refused { status, body, .. } => {
            panic!("the new token is refused after SIGHUP: {status} {body}")
        }
    };
    rotated.initialize("rotated").await?;
    a_turn(&mut rotated, "acme with its new token").await?;
    // beta's relayed session went on through the reload.
    beta.start_turn(&beta_thread, "beta after the reload")
        .await?;
    let msgs = beta.until_turn_completed(&beta_thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("beta after the reload")));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_moves_a_tenant_to_another_node_and_a_node_s_refusal_passes_through(
) -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let edge_file = s.files.dir.path().join("edge0.toml");
    // Only the edge learns that beta is on n1: n1 does not hold beta, and its refusal (404,
    // the tenant is not on this node) reaches the client as the same HTTP answer.
    edit_and_reload(&edge_file, &s.edges[0], |t| {
        // acme is on n1 already: move beta's line only (the second `node = "n2"` is beta's
        // when tenants are listed acme, beta).
        let (head, tail) = t.split_once("id = \"beta\"").expect("beta");
        format!(
            "{head}id = \"beta\"{}",
            tail.replacen("node = \"n2\"", "node = \"n1\"", 1)
        )
    })?;
    let refused = until_upgrade(&s, &s.token("beta"), false).await?;
    match refused {
        Upgrade::Refused { status, body, .. } => {
            assert_eq!(status, 404, "{body}");
            assert!(body.contains("not on this node"), "{body}");
        }
        Upgrade::Open(_) => panic!("a session opened on a node that does not hold its tenant"),
    }
    // Now n1 holds beta too (its file names n1 for beta; SIGHUP): the same edge's sessions
    // of beta are served there.
    let n1 = s.nodes[0].process.as_ref().context("n1")?;
    edit_and_reload(&s.nodes[0].config, n1, |t| {
        let (head, tail) = t.split_once("id = \"beta\"").expect("beta");
        format!(
            "{head}id = \"beta\"{}",
            tail.replacen("node = \"n2\"", "node = \"n1\"", 1)
        )
    })?;
    let mut moved = match until_upgrade(&s, &s.token("beta"), true).await? {
        Upgrade::Open(c) => *c,
        Upgrade::Refused { status, body, .. } => {
            panic!("beta is refused after both reloads: {status} {body}")
        }
    };
    moved.initialize("moved").await?;
    a_turn(&mut moved, "beta on n1").await?;
    let on_n1 = testkit::http_get(n1.admin, "/metrics").await?.1;
    assert_eq!(
        testkit::metric_in(&on_n1, "codex_fleet_sessions", &[("tenant", "beta")]),
        1.0,
        "the moved tenant's session runs on n1:\n{on_n1}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_node_is_refused_with_retry_after_and_named_in_readyz() -> anyhow::Result<()>
{
    let mut s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, "").await?;
    let ready = s.edge_readyz(0).await?;
    assert_eq!(ready["edge"]["unreachableTenants"], json!([]), "{ready}");
    s.nodes[0]
        .process
        .take()
        .context("n1")?
        .signal(Signal::SIGKILL)?;
    let named = wait_until_async(Duration::from_secs(10), || async {
        s.edge_readyz(0)
            .await
            .is_ok_and(|r| r["edge"]["unreachableTenants"] == json!(["acme"]))
    })
    .await;
    let ready = s.edge_readyz(0).await?;
    assert!(named, "{ready}");
    let nodes = ready["edge"]["nodes"].as_array().context("nodes")?;
    let n1 = nodes.iter().find(|n| n["name"] == "n1").context("n1")?;
    assert_eq!(n1["reachable"], false, "{ready}");
    assert!(
        n1["lastError"].as_str().is_some_and(|e| !e.is_empty()),
        "{ready}"
    );
    let n2 = nodes.iter().find(|n| n["name"] == "n2").context("n2")?;
    assert_eq!(n2["reachable"], true, "{ready}");
    // One node of two is reachable: the edge stays ready.
    let (status, _) = testkit::http_get(s.edges[0].admin, "/readyz").await?;
    assert_eq!(status, 200);
    match Client::try_connect(&s.edges[0].url(), &s.files.ca, Some(&s.token("acme"))).await? {
        Upgrade::Refused {
            status,
            retry_after,
            body,
        } => {
            assert_eq!(status, 503, "{body}");
            assert!(body.contains("nodeUnavailable"), "{body}");
            assert!(
                retry_after.is_some_and(|s| s >= 1),
                "Retry-After: {retry_after:?}"
            );
        }
        Upgrade::Open(_) => panic!("a session opened for a tenant whose node is down"),
    }
    // beta's node is fine.
    let mut beta = s.client(0, "beta").await?;
    a_turn(&mut beta, "beta while n1 is down").await?;
    Ok(())
}

/// Writes a PEM file as the link's files are written (private).
fn write_pem(path: &std::path::Path, pem: &str) -> anyhow::Result<()> {
    router::fsutil::write_private(path, pem)?;
    Ok(())
}

/// docs/decisions/0017-settings-travel-with-the-tenant.md: cert-manager renews the link
/// certificates in place before they expire. An edge whose client certificate expires in seconds
/// presents, once the files hold a renewed pair, the renewed one: links work again without a
/// restart, and the reload is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_presents_its_link_certificate_renewed_in_place() -> anyhow::Result<()> {
    let mut s = Split::start(&[("acme", "n1")], 1, "").await?;
    // A fresh link PKI in the link's files: the nodes are restarted on it, a new edge starts
    // with a client certificate that expires in 8 s.
    let pki = testkit::pki::TestPki::new()?;
    let link = s.link.clone();
    let (node_crt, node_key) = pki.leaf(
        &["localhost", "127.0.0.1"],
        vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth],
        None,
    )?;
    let lifetime = Duration::from_secs(8);
    let (edge_crt, edge_key) = pki.leaf(
        &["codex-fleet-edge"],
        vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        Some(lifetime),
    )?;
    let expires = tokio::time::Instant::now() + lifetime;
    write_pem(&link.join("ca.pem"), &pki.ca)?;
    write_pem(&link.join("node.crt"), &node_crt)?;
    write_pem(&link.join("node.key"), &node_key)?;
    write_pem(&link.join("edge.crt"), &edge_crt)?;
    write_pem(&link.join("edge.key"), &edge_key)?;
    for i in 0..s.nodes.len() {
        // Reaped before the restart: a node killed on drop may still hold its port.
        if let Some(mut old) = s.nodes[i].process.take() {
            old.signal(Signal::SIGKILL)?;
            old.wait(Duration::from_secs(10)).await?;
        }
        s.start_node(i).await?;
    }
    let edge = FleetProcess::spawn_role(
        &fleet_bin(),
        "serve",
        &s.files.dir.path().join("edge0.toml"),
        |_| {},
    )
    .await?;
    let mut before = edge.client(&s.files, &s.token("acme")).await?;
    before.request("thread/loaded/list", json!({})).await?;
    before.close().await;

    // Past its end, the certificate opens no link: the node refuses it, the client gets 503.
    tokio::time::sleep_until(expires + Duration::from_secs(1)).await;
    match Client::try_connect(&edge.url(), &s.files.ca, Some(&s.token("acme"))).await? {
        Upgrade::Refused { status, body, .. } => assert_eq!(status, 503, "{body}"),
        Upgrade::Open(_) => panic!("a link opened with an expired client certificate"),
    }

    // Renewed in place (a new key too): the next links present it.
    let (renewed_crt, renewed_key) = pki.leaf(
        &["codex-fleet-edge"],
        vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        Some(Duration::from_secs(86_400)),
    )?;
    write_pem(&link.join("edge.key"), &renewed_key)?;
    write_pem(&link.join("edge.crt"), &renewed_crt)?;
    let reloaded = wait_until_async(Duration::from_secs(15), || async {
        matches!(
            Client::try_connect(&edge.url(), &s.files.ca, Some(&s.token("acme"))).await,
            Ok(Upgrade::Open(_))
        )
    })
    .await;
    assert!(reloaded, "the edge never presented the renewed certificate");
    let mut after = edge.client(&s.files, &s.token("acme")).await?;
    let thread = a_turn(&mut after, "after the renewal").await?;
    assert!(!thread.is_empty());
    let ok = metric_at(edge.admin, router::tls::TLS_RELOADS, &[("result", "ok")]).await?;
    assert!(ok >= 1.0, "reloads counted: {ok}");
    Ok(())
}
