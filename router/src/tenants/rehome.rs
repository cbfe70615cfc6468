//! Threads outlive their worker: when a worker ends with threads that sessions are subscribed
//! to, each such thread is resumed on a ready worker of the same tenant, once per subscribed
//! session on that session's own leg, instead of being closed.
//!
//! The tenant decides once per thread where it goes ([`Tenant::on_worker_exited`]), and tells
//! every session with a [`Rehome`] order on its relay; each session then ends the turn that was
//! running (in the shape app-server itself leaves such a turn: `interrupted`), resolves the dead
//! worker's prompts, and resumes the thread on the chosen worker (see `session/rehome.rs`).
//!
//! [`Tenant::on_worker_exited`]: crate::tenants::Tenant

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use proto::Method;
use serde_json::{json, Value};
use tokio::time::Instant;
use worker::metrics::ExitReason;
use worker::WorkerId;

/// Why a worker's threads are being moved: the `cause` label of the re-home metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// It exited unexpectedly, or failed its peer check.
    Crash,
    /// It missed its health deadline and was killed.
    Hang,
    /// It was retired on purpose (memory guard, idle stop) after its turns ended.
    Retired,
}

impl Cause {
    /// Every cause, so each series exists (at zero) from the start.
    pub const ALL: [Cause; 3] = [Cause::Crash, Cause::Hang, Cause::Retired];

    /// The cause of a worker's end, or `None` when its threads are not re-homed (codex-fleet is
    /// stopping, or the worker never became ready).
    pub fn of(reason: ExitReason) -> Option<Cause> {
        match reason {
            ExitReason::Crash | ExitReason::Fault => Some(Cause::Crash),
            ExitReason::Hang => Some(Cause::Hang),
            ExitReason::Idle | ExitReason::Memory => Some(Cause::Retired),
            ExitReason::Stopped | ExitReason::StartFail => None,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Crash => "crash",
            Cause::Hang => "hang",
            Cause::Retired => "retired",
        }
    }

    /// What a client is told about a turn that was running when its worker ended.
    pub fn turn_message(self) -> &'static str {
        match self {
            Cause::Crash => {
                "codex-fleet: the worker running this turn ended unexpectedly; the turn did not \
                 complete and was not retried. The thread continues on another worker."
            }
            Cause::Hang => {
                "codex-fleet: the worker running this turn stopped responding and was stopped; \
                 the turn did not complete and was not retried. The thread continues on another \
                 worker."
            }
            Cause::Retired => {
                "codex-fleet: the worker running this turn was retired; the turn did not \
                 complete and was not retried. The thread continues on another worker."
            }
        }
    }
}

/// How a session's re-home of one thread ended: the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Resumed on the new worker: the session keeps its subscription.
    Rehomed,
    /// No worker of the tenant could take the thread (quarantined, at its cap, none started in
    /// time): the session got `thread/closed`.
    NoWorker,
    /// The new worker refused the resume, or its leg could not be opened: the session got
    /// `thread/closed`.
    ResumeFailed,
}

impl Outcome {
    /// Every outcome, so each series exists (at zero) from the start.
    pub const ALL: [Outcome; 3] = [Outcome::Rehomed, Outcome::NoWorker, Outcome::ResumeFailed];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Rehomed => "rehomed",
            Outcome::NoWorker => "no_worker",
            Outcome::ResumeFailed => "resume_failed",
        }
    }
}

/// The tenant's order about one thread of a worker that ended.
#[derive(Debug)]
pub struct Rehome {
    /// The thread.
    pub thread: Arc<str>,
    /// The worker that ended.
    pub from: WorkerId,
    /// Where the thread goes; `None` when no worker could take it (sessions fall back to
    /// `systemError` and `thread/closed`).
    pub to: Option<WorkerId>,
    /// Why the worker ended.
    pub cause: Cause,
    /// When the tenant learned that the worker ended (for the re-home duration).
    pub since: Instant,
    /// The thread was running a turn (or waiting on the user) when its worker ended: sessions
    /// that do not follow it saw it `active` and are told it is `idle` again, and so are
    /// followers that have no turn of it to end.
    pub was_active: bool,
}

/// How long after the last session's move settled its echoes are still held back (they are
/// broadcast by the new worker while it handles the resumes, and reach other sessions through
/// other paths).
const MOVE_ECHO_GRACE: std::time::Duration = std::time::Duration::from_millis(500);
/// Longest a move is considered under way (a session that vanished never settles its part).
const MOVE_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The threads of one tenant being re-homed: while a thread moves, and shortly after, what the
/// resumes make the new worker broadcast about it (`thread/status/changed` restating `idle`,
/// `thread/goal/cleared`) is held back, so a move of an idle thread is invisible.
#[derive(Default)]
pub struct Moves {
    moving: Mutex<HashMap<String, Move>>,
}

