//! Offline mock of the Responses API that codex app-server workers run turns against (tests and `codex-fleet dev`).
//!
//! `POST …/responses` answers with a Server-Sent Events stream chosen from the request's `input`,
//! looking at the last user message and whether a `function_call_output` follows it:
//!
//! - by default, an assistant message streamed as deltas whose text is [`reply_text`] of the user text;
//! - `RUNSHELL` (before any tool output): an `exec_command` call that asks for approval, after whose
//!   output the default message follows;
//! - `RUNCMD:<command>` (before any tool output): the same approval-gated `exec_command` call for
//!   `<command>` (the rest of the user text);
//! - `SLOW` or `SLOW<n>` (before any tool output): a pause of 5 s or `n` s right after `response.created`;
//! - `NOCOMPLETE`: no `response.completed`, so the turn fails;
//! - `MANY<n>`: [`reply_text`] grows by `n` padded words, streamed as one delta each with no
//!   pause in between (a flood of `item/agentMessage/delta`).
//!
//! `GET …/models` answers `{"models": []}`; everything else is 404.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Sleep;

/// Model slug the overrides select; codex warns that it has no metadata for it, which is harmless.
const MODEL: &str = "mock-model";
/// Provider id under `model_providers` in the overrides.
const PROVIDER_ID: &str = "codex_fleet_mock";
/// Largest request body accepted; larger ones get 413.
const MAX_BODY_BYTES: usize = 64 << 20;
/// Pause for a bare `SLOW`.
const DEFAULT_SLOW: Duration = Duration::from_secs(5);
/// Pause before each text delta, so the message really arrives in pieces.
const DELTA_GAP: Duration = Duration::from_millis(5);

type ResponseBody = BoxBody<Bytes, Infallible>;

/// A running mock Responses API server; dropping it stops the server and its connections.
#[derive(Debug)]
pub struct MockModel {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    server: JoinHandle<()>,
}

