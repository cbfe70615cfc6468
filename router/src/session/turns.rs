//! Which worker notifications start or end a turn: the protocol core's typed events
//! ([`proto::event`]), as the session counts turns.

use proto::event::Event as Notification;

/// What a notification says about the turn on its thread.
pub use proto::event::Turn as Event;

/// The turn event a parsed notification carries, with its thread id.
pub fn turn_of<'n>(n: &'n Notification<'_>) -> Option<(Event, &'n str)> {
    Some((n.turn()?, n.thread()))
}

/// As [`turn_of`], for a method name and its params.
#[cfg(test)]
pub fn event(
    method: &str,
    params: Option<&serde_json::value::RawValue>,
) -> Option<(Event, String)> {
    let n = Notification::parse(&proto::Method::parse(method), params)?;
    turn_of(&n).map(|(event, thread)| (event, thread.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::value::RawValue;

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
}
