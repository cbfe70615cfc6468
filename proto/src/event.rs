//! Thread lifecycle and turn notifications, parsed once into [`Event`]; what they mean for a
//! worker's loaded threads ([`Event::lifecycle`]) and for running turns ([`Event::turn`]).

use std::borrow::Cow;
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use tokio_tungstenite::tungstenite::Utf8Bytes;

use crate::method::Method;
use crate::rpc::{Frame, Message};

/// `ThreadStatus.type` of a thread that is no longer loaded (docs/app-server-facts.md §4).
pub const STATUS_NOT_LOADED: &str = "notLoaded";
/// `ThreadStatus.type` of a thread that runs a turn or waits on an approval or user input.
pub const STATUS_ACTIVE: &str = "active";

/// A notification about one thread's lifecycle or turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<'a> {
    /// `thread/started` (`params.thread.id`, `params.thread.status.type` if any).
    ThreadStarted {
        /// The thread.
        thread: Cow<'a, str>,
        /// Its status type, when the summary has one.
        status: Option<Cow<'a, str>>,
    },
    /// `thread/status/changed` (`params.threadId`, `params.status.type`).
    ThreadStatusChanged {
        /// The thread.
        thread: Cow<'a, str>,
        /// The new status type.
        status: Cow<'a, str>,
    },
    /// `thread/closed` (`params.threadId`).
    ThreadClosed {
        /// The thread.
        thread: Cow<'a, str>,
    },
    /// `turn/started` (`params.threadId`, and what `params.turn` says of itself).
    TurnStarted {
        /// The thread.
        thread: Cow<'a, str>,
        /// The turn.
        turn: TurnHead<'a>,
    },
    /// `turn/completed` (`params.threadId`, and what `params.turn` says of itself).
    TurnCompleted {
        /// The thread.
        thread: Cow<'a, str>,
        /// The turn.
        turn: TurnHead<'a>,
    },
}

/// What an [`Event`] says about a worker's loaded threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Loaded (`thread/started`, or a status other than `notLoaded`); `active` if it runs a turn
    /// or waits on the user.
    Loaded {
        /// Whether the status is `active`.
        active: bool,
    },
    /// No longer loaded (`thread/closed`, or status `notLoaded`).
    Unloaded,
}

/// What an [`Event`] says about the turn on its thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// A turn runs (`turn/started`, or the thread's status became `active`).
    Started,
    /// No turn runs any more (`turn/completed`, `thread/closed`, or a status other than `active`).
    Ended,
}

/// What a `turn/*` notification's `params.turn` says of itself, read in the same pass as the
/// thread id (its `items` skipped). Read leniently: a missing or oddly shaped field is `None`,
/// and a `turn` that is not an object is an empty head, never the loss of the event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnHead<'a> {
    /// `turn.id`.
    pub id: Option<Cow<'a, str>>,
    /// `turn.status` (`completed`, `interrupted`, `failed`, `inProgress`).
    pub status: Option<Cow<'a, str>>,
    /// `turn.durationMs`.
    pub duration_ms: Option<u64>,
}

impl TurnHead<'_> {
    fn into_owned(self) -> TurnHead<'static> {
        let own = |c: Cow<'_, str>| Cow::Owned(c.into_owned());
        TurnHead {
            id: self.id.map(own),
            status: self.status.map(own),
            duration_ms: self.duration_ms,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for TurnHead<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Loose::deserialize(d)? {
            Loose::Turn(head) => head,
            Loose::Str(_) | Loose::U64(_) | Loose::Other => TurnHead::default(),
        })
    }
}

/// One JSON value read leniently: a string, an unsigned integer, an object read as a turn's
/// head, or anything else skipped.
enum Loose<'a> {
    Str(Cow<'a, str>),
    U64(u64),
    Turn(TurnHead<'a>),
    Other,
}

impl<'a> Loose<'a> {
    fn str(self) -> Option<Cow<'a, str>> {
        match self {
            Loose::Str(s) => Some(s),
            Loose::U64(_) | Loose::Turn(_) | Loose::Other => None,
        }
    }

    fn u64(self) -> Option<u64> {
        match self {
            Loose::U64(n) => Some(n),
            Loose::Str(_) | Loose::Turn(_) | Loose::Other => None,
        }
    }
}

impl<'de> Deserialize<'de> for Loose<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LooseVisitor)
    }
}

struct LooseVisitor;

