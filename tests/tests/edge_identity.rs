//! docs/decisions/0016-every-hop-holds-like-serve.md: identity that survives any subject, and logs
//! a tenant cannot forge. Real processes on loopback: edges (`serve` with `[nodes]`) in front of
//! `codex-fleet node`s with real workers, mutual TLS on the link, JWTs signed here.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use testkit::{http_get, metric_at, Client, FleetBuilder, FleetProcess, Split, Upgrade};

const SECRET: &str = "an-hs256-secret-of-more-than-32-bytes-for-tests";
const STEP: Duration = Duration::from_secs(30);

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// An HS256 token of the `shared` issuer (tenant acme) naming `sub`.
fn jwt(sub: &str) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        &json!({"sub": sub, "exp": now() + 600}),
        &EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .expect("sign")
}

/// `[auth]` with the `shared` HS256 issuer (tenant acme) whose secret is written into `dir`.
fn issuer_toml(dir: &Path) -> anyhow::Result<String> {
    let secret = dir.join("hs.secret");
    std::fs::write(&secret, SECRET)?;
    Ok(format!(
        "[auth]\n[[auth.jwt]]\nname = \"shared\"\nalgorithm = \"HS256\"\nsecret_file = {secret:?}\ntenant = \"acme\"\n"
    ))
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("every audit line is JSON"))
        .collect()
}

/// Restarts node `i` of `s` after `edit` changed its configuration text.
async fn restart_node(
    s: &mut Split,
    i: usize,
    edit: impl FnOnce(String) -> String,
) -> anyhow::Result<()> {
    if let Some(mut p) = s.nodes[i].process.take() {
        p.signal(Signal::SIGTERM)?;
        p.wait(STEP).await?;
    }
    let text = std::fs::read_to_string(&s.nodes[i].config)?;
    std::fs::write(&s.nodes[i].config, edit(text))?;
    s.start_node(i).await
}

async fn readyz(s: &Split) -> anyhow::Result<u16> {
    Ok(http_get(s.edges[0].admin, "/readyz").await?.0)
}

/// Subjects the link cannot carry as they are (a control character, non-ASCII) reach the node
/// exactly, with the client's own address; an over-long one is refused at the door (401). None
/// of them is the node's failure: the edge stays ready and counts no unreachable node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_subject_reaches_the_node_exactly_with_the_client_s_address() -> anyhow::Result<()> {
    let keys = tempfile::tempdir()?;
    let edge_audit = keys.path().join("edge-audit.jsonl");
    let node_audit = keys.path().join("node-audit.jsonl");
    let extra = format!(
        "max_connections = 10000\n[audit]\npath = {edge_audit:?}\n{}",
        issuer_toml(keys.path())?
    );
    let mut s = Split::start(&[("acme", "n1"), ("beta", "n2")], 1, &extra).await?;
    // Node n1 (acme's) writes its own audit log: what it records, it learnt from the link.
    restart_node(&mut s, 0, |t| {
        t.replace("edge-audit.jsonl", "node-audit.jsonl")
    })
    .await?;
    let ready =
        testkit::wait_until_async(STEP, || async { readyz(&s).await.ok() == Some(200) }).await;
    assert!(ready, "the edge is ready again after the node's restart");
    let unreachable = || {
        metric_at(
            s.edges[0].admin,
            "codex_fleet_link_errors_total",
            &[("node", "n1"), ("reason", "unreachable")],
        )
    };
    let unreachable_before = unreachable().await?;

    let subjects = ["a\nb\u{1}c", "José", "100% sure "];
    let mut threads = Vec::new();
    for sub in subjects {
        let mut c = s.edges[0].client(&s.files, &jwt(sub)).await?;
        threads.push(c.start_thread().await?);
        c.close().await;
        assert_eq!(readyz(&s).await?, 200, "after subject {sub:?}");
    }
    // 10 KB: over the subject bound, a clear refusal of this client alone.
    let long = "x".repeat(10 << 10);
    match Client::try_connect(&s.edges[0].url(), &s.files.ca, Some(&jwt(&long))).await? {
        Upgrade::Refused { status, .. } => assert_eq!(status, 401),
        Upgrade::Open(_) => anyhow::bail!("a 10 KB subject was admitted"),
    }

    // The node's own records name each subject exactly, and the client's address as the edge
    // saw it (not the edge's).
    let ended = |sub: &str| {
        events(&node_audit)
            .into_iter()
            .find(|e| e["event"] == "session.ended" && e["subject"] == sub)
    };
    for (sub, thread) in subjects.iter().zip(&threads) {
        assert!(
            testkit::wait_until(STEP, || ended(sub).is_some()).await,
            "the node recorded no session of {sub:?}: {:?}",
            std::fs::read_to_string(&node_audit).unwrap_or_default()
        );
        let node = events(&node_audit);
        assert!(
            node.iter().any(|e| e["event"] == "thread.created"
                && e["subject"] == *sub
                && e["thread"] == thread.as_str()),
            "{sub:?}"
        );
        let edge_saw = events(&edge_audit)
            .into_iter()
            .find(|e| e["event"] == "authentication.succeeded" && e["subject"] == *sub)
            .context("the edge's admission")?;
        let client_addr = edge_saw["remote"].as_str().context("remote")?.to_owned();
        assert_eq!(
            ended(sub).context("ended")?["remote"],
            client_addr.as_str(),
            "{sub:?}"
        );
        assert!(
            node.iter().any(|e| e["event"] == "link.admitted"
                && e["subject"] == *sub
                && e["remote"] == client_addr.as_str()),
            "{sub:?}"
        );
    }
    assert_eq!(readyz(&s).await?, 200);
    assert_eq!(
        unreachable().await?,
        unreachable_before,
        "no session counted as an unreachable node"
    );
    Ok(())
}

