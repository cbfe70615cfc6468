//! The link's CA rotates in place (docs/decisions/0017-settings-travel-with-the-tenant.md):
//! cert-manager reissues the link CA and the certificates it signs, and the edge (which checks
//! nodes against `nodes.ca`) and the node (which checks edges against `node.edge_ca`) put the new
//! bundle in force for the next handshake, with no restart: the old CA stops opening a node's port,
//! open sessions are not touched, and a bundle that is not one is refused while the previous one
//! stays. Real processes on loopback: `codex-fleet node` with a real worker, `codex-fleet serve`
//! with `[nodes]`, mutual TLS on the link.

use std::path::Path;
use std::time::Duration;

use router::tls::TLS_RELOADS;
use serde_json::json;
use testkit::link::{straight_to_node, Straight};
use testkit::pki::TestPki;
use testkit::{agent_text, metric_at, reply_text, wait_until_async, Client, FleetProcess, Split};

/// A turn on a new thread.
async fn a_turn(c: &mut Client, prompt: &str) -> anyhow::Result<()> {
    let thread = c.start_thread().await?;
    c.start_turn(&thread, prompt).await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(())
}

fn write_pem(path: &Path, pem: &str) -> anyhow::Result<()> {
    router::fsutil::write_private(path, pem)?;
    Ok(())
}

/// Reloads of TLS files counted by `process`, by result.
async fn reloads(process: &FleetProcess, result: &str) -> anyhow::Result<f64> {
    metric_at(process.admin, TLS_RELOADS, &[("result", result)]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_ca_rotates_in_place_on_edges_and_nodes() -> anyhow::Result<()> {
    let s = Split::start(&[("acme", "n1")], 1, "").await?;
    let edge = &s.edges[0];
    let node = s.nodes[0].process.as_ref().expect("n1 runs");
    let port = s.nodes[0].port;
    let mut open = s.client(0, "acme").await?;
    a_turn(&mut open, "on the first CA").await?;
    let (edge_before, node_before) = (reloads(edge, "ok").await?, reloads(node, "ok").await?);

    // The old edge pair, kept to knock on the node's port after the rotation.
    let old = tempfile::tempdir()?;
    for f in ["edge.crt", "edge.key"] {
        std::fs::copy(s.link.join(f), old.path().join(f))?;
    }

    // A new CA, and new pairs it signed, in place of every link file; the bundle holds only the
    // new CA, so what the old one signed is no longer trusted.
    let pki = TestPki::new()?;
    let (node_crt, node_key) = pki.leaf(
        &["localhost", "127.0.0.1"],
        vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth],
        None,
    )?;
    let (edge_crt, edge_key) = pki.leaf(
        &["codex-fleet-edge"],
        vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        None,
    )?;
    write_pem(&s.link.join("ca.pem"), &pki.ca)?;
    write_pem(&s.link.join("node.key"), &node_key)?;
    write_pem(&s.link.join("node.crt"), &node_crt)?;
    write_pem(&s.link.join("edge.key"), &edge_key)?;
    write_pem(&s.link.join("edge.crt"), &edge_crt)?;

    // Each side puts the new files in force within its poll: the pair and the bundle, 2 reloads
    // each. Until both did, a new link may be refused; once both did, links open on the new CA.
    let rotated = wait_until_async(Duration::from_secs(20), || async {
        reloads(edge, "ok").await.unwrap_or(0.0) - edge_before >= 2.0
            && reloads(node, "ok").await.unwrap_or(0.0) - node_before >= 2.0
    })
    .await;
    assert!(
        rotated,
        "reloads: edge {}, node {}",
        reloads(edge, "ok").await? - edge_before,
        reloads(node, "ok").await? - node_before
    );
    let mut after = s.client(0, "acme").await?;
    a_turn(&mut after, "on the new CA").await?;
    // The session opened before the rotation was not touched.
    open.request("thread/loaded/list", json!({})).await?;

    // The old CA no longer opens the node's port: its edge certificate is refused, the new one
    // answered (the positive control, same port, same moment).
    let ca = s.link.join("ca.pem");
    let new_cert = (s.link.join("edge.crt"), s.link.join("edge.key"));
    let genuine = straight_to_node(port, &ca, Some((&new_cert.0, &new_cert.1))).await?;
    assert!(matches!(genuine, Straight::Answered), "{genuine:?}");
    let stale = straight_to_node(
        port,
        &ca,
        Some((&old.path().join("edge.crt"), &old.path().join("edge.key"))),
    )
    .await?;
    assert!(
        matches!(stale, Straight::CertificateRefused(_)),
        "a certificate of the old CA opened the node: {stale:?}"
    );

    // A bundle that is not one is refused on both sides, counted, and the one in force stays:
    // links keep opening.
    let (edge_bad, node_bad) = (
        reloads(edge, "invalid").await?,
        reloads(node, "invalid").await?,
    );
    std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\nnot a certificate\n")?;
    let refused = wait_until_async(Duration::from_secs(10), || async {
        reloads(edge, "invalid").await.unwrap_or(0.0) > edge_bad
            && reloads(node, "invalid").await.unwrap_or(0.0) > node_bad
    })
    .await;
    assert!(refused, "a broken CA bundle was not reported by both");
    let mut still = s.client(0, "acme").await?;
    still.request("thread/loaded/list", json!({})).await?;
    Ok(())
}