impl<'de> Visitor<'de> for LooseVisitor {
    type Value = Loose<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Loose<'de>, E> {
        Ok(Loose::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Loose<'de>, E> {
        Ok(Loose::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Loose<'de>, E> {
        Ok(Loose::U64(v))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Loose<'de>, E> {
        Ok(Loose::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Loose<'de>, E> {
        Ok(Loose::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Loose<'de>, E> {
        Ok(Loose::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Loose<'de>, E> {
        Ok(Loose::Other)
    }

    fn visit_none<E: de::Error>(self) -> Result<Loose<'de>, E> {
        Ok(Loose::Other)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Loose<'de>, D::Error> {
        Loose::deserialize(d)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Loose<'de>, A::Error> {
        while a.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(Loose::Other)
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut a: A) -> Result<Loose<'de>, A::Error> {
        let mut head = TurnHead::default();
        while let Some(key) = a.next_key::<Loose<'de>>()? {
            match key.str().as_deref() {
                Some("id") => head.id = a.next_value::<Loose<'de>>()?.str(),
                Some("status") => head.status = a.next_value::<Loose<'de>>()?.str(),
                Some("durationMs") => head.duration_ms = a.next_value::<Loose<'de>>()?.u64(),
                _ => {
                    a.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        Ok(Loose::Turn(head))
    }
}

#[derive(serde::Deserialize)]
struct Status<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
}

#[derive(serde::Deserialize)]
struct StartedParams<'a> {
    #[serde(borrow)]
    thread: ThreadSummary<'a>,
}

#[derive(serde::Deserialize)]
struct ThreadSummary<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(default, borrow)]
    status: Option<Status<'a>>,
}

#[derive(serde::Deserialize)]
struct StatusParams<'a> {
    #[serde(rename = "threadId", borrow)]
    thread_id: Cow<'a, str>,
    #[serde(borrow)]
    status: Status<'a>,
}

#[derive(serde::Deserialize)]
struct ThreadParams<'a> {
    #[serde(rename = "threadId", borrow)]
    thread_id: Cow<'a, str>,
}

#[derive(serde::Deserialize)]
struct TurnParams<'a> {
    #[serde(rename = "threadId", borrow)]
    thread_id: Cow<'a, str>,
    #[serde(default, borrow)]
    turn: TurnHead<'a>,
}

// === impl Event ===

impl<'a> Event<'a> {
    /// The event a notification carries; `None` for other methods or unexpected shapes.
    pub fn parse(method: &Method<'_>, params: Option<&'a RawValue>) -> Option<Self> {
        let params = params?;
        let mut de = serde_json::Deserializer::from_str(params.get());
        Self::from_params(method, &mut de)
    }

    /// As [`Event::parse`], from a whole notification already parsed into a [`Value`].
    pub fn from_value(message: &'a Value) -> Option<Self> {
        let method = Method::parse(message.get("method")?.as_str()?);
        let params = message.get("params").unwrap_or(&Value::Null);
        Self::from_params(&method, params)
    }

    fn from_params<D: Deserializer<'a>>(method: &Method<'_>, params: D) -> Option<Self> {
        Some(match method {
            Method::ThreadStarted => {
                let p = StartedParams::deserialize(params).ok()?;
                Event::ThreadStarted {
                    thread: p.thread.id,
                    status: p.thread.status.map(|s| s.kind),
                }
            }
            Method::ThreadStatusChanged => {
                let p = StatusParams::deserialize(params).ok()?;
                Event::ThreadStatusChanged {
                    thread: p.thread_id,
                    status: p.status.kind,
                }
            }
            Method::ThreadClosed => Event::ThreadClosed {
                thread: ThreadParams::deserialize(params).ok()?.thread_id,
            },
            Method::TurnStarted => {
                let p = TurnParams::deserialize(params).ok()?;
                Event::TurnStarted {
                    thread: p.thread_id,
                    turn: p.turn,
                }
            }
            Method::TurnCompleted => {
                let p = TurnParams::deserialize(params).ok()?;
                Event::TurnCompleted {
                    thread: p.thread_id,
                    turn: p.turn,
                }
            }
            _ => return None,
        })
    }

    /// The same event, owning its strings.
    pub fn into_owned(self) -> Event<'static> {
        let own = |c: Cow<'_, str>| Cow::Owned(c.into_owned());
        match self {
            Event::ThreadStarted { thread, status } => Event::ThreadStarted {
                thread: own(thread),
                status: status.map(own),
            },
            Event::ThreadStatusChanged { thread, status } => Event::ThreadStatusChanged {
                thread: own(thread),
                status: own(status),
            },
            Event::ThreadClosed { thread } => Event::ThreadClosed {
                thread: own(thread),
            },
            Event::TurnStarted { thread, turn } => Event::TurnStarted {
                thread: own(thread),
                turn: turn.into_owned(),
            },
            Event::TurnCompleted { thread, turn } => Event::TurnCompleted {
                thread: own(thread),
                turn: turn.into_owned(),
            },
        }
    }

    /// The thread the event is about.
    pub fn thread(&self) -> &str {
        match self {
            Event::ThreadStarted { thread, .. }
            | Event::ThreadStatusChanged { thread, .. }
            | Event::ThreadClosed { thread }
            | Event::TurnStarted { thread, .. }
            | Event::TurnCompleted { thread, .. } => thread,
        }
    }

    /// Its meaning for the worker's loaded threads; `None` for turn events.
    pub fn lifecycle(&self) -> Option<Lifecycle> {
        match self {
            Event::ThreadStarted { status, .. } => Some(Lifecycle::Loaded {
                active: status.as_deref() == Some(STATUS_ACTIVE),
            }),
            Event::ThreadStatusChanged { status, .. } if status == STATUS_NOT_LOADED => {
                Some(Lifecycle::Unloaded)
            }
            Event::ThreadStatusChanged { status, .. } => Some(Lifecycle::Loaded {
                active: status == STATUS_ACTIVE,
            }),
            Event::ThreadClosed { .. } => Some(Lifecycle::Unloaded),
            Event::TurnStarted { .. } | Event::TurnCompleted { .. } => None,
        }
    }

    /// Its meaning for the turn on the thread; `None` for `thread/started`.
    pub fn turn(&self) -> Option<Turn> {
        match self {
            Event::TurnStarted { .. } => Some(Turn::Started),
            Event::ThreadStatusChanged { status, .. } if status == STATUS_ACTIVE => {
                Some(Turn::Started)
            }
            Event::TurnCompleted { .. }
            | Event::ThreadClosed { .. }
            | Event::ThreadStatusChanged { .. } => Some(Turn::Ended),
            Event::ThreadStarted { .. } => None,
        }
    }
}

