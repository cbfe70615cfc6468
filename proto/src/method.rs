//! The app-server methods codex-fleet acts on, as an enum; every other method is `Other` and is
//! forwarded untouched.

use std::borrow::Cow;
use std::fmt;

mod known;
pub use known::{is_app_server_method, unknown_method_message, APP_SERVER_METHODS};

macro_rules! methods {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// A JSON-RPC method name: the ones the router, the worker supervisor or the tools act on,
        /// or [`Method::Other`].
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum Method<'a> {
            $($(#[$doc])* $variant,)*
            /// Any other method, as sent.
            Other(Cow<'a, str>),
        }

        impl<'a> Method<'a> {
            /// The method a name stands for.
            pub fn parse(name: impl Into<Cow<'a, str>>) -> Self {
                let name = name.into();
                match name.as_ref() {
                    $($name => Method::$variant,)*
                    _ => Method::Other(name),
                }
            }

            /// The name on the wire.
            pub fn as_str(&self) -> &str {
                match self {
                    $(Method::$variant => $name,)*
                    Method::Other(name) => name,
                }
            }

            /// The name of a known method, as a `'static` string; `None` for [`Method::Other`].
            pub fn known_name(&self) -> Option<&'static str> {
                match self {
                    $(Method::$variant => Some($name),)*
                    Method::Other(_) => None,
                }
            }
        }
    };
}

methods! {
    /// `initialize` (client → server request).
    Initialize = "initialize",
    /// `initialized` (client → server notification).
    Initialized = "initialized",
    /// `thread/start`.
    ThreadStart = "thread/start",
    /// `thread/resume`.
    ThreadResume = "thread/resume",
    /// `thread/fork`.
    ThreadFork = "thread/fork",
    /// `thread/read`.
    ThreadRead = "thread/read",
    /// `thread/list`.
    ThreadList = "thread/list",
    /// `thread/loaded/list`: the loaded threads of one worker (also the health probe).
    ThreadLoadedList = "thread/loaded/list",
    /// `turn/start`.
    TurnStart = "turn/start",
    /// `turn/interrupt`.
    TurnInterrupt = "turn/interrupt",
    /// `thread/started` (notification).
    ThreadStarted = "thread/started",
    /// `thread/status/changed` (notification).
    ThreadStatusChanged = "thread/status/changed",
    /// `thread/closed` (notification).
    ThreadClosed = "thread/closed",
    /// `turn/started` (notification).
    TurnStarted = "turn/started",
    /// `turn/completed` (notification).
    TurnCompleted = "turn/completed",
    /// `serverRequest/resolved` (notification): a server request was answered or withdrawn.
    ServerRequestResolved = "serverRequest/resolved",
    /// `item/agentMessage/delta` (notification).
    AgentMessageDelta = "item/agentMessage/delta",
    /// `thread/unsubscribe`: the connection stops following a thread.
    ThreadUnsubscribe = "thread/unsubscribe",
}

// === impl Method ===

impl Method<'_> {
    /// Whether the method is about one thread (`thread/…`); process-wide news is not.
    pub fn is_thread_scoped(&self) -> bool {
        self.as_str().starts_with("thread/")
    }

    /// Streaming deltas (`item/agentMessage/delta`, `item/commandExecution/outputDelta`,
    /// `item/reasoning/textDelta`, `item/reasoning/summaryTextDelta`, `item/plan/delta`,
    /// `item/fileChange/outputDelta`, …): the item's `item/completed` carries the whole result,
    /// so a client that has fallen behind can lose them.
    pub fn is_delta(&self) -> bool {
        let m = self.as_str();
        m.starts_with("item/") && (m.ends_with("/delta") || m.ends_with("Delta"))
    }

    /// The same method, owning its name.
    pub fn into_owned(self) -> Method<'static> {
        match self {
            Method::Other(name) => Method::Other(Cow::Owned(name.into_owned())),
            // Every other variant has no borrowed data: re-parse its static name.
            known => Method::parse(Cow::Owned(known.as_str().to_owned())),
        }
    }
}

impl fmt::Display for Method<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for Method<'_> {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Method<'_> {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in [
            "initialize",
            "initialized",
            "thread/start",
            "thread/resume",
            "thread/fork",
            "thread/read",
            "thread/list",
            "thread/loaded/list",
            "turn/start",
            "turn/interrupt",
            "thread/started",
            "thread/status/changed",
            "thread/closed",
            "turn/started",
            "turn/completed",
            "serverRequest/resolved",
            "item/agentMessage/delta",
            "thread/unsubscribe",
        ] {
            let m = Method::parse(name);
            assert!(!matches!(m, Method::Other(_)), "{name} is known");
            assert_eq!(m.as_str(), name);
            assert_eq!(m.known_name(), Some(name));
            assert_eq!(m.clone().into_owned(), m);
        }
        let other = Method::parse("fs/readFile");
        assert_eq!(other, Method::Other("fs/readFile".into()));
        assert_eq!(other, "fs/readFile");
        assert_eq!(other.to_string(), "fs/readFile");
        assert_eq!(other.known_name(), None);
    }

    #[test]
    fn deltas_and_thread_scope() {
        for delta in [
            "item/agentMessage/delta",
            "item/commandExecution/outputDelta",
            "item/reasoning/textDelta",
            "item/reasoning/summaryTextDelta",
            "item/plan/delta",
            "item/fileChange/outputDelta",
        ] {
            assert!(Method::parse(delta).is_delta(), "{delta}");
        }
        for not in [
            "item/completed",
            "item/started",
            "turn/completed",
            "item/reasoning/summaryPartAdded",
            "command/exec/outputDelta",
            "thread/status/changed",
        ] {
            assert!(!Method::parse(not).is_delta(), "{not}");
        }
        assert!(Method::ThreadClosed.is_thread_scoped());
        assert!(Method::parse("thread/name/updated").is_thread_scoped());
        assert!(!Method::TurnStarted.is_thread_scoped());
    }
}
