//! JSON-RPC frames as app-server speaks them: parsed once into typed messages.
//!
//! Frames are forwarded as the text they arrived as; only the envelope is parsed (params and
//! results stay raw), and a frame is re-serialized only where an id must change.

use std::borrow::Cow;
use std::fmt;

use serde::de::Deserializer;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::codes;
use crate::method::Method;

/// The longest `id` accepted, as written in the frame (a string's quotes and escapes included).
/// The router keeps a request's id until it is answered, on every hop (the session's requests in
/// flight, an edge's): without a bound, a tenant's requests with ids of 30 MiB, held in flight
/// by a slow method, would be gigabytes of copies outside every byte bound. The TUI's longest is
/// `"startup-thread-start-<uuid>"`, 58 bytes.
pub const MAX_ID_BYTES: usize = 1024;

/// A request id: app-server accepts integers and strings and echoes them verbatim.
///
/// Read by a visitor of its own rather than `#[serde(untagged)]`, which buffers the value into
/// serde's `Content` first and then tries each variant: every request and response in both
/// directions carries an id, and the buffering was code on each round trip's path
/// (BENCHMARKS.md, "What a cold round trip touches"). The same values are accepted:
/// integers that fit an `i64`, and strings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(untagged)]
pub enum RequestId {
    /// An integer id.
    Int(i64),
    /// A string id (the TUI uses `"initialize"` and `"startup-thread-start-<uuid>"`).
    Str(String),
}

impl<'de> Deserialize<'de> for RequestId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(IdVisitor)
    }
}

/// Reads a [`RequestId`]: an integer that fits an `i64`, or a string.
struct IdVisitor;

impl serde::de::Visitor<'_> for IdVisitor {
    type Value = RequestId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an integer or a string")
    }

    fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<RequestId, E> {
        Ok(RequestId::Int(n))
    }

    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<RequestId, E> {
        i64::try_from(n)
            .map(RequestId::Int)
            .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(n), &self))
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<RequestId, E> {
        Ok(RequestId::Str(s.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, s: String) -> Result<RequestId, E> {
        Ok(RequestId::Str(s))
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestId::Int(n) => write!(f, "{n}"),
            RequestId::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// One parsed JSON-RPC message (the protocol is symmetric: clients and workers both send all three).
#[derive(Debug)]
pub enum Message<'a> {
    /// `{id, method, params?}`
    Request {
        /// The id.
        id: RequestId,
        /// The method.
        method: Method<'a>,
        /// The params, unparsed.
        params: Option<&'a RawValue>,
    },
    /// `{method, params?}`
    Notification {
        /// The method.
        method: Method<'a>,
        /// The params, unparsed.
        params: Option<&'a RawValue>,
    },
    /// `{id, result}` or `{id, error}`
    Response {
        /// The id being answered.
        id: RequestId,
    },
}

/// Why a frame is not a message we accept; each maps to a defined answer at the session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not JSON at all.
    #[error("Parse error: {0}")]
    NotJson(String),
    /// A JSON array: app-server has no batches.
    #[error("Invalid request: batches are not supported")]
    Batch,
    /// JSON, but not an object.
    #[error("Invalid request: a message must be a JSON object")]
    NotObject,
    /// `id` is null, fractional or of another type.
    #[error("Invalid request: id must be an integer or a string")]
    BadId {
        /// Whether it carried a method (a request) rather than being a response.
        request: bool,
    },
    /// Neither a method nor a result/error.
    #[error("Invalid request: not a JSON-RPC request, notification or response")]
    NotJsonRpc,
    /// `id` longer than [`MAX_ID_BYTES`].
    #[error("Invalid request: id longer than {MAX_ID_BYTES} bytes")]
    LongId,
    /// A request whose `trace` is not a W3C trace context. app-server reads such a frame as a
    /// notification and answers nothing, so the request would wait forever (holding its
    /// worker's in-flight slot); it is answered here, with its id.
    #[error("Invalid request: trace must be a W3C trace context, an object of string traceparent and tracestate")]
    BadTrace {
        /// The request's id.
        id: RequestId,
    },
}

impl ParseError {
    /// The id to answer it with, when the frame's id could be read (a request otherwise well
    /// formed); `None`: answered with a null id.
    pub fn id(&self) -> Option<&RequestId> {
        match self {
            ParseError::BadTrace { id } => Some(id),
            _ => None,
        }
    }

    /// The JSON-RPC error code for answering it.
    pub fn code(&self) -> i64 {
        match self {
            ParseError::NotJson(_) => codes::PARSE_ERROR,
            _ => codes::INVALID_REQUEST,
        }
    }
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(default, borrow, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    method: Option<Text<'a>>,
    #[serde(default, borrow, deserialize_with = "present")]
    params: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    result: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    error: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    trace: Option<&'a RawValue>,
}

/// app-server's `W3cTraceContext` (a request's `trace`), read as it reads one: `null`, or an
/// object (or array) of optional strings, other keys ignored.
#[derive(Deserialize)]
struct TraceContext {
    #[serde(default)]
    #[allow(dead_code)]
    traceparent: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    tracestate: Option<String>,
}

/// Whether app-server reads `raw` as a request's `trace`.
fn is_trace(raw: &RawValue) -> bool {
    serde_json::from_str::<Option<TraceContext>>(raw.get()).is_ok()
}

/// A string read in place unless it has escapes. serde borrows a `Cow` only where a field is
/// one: an `Option<Cow<str>>` is always read into a new `String`.
#[derive(Deserialize)]
pub(crate) struct Text<'a>(#[serde(borrow)] pub(crate) Cow<'a, str>);

/// A field that is present (even as `null`) is `Some(raw)`; only an absent one is `None`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// One parsed frame: the message, and for a response whether it carries a result or an error
/// (both left unparsed).
#[derive(Debug)]
pub struct Frame<'a> {
    /// What the frame is.
    pub message: Message<'a>,
    /// `result` of a response, unparsed.
    pub result: Option<&'a RawValue>,
    /// `error` of a response, unparsed.
    pub error: Option<&'a RawValue>,
}

