//! Clients of a fleet, as a real client talks to it: the wss JSON-RPC [`Client`], the real
//! `codex exec --remote`, plain HTTP on the admin port and raw HTTPS on the wss port.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};

use crate::process::codex_bin;
use crate::wait::STEP;

/// Malformed text frames, the JSON-RPC error code each is answered with, and the answer's `id`:
/// the same through `serve` and through an edge. Null for not JSON, a batch, a bare value, ids
/// the protocol does not allow (null, fractional), no method, and an id over the 1 KiB kept for
/// an answer; the request's own for a request with a `trace` app-server cannot read (it would
/// answer nothing, and the request would wait forever).
pub fn bad_frames() -> Vec<(String, i64, Value)> {
    let long_id = format!(
        r#"{{"id":"{}","method":"thread/loaded/list","params":{{}}}}"#,
        "i".repeat(1100)
    );
    [
        ("{this is not json", -32700),
        (
            r#"[{"id":1,"method":"thread/loaded/list","params":{}}]"#,
            -32600,
        ),
        ("42", -32600),
        (
            r#"{"id":null,"method":"thread/loaded/list","params":{}}"#,
            -32600,
        ),
        (
            r#"{"id":3.5,"method":"thread/loaded/list","params":{}}"#,
            -32600,
        ),
        (r#"{"id":7}"#, -32600),
        (long_id.as_str(), -32600),
    ]
    .into_iter()
    .map(|(f, code)| (f.to_owned(), code, Value::Null))
    .chain([(
        r#"{"id":"traced","method":"model/list","params":{},"trace":5}"#.to_owned(),
        -32600,
        json!("traced"),
    )])
    .collect()
}

/// A hostile client's connection: upgraded with a bearer token, then `sent` bytes of a text
/// frame announced as `announced` bytes, never finished. What the server has read of it sits in
/// the socket's read buffer for as long as the client likes.
pub struct Unfinished {
    tls: tokio_rustls::client::TlsStream<TcpStream>,
}

impl Unfinished {
    /// Upgrades at `addr` (wss, trusting `ca`) as `token`, then sends the frame's head and
    /// `sent` bytes of it.
    pub async fn open(
        addr: SocketAddr,
        ca: &Path,
        token: &str,
        announced: usize,
        sent: usize,
    ) -> anyhow::Result<Unfinished> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let connector = tokio_rustls::TlsConnector::from(client_tls(ca)?);
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        let mut tls = tokio::time::timeout(
            STEP,
            connector.connect(name, TcpStream::connect(addr).await?),
        )
        .await
        .context("TLS handshake timed out")??;
        tls.write_all(upgrade_request("/", token).as_bytes())
            .await?;
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            let n = tokio::time::timeout(STEP, tls.read(&mut b))
                .await
                .context("no answer to the upgrade")??;
            anyhow::ensure!(n == 1, "closed before the upgrade was answered");
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head);
        anyhow::ensure!(head.starts_with("HTTP/1.1 101"), "not upgraded: {head}");
        // FIN, text; masked (with a zero key, so the payload is sent as is), 64-bit length.
        // Nothing at all when `announced` is 0.
        if announced > 0 {
            let mut frame = vec![0x81, 0x80 | 127];
            frame.extend_from_slice(&(announced as u64).to_be_bytes());
            frame.extend_from_slice(&[0; 4]);
            tls.write_all(&frame).await?;
        }
        let chunk = vec![b'a'; 64 << 10];
        let mut left = sent;
        while left > 0 {
            let n = left.min(chunk.len());
            if tls.write_all(&chunk[..n]).await.is_err() {
                break; // closed by the server: [`Unfinished::closed_within`] says why
            }
            left -= n;
        }
        let _flushed = tls.flush().await;
        Ok(Unfinished { tls })
    }

    /// Like [`Unfinished::open`], but the unfinished message is `sent` bytes of 60 KiB
    /// fragments (a text frame without FIN, then continuations), each followed by a ping: a
    /// message the server must count across its fragments and the control frames between them.
    pub async fn open_fragmented(
        addr: SocketAddr,
        ca: &Path,
        token: &str,
        sent: usize,
    ) -> anyhow::Result<Unfinished> {
        use tokio::io::AsyncWriteExt;
        let mut u = Unfinished::open(addr, ca, token, 0, 0).await?;
        let fragment = 60 << 10;
        let mut left = sent;
        let mut first = true;
        while left > 0 {
            let n = left.min(fragment);
            let opcode = if first { 0x01 } else { 0x00 };
            first = false;
            let mut frame = vec![opcode, 0x80 | 126];
            frame.extend_from_slice(&(n as u16).to_be_bytes());
            frame.extend_from_slice(&[0; 4]);
            frame.resize(frame.len() + n, b'a');
            // A masked ping with no payload.
            frame.extend_from_slice(&[0x89, 0x80, 0, 0, 0, 0]);
            if u.tls.write_all(&frame).await.is_err() {
                break; // closed by the server: [`Unfinished::closed_within`] says why
            }
            left -= n;
        }
        let _flushed = u.tls.flush().await;
        Ok(u)
    }

    /// `n` such connections of one tenant, opened one after another (every other one sending
    /// its message as [`Unfinished::open_fragmented`] does); then how many of them were
    /// closed within 5 s, each with 1008 and `reason` (any other close fails), and the
    /// connections (those closed included, as the server left them).
    pub async fn open_many(
        n: usize,
        addr: SocketAddr,
        ca: &Path,
        token: &str,
        (announced, sent): (usize, usize),
        reason: &str,
    ) -> anyhow::Result<(usize, Vec<Unfinished>)> {
        let mut all = Vec::new();
        for i in 0..n {
            // Every other one sends its message in fragments, with pings between them.
            all.push(if i % 2 == 0 {
                Unfinished::open(addr, ca, token, announced, sent).await?
            } else {
                Unfinished::open_fragmented(addr, ca, token, sent).await?
            });
        }
        let outcomes = futures_util::future::join_all(
            all.iter_mut()
                .map(|u| u.closed_within(Duration::from_secs(5))),
        )
        .await;
        let mut closed = 0;
        for outcome in outcomes {
            if let Some(close) = outcome? {
                anyhow::ensure!(close == (1008, reason.to_owned()), "closed with {close:?}");
                closed += 1;
            }
        }
        Ok((closed, all))
    }

    /// The close frame's code and reason when the server closes within `within`; `None` when
    /// the connection is still open then.
    pub async fn closed_within(
        &mut self,
        within: Duration,
    ) -> anyhow::Result<Option<(u16, String)>> {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // Pongs (answers to the pings sent) come first: skipped.
            while got.len() >= 2 && got[0] == 0x8a && got.len() >= 2 + usize::from(got[1] & 0x7f) {
                got.drain(..2 + usize::from(got[1] & 0x7f));
            }
            if got.len() >= 2 && got.len() >= 2 + usize::from(got[1] & 0x7f) {
                anyhow::ensure!(got[0] == 0x88, "a frame other than close: {got:?}");
                let end = 2 + usize::from(got[1] & 0x7f);
                let code = u16::from_be_bytes([got[2], got[3]]);
                return Ok(Some((
                    code,
                    String::from_utf8_lossy(&got[4..end]).into_owned(),
                )));
            }
            let mut buf = [0u8; 512];
            match tokio::time::timeout_at(deadline, self.tls.read(&mut buf)).await {
                Err(_) => return Ok(None),
                Ok(Ok(0)) => anyhow::bail!("closed without a close frame: {got:?}"),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => anyhow::bail!("read: {e} (after {got:?})"),
            }
        }
    }
}

