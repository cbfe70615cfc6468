//! Which worker notifications start or end a turn, and which ones are expendable deltas.

use serde::Deserialize;
use serde_json::value::RawValue;

/// What a notification says about the turn on its thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A turn runs (`turn/started`, or the thread's status became `active`).
    Started,
    /// No turn runs any more (`turn/completed`, `thread/closed`, or a status other than `active`).
    Ended,
}

#[derive(Deserialize)]
struct Params<'a> {
    #[serde(rename = "threadId", borrow, default)]
    thread_id: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    status: Option<Status<'a>>,
}

#[derive(Deserialize)]
struct Status<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
}

/// The turn event a notification carries, with its thread id.
pub fn event(method: &str, params: Option<&RawValue>) -> Option<(Event, String)> {
    let kind = match method {
        "turn/started" => Event::Started,
        "turn/completed" | "thread/closed" => Event::Ended,
        "thread/status/changed" => Event::Ended, // refined below by the status
        _ => return None,
    };
    let p: Params<'_> = serde_json::from_str(params?.get()).ok()?;
    let thread = p.thread_id?.into_owned();
    let kind = match (method, p.status) {
        ("thread/status/changed", Some(s)) if s.kind == "active" => Event::Started,
        ("thread/status/changed", None) => return None,
        _ => kind,
    };
    Some((kind, thread))
}

/// Streaming deltas (`item/agentMessage/delta`, `item/commandExecution/outputDelta`,
/// `item/reasoning/textDelta`, `item/reasoning/summaryTextDelta`, `item/plan/delta`,
/// `item/fileChange/outputDelta`, …): the item's `item/completed` carries the whole result,
/// so a client that has fallen behind can lose them.
pub fn is_delta(method: &str) -> bool {
    method.starts_with("item/") && (method.ends_with("/delta") || method.ends_with("Delta"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(method: &str, params: &str) -> Option<(Event, String)> {
        let raw: Box<RawValue> = serde_json::from_str(params).unwrap();
        event(method, Some(&raw))
    }

    #[test]
    fn turn_events_come_from_turn_and_status_notifications() {
        let t = |e| Some((e, "t1".to_owned()));
        assert_eq!(
            ev("turn/started", r#"{"threadId":"t1","turn":{}}"#),
            t(Event::Started)
        );
        assert_eq!(
            ev("turn/completed", r#"{"threadId":"t1","turn":{}}"#),
            t(Event::Ended)
        );
        assert_eq!(ev("thread/closed", r#"{"threadId":"t1"}"#), t(Event::Ended));
        assert_eq!(
            ev(
                "thread/status/changed",
                r#"{"threadId":"t1","status":{"type":"active","activeFlags":[]}}"#
            ),
            t(Event::Started)
        );
        assert_eq!(
            ev(
                "thread/status/changed",
                r#"{"threadId":"t1","status":{"type":"idle"}}"#
            ),
            t(Event::Ended)
        );
        assert_eq!(ev("thread/status/changed", r#"{"threadId":"t1"}"#), None);
        assert_eq!(ev("item/started", r#"{"threadId":"t1"}"#), None);
        assert_eq!(ev("turn/started", r#"{"turn":{}}"#), None);
        assert_eq!(event("turn/started", None), None);
    }

    #[test]
    fn deltas_are_recognised_and_nothing_else() {
        for m in [
            "item/agentMessage/delta",
            "item/commandExecution/outputDelta",
            "item/reasoning/textDelta",
            "item/reasoning/summaryTextDelta",
            "item/plan/delta",
            "item/fileChange/outputDelta",
        ] {
            assert!(is_delta(m), "{m}");
        }
        for m in [
            "item/completed",
            "item/started",
            "turn/completed",
            "item/reasoning/summaryPartAdded",
            "command/exec/outputDelta",
            "thread/status/changed",
        ] {
            assert!(!is_delta(m), "{m}");
        }
    }
}