// === impl Frame ===

impl<'a> Frame<'a> {
    /// Parses one text frame.
    pub fn parse(text: &'a str) -> Result<Self, ParseError> {
        let is_json = || serde_json::from_str::<&RawValue>(text).is_ok();
        match text.trim_start().as_bytes().first() {
            Some(b'{') => {}
            Some(b'[') if is_json() => return Err(ParseError::Batch),
            Some(_) if is_json() => return Err(ParseError::NotObject),
            _ => {
                let e = serde_json::from_str::<&RawValue>(text).err();
                return Err(ParseError::NotJson(
                    e.map(|e| e.to_string()).unwrap_or_default(),
                ));
            }
        }
        let env: Envelope<'_> = serde_json::from_str(text).map_err(|e| {
            if is_json() {
                ParseError::NotJsonRpc // an object, but with fields of the wrong types
            } else {
                ParseError::NotJson(e.to_string())
            }
        })?;
        let id = match env.id {
            None => None,
            Some(raw) if raw.get().len() > MAX_ID_BYTES => return Err(ParseError::LongId),
            Some(raw) => Some(serde_json::from_str::<RequestId>(raw.get()).map_err(|_| {
                ParseError::BadId {
                    request: env.method.is_some(),
                }
            })?),
        };
        let message = match (id, env.method.map(|m| m.0)) {
            (Some(id), Some(_)) if env.trace.is_some_and(|t| !is_trace(t)) => {
                return Err(ParseError::BadTrace { id });
            }
            (Some(id), Some(method)) => Message::Request {
                id,
                method: Method::parse(method),
                params: env.params,
            },
            (None, Some(method)) => Message::Notification {
                method: Method::parse(method),
                params: env.params,
            },
            (Some(id), None) if env.result.is_some() || env.error.is_some() => {
                Message::Response { id }
            }
            _ => return Err(ParseError::NotJsonRpc),
        };
        let (result, error) = match message {
            Message::Response { .. } => (env.result, env.error),
            _ => (None, None),
        };
        Ok(Frame {
            message,
            result,
            error,
        })
    }

    /// The `code` of a response's `error`, when it has one.
    pub fn error_code(&self) -> Option<i64> {
        #[derive(Deserialize)]
        struct Code {
            code: i64,
        }
        serde_json::from_str::<Code>(self.error?.get())
            .ok()
            .map(|c| c.code)
    }
}