/// A notification from a worker, parsed once where it arrives: its text exactly as sent (to
/// forward), its method, the lifecycle or turn event it carries and the thread it is about, so
/// nothing downstream parses it again.
#[derive(Debug, Clone)]
pub struct Notice {
    /// The notification as the worker sent it, in one allocation of its own: every session that
    /// forwards it shares it (cloning is a reference count), and it holds no reader's buffer.
    pub text: Utf8Bytes,
    /// Its method.
    pub method: Method<'static>,
    /// The thread lifecycle or turn event, if it is one.
    pub event: Option<Event<'static>>,
    /// The thread it is about: the event's, or `params.threadId` of another thread-scoped
    /// notification.
    pub thread: Option<Arc<str>>,
}

#[derive(serde::Deserialize)]
struct ThreadIdOnly<'a> {
    #[serde(rename = "threadId", borrow)]
    thread_id: Option<crate::rpc::Text<'a>>,
}

impl Notice {
    /// The notification `method` with `params`, whose whole frame is `text`.
    pub fn new(text: &str, method: Method<'_>, params: Option<&RawValue>) -> Self {
        let event = Event::parse(&method, params).map(Event::into_owned);
        let thread = match &event {
            Some(e) => Some(Arc::from(e.thread())),
            None if method.is_thread_scoped() => params
                .and_then(|p| serde_json::from_str::<ThreadIdOnly<'_>>(p.get()).ok())
                .and_then(|p| p.thread_id)
                .map(|t| Arc::from(t.0.as_ref())),
            None => None,
        };
        Self {
            text: Utf8Bytes::from(text),
            method: method.into_owned(),
            event,
            thread,
        }
    }

    /// Parses a frame; `None` unless it is a notification.
    pub fn parse(text: &str) -> Option<Self> {
        match Frame::parse(text).ok()?.message {
            Message::Notification { method, params } => Some(Self::new(text, method, params)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(method: &str, params: &str) -> Option<Event<'static>> {
        let raw: Box<RawValue> = serde_json::from_str(params).unwrap();
        let raw: &'static RawValue = Box::leak(raw);
        Event::parse(&Method::parse(method), Some(raw))
    }

    #[test]
    fn a_notice_is_parsed_once_and_keeps_its_text() {
        let text = r#"{"method":"thread/status/changed","params":{"threadId":"t1","status":{"type":"active","activeFlags":[]}}}"#;
        let n = Notice::parse(text).unwrap();
        assert_eq!(&*n.text, text);
        assert_eq!(n.method, Method::ThreadStatusChanged);
        assert_eq!(n.event.as_ref().and_then(Event::turn), Some(Turn::Started));
        assert_eq!(n.thread.as_deref(), Some("t1"));
        let goal = Notice::parse(r#"{"method":"thread/goal/cleared","params":{"threadId":"t2"}}"#)
            .unwrap();
        assert_eq!((goal.event, goal.thread.as_deref()), (None, Some("t2")));
        let global =
            Notice::parse(r#"{"method":"account/updated","params":{"threadId":"x"}}"#).unwrap();
        assert_eq!(global.thread, None, "not thread-scoped");
        assert!(Notice::parse(r#"{"id":1,"result":{}}"#).is_none());
        assert!(Notice::parse("nope").is_none());
    }

    #[test]
    fn lifecycle_of_each_event() {
        let started = ev(
            "thread/started",
            r#"{"thread":{"id":"a","status":{"type":"idle"}}}"#,
        )
        .unwrap();
        assert_eq!(started.thread(), "a");
        assert_eq!(
            started.lifecycle(),
            Some(Lifecycle::Loaded { active: false })
        );
        assert_eq!(started.turn(), None);
        let active = ev(
            "thread/status/changed",
            r#"{"threadId":"a","status":{"type":"active","activeFlags":[]}}"#,
        )
        .unwrap();
        assert_eq!(active.lifecycle(), Some(Lifecycle::Loaded { active: true }));
        assert_eq!(active.turn(), Some(Turn::Started));
        let gone = ev(
            "thread/status/changed",
            r#"{"threadId":"a","status":{"type":"notLoaded"}}"#,
        )
        .unwrap();
        assert_eq!(gone.lifecycle(), Some(Lifecycle::Unloaded));
        assert_eq!(gone.turn(), Some(Turn::Ended));
        let closed = ev("thread/closed", r#"{"threadId":"a"}"#).unwrap();
        assert_eq!(closed.lifecycle(), Some(Lifecycle::Unloaded));
        assert_eq!(closed.turn(), Some(Turn::Ended));
        let t = ev("turn/started", r#"{"threadId":"t1","turn":{}}"#).unwrap();
        assert_eq!(
            (t.thread(), t.turn(), t.lifecycle()),
            ("t1", Some(Turn::Started), None)
        );
        let t = ev("turn/completed", r#"{"threadId":"t1","turn":{}}"#).unwrap();
        assert_eq!(t.turn(), Some(Turn::Ended));
    }

    #[test]
    fn a_turns_head_is_read_with_its_thread_and_leniently() {
        let done = ev(
            "turn/completed",
            r#"{"threadId":"t1","turn":{"items":[{"id":"x","text":"a \"quoted\" {"}],"id":"u1","status":"interrupted","durationMs":2500,"error":null}}"#,
        )
        .unwrap();
        let head = TurnHead {
            id: Some("u1".into()),
            status: Some("interrupted".into()),
            duration_ms: Some(2500),
        };
        assert_eq!(
            done,
            Event::TurnCompleted {
                thread: "t1".into(),
                turn: head.clone()
            }
        );
        assert_eq!(done.clone().into_owned(), done);
        // Odd shapes lose the field, never the event (turn tracking rests on the thread id).
        for (params, head) in [
            (r#"{"threadId":"t1"}"#, TurnHead::default()),
            (r#"{"threadId":"t1","turn":null}"#, TurnHead::default()),
            (r#"{"threadId":"t1","turn":"u1"}"#, TurnHead::default()),
            (
                r#"{"threadId":"t1","turn":[1,{"id":"u1"}]}"#,
                TurnHead::default(),
            ),
            (
                r#"{"threadId":"t1","turn":{"id":7,"status":{"type":"x"},"durationMs":-1}}"#,
                TurnHead::default(),
            ),
            (
                r#"{"threadId":"t1","turn":{"id":"a\u0062","durationMs":1.5}}"#,
                TurnHead {
                    id: Some("ab".into()),
                    ..TurnHead::default()
                },
            ),
        ] {
            assert_eq!(
                ev("turn/started", params),
                Some(Event::TurnStarted {
                    thread: "t1".into(),
                    turn: head
                }),
                "{params}"
            );
        }
        // The same from a parsed value.
        let v =
            json!({"method": "turn/started", "params": {"threadId": "t1", "turn": {"id": "u2"}}});
        assert!(matches!(
            Event::from_value(&v),
            Some(Event::TurnStarted { turn: TurnHead { id: Some(id), .. }, .. }) if id == "u2"
        ));
    }

    #[test]
    fn other_methods_and_shapes_are_none() {
        assert_eq!(ev("thread/status/changed", r#"{"threadId":"t1"}"#), None);
        assert_eq!(ev("item/started", r#"{"threadId":"t1"}"#), None);
        assert_eq!(ev("turn/started", r#"{"turn":{}}"#), None);
        assert_eq!(ev("thread/closed", "{}"), None);
        assert_eq!(Event::parse(&Method::TurnStarted, None), None);
    }

    #[test]
    fn from_a_value_as_from_text() {
        let v = json!({"method": "thread/started", "params": {"thread": {
            "id": "x", "status": {"type": "active"}}}});
        let e = Event::from_value(&v).unwrap();
        assert_eq!(e.thread(), "x");
        assert_eq!(e.lifecycle(), Some(Lifecycle::Loaded { active: true }));
        assert_eq!(
            Event::from_value(&json!({"method": "thread/name/updated", "params": {}})),
            None
        );
        assert_eq!(Event::from_value(&json!({"method": "thread/closed"})), None);
    }
}