struct Move {
    /// Subscribed sessions whose resume is not answered yet.
    pending: usize,
    /// Until when echoes are held back.
    until: Instant,
}

impl Moves {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Move>> {
        self.moving.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `thread` starts moving for `sessions` subscribed sessions.
    pub fn begin(&self, thread: &str, sessions: usize) {
        let now = Instant::now();
        let mut moving = self.lock();
        moving.retain(|_, m| m.until > now);
        moving.insert(
            thread.to_owned(),
            Move {
                pending: sessions,
                until: now + MOVE_LIMIT,
            },
        );
    }

    /// One session's part of the move of `thread` is done (re-homed or failed).
    pub fn settle(&self, thread: &str) {
        if let Some(m) = self.lock().get_mut(thread) {
            m.pending = m.pending.saturating_sub(1);
            if m.pending == 0 {
                m.until = m.until.min(Instant::now() + MOVE_ECHO_GRACE);
            }
        }
    }

    /// Whether a notification about `thread` may be an echo of its move.
    pub fn quiet(&self, thread: &str) -> bool {
        self.lock()
            .get(thread)
            .is_some_and(|m| m.until > Instant::now())
    }
}

/// Whether a notification is one a move makes the new worker send about the moved thread (held
/// back while [`Moves::quiet`]): the restated idle status and the cleared goal. A status that
/// says the thread is active again (a new turn) is news and always passes.
pub fn is_move_echo(method: &str, status: Option<&str>) -> bool {
    match method {
        "thread/goal/cleared" => true,
        "thread/status/changed" => status == Some("idle"),
        _ => false,
    }
}

/// How many sessions are subscribed to each thread of one tenant: a thread with none is closed
/// when its worker ends (nobody would see it again until they resume it), one with some is
/// re-homed.
#[derive(Default)]
pub struct Subscribers {
    counts: Mutex<HashMap<Arc<str>, usize>>,
}

impl Subscribers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, usize>> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one more subscriber of `thread` until the guard is dropped.
    pub fn subscribe(self: &Arc<Self>, thread: &str) -> Subscription {
        let thread: Arc<str> = Arc::from(thread);
        *self.lock().entry(thread.clone()).or_default() += 1;
        Subscription {
            subscribers: self.clone(),
            thread,
        }
    }

    /// Sessions subscribed to `thread` now.
    pub fn count(&self, thread: &str) -> usize {
        self.lock().get(thread).copied().unwrap_or(0)
    }
}

/// One session's subscription to one thread, counted in [`Subscribers`] while it lives.
pub struct Subscription {
    subscribers: Arc<Subscribers>,
    thread: Arc<str>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut counts = self.subscribers.lock();
        if let Some(n) = counts.get_mut(&self.thread) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.thread);
            }
        }
    }
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Subscription").field(&self.thread).finish()
    }
}

/// What a subscribed client is sent when the turn `turn` (the object its `turn/started`
/// carried) was running on a worker that ended: an `error` notification that will not be
/// retried, the thread going idle, and `turn/completed` with status `interrupted` — the status
/// app-server itself gives such a turn once the thread is resumed from disk (measured on the
/// pinned app-server: a turn whose process was killed reads back as `interrupted`), with the
/// message in the turn's `error`.
pub fn turn_ended_frames(
    thread: &str,
    turn: &Value,
    message: &str,
    now_ms: u64,
) -> [Synthesized; 3] {
    let error = json!({"message": message, "codexErrorInfo": null, "additionalDetails": null});
    let mut turn = turn.clone();
    let turn_id = turn.get("id").cloned().unwrap_or(Value::Null);
    if let Some(t) = turn.as_object_mut() {
        let started_secs = t.get("startedAt").and_then(Value::as_u64);
        t.insert("status".into(), json!("interrupted"));
        t.insert("error".into(), error.clone());
        t.insert("items".into(), json!([]));
        t.insert("itemsView".into(), json!("notLoaded"));
        t.insert("completedAt".into(), json!(now_ms / 1000));
        if let Some(started) = started_secs {
            t.insert(
                "durationMs".into(),
                json!(now_ms.saturating_sub(started * 1000)),
            );
        }
    }
    [
        Synthesized::new(
            Method::Other("error".into()),
            json!({"error": error, "willRetry": false, "threadId": thread, "turnId": turn_id}),
        ),
        thread_idle_frame(thread),
        Synthesized::new(
            Method::TurnCompleted,
            json!({"threadId": thread, "turn": turn}),
        ),
    ]
}