/// A JSON-RPC client over wss, as the protocol manual describes one.
pub struct Client {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: i64,
    /// Messages received while waiting for something else, in order.
    pub backlog: std::collections::VecDeque<Value>,
}

/// What an upgrade attempt got.
pub enum Upgrade {
    /// Upgraded.
    Open(Box<Client>),
    /// Refused with an HTTP answer.
    Refused {
        /// The status code.
        status: u16,
        /// `Retry-After` in seconds, when sent.
        retry_after: Option<u64>,
        /// The body.
        body: String,
    },
}

// === impl Client ===

impl Client {
    /// Starts a thread and gives it `turns` turns with prompts of `prompt_bytes` (the mock model
    /// echoes them), so that its `thread/read` with every turn is large; returns the thread and
    /// the size of that answer.
    pub async fn large_thread(
        &mut self,
        turns: usize,
        prompt_bytes: usize,
    ) -> anyhow::Result<(String, usize)> {
        let thread = self.start_thread().await?;
        // One word: the mock streams its echo as a few deltas, not one per word.
        let prompt = "x".repeat(prompt_bytes);
        for _ in 0..turns {
            self.start_turn(&thread, &prompt).await?;
            let msgs = self.until_turn_completed(&thread).await?;
            anyhow::ensure!(
                agent_text(&msgs).is_some_and(|t| t.len() > prompt_bytes),
                "no echo: {:?}",
                msgs.iter()
                    .filter(|m| m.to_string().contains("rror"))
                    .map(|m| format!("{m:.400}"))
                    .collect::<Vec<_>>()
            );
        }
        let id = self.send_request("thread/read", read_all(&thread)).await?;
        let answer = self.wait_for(|v| v["id"] == id).await?;
        let answer_bytes = answer.to_string().len();
        anyhow::ensure!(answer.get("result").is_some(), "thread/read: {answer:.500}");
        eprintln!(
            "measured: thread/read includeTurns of {turns} turns: {:.1} MiB",
            answer_bytes as f64 / 1048576.0
        );
        anyhow::ensure!(
            answer_bytes > 2 * prompt_bytes * turns * 9 / 10,
            "{answer_bytes}"
        );
        Ok((thread, answer_bytes))
    }
    /// Opens the wss connection; `token` goes in `Authorization: Bearer`.
    pub async fn connect(url: &str, ca: &Path, token: Option<&str>) -> anyhow::Result<Client> {
        Client::connect_over(url, ca, token, None).await
    }