/// Parses one text frame into its message.
pub fn parse(text: &str) -> Result<Message<'_>, ParseError> {
    Frame::parse(text).map(|f| f.message)
}

/// The id and the `result` text of an answer written the way app-server writes one:
/// `{"id":<id>,"result":<value>}`, compact, with `id` first and `result` last (0.171.0 does; the
/// end-to-end test `the_workers_answers_are_read_by_their_head` checks it on the real worker).
/// Its errors are written `error` first, and go to the full parse.
///
/// Only the head is read: the result (for `thread/read`, a whole thread's items) is not scanned,
/// so it is not checked as JSON either. Meant for frames from a worker the router started, whose
/// answers `serde_json` wrote; wherever the result's content is needed ([`thread_of_result`],
/// [`first_value`]) it is parsed then, and text that does not start with a JSON value reads as
/// no thread.
///
/// The id is read exactly as [`Frame::parse`] reads it, and an id in any other form (escapes,
/// fractions, exponents, leading zeros) is left to it: `None` means "parse it the general way".
pub fn result_head(text: &str) -> Option<(RequestId, &str)> {
    let rest = text.strip_prefix(r#"{"id":"#)?;
    let (id, rest) = match rest.strip_prefix('"') {
        Some(quoted) => {
            let end = quoted.find(['"', '\\'])?;
            if quoted.as_bytes()[end] != b'"' || quoted[..end].bytes().any(|b| b < 0x20) {
                return None;
            }
            (RequestId::Str(quoted[..end].to_owned()), &quoted[end + 1..])
        }
        None => {
            let digits = rest.strip_prefix('-').unwrap_or(rest);
            let len = digits.bytes().take_while(u8::is_ascii_digit).count();
            // `-0` too: serde_json reads it as a float, which is no id.
            let signed = digits.len() != rest.len();
            if len == 0 || (digits.starts_with('0') && (len > 1 || signed)) {
                return None;
            }
            let end = (rest.len() - digits.len()) + len;
            (RequestId::Int(rest[..end].parse().ok()?), &rest[end..])
        }
    };
    let result = rest.strip_prefix(r#","result":"#)?.strip_suffix('}')?;
    // Compact: whitespace around the value would be left out of the full parse's raw result.
    let space = |b: Option<&u8>| b.is_none_or(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    let bytes = result.as_bytes();
    (!space(bytes.first()) && !space(bytes.last())).then_some((id, result))
}

/// The `threadId` of a request's params, when it names one: borrowed from them unless it has
/// escapes, so routing a request by its thread allocates nothing.
pub fn thread_id(params: Option<&RawValue>) -> Option<Cow<'_, str>> {
    #[derive(Deserialize)]
    struct P<'a> {
        #[serde(rename = "threadId", borrow, default)]
        thread_id: Option<Text<'a>>,
    }
    let p: P<'_> = serde_json::from_str(params?.get()).ok()?;
    p.thread_id.map(|t| t.0)
}

/// An error response, serialized.
pub fn error_response(
    id: Option<&RequestId>,
    code: i64,
    message: &str,
    data: Option<Value>,
) -> String {
    let mut error = Map::new();
    error.insert("code".into(), code.into());
    error.insert("message".into(), message.into());
    if let Some(data) = data {
        error.insert("data".into(), data);
    }
    let mut m = Map::new();
    m.insert(
        "id".into(),
        id.map_or(Value::Null, |id| {
            serde_json::to_value(id).unwrap_or(Value::Null)
        }),
    );
    m.insert("error".into(), Value::Object(error));
    Value::Object(m).to_string()
}

/// A request the router itself sends (used to replay `initialize` on a new leg).
pub fn request(id: &RequestId, method: &str, params: Option<&RawValue>) -> String {
    let mut m = Map::new();
    m.insert("id".into(), serde_json::to_value(id).unwrap_or(Value::Null));
    m.insert("method".into(), method.into());
    if let Some(p) = params {
        if let Ok(v) = serde_json::from_str::<Value>(p.get()) {
            m.insert("params".into(), v);
        }
    }
    Value::Object(m).to_string()
}

/// A JSON object whose members stay as they arrived: only the envelope is rebuilt, so any
/// frame [`parse`] accepts can have its id rewritten (even with numbers `f64` cannot hold).
type RawObject<'a> = std::collections::BTreeMap<Cow<'a, str>, &'a RawValue>;

/// Rewrites the top-level `id` of a message; `None` if the text is not a JSON object.
pub fn with_id(text: &str, id: &RequestId) -> Option<String> {
    let mut m: RawObject<'_> = serde_json::from_str(text).ok()?;
    let id = serde_json::value::to_raw_value(id).ok()?;
    m.insert(Cow::Borrowed("id"), &id);
    serde_json::to_string(&m).ok()
}

/// Rewrites `params.requestId` (as in `serverRequest/resolved`).
pub fn with_params_request_id(text: &str, id: &RequestId) -> Option<String> {
    let mut m: RawObject<'_> = serde_json::from_str(text).ok()?;
    let mut params: RawObject<'_> = serde_json::from_str(m.get("params")?.get()).ok()?;
    let id = serde_json::value::to_raw_value(id).ok()?;
    params.insert(Cow::Borrowed("requestId"), &id);
    let params = serde_json::value::to_raw_value(&params).ok()?;
    m.insert(Cow::Borrowed("params"), &params);
    serde_json::to_string(&m).ok()
}

/// `params.requestId` of a notification such as `serverRequest/resolved`.
pub fn params_request_id(params: Option<&RawValue>) -> Option<RequestId> {
    #[derive(Deserialize)]
    struct P {
        #[serde(rename = "requestId")]
        request_id: RequestId,
    }
    serde_json::from_str::<P>(params?.get())
        .ok()
        .map(|p| p.request_id)
}

/// `result.thread.id` of a response (thread/start, thread/fork, thread/resume).
pub fn result_thread_id(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Resp<'a> {
        #[serde(borrow)]
        result: Option<&'a RawValue>,
    }
    let r: Resp<'_> = serde_json::from_str(text).ok()?;
    thread_of_result(r.result?.get())
}