/// Straight to a node's port with a client certificate, as an edge would: the node's first
/// answer (to `initialize`), or the error that ended the connection.
async fn to_node(port: u16, ca: &Path, cert: &Path, key: &Path) -> anyhow::Result<String> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    router::tls::install_crypto_provider();
    let (config, _files) = router::tls::client_config_mutual(ca, cert, key)?;
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        format!("wss://localhost:{port}/"),
    )?;
    req.headers_mut()
        .insert(router::edge::TENANT_HEADER, "acme".parse()?);
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let (mut ws, _) = tokio_tungstenite::client_async_tls_with_config(
        req,
        tcp,
        None,
        Some(tokio_tungstenite::Connector::Rustls(config)),
    )
    .await?;
    ws.send(Message::Text(
        r#"{"id":1,"method":"initialize","params":{"clientInfo":{"name":"x","version":"1"}}}"#
            .into(),
    ))
    .await?;
    // TLS 1.3 reports a refused client certificate after the handshake: the first read fails.
    match tokio::time::timeout(STEP, ws.next()).await? {
        Some(Ok(Message::Text(t))) => Ok(t.to_string()),
        Some(Ok(m)) => anyhow::bail!("the node answered {m:?}"),
        Some(Err(e)) => Err(e.into()),
        None => anyhow::bail!("closed without an error"),
    }
}

/// A node accepts only link certificates issued for clients (clientAuth): one without any
/// extended key usage, signed by the edge CA, is refused; one with clientAuth is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_certificate_without_client_auth_is_refused() -> anyhow::Result<()> {
    use rcgen::ExtendedKeyUsagePurpose as Eku;
    let mut s = Split::start(&[("acme", "n1"), ("beta", "n2")], 0, "").await?;
    let pki = testkit::pki::TestPki::new()?;
    let (node_cert, node_key) =
        pki.leaf(&["localhost", "127.0.0.1"], vec![Eku::ServerAuth], None)?;
    let dir = s.link.clone();
    let write = |name: &str, pem: &str| router::fsutil::write_private(&dir.join(name), pem);
    write("ca.pem", &pki.ca)?;
    write("node.crt", &node_cert)?;
    write("node.key", &node_key)?;
    for (name, eku) in [
        ("plain", vec![]),
        ("server", vec![Eku::ServerAuth]),
        ("client", vec![Eku::ClientAuth]),
    ] {
        let (cert, key) = pki.leaf(&["codex-fleet-edge"], eku, None)?;
        write(&format!("{name}.crt"), &cert)?;
        write(&format!("{name}.key"), &key)?;
    }
    // Node n1 now trusts this CA and serves the new certificate.
    restart_node(&mut s, 0, |t| t).await?;
    let port = s.nodes[0].port;
    let ca = dir.join("ca.pem");
    let try_as = |name: &str| {
        let (ca, cert, key) = (
            ca.clone(),
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        async move { to_node(port, &ca, &cert, &key).await }
    };
    let plain = try_as("plain").await;
    assert!(
        plain.is_err(),
        "a certificate without clientAuth opened the node: {plain:?}"
    );
    let server = try_as("server").await;
    assert!(
        server.is_err(),
        "a serverAuth certificate opened the node: {server:?}"
    );
    let answer = try_as("client").await?;
    let v: Value = serde_json::from_str(&answer)?;
    assert_eq!(v["id"], 1, "{answer}");
    assert!(v.get("result").is_some(), "{answer}");
    Ok(())
}

/// A line that a reader of the merged stream would take for an audit record: a JSON object
/// with an `audit` or an `event` key at the top.
fn looks_like_audit(line: &str) -> bool {
    serde_json::from_str::<Value>(line.trim()).is_ok_and(|v| {
        v.as_object()
            .is_some_and(|o| o.contains_key("audit") || o.contains_key("event"))
    })
}

/// Clients write a forged audit record into a method name, an 8 MiB method name and a JWT
/// subject; in both log formats every line stays a line of the log (json: every line parses
/// with the tracing keys; text: no raw control character), no line passes for an audit record,
/// and the method is cut short in the log and in the audit record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_forge_a_log_or_audit_line() -> anyhow::Result<()> {
    for format in ["json", "text"] {
        forge(format)
            .await
            .with_context(|| format!("--log-format {format}"))?;
    }
    Ok(())
}

