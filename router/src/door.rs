//! The door every role's upgrade passes: what one accepted connection holds until its upgrade
//! is answered, and the HTTP answers it may get there (refusals with their metric and audit
//! record, 101, and the task that runs the upgraded WebSocket).
//!
//! The listener ([`crate::listener`]) fills a [`Door`] for each TLS connection and checks the
//! upgrade request; the embedded and node sessions are started from there, the edge's relay
//! from [`crate::edge::Edge::upgrade`]. Every answer but 101 carries `Connection: close`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::admission::{Admission, ReadMeter, Rejection};
use crate::audit::Audit;
use crate::auth::AuthError;
use crate::metrics::RouterMetrics;

/// One accepted connection, before and while its upgrade is answered.
pub struct Door {
    /// Rates and caps.
    pub(crate) admission: Arc<Admission>,
    /// Router metrics.
    pub(crate) metrics: RouterMetrics,
    /// Largest message in either direction.
    pub(crate) max_message_bytes: usize,
    /// Frames queued towards one client.
    pub(crate) client_queue: usize,
    /// Bytes queued towards one client.
    pub(crate) client_queue_bytes: usize,
    /// Bytes queued towards all of one tenant's clients.
    pub(crate) tenant_queue_bytes: usize,
    /// Cancelled to stop accepting and close sessions with 1001.
    pub(crate) shutdown: CancellationToken,
    /// Tracks every connection task.
    pub(crate) tracker: TaskTracker,
    /// The connection's remote address.
    pub(crate) addr: SocketAddr,
    /// The audit log.
    pub(crate) audit: Audit,
}

// === impl Door ===

impl Door {
    /// A failed authentication costs the source address one more handshake: over its rate,
    /// its next connections are answered 429.
    pub(crate) fn charge_failed_auth(&self) {
        // Refused or not, the attempt is counted; the refusal shows on the next connection.
        let _charged = self.admission.check_handshake(self.addr.ip());
    }
    pub(crate) fn refused(&self, reason: &str) {
        // A label outside the list would have no series until its first refusal, and no place
        // on the dashboard's panels: debug builds (every test's) say so at its first use.
        debug_assert!(
            crate::metrics::is_upgrade_refusal(reason),
            "upgrade refusal label {reason:?} is not in UPGRADE_REFUSALS"
        );
        self.metrics
            .upgrades_refused
            .with_label_values(&[reason])
            .inc();
    }
    pub(crate) fn plain(
        &self,
        status: StatusCode,
        reason: &str,
        body: &str,
    ) -> Response<Full<Bytes>> {
        self.refused(reason);
        let mut resp = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        // Every answer but 101 is the connection's last.
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        resp
    }
    /// A credential that does not authenticate: 401, charged to the source address; or an
    /// `Origin` the tenant does not allow: 403.
    pub(crate) fn auth_refused(&self, e: &AuthError) -> Response<Full<Bytes>> {
        let reason = e.reason();
        tracing::info!(reason, "upgrade refused: {e}");
        self.audit.record(
            "authentication.failed",
            serde_json::json!({ "reason": reason, "remote": self.addr.to_string() }),
        );
        if *e != AuthError::Origin {
            self.charge_failed_auth();
        }
        self.plain(e.status(), reason, &e.to_string())
    }
    pub(crate) fn audit_admitted(&self, tenant: &str, subject: &str, kind: &str, key_id: &str) {
        self.audit.record(
            "authentication.succeeded",
            serde_json::json!({
                "tenant": tenant, "subject": subject, "credential": kind, "key_id": key_id,
                "remote": self.addr.to_string(),
            }),
        );
    }
    /// An admission refusal: 429 (rates) or 503 (caps) with `Retry-After`, and the connection
    /// is closed after the answer.
    pub(crate) fn overloaded(&self, r: &Rejection, reason: &str) -> Response<Full<Bytes>> {
        self.metrics.rejected(r);
        let status =
            StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut resp = self.plain(status, reason, &r.http_body());
        let h = resp.headers_mut();
        h.insert(header::RETRY_AFTER, HeaderValue::from(r.retry_after_secs()));
        if let Ok(v) = HeaderValue::from_str(&r.http_header()) {
            h.insert(crate::admission::REFUSAL_HEADER, v);
        }
        resp
    }
    /// The refusal of an upgrade while codex-fleet drains: 503, `Retry-After: 5`, and
    /// [`crate::admission::DRAINING_REFUSAL`] in the refusal header beside the body older edges
    /// read ([`crate::admission::DRAINING_BODY`]), so an edge's link looks for the tenant's next
    /// node.
    pub(crate) fn draining(&self) -> Response<Full<Bytes>> {
        let mut resp = self.plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            crate::admission::DRAINING_BODY,
        );
        let h = resp.headers_mut();
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        h.insert(
            crate::admission::REFUSAL_HEADER,
            HeaderValue::from_static(crate::admission::DRAINING_REFUSAL),
        );
        resp
    }
    /// After the 101: waits for the upgraded connection, takes its TLS stream back from hyper
    /// ([`ClientIo`], its reads counted by `meter`, the session's), records the handshake time
    /// and runs `serve` on its WebSocket in a tracked task.
    pub(crate) fn spawn_upgraded<F, Fut>(
        &self,
        on_upgrade: hyper::upgrade::OnUpgrade,
        started: tokio::time::Instant,
        span: tracing::Span,
        meter: Arc<ReadMeter>,
        serve: F,
    ) where
        F: FnOnce(WebSocketStream<ClientIo>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let max = self.max_message_bytes;
        let handshake = self.metrics.handshake_seconds.clone();
        self.tracker.spawn(
            async move {
                let upgraded = match on_upgrade.await {
                    Ok(u) => u,
                    Err(e) => {
                        tracing::debug!(error = %e, "upgrade failed");
                        return;
                    }
                };
                handshake.observe(started.elapsed().as_secs_f64());
                let io = match ClientIo::from_upgraded(upgraded, meter) {
                    Ok(io) => io,
                    Err(_) => {
                        tracing::error!("upgraded connection of an unexpected type; closed");
                        return;
                    }
                };
                let ws = WebSocketStream::from_raw_socket(
                    io,
                    Role::Server,
                    Some(proto::ws::client_config(max)),
                )
                .await;
                serve(ws).await;
            }
            .instrument(span),
        );
    }
}