    /// Opens the wss connection over a TCP socket with a small receive buffer, so a client
    /// that stops reading backs up into codex-fleet quickly.
    pub async fn connect_small_window(
        addr: SocketAddr,
        url: &str,
        ca: &Path,
        token: Option<&str>,
        rcvbuf: u32,
    ) -> anyhow::Result<Client> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_recv_buffer_size(rcvbuf)?;
        let tcp = socket.connect(addr).await?;
        Client::connect_over(url, ca, token, Some(tcp)).await
    }

    /// One upgrade attempt: the client, or the refusal's status and `Retry-After`.
    pub async fn try_connect(url: &str, ca: &Path, token: Option<&str>) -> anyhow::Result<Upgrade> {
        match Client::connect(url, ca, token).await {
            Ok(c) => Ok(Upgrade::Open(Box::new(c))),
            Err(e) => match e.downcast::<tokio_tungstenite::tungstenite::Error>() {
                Ok(tokio_tungstenite::tungstenite::Error::Http(resp)) => Ok(Upgrade::Refused {
                    status: resp.status().as_u16(),
                    retry_after: resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse().ok()),
                    body: String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default())
                        .into_owned(),
                }),
                Ok(other) => Err(other.into()),
                Err(e) => Err(e),
            },
        }
    }

    async fn connect_over(
        url: &str,
        ca: &Path,
        token: Option<&str>,
        tcp: Option<TcpStream>,
    ) -> anyhow::Result<Client> {
        let mut req = url.into_client_request()?;
        if let Some(t) = token {
            req.headers_mut()
                .insert("authorization", format!("Bearer {t}").parse()?);
        }
        req.headers_mut()
            .insert("x-codex-app-server-compression", "zstd-stream-v1".parse()?);
        let connector = Connector::Rustls(client_tls(ca)?);
        let connecting = async {
            match tcp {
                Some(tcp) => {
                    tokio_tungstenite::client_async_tls_with_config(req, tcp, None, Some(connector))
                        .await
                }
                None => {
                    // Nagle off, as interactive clients want: with it, a request written right
                    // after another small frame waits ~40 ms for the server's delayed ACK.
                    tokio_tungstenite::connect_async_tls_with_config(
                        req,
                        None,
                        true,
                        Some(connector),
                    )
                    .await
                }
            }
        };
        let (ws, resp) = tokio::time::timeout(STEP, connecting)
            .await
            .context("connect timed out")??;
        if resp
            .headers()
            .contains_key("x-codex-app-server-compression")
        {
            bail!("the router must not echo x-codex-app-server-compression");
        }
        Ok(Client {
            ws,
            next_id: 1,
            backlog: Default::default(),
        })
    }

    /// Sends a raw text frame.
    pub async fn send_text(&mut self, text: &str) -> anyhow::Result<()> {
        self.ws.send(Message::text(text)).await?;
        Ok(())
    }

    /// Sends 1 MiB notifications, at most `max`, until one is not taken within 2 s (the client
    /// is held: no longer read), calling `each` after every one that went. Returns how many
    /// went, and whether the client was held; an error if the session was closed instead.
    pub async fn flood_until_held(
        &mut self,
        max: usize,
        mut each: impl FnMut(),
    ) -> anyhow::Result<(usize, bool)> {
        let pad = "x".repeat(1 << 20);
        let frame = serde_json::json!({"method": "x/flood", "params": {"pad": pad}}).to_string();
        for sent in 0..max {
            match tokio::time::timeout(Duration::from_secs(2), self.send_text(&frame)).await {
                Ok(Ok(())) => each(),
                Err(_) => return Ok((sent, true)),
                Ok(Err(e)) => anyhow::bail!("the session was closed instead of held: {e}"),
            }
        }
        Ok((max, false))
    }

    /// Sends a binary frame.
    pub async fn send_binary(&mut self, bytes: Vec<u8>) -> anyhow::Result<()> {
        self.ws.send(Message::binary(bytes)).await?;
        Ok(())
    }

    /// Sends a WebSocket ping frame.
    pub async fn send_ping(&mut self, payload: Vec<u8>) -> anyhow::Result<()> {
        self.ws.send(Message::Ping(payload.into())).await?;
        Ok(())
    }

    /// Sends a JSON value.
    pub async fn send(&mut self, v: &Value) -> anyhow::Result<()> {
        self.send_text(&v.to_string()).await
    }

    /// The next JSON message from the wire (not the backlog); errors on close or timeout.
    pub async fn recv_wire(&mut self, within: Duration) -> anyhow::Result<Value> {
        loop {
            let frame = tokio::time::timeout(within, self.ws.next())
                .await
                .context("timed out waiting for a message")?;
            match frame {
                Some(Ok(Message::Text(t))) => return Ok(serde_json::from_str(&t)?),
                Some(Ok(Message::Close(c))) => bail!("connection closed: {c:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("read error: {e}"),
                None => bail!("connection ended"),
            }
        }
    }

    /// Waits for the close frame (or end) and returns its code.
    pub async fn recv_close(&mut self, within: Duration) -> anyhow::Result<Option<u16>> {
        Ok(self.recv_close_frame(within).await?.map(|(code, _)| code))
    }

    /// Waits for the close frame (or end) and returns its code and reason; text frames on the
    /// way go to the backlog.
    pub async fn recv_close_frame(
        &mut self,
        within: Duration,
    ) -> anyhow::Result<Option<(u16, String)>> {
        loop {
            let frame = tokio::time::timeout(within, self.ws.next())
                .await
                .context("timed out waiting for close")?;
            match frame {
                Some(Ok(Message::Close(c))) => {
                    return Ok(c.map(|c| (u16::from(c.code), c.reason.to_string())))
                }
                Some(Ok(Message::Text(t))) => self.backlog.push_back(serde_json::from_str(&t)?),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Ok(None),
            }
        }
    }

    /// The error answers kept in the backlog (none, when every request got the answer waited for).
    pub fn backlog_errors(&self) -> Vec<&Value> {
        self.backlog
            .iter()
            .filter(|v| v.get("error").is_some())
            .collect()
    }

    /// The next message matching `pred`, from the backlog first; others are kept in the backlog.
    pub async fn wait_for(&mut self, pred: impl FnMut(&Value) -> bool) -> anyhow::Result<Value> {
        self.wait_for_within(pred, STEP).await
    }

    /// [`Client::wait_for`], waiting at most `within` for it.
    pub async fn wait_for_within(
        &mut self,
        mut pred: impl FnMut(&Value) -> bool,
        within: Duration,
    ) -> anyhow::Result<Value> {
        if let Some(pos) = self.backlog.iter().position(&mut pred) {
            return Ok(self.backlog.remove(pos).expect("position"));
        }
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let v = self.recv_wire(left).await?;
            if pred(&v) {
                return Ok(v);
            }
            self.backlog.push_back(v);
        }
    }

    /// The next notification named `method`.
    pub async fn notification(&mut self, method: &str) -> anyhow::Result<Value> {
        self.wait_for(|v| v["method"] == method && v.get("id").is_none())
            .await
            .with_context(|| format!("waiting for {method}"))
    }

    /// Sends a request and returns its response (result or error object).
    pub async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        self.wait_for(|v| v["id"] == id && v.get("method").is_none())
            .await
            .with_context(|| format!("waiting for the answer to {method}"))
    }

    /// Sends a request and returns its result, failing on an error response.
    pub async fn request(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let resp = self.call(method, params).await?;
        if let Some(e) = resp.get("error") {
            bail!("{method} failed: {e}");
        }
        Ok(resp["result"].clone())
    }

    /// `initialize` + `initialized`, as the TUI does (string id "initialize").
    pub async fn initialize(&mut self, name: &str) -> anyhow::Result<Value> {
        self.initialize_within(name, STEP).await
    }

    /// [`Client::initialize`], waiting at most `within` for its answer (a first session whose
    /// node must start first).
    pub async fn initialize_within(
        &mut self,
        name: &str,
        within: Duration,
    ) -> anyhow::Result<Value> {
        self.initialize_with(name, Some(json!({ "experimentalApi": true })), within)
            .await
    }

    /// [`Client::initialize`] with no `capabilities` at all (the field left out).
    pub async fn initialize_without_capabilities(&mut self, name: &str) -> anyhow::Result<Value> {
        self.initialize_with(name, None, STEP).await
    }

    /// [`Client::initialize`] for a client that opted out of `methods`
    /// (`optOutNotificationMethods`).
    pub async fn initialize_opting_out(
        &mut self,
        name: &str,
        methods: &[&str],
    ) -> anyhow::Result<Value> {
        let capabilities = json!({ "experimentalApi": true, "optOutNotificationMethods": methods });
        self.initialize_with(name, Some(capabilities), STEP).await
    }

    async fn initialize_with(
        &mut self,
        name: &str,
        capabilities: Option<Value>,
        within: Duration,
    ) -> anyhow::Result<Value> {
        let mut params = json!({
            "clientInfo": { "name": name, "title": null, "version": "0.0.1" },
        });
        if let Some(capabilities) = capabilities {
            params["capabilities"] = capabilities;
        }
        self.send(&json!({ "id": "initialize", "method": "initialize", "params": params }))
            .await?;
        let resp = self
            .wait_for_within(|v| v["id"] == "initialize", within)
            .await
            .context("waiting for initialize")?;
        if resp.get("error").is_some() {
            bail!("initialize failed: {resp}");
        }
        self.send(&json!({ "method": "initialized" })).await?;
        Ok(resp["result"].clone())
    }

    /// `thread/start` with defaults; returns the thread id.
    pub async fn start_thread(&mut self) -> anyhow::Result<String> {
        let r = self.request("thread/start", json!({})).await?;
        r["thread"]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("thread/start without thread.id: {r}"))
    }

    /// `turn/start` with one text input; returns the turn id.
    pub async fn start_turn(&mut self, thread: &str, text: &str) -> anyhow::Result<String> {
        let r = self
            .request(
                "turn/start",
                json!({
                    "threadId": thread,
                    "input": [{ "type": "text", "text": text, "text_elements": [] }]
                }),
            )
            .await?;
        r["turn"]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("turn/start without turn.id: {r}"))
    }

    /// Collects every message until `turn/completed` for `thread`; returns them in order.
    pub async fn until_turn_completed(&mut self, thread: &str) -> anyhow::Result<Vec<Value>> {
        let mut seen = Vec::new();
        loop {
            let v = self
                .wait_for(|_| true)
                .await
                .context("waiting for turn/completed")?;
            let done = v["method"] == "turn/completed" && v["params"]["threadId"] == thread;
            seen.push(v);
            if done {
                return Ok(seen);
            }
        }
    }

    /// [`Client::until_turn_completed`], and on until the thread's `idle` status change too: the
    /// end of a turn as a client sees it whole. app-server orders status changes freely against
    /// a turn's items, and codex-fleet relays them, so the idle may come after `turn/completed`.
    pub async fn until_turn_over(&mut self, thread: &str) -> anyhow::Result<Vec<Value>> {
        let idle = |v: &Value| {
            v["method"] == "thread/status/changed"
                && v["params"]["threadId"] == thread
                && v["params"]["status"]["type"] == "idle"
        };
        let active = |v: &Value| {
            v["method"] == "thread/status/changed"
                && v["params"]["threadId"] == thread
                && v["params"]["status"]["type"] == "active"
        };
        // An idle before the turn's last `active` (an earlier turn's, a resume's restated idle)
        // is not this turn's end.
        let over = |seen: &[Value]| {
            seen.iter()
                .rposition(active)
                .is_some_and(|i| seen[i..].iter().any(idle))
        };
        let mut seen = self.until_turn_completed(thread).await?;
        while !over(&seen) {
            let v = self
                .wait_for(|_| true)
                .await
                .context("waiting for the turn's idle")?;
            seen.push(v);
        }
        Ok(seen)
    }

    /// Sends a request without waiting for its answer; returns its id.
    pub async fn send_request(&mut self, method: &str, params: Value) -> anyhow::Result<i64> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        Ok(id)
    }

    /// Closes the connection politely.
    pub async fn close(mut self) {
        let _closed = self.ws.close(None).await;
    }
}

