//! A client that goes straight to a node's link port, past the edges: what the port does with
//! the certificate it presents (tests of the link's mutual TLS, and of its CA rotating).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

/// What a node's port did with a client that went straight to it.
#[derive(Debug)]
pub enum Straight {
    /// The node answered a frame: the client got through.
    Answered,
    /// The TLS layer refused the client's certificate (a fatal alert from the node).
    CertificateRefused(String),
}

/// A TLS client presenting `cert` (or none) straight to a node's port, sending `initialize`.
/// Anything but an answer or a certificate alert (a refused connect, a timeout, a wrong port) is
/// an error, so a test cannot mistake a dead port for a refusal.
pub async fn straight_to_node(
    port: u16,
    ca: &Path,
    cert: Option<(&Path, &Path)>,
) -> anyhow::Result<Straight> {
    router::tls::install_crypto_provider();
    let config = match cert {
        Some((cert, key)) => router::tls::client_config_mutual(ca, cert, key)?.0,
        None => {
            let mut roots = rustls::RootCertStore::empty();
            for c in router::tls::load_certs(ca)? {
                roots.add(c)?;
            }
            Arc::new(
                rustls::ClientConfig::builder()
                    .with_root_certificates(roots)
                    .with_no_client_auth(),
            )
        }
    };
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        format!("wss://localhost:{port}/"),
    )?;
    req.headers_mut()
        .insert(router::edge::TENANT_HEADER, "acme".parse()?);
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .context("connect to the node's port")?;
    let alert = |e: &dyn std::fmt::Display| {
        let text = e.to_string();
        text.contains("alert").then_some(text)
    };
    let (mut ws, _) = match tokio_tungstenite::client_async_tls_with_config(
        req,
        tcp,
        None,
        Some(tokio_tungstenite::Connector::Rustls(config)),
    )
    .await
    {
        Ok(ws) => ws,
        Err(e) => match alert(&e) {
            Some(text) => return Ok(Straight::CertificateRefused(text)),
            None => return Err(e).context("the upgrade failed, not by a certificate alert"),
        },
    };
    // TLS 1.3 reports a refused client certificate after the handshake: the first read fails.
    use futures_util::{SinkExt, StreamExt};
    ws.send(tokio_tungstenite::tungstenite::Message::Text(
        r#"{"id":1,"method":"initialize","params":{"clientInfo":{"name":"x","version":"1"}}}"#
            .into(),
    ))
    .await?;
    match tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .context("no answer and no alert within 5 s")?
    {
        Some(Ok(_)) => Ok(Straight::Answered),
        Some(Err(e)) => match alert(&e) {
            Some(text) => Ok(Straight::CertificateRefused(text)),
            None => Err(e).context("the first read failed, not by a certificate alert"),
        },
        None => anyhow::bail!("closed without an answer or an alert"),
    }
}