/// The 101 answer. Deliberately no x-codex-app-server-compression echo: clients then send plain
/// text frames.
pub(crate) fn switching_protocols(accept: &str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(v) = HeaderValue::from_str(accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    resp
}

/// The transport the listener serves HTTP on, and so what an upgraded connection is.
pub(crate) type ClientTls = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

/// A client's connection after its upgrade: its TLS stream itself, taken back from hyper,
/// with whatever hyper had read past the upgrade request (the client may send its first frame
/// at once), which is read first.
///
/// Not hyper's `Upgraded`: that wraps the stream in a boxed `dyn` transport behind two adapters
/// between tokio's and hyper's I/O traits, and every read and write of the session's life went
/// through all of them.
pub struct ClientIo<T = ClientTls> {
    /// Read past the upgrade request by hyper; returned before anything from `io`.
    ahead: Bytes,
    /// Boxed: a TLS stream is a large value, and the futures that hold a session's stream
    /// across their awaits would each lay out room for it inline (about 2.5 KiB more per
    /// relayed session on an edge, measured, than with the stream behind a pointer).
    io: Box<T>,
    /// Counts what is read against the tenant's read buffers as it arrives, so a message that
    /// is never finished is bounded too; a read that would take the tenant over fails.
    meter: Arc<ReadMeter>,
}

impl ClientIo {
    /// The TLS stream under an upgraded connection, its reads counted by `meter`; the
    /// connection back if it is not one of the listener's.
    pub(crate) fn from_upgraded(
        upgraded: hyper::upgrade::Upgraded,
        meter: Arc<ReadMeter>,
    ) -> Result<ClientIo, hyper::upgrade::Upgraded> {
        let parts = upgraded.downcast::<TokioIo<ClientTls>>()?;
        Ok(ClientIo::new(parts.read_buf, parts.io.into_inner(), meter))
    }
}

impl<T> ClientIo<T> {
    fn new(ahead: Bytes, io: T, meter: Arc<ReadMeter>) -> ClientIo<T> {
        let mut io = ClientIo {
            ahead,
            io: Box::new(io),
            meter,
        };
        io.release_ahead();
        io
    }

    /// Once what was read ahead is all read, lets go of it: even empty, a slice of hyper's read
    /// buffer keeps that whole buffer allocated for the connection's life (about 6 KiB more per
    /// relayed session on an edge, measured).
    fn release_ahead(&mut self) {
        if self.ahead.is_empty() {
            self.ahead = Bytes::new();
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ClientIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        if !self.ahead.is_empty() {
            let n = self.ahead.len().min(buf.remaining());
            buf.put_slice(&self.ahead.split_to(n));
            self.release_ahead();
        } else {
            std::task::ready!(Pin::new(&mut *self.io).poll_read(cx, buf))?;
        }
        if self.meter.read(buf.filled().len() - before) {
            return Poll::Ready(Ok(()));
        }
        Poll::Ready(Err(std::io::Error::other(
            "the tenant's read buffers are full",
        )))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ClientIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.io).poll_shutdown(cx)
    }
}

/// The client's socket handed over `m`: a data message or a close ends what it was reading; a
/// ping or a pong may come between the fragments of a message that stays unfinished. False
/// when `m`'s size takes the tenant's read buffers over their bound.
pub(crate) fn took(meter: &ReadMeter, m: &tokio_tungstenite::tungstenite::Message) -> bool {
    match m {
        tokio_tungstenite::tungstenite::Message::Ping(p)
        | tokio_tungstenite::tungstenite::Message::Pong(p) => {
            meter.took_control(p.len());
            true
        }
        m => meter.took(m.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn what_hyper_read_ahead_comes_first_then_the_stream_and_writes_go_through() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let meter = Arc::new(ReadMeter::new(crate::admission::HeldBuffer::new(
            Arc::default(),
            usize::MAX,
        )));
        let mut io = ClientIo::new(Bytes::from_static(b"ahead:"), ours, meter);
        theirs.write_all(b"then").await.unwrap();
        // A small buffer takes what was read ahead in parts, before the stream.
        let mut small = [0u8; 4];
        io.read_exact(&mut small).await.unwrap();
        assert_eq!(&small, b"ahea");
        let mut rest = [0u8; 6];
        io.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"d:then");
        io.write_all(b"back").await.unwrap();
        io.flush().await.unwrap();
        let mut got = [0u8; 4];
        theirs.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"back");
        io.shutdown().await.unwrap();
        assert_eq!(
            theirs.read(&mut got).await.unwrap(),
            0,
            "shut down goes through"
        );
    }
}