/// `thread.id` of a response's `result` text (thread/start, thread/fork, thread/resume).
pub fn thread_of_result(result: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct WithThread<'a> {
        #[serde(borrow)]
        thread: Option<ThreadRef<'a>>,
    }
    #[derive(Deserialize)]
    struct ThreadRef<'a> {
        #[serde(borrow)]
        id: Cow<'a, str>,
    }
    let r: Option<WithThread<'_>> = first_value(result)?;
    Some(r?.thread?.id.into_owned())
}

/// The first JSON value of `text`, whatever follows it: a result read by [`result_head`] runs to
/// its frame's last `}`, so members a writer put after `result` would follow its value.
pub fn first_value<'a, T: Deserialize<'a>>(text: &'a str) -> Option<T> {
    T::deserialize(&mut serde_json::Deserializer::from_str(text)).ok()
}

/// `error.message` of an error response.
pub fn error_message(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Resp<'a> {
        #[serde(borrow)]
        error: Option<&'a RawValue>,
    }
    let r: Resp<'_> = serde_json::from_str(text).ok()?;
    message_of_error(r.error?.get())
}

/// `message` of a response's `error` text.
pub fn message_of_error(error: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct ErrorBody<'a> {
        #[serde(borrow)]
        message: Cow<'a, str>,
    }
    let e: Option<ErrorBody<'_>> = serde_json::from_str(error).ok()?;
    Some(e?.message.into_owned())
}

#[cfg(test)]
mod tests;
