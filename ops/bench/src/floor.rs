//! The floor relay: what this stack (tokio, rustls, tungstenite) costs a WebSocket round trip with
//! no routing. It terminates TLS, accepts the client's WebSocket upgrade, opens a WebSocket to one
//! Unix socket (the same worker socket codex-fleet and HAProxy front in `added-latency`) and relays
//! frames as they are, one task per direction: no JSON parsing, no authentication, no admission,
//! no policy. Nagle is off on the client's TCP socket, as codex-fleet's listener sets it.
//!
//! It runs as its own process (`floor-relay`), like codex-fleet and HAProxy, so the three proxies
//! are measured the same way: their own scheduler, their own threads, a process boundary on either
//! side. Its runtime is the same flavour codex-fleet runs (tokio's multi-thread default).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use futures_util::StreamExt;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio_rustls::TlsAcceptor;

/// Accepts connections on `listener` forever, relaying each to a fresh WebSocket on `upstream`.
/// A connection that fails (handshake, upstream refused) is reported on stderr and dropped; the
/// others go on.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    upstream: PathBuf,
) -> anyhow::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let upstream = Arc::new(upstream);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: wait a moment rather than spin.
                eprintln!("floor-relay: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            if let Err(e) = relay(acceptor, tcp, &upstream).await {
                eprintln!("floor-relay: {peer}: {e:#}");
            }
        });
    }
}

/// One client: TLS, the upgrade, the upstream WebSocket, then a task per direction until either
/// side ends.
async fn relay(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    upstream: &std::path::Path,
) -> anyhow::Result<()> {
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    let tls = acceptor.accept(tcp).await.context("TLS handshake")?;
    let client = tokio_tungstenite::accept_async(tls)
        .await
        .context("WebSocket upgrade")?;
    let unix = UnixStream::connect(upstream)
        .await
        .with_context(|| format!("connect {}", upstream.display()))?;
    let (worker, _) = tokio_tungstenite::client_async("ws://localhost/", unix)
        .await
        .context("upstream WebSocket handshake")?;
    let (client_tx, client_rx) = client.split();
    let (worker_tx, worker_rx) = worker.split();
    // `forward` hands over every frame that is ready and flushes once the source has no more:
    // a burst goes out as one write, a lone frame at once.
    // The client→worker direction is a task of its own, the worker→client one runs here; when
    // either ends, the other is dropped with its halves, which closes both sockets.
    let mut up = tokio::spawn(client_rx.forward(worker_tx));
    let ended = tokio::select! {
        r = worker_rx.forward(client_tx) => r,
        r = &mut up => r.unwrap_or(Ok(())),
    };
    up.abort();
    // A close from either side ends the relay; so does a peer that just goes away (the bench's
    // clients drop their connections): neither is a failure of the relay.
    use tokio_tungstenite::tungstenite::error::{Error, ProtocolError};
    match ended {
        Ok(())
        | Err(Error::ConnectionClosed)
        | Err(Error::AlreadyClosed)
        | Err(Error::Protocol(ProtocolError::ResetWithoutClosingHandshake)) => Ok(()),
        Err(Error::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}