/// `thread/read` params asking for every turn.
pub fn read_all(thread: &str) -> Value {
    json!({ "threadId": thread, "includeTurns": true })
}

/// The text of the last completed agent message among `msgs`.
pub fn agent_text(msgs: &[Value]) -> Option<String> {
    msgs.iter()
        .rev()
        .filter(|m| m["method"] == "item/completed")
        .find(|m| m["params"]["item"]["type"] == "agentMessage")
        .and_then(|m| m["params"]["item"]["text"].as_str().map(str::to_owned))
}

/// Runs the real `codex exec --remote URL --remote-auth-token-env … PROMPT` with `token` in that
/// variable, trusting the CA bundle `ca`, in a fresh CODEX_HOME; its output (within 90 s).
pub async fn codex_exec_remote(
    url: &str,
    ca: &Path,
    token: &str,
    prompt: &str,
) -> anyhow::Result<std::process::Output> {
    let client_home = tempfile::tempdir()?;
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(codex_bin())
            .args(["exec", "--skip-git-repo-check", "--remote", url])
            .args(["--remote-auth-token-env", "CODEX_FLEET_TOKEN", prompt])
            .env("SSL_CERT_FILE", ca)
            .env("CODEX_FLEET_TOKEN", token)
            .env("CODEX_HOME", client_home.path())
            .current_dir(client_home.path())
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .context("codex exec did not finish within 90 s")??;
    Ok(out)
}

