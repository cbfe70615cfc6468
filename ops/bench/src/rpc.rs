//! The protocol core's JSON-RPC client as the bench tools drive a session: over wss to
//! codex-fleet or over a simulator's Unix socket, with the same code on both paths.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use proto::client::Client;
use proto::event::Event;
use proto::initialize::InitializeParams;
use proto::rpc::{Frame, Message as RpcMessage, ParseError, RequestId};
use proto::Method;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};

/// One session's connection.
pub struct Rpc<S> {
    /// The underlying client.
    pub client: Client<WebSocketStream<S>>,
    /// Frames other than answers read so far (notifications and server requests): what a path
    /// sends a client beyond what it asked for.
    pub unasked: u64,
}

/// A session through codex-fleet.
pub type WssRpc = Rpc<MaybeTlsStream<TcpStream>>;
/// A session directly on a simulator socket.
pub type UnixRpc = Rpc<UnixStream>;

/// wss to codex-fleet with a bearer token (Nagle off, as an interactive client wants).
pub async fn connect_wss(
    url: &str,
    tls: Arc<rustls::ClientConfig>,
    token: &str,
) -> anyhow::Result<WssRpc> {
    let mut req = url.into_client_request()?;
    req.headers_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let (ws, _) = tokio_tungstenite::connect_async_tls_with_config(
        req,
        None,
        true,
        Some(Connector::Rustls(tls)),
    )
    .await
    .with_context(|| format!("connect {url}"))?;
    Ok(Rpc::new(ws))
}

/// Plain WebSocket on a Unix socket (a simulator's, or a worker's).
pub async fn connect_unix(socket: &Path) -> anyhow::Result<UnixRpc> {
    let stream = UnixStream::connect(socket)
        .await
        .with_context(|| format!("connect {}", socket.display()))?;
    let (ws, _) = tokio_tungstenite::client_async("ws://localhost/", stream).await?;
    Ok(Rpc::new(ws))
}

/// Answers every server request "accept".
fn accept_server_request(_text: &str, m: &RpcMessage<'_>) -> Option<String> {
    match m {
        RpcMessage::Request { id, .. } => {
            Some(json!({"id": id, "result": {"decision": "accept"}}).to_string())
        }
        _ => None,
    }
}

// === impl Rpc ===

impl<S: AsyncRead + AsyncWrite + Unpin> Rpc<S> {
    /// Wraps an open WebSocket.
    pub fn new(ws: WebSocketStream<S>) -> Self {
        Rpc {
            client: Client::new(ws),
            unasked: 0,
        }
    }

    /// A request's result and its latency; notifications on the way are skipped, server
    /// requests are answered "accept".
    pub async fn call(
        &mut self,
        method: Method<'_>,
        params: Value,
    ) -> anyhow::Result<(Value, Duration)> {
        let t0 = Instant::now();
        let unasked = &mut self.unasked;
        let reply = self
            .client
            .call_with(&method, params, |text, m| {
                *unasked += 1;
                accept_server_request(text, m)
            })
            .await?;
        let took = t0.elapsed();
        Ok((reply.result()?, took))
    }

    /// `initialize` then `initialized`; how long the answer took.
    pub async fn initialize(&mut self, name: &str) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        self.client
            .call_id(
                &RequestId::Str("initialize".into()),
                &Method::Initialize,
                InitializeParams::experimental(name, "0.0.1"),
                |_, _| None,
            )
            .await?;
        self.client.notify(&Method::Initialized).await?;
        Ok(t0.elapsed())
    }

    /// `thread/start`; the new thread's id and the call's latency.
    pub async fn start_thread(&mut self) -> anyhow::Result<(String, Duration)> {
        let (started, took) = self.call(Method::ThreadStart, json!({})).await?;
        let thread = started["thread"]["id"]
            .as_str()
            .context("thread/start answered without a thread id")?
            .to_owned();
        Ok((thread, took))
    }

    /// `turn/start` with one text input; the call's latency.
    pub async fn start_turn(&mut self, thread: &str, text: &str) -> anyhow::Result<Duration> {
        let (_, took) = self
            .call(
                Method::TurnStart,
                json!({"threadId": thread, "input": [{"type": "text", "text": text, "text_elements": []}]}),
            )
            .await?;
        Ok(took)
    }

    /// Reads until the thread's `turn/completed`, handing every notification's method to
    /// `seen` (that one included) and answering server requests "accept".
    pub async fn until_turn_completed(
        &mut self,
        thread: &str,
        mut seen: impl FnMut(&Method<'_>),
    ) -> anyhow::Result<()> {
        loop {
            let text = self.client.next_text().await?;
            self.unasked += 1;
            let frame = match Frame::parse(&text) {
                Ok(frame) => frame,
                Err(ParseError::NotJson(e)) => bail!("invalid JSON: {e}"),
                Err(_) => continue,
            };
            if let Some(answer) = accept_server_request(&text, &frame.message) {
                self.client.send_text(answer).await?;
            }
            let RpcMessage::Notification { method, params } = frame.message else {
                continue;
            };
            seen(&method);
            if let Some(Event::TurnCompleted { thread: done, .. }) = Event::parse(&method, params) {
                if done == thread {
                    return Ok(());
                }
            }
        }
    }
}