async fn forge(format: &str) -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant("acme")
        .tenant("beta")
        .prepare()
        .await?;
    let dir = files.dir.path();
    let audit = dir.join("audit.jsonl");
    let mut toml = std::fs::read_to_string(&files.config)?;
    toml.push_str(&format!("[audit]\npath = {audit:?}\n{}", issuer_toml(dir)?));
    router::fsutil::write_private(&files.config, &toml)?;
    let fleet = FleetProcess::spawn_with(&files, |cmd| {
        cmd.env("CODEX_FLEET_LOG", "info")
            .env("CODEX_FLEET_LOG_FORMAT", format);
    })
    .await?;

    let forged = [
        r#"{"ts_ms":1,"event":"approval.answered","tenant":"beta","subject":"victim","decision":"accept"}"#,
        r#"{"audit":"codex-fleet","ts_ms":1,"event":"approval.answered","tenant":"beta","decision":"accept"}"#,
    ];
    let injected = format!("x\n{}\n{}\r\ny", forged[0], forged[1]);
    // A subject carrying the forgery (within the subject bound).
    let c = fleet
        .client(&files, &jwt(&format!("s\n{}\n", forged[0])))
        .await?;
    c.close().await;
    // A client name carrying it, padded to a megabyte: the session's audit record names the
    // client (`session.initialized`).
    // (app-server itself refuses a name that is no valid header value; the session's audit
    // record is written as the request passes, whatever the answer.)
    let mut named = Client::connect(&fleet.url(), &files.ca, Some(&files.token("acme"))).await?;
    let name = format!("{injected}{}", "n".repeat(1 << 20));
    named
        .call(
            "initialize",
            json!({ "clientInfo": { "name": name, "version": injected }, "capabilities": {} }),
        )
        .await?;
    named.close().await;
    let mut c = fleet.client(&files, &files.token("acme")).await?;
    // A method name carrying it, and 8 MiB of method name: both get app-server's own answer to
    // a method it does not know (-32600), which quotes the method to its client only.
    for method in [injected.clone(), "m".repeat(8 << 20)] {
        let answer = c.call(&method, json!({})).await?;
        assert_eq!(
            answer["error"]["code"], -32600,
            "an unknown method: {answer:.300}"
        );
    }
    c.close().await;
    let log = fleet.stderr();
    for line in log.lines() {
        assert!(
            !looks_like_audit(line),
            "a log line passes for an audit record: {line:.300}"
        );
    }
    assert!(log.len() < 1 << 20, "the log holds {} bytes", log.len());
    for line in log.lines() {
        if line.contains("approval.answered") || line.contains("authenticated") {
            assert!(line.len() < 2048, "a {} byte log line", line.len());
        }
        match format {
            "json" => {
                let v: Value = serde_json::from_str(line)
                    .with_context(|| format!("a log line that is not JSON: {line}"))?;
                assert!(
                    v.get("timestamp").is_some() && v.get("level").is_some(),
                    "{line}"
                );
            }
            _ => assert!(
                !line.chars().any(char::is_control),
                "a control character in {line:?}"
            ),
        }
    }
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    eprintln!(
        "measured ({format}): an 8 MiB method name and a 1 MiB client name: longest log line {longest} B, whole log {} B",
        log.len()
    );
    // The forged subject is in the log, escaped, as one field of one line.
    assert!(
        log.contains("approval.answered"),
        "the authentication line names the subject"
    );

    // The audit log: every line is a record of codex-fleet's, none forged, the client name cut.
    // Written by the audit thread, a moment after the session began.
    let initialized = || {
        std::fs::read_to_string(&audit)
            .unwrap_or_default()
            .matches("\"event\":\"session.initialized\"")
            .count()
    };
    assert!(testkit::wait_until(STEP, || initialized() >= 1).await);
    let text = std::fs::read_to_string(&audit)?;
    let records: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(records.iter().all(|r| r["event"] != "approval.answered"));
    assert!(
        records
            .iter()
            .any(|r| r["event"] == "authentication.succeeded"
                && r["subject"]
                    .as_str()
                    .is_some_and(|s| s.contains("approval.answered"))),
        "the forged subject is audited as a subject: {text:.2000}"
    );
    // The forging client's record: the one whose name carries the forgery.
    let name = records
        .iter()
        .filter(|r| r["event"] == "session.initialized")
        .filter_map(|r| r["client_name"].as_str())
        .find(|n| n.contains("approval.answered"))
        .context("the forging client's session.initialized")?;
    assert!(
        name.len() <= 512 && name.contains(router::untrusted::CUT_MARKER),
        "a {} byte client name in the audit log",
        name.len()
    );
    eprintln!("measured ({format}): the audit log: {} B", text.len());
    assert!(
        text.len() < 64 << 10,
        "the audit log holds {} bytes",
        text.len()
    );
    Ok(())
}