/// A minimal HTTP/1.0 GET over loopback.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad HTTP response: {text}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_owned();
    Ok((status, body))
}

/// A rustls client configuration that trusts only `ca`.
pub fn client_tls(ca: &Path) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    router::tls::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for cert in router::tls::load_certs(ca)? {
        roots.add(cert)?;
    }
    Ok(Arc::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ))
}

/// A WebSocket upgrade request for `path` with `token` as its bearer token, as raw HTTP/1.1
/// text (the fixed key of RFC 6455's example), for tests that read or break the answer's head.
pub fn upgrade_request(path: &str, token: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Authorization: Bearer {token}\r\n\r\n"
    )
}

/// Reads an HTTP request's head from `stream`, a test server's side of a connection: up to and
/// including its blank line. `None` if the stream ends or fails first (a client that only shook
/// hands, or went away).
pub async fn read_request_head<S>(stream: &mut S) -> Option<Vec<u8>>
where
    S: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0_u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(head)
}

/// Sends `request` (raw HTTP/1.1 text) over TLS to `addr` (trusting `ca`, SNI `localhost`) and
/// returns everything the server sent until it closed, as text.
pub async fn https_raw(addr: SocketAddr, ca: &Path, request: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connector = tokio_rustls::TlsConnector::from(client_tls(ca)?);
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut tls = tokio::time::timeout(STEP, connector.connect(name, tcp))
        .await
        .context("TLS handshake timed out")??;
    tls.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    // A server that answers and closes ends the read; one that keeps the connection open
    // after its answer is read up to the timeout.
    let _read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut buf)).await;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