/// What every session is told about a thread that was not re-homed: it failed (`systemError`)
/// or, after a retirement, simply unloaded (`notLoaded`), then it closed.
pub fn thread_closed_frames(thread: &str, status: &str) -> [Synthesized; 2] {
    [
        Synthesized::new(
            Method::ThreadStatusChanged,
            json!({"threadId": thread, "status": {"type": status}}),
        ),
        Synthesized::new(Method::ThreadClosed, json!({"threadId": thread})),
    ]
}

/// A notification codex-fleet writes itself, as app-server would have sent it, with its method
/// (a client that opted out of the method does not get it).
pub struct Synthesized {
    pub method: Method<'static>,
    pub text: String,
}

impl Synthesized {
    fn new(method: Method<'static>, params: Value) -> Synthesized {
        let text = json!({"method": method.as_str(), "params": params}).to_string();
        Synthesized { method, text }
    }
}

/// A thread that was active is idle again (its worker ended; told to sessions that do not
/// follow it, which saw it active, and to followers whose `turn/started` the worker never
/// wrote).
pub fn thread_idle_frame(thread: &str) -> Synthesized {
    Synthesized::new(
        Method::ThreadStatusChanged,
        json!({"threadId": thread, "status": {"type": "idle"}}),
    )
}

/// `serverRequest/resolved` for a prompt of a worker that ended (its answer can reach nobody).
pub fn request_resolved_frame(thread: &str, request_id: i64) -> Synthesized {
    Synthesized::new(
        Method::ServerRequestResolved,
        json!({"threadId": thread, "requestId": request_id}),
    )
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_turn_ends_interrupted_with_the_reason() {
        let started = json!({"id": "t1", "items": [], "itemsView": "notLoaded", "status": "inProgress",
            "error": null, "startedAt": 1000, "completedAt": null, "durationMs": null, "rootTurnId": "t1"});
        let [error, idle, completed] = turn_ended_frames("th", &started, "worker ended", 1_002_500);
        let methods = [
            error.method.as_str(),
            idle.method.as_str(),
            completed.method.as_str(),
        ];
        assert_eq!(
            methods,
            ["error", "thread/status/changed", "turn/completed"]
        );
        let (error, idle, completed) = (error.text, idle.text, completed.text);
        let error: Value = serde_json::from_str(&error).unwrap();
        assert_eq!(error["method"], "error");
        assert_eq!(error["params"]["willRetry"], false);
        assert_eq!(error["params"]["turnId"], "t1");
        assert_eq!(error["params"]["error"]["message"], "worker ended");
        let idle: Value = serde_json::from_str(&idle).unwrap();
        assert_eq!(idle["params"]["status"]["type"], "idle");
        let completed: Value = serde_json::from_str(&completed).unwrap();
        assert_eq!(completed["method"], "turn/completed");
        let turn = &completed["params"]["turn"];
        assert_eq!(turn["status"], "interrupted");
        assert_eq!(turn["id"], "t1");
        assert_eq!(turn["rootTurnId"], "t1");
        assert_eq!(turn["completedAt"], 1002);
        assert_eq!(turn["durationMs"], 2500);
        assert_eq!(turn["error"]["message"], "worker ended");
    }

    #[test]
    fn subscriptions_are_counted_until_dropped() {
        let subs = Arc::new(Subscribers::default());
        let a = subs.subscribe("t");
        let b = subs.subscribe("t");
        assert_eq!(subs.count("t"), 2);
        drop(a);
        assert_eq!(subs.count("t"), 1);
        drop(b);
        assert_eq!(subs.count("t"), 0);
        assert!(subs.lock().is_empty());
    }

    #[test]
    fn only_unplanned_and_retired_ends_move_threads() {
        assert_eq!(Cause::of(ExitReason::Crash), Some(Cause::Crash));
        assert_eq!(Cause::of(ExitReason::Fault), Some(Cause::Crash));
        assert_eq!(Cause::of(ExitReason::Hang), Some(Cause::Hang));
        assert_eq!(Cause::of(ExitReason::Memory), Some(Cause::Retired));
        assert_eq!(Cause::of(ExitReason::Idle), Some(Cause::Retired));
        assert_eq!(Cause::of(ExitReason::Stopped), None);
        assert_eq!(Cause::of(ExitReason::StartFail), None);
    }
}