impl MockModel {
    /// Binds (e.g. 127.0.0.1:0) and serves in a background task.
    ///
    /// Fails only if the address cannot be bound. Must be called inside a tokio runtime.
    pub async fn start(bind: SocketAddr) -> std::io::Result<MockModel> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let requests = Arc::new(AtomicUsize::new(0));
        let server = tokio::spawn(serve(listener, Arc::clone(&requests)));
        tracing::debug!(%addr, "mock model listening");
        Ok(MockModel {
            addr,
            requests,
            server,
        })
    }

    /// The address the server is bound to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// "http://127.0.0.1:PORT/v1" (a wildcard bind address is replaced by loopback).
    pub fn base_url(&self) -> String {
        let mut addr = self.addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(match addr.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        format!("http://{addr}/v1")
    }

    /// `-c key=value` overrides (WITHOUT the "-c") that point a codex app-server at this mock:
    /// `model`, `model_provider`, `model_providers.<id>.{name,base_url,wire_api,request_max_retries,stream_max_retries}`
    /// plus `approval_policy="on-request"` and `sandbox_mode="read-only"`. Values are TOML values, as codex parses `-c`.
    ///
    /// Pass each entry as its own argument after a `-c`. codex then sends a `warning` notification (no metadata
    /// for the mock model) on every `turn/start`, before its response; that is expected.
    pub fn codex_config_overrides(&self) -> Vec<String> {
        let provider = format!("model_providers.{PROVIDER_ID}");
        vec![
            format!("model={}", toml_string(MODEL)),
            format!("model_provider={}", toml_string(PROVIDER_ID)),
            format!("{provider}.name={}", toml_string("codex-fleet mock model")),
            format!("{provider}.base_url={}", toml_string(&self.base_url())),
            format!("{provider}.wire_api={}", toml_string("responses")),
            format!("{provider}.request_max_retries=0"),
            format!("{provider}.stream_max_retries=0"),
            format!("approval_policy={}", toml_string("on-request")),
            format!("sandbox_mode={}", toml_string("read-only")),
        ]
    }

    /// Number of POST /responses requests served so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for MockModel {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The exact assistant text the mock answers to a user message `text` (so tests can assert it).
///
/// A user message made of several text parts is seen as the parts joined with `\n`.
pub fn reply_text(user_text: &str) -> String {
    let mut text = format!("mock reply: {user_text}");
    for i in 0..many(user_text).unwrap_or(0) {
        text.push_str(&format!(" w{i:06}{MANY_PAD}"));
    }
    text
}

/// Padding of every `MANY` word, so a flood of deltas is also a flood of bytes.
const MANY_PAD: &str = "................................................................";
/// Most deltas a `MANY<n>` prompt asks for.
const MAX_MANY: usize = 100_000;

/// The delta count a `MANY<n>` prompt asks for.
fn many(text: &str) -> Option<usize> {
    let start = text.find("MANY")? + "MANY".len();
    let digits: String = text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok().map(|n: usize| n.min(MAX_MANY))
}

/// A TOML basic string; JSON string escaping is valid TOML for the characters we emit.
fn toml_string(s: &str) -> String {
    Value::from(s).to_string()
}

/// Accepts connections until aborted; aborting drops the `JoinSet`, which aborts every connection.
async fn serve(listener: TcpListener, requests: Arc<AtomicUsize>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, Arc::clone(&requests)));
                }
                Err(err) => {
                    // Usually fd exhaustion: back off instead of spinning.
                    tracing::warn!(%err, "mock model accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve_connection(stream: TcpStream, requests: Arc<AtomicUsize>) {
    // SSE chunks should leave as soon as they are written.
    if let Err(err) = stream.set_nodelay(true) {
        tracing::debug!(%err, "mock model: set_nodelay failed");
    }
    let service = service_fn(move |req| {
        let requests = Arc::clone(&requests);
        async move { Ok::<_, Infallible>(route(req, &requests).await) }
    });
    if let Err(err) = http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await
    {
        tracing::debug!(%err, "mock model connection ended with an error");
    }
}

async fn route(req: Request<Incoming>, requests: &AtomicUsize) -> Response<ResponseBody> {
    let path = req.uri().path();
    tracing::debug!(method = %req.method(), path, "mock model request");
    if req.method() == Method::POST && path.ends_with("/responses") {
        responses(req, requests).await
    } else if req.method() == Method::GET && path.ends_with("/models") {
        plain(StatusCode::OK, "application/json", r#"{"models": []}"#)
    } else {
        plain(StatusCode::NOT_FOUND, "application/json", "{}")
    }
}

async fn responses(req: Request<Incoming>, requests: &AtomicUsize) -> Response<ResponseBody> {
    if req.body().size_hint().lower() > MAX_BODY_BYTES as u64 {
        return too_large();
    }
    let bytes = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<LengthLimitError>() => return too_large(),
        Err(err) => {
            tracing::debug!(%err, "mock model: reading request body failed");
            return plain(StatusCode::BAD_REQUEST, "text/plain", "unreadable body");
        }
    };
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return plain(StatusCode::BAD_REQUEST, "text/plain", "body is not JSON");
    };
    let n = requests.fetch_add(1, Ordering::SeqCst) + 1;
    let prompt = Prompt::from_request(&body);
    tracing::debug!(n, text = %prompt.text, tool_output = prompt.tool_output, "mock model turn");
    let mut response = Response::new(script(n, &prompt).boxed());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn plain(
    status: StatusCode,
    content_type: &'static str,
    body: &'static str,
) -> Response<ResponseBody> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn too_large() -> Response<ResponseBody> {
    plain(
        StatusCode::PAYLOAD_TOO_LARGE,
        "text/plain",
        "request body too large",
    )
}

/// What the mock reacts to in a request.
struct Prompt {
    /// Text of the last user message (its text parts joined with `\n`).
    text: String,
    /// Whether a `function_call_output` follows the last user message.
    tool_output: bool,
}

impl Prompt {
    fn from_request(body: &Value) -> Prompt {
        let items = body
            .get("input")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let last_user = items
            .iter()
            .rposition(|item| item.get("role").and_then(Value::as_str) == Some("user"));
        let text = last_user
            .map(|i| message_text(&items[i]))
            .unwrap_or_default();
        let tool_output = items[last_user.unwrap_or(0)..]
            .iter()
            .any(|item| item.get("type").and_then(Value::as_str) == Some("function_call_output"));
        Prompt { text, tool_output }
    }

    /// The pause a `SLOW`/`SLOW<n>` prompt asks for.
    fn slow(&self) -> Option<Duration> {
        let start = self.text.find("SLOW")? + "SLOW".len();
        let digits = self.text[start..]
            .find(|c: char| !c.is_ascii_digit())
            .map_or(&self.text[start..], |end| &self.text[start..start + end]);
        Some(digits.parse().map_or(DEFAULT_SLOW, Duration::from_secs))
    }
}

fn message_text(item: &Value) -> String {
    match item.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Tokens the mock reports for every response (`response.completed` `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MockUsage {
    /// `input_tokens`.
    pub input: u64,
    /// `input_tokens_details.cached_tokens`.
    pub cached_input: u64,
    /// `output_tokens`.
    pub output: u64,
    /// `output_tokens_details.reasoning_tokens`.
    pub reasoning_output: u64,
}

/// What every mock response reports as its usage.
pub const MOCK_USAGE: MockUsage = MockUsage {
    input: 100,
    cached_input: 40,
    output: 7,
    reasoning_output: 3,
};

/// Builds the SSE stream for request number `n`.
fn script(n: usize, prompt: &Prompt) -> Script {
    let response_id = format!("resp-{n}");
    let mut script = Script::default();
    script.event(json!({"type": "response.created", "response": {"id": response_id}}));
    if !prompt.tool_output {
        if let Some(pause) = prompt.slow() {
            script.wait(pause);
        }
    }
    let command = match prompt.text.split_once("RUNCMD:") {
        Some((_, cmd)) => Some(cmd.trim()),
        None if prompt.text.contains("RUNSHELL") => Some("echo mock-approved"),
        None => None,
    };
    if let Some(cmd) = command.filter(|_| !prompt.tool_output) {
        let arguments = json!({
            "cmd": cmd,
            "yield_time_ms": 1000,
            "sandbox_permissions": "require_escalated",
            "justification": "mock wants to run a command",
        });
        script.event(json!({
            "type": "response.output_item.done",
            "item": {
                "type": "function_call",
                "call_id": format!("call-{n}"),
                "name": "exec_command",
                "arguments": arguments.to_string(),
            },
        }));
    } else {
        let item_id = format!("msg-{n}");
        let text = reply_text(&prompt.text);
        script.event(json!({
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {
                "type": "message",
                "role": "assistant",
                "id": item_id,
                "status": "in_progress",
                "content": [],
            },
        }));
        let gap = if many(&prompt.text).is_some() {
            Duration::ZERO
        } else {
            DELTA_GAP
        };
        for delta in text.split_inclusive(' ') {
            if !gap.is_zero() {
                script.wait(gap);
            }
            script.event(json!({
                "type": "response.output_text.delta",
                "item_id": item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": delta,
            }));
        }
        script.event(json!({
            "type": "response.output_item.done",
            "output_index": 0,
            "item": {
                "type": "message",
                "role": "assistant",
                "id": item_id,
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            },
        }));
    }
    if !prompt.text.contains("NOCOMPLETE") {
        script.event(json!({
            "type": "response.completed",
            "response": {
                "id": response_id,
                // Fixed, non-zero usage per response, so usage accounting can be checked.
                "usage": {
                    "input_tokens": MOCK_USAGE.input,
                    "input_tokens_details": {"cached_tokens": MOCK_USAGE.cached_input},
                    "output_tokens": MOCK_USAGE.output,
                    "output_tokens_details": {"reasoning_tokens": MOCK_USAGE.reasoning_output},
                    "total_tokens": MOCK_USAGE.input + MOCK_USAGE.output,
                },
            },
        }));
    }
    script
}

enum Step {
    Send(Bytes),
    Wait(Duration),
}

/// A response body that plays SSE events with pauses in between, without a task of its own:
/// dropping it (client gone, server stopped) cancels the rest.
#[derive(Default)]
struct Script {
    steps: VecDeque<Step>,
    pause: Option<Pin<Box<Sleep>>>,
}

impl Script {
    fn event(&mut self, event: Value) {
        let kind = event["type"].as_str().unwrap_or_default();
        let frame = format!("event: {kind}\ndata: {event}\n\n");
        self.steps.push_back(Step::Send(Bytes::from(frame)));
    }

    fn wait(&mut self, pause: Duration) {
        self.steps.push_back(Step::Wait(pause));
    }
}

impl Body for Script {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if let Some(pause) = this.pause.as_mut() {
                ready!(pause.as_mut().poll(cx));
                this.pause = None;
            }
            match this.steps.pop_front() {
                Some(Step::Send(bytes)) => return Poll::Ready(Some(Ok(Frame::data(bytes)))),
                Some(Step::Wait(pause)) => this.pause = Some(Box::pin(tokio::time::sleep(pause))),
                None => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pause.is_none() && self.steps.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(input: Value) -> Prompt {
        Prompt::from_request(&json!({ "input": input }))
    }

    fn user(text: &str) -> Value {
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    }

    #[test]
    fn finds_last_user_message_and_tool_output() {
        let p = prompt(json!([user("first"), user("please RUNSHELL")]));
        assert_eq!(p.text, "please RUNSHELL");
        assert!(!p.tool_output);
        let p = prompt(json!([
            user("please RUNSHELL"),
            {"type": "function_call", "call_id": "c", "name": "exec_command", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ]));
        assert!(p.tool_output);
        let p = prompt(json!("not a list"));
        assert_eq!(p.text, "");
        assert!(!p.tool_output);
    }

    #[test]
    fn slow_parses_seconds() {
        let slow = |text: &str| {
            Prompt {
                text: text.into(),
                tool_output: false,
            }
            .slow()
        };
        assert_eq!(slow("go SLOW12 now"), Some(Duration::from_secs(12)));
        assert_eq!(slow("SLOW"), Some(DEFAULT_SLOW));
        assert_eq!(slow("SLOW99999999999999999999999"), Some(DEFAULT_SLOW));
        assert_eq!(slow("fast"), None);
    }

    #[test]
    fn many_adds_padded_words_deterministically() {
        assert_eq!(many("go MANY3 now"), Some(3));
        assert_eq!(many("MANY"), None);
        assert_eq!(many("MANY999999999"), Some(MAX_MANY));
        let text = reply_text("MANY3");
        assert_eq!(text, reply_text("MANY3"));
        assert_eq!(text.split_inclusive(' ').count(), 3 + 3);
        assert!(text.ends_with(&format!(" w000002{MANY_PAD}")));
    }

    #[test]
    fn deltas_concatenate_to_reply() {
        let script = script(1, &prompt(json!([user("hello there")])));
        let mut deltas = String::new();
        for step in &script.steps {
            let Step::Send(bytes) = step else { continue };
            let text = std::str::from_utf8(bytes).expect("utf-8");
            let data = text.lines().nth(1).and_then(|l| l.strip_prefix("data: "));
            let event: Value = serde_json::from_str(data.expect("data line")).expect("json");
            if event["type"] == "response.output_text.delta" {
                deltas.push_str(event["delta"].as_str().expect("delta"));
            }
        }
        assert_eq!(deltas, reply_text("hello there"));
    }
}
