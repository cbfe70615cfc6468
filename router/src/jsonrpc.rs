//! JSON-RPC frames as app-server speaks them: parsed once at the edge into typed messages.
//!
//! Frames are forwarded as the text they arrived as; only the envelope is parsed (params and
//! results stay raw), and a frame is re-serialized only where the router must change an id.

use std::borrow::Cow;
use std::fmt;

use serde::de::Deserializer;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A request id: app-server accepts integers and strings and echoes them verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestId {
    /// An integer id.
    Int(i64),
    /// A string id (the TUI uses `"initialize"` and `"startup-thread-start-<uuid>"`).
    Str(String),
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
        method: Cow<'a, str>,
        /// The params, unparsed.
        params: Option<&'a RawValue>,
    },
    /// `{method, params?}`
    Notification {
        /// The method.
        method: Cow<'a, str>,
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
}

impl ParseError {
    /// The JSON-RPC error code for answering it.
    pub fn code(&self) -> i64 {
        match self {
            ParseError::NotJson(_) => codes::PARSE_ERROR,
            _ => codes::INVALID_REQUEST,
        }
    }
}

/// Error codes used on the wire.
pub mod codes {
    /// Invalid JSON.
    pub const PARSE_ERROR: i64 = -32700;
    /// Invalid request (app-server also uses it for unknown methods and "Not initialized").
    pub const INVALID_REQUEST: i64 = -32600;
    /// Internal error.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// Saturated: retry later (app-server's own overload code).
    pub const OVERLOADED: i64 = -32001;
    /// The worker that held the request went away; retryable.
    pub const WORKER_UNAVAILABLE: i64 = -32002;
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(default, borrow, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    method: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "present")]
    params: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    result: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    error: Option<&'a RawValue>,
}

/// A field that is present (even as `null`) is `Some(raw)`; only an absent one is `None`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// Parses one text frame.
pub fn parse(text: &str) -> Result<Message<'_>, ParseError> {
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
    let id =
        match env.id {
            None => None,
            Some(raw) => Some(serde_json::from_str::<RequestId>(raw.get()).map_err(|_| {
                ParseError::BadId {
                    request: env.method.is_some(),
                }
            })?),
        };
    match (id, env.method) {
        (Some(id), Some(method)) => Ok(Message::Request {
            id,
            method,
            params: env.params,
        }),
        (None, Some(method)) => Ok(Message::Notification {
            method,
            params: env.params,
        }),
        (Some(id), None) if env.result.is_some() || env.error.is_some() => {
            Ok(Message::Response { id })
        }
        _ => Err(ParseError::NotJsonRpc),
    }
}

/// The `threadId` of a request's params, when it names one.
pub fn thread_id(params: Option<&RawValue>) -> Option<String> {
    #[derive(Deserialize)]
    struct P<'a> {
        #[serde(rename = "threadId", borrow, default)]
        thread_id: Option<Cow<'a, str>>,
    }
    let p: P<'_> = serde_json::from_str(params?.get()).ok()?;
    p.thread_id.map(Cow::into_owned)
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
        result: Option<WithThread<'a>>,
    }
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
    let r: Resp<'_> = serde_json::from_str(text).ok()?;
    Some(r.result?.thread?.id.into_owned())
}

/// `error.message` of an error response.
pub fn error_message(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Resp<'a> {
        #[serde(borrow)]
        error: Option<ErrorBody<'a>>,
    }
    #[derive(Deserialize)]
    struct ErrorBody<'a> {
        #[serde(borrow)]
        message: Cow<'a, str>,
    }
    let r: Resp<'_> = serde_json::from_str(text).ok()?;
    Some(r.error?.message.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_the_three_kinds() {
        match parse(r#"{"id":"initialize","method":"initialize","params":{"a":1}}"#).unwrap() {
            Message::Request { id, method, params } => {
                assert_eq!(id, RequestId::Str("initialize".into()));
                assert_eq!(method, "initialize");
                assert_eq!(params.unwrap().get(), r#"{"a":1}"#);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(r#"{"method":"initialized"}"#).unwrap(),
            Message::Notification { .. }
        ));
        assert!(matches!(
            parse(r#"{"id":7,"result":{"decision":"accept"}}"#).unwrap(),
            Message::Response {
                id: RequestId::Int(7)
            }
        ));
        assert!(matches!(
            parse(r#"{"id":7,"error":{"code":1,"message":"x"}}"#).unwrap(),
            Message::Response { .. }
        ));
    }

    #[test]
    fn bad_input_gets_a_defined_error() {
        assert!(matches!(parse("{not json"), Err(ParseError::NotJson(_))));
        assert!(matches!(parse(""), Err(ParseError::NotJson(_))));
        assert_eq!(
            parse(r#"[{"id":1,"method":"a"}]"#).unwrap_err(),
            ParseError::Batch
        );
        assert_eq!(parse("42").unwrap_err(), ParseError::NotObject);
        assert_eq!(
            parse(r#"{"id":null,"method":"a"}"#).unwrap_err(),
            ParseError::BadId { request: true }
        );
        assert_eq!(
            parse(r#"{"id":3.5,"method":"a"}"#).unwrap_err(),
            ParseError::BadId { request: true }
        );
        assert_eq!(parse(r#"{"id":3}"#).unwrap_err(), ParseError::NotJsonRpc);
        assert_eq!(parse("[1,").unwrap_err().code(), codes::PARSE_ERROR);
        assert_eq!(
            parse(r#"{"id":1,"method":7}"#).unwrap_err(),
            ParseError::NotJsonRpc
        );
    }

    #[test]
    fn thread_ids_come_from_params() {
        let m = parse(r#"{"id":1,"method":"turn/start","params":{"threadId":"t-1","input":[]}}"#)
            .unwrap();
        let Message::Request { params, .. } = m else {
            panic!()
        };
        assert_eq!(thread_id(params).as_deref(), Some("t-1"));
        assert_eq!(thread_id(None), None);
    }

    #[test]
    fn ids_are_rewritten_without_touching_the_rest() {
        let text = r#"{"method":"item/commandExecution/requestApproval","id":0,"params":{"threadId":"t"}}"#;
        let out = with_id(text, &RequestId::Int(17)).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["id"], 17);
        assert_eq!(v["params"]["threadId"], "t");
        let resolved =
            r#"{"method":"serverRequest/resolved","params":{"threadId":"t","requestId":0}}"#;
        let out = with_params_request_id(resolved, &RequestId::Int(17)).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["params"]["requestId"], 17);
        assert_eq!(
            result_thread_id(r#"{"id":1,"result":{"thread":{"id":"t-9","x":1}}}"#).as_deref(),
            Some("t-9")
        );
        assert_eq!(result_thread_id(r#"{"id":1,"result":{}}"#), None);
        assert_eq!(
            error_message(r#"{"id":1,"error":{"code":-32600,"message":"m"}}"#).as_deref(),
            Some("m")
        );
        let err = error_response(None, -32700, "Parse error", None);
        assert_eq!(
            err,
            r#"{"error":{"code":-32700,"message":"Parse error"},"id":null}"#
        );
    }
}
