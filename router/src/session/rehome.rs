//! A session's side of re-homing (see [`crate::tenants::rehome`]): which threads this client follows and
//! on which worker, the turn running on each, and what it does when the tenant orders a thread
//! of a worker that ended moved.
//!
//! For each thread it follows on the worker that ended, the session ends the running turn the
//! way app-server leaves such a turn (`interrupted`, with the reason), then resumes the thread
//! on the tenant's chosen worker on its own leg with the router's own request id; the answer is
//! not forwarded, and the new worker's restated `thread/status/changed` is held back until it
//! arrives, so a client whose thread moved while idle sees nothing at all. Nothing is retried
//! on the client's behalf. When no worker can take the thread, or the resume fails, the client
//! gets what a single app-server's death would have meant for the thread: `systemError`, then
//! `thread/closed`.

use std::borrow::Cow;
use std::sync::Arc;

use proto::event::Event;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::Instant;
use worker::WorkerId;

use super::{End, Session};
use crate::tenants::rehome::{self, Cause, Outcome, Rehome, Subscription};
use proto::rpc::{self, RequestId};
use proto::Method;

/// Prefix of the ids of the router's own resumes on legs; their answers are swallowed.
pub(super) const REHOME_ID_PREFIX: &str = "codex-fleet:rehome:";
/// Notifications (besides `thread/status/changed`) a resume makes app-server send about the
/// thread, to the resuming connection or to all.
const MOVE_ECHOES: [&str; 2] = ["thread/goal/cleared", "thread/tokenUsage/updated"];

/// A thread this session follows: where it is loaded, the turn running on it (a copy of its
/// `turn/started` params, parsed only if the turn must be ended for the client; a copy, not the
/// frame, which may share a whole read buffer for as long as the turn runs), and its place in the
/// tenant's subscriber count.
#[derive(Debug)]
pub(super) struct Followed {
    worker: WorkerId,
    turn: Option<Box<RawValue>>,
    _counted: Subscription,
}

/// A resume the router sent to move a followed thread.
#[derive(Debug)]
pub(super) struct Moving {
    thread: Arc<str>,
    to: WorkerId,
    cause: Cause,
    since: Instant,
}

/// The threads a session follows and the moves under way.
#[derive(Debug, Default)]
pub(super) struct Following {
    threads: super::Map<String, Followed>,
    moving: super::Map<RequestId, Moving>,
    /// Threads just resumed by a move on a worker, whose replayed `thread/tokenUsage/updated`
    /// (app-server restates the last usage to a connection that resumes) is still to come.
    usage_replays: super::Set<(String, WorkerId)>,
    next: u64,
}

impl Following {
    /// Whether `id` is one of the router's re-home resumes.
    pub(super) fn is_own(id: &RequestId) -> bool {
        matches!(id, RequestId::Str(s) if s.starts_with(REHOME_ID_PREFIX))
    }

    /// Whether `thread` is being moved to `worker` now (its restated status is held back).
    fn moving_to(&self, thread: &str, worker: Option<WorkerId>) -> bool {
        self.moving
            .values()
            .any(|m| &*m.thread == thread && worker.is_none_or(|w| w == m.to))
    }
}

// === impl Session: re-homing ===

impl Session {
    /// The client now follows `thread` on `worker` (a `thread/start`, `thread/fork` or
    /// `thread/resume` it sent was answered there).
    pub(super) fn follow(&mut self, thread: &str, worker: WorkerId) {
        match self.following.threads.get_mut(thread) {
            Some(f) => f.worker = worker,
            None => {
                let counted = self.ctx.tenant.subscribers.subscribe(thread);
                self.following.threads.insert(
                    thread.to_owned(),
                    Followed {
                        worker,
                        turn: None,
                        _counted: counted,
                    },
                );
            }
        }
    }

    /// The client stopped following `thread` (`thread/unsubscribe` answered, or it closed).
    pub(super) fn unfollow(&mut self, thread: &str) {
        self.following.threads.remove(thread);
    }

    /// Tracks, from a worker's notification on a leg, the turn running on a followed thread and
    /// threads that closed. Returns `true` when the frame must not reach the client: an echo of
    /// a move (see [`Session::is_move_echo`]).
    pub(super) fn follow_notification(
        &mut self,
        worker: WorkerId,
        method: &Method<'_>,
        params: Option<&RawValue>,
        event: Option<&Event<'_>>,
    ) -> bool {
        match method {
            Method::TurnStarted | Method::TurnCompleted | Method::ThreadClosed => {
                if let Some(event) = event.filter(|_| !self.following.threads.is_empty()) {
                    self.follow_turn(worker, params, event);
                }
                false
            }
            Method::ThreadStatusChanged => self.is_move_echo(worker, method, params, event),
            Method::Other(name) if MOVE_ECHOES.contains(&name.as_ref()) => {
                self.is_move_echo(worker, method, params, event)
            }
            _ => false,
        }
    }

    /// `event` is the notification's, parsed once where it arrived.
    fn follow_turn(&mut self, worker: WorkerId, params: Option<&RawValue>, event: &Event<'_>) {
        let thread = event.thread();
        let Some(f) = self
            .following
            .threads
            .get_mut(thread)
            .filter(|f| f.worker == worker)
        else {
            return;
        };
        match event {
            Event::TurnStarted { .. } => {
                f.turn = params.map(ToOwned::to_owned);
                self.following
                    .usage_replays
                    .remove(&(thread.to_owned(), worker));
            }
            Event::TurnCompleted { .. } => f.turn = None,
            Event::ThreadClosed { .. } => self.unfollow(thread),
            Event::ThreadStarted { .. } | Event::ThreadStatusChanged { .. } => {}
        }
    }

    /// Whether a notification from `worker` is an echo of a move rather than news: anything
    /// about a thread this session is moving there, the usage app-server replays to the
    /// connection that resumed it, and while the tenant moves a thread, the restated idle status
    /// and cleared goal the other sessions' resumes make the new worker broadcast.
    fn is_move_echo(
        &mut self,
        worker: WorkerId,
        method: &Method<'_>,
        params: Option<&RawValue>,
        event: Option<&Event<'_>>,
    ) -> bool {
        // The parsed event names the thread as `params.threadId` does; other methods (and
        // params the event parse refused) read it from the params.
        let Some(thread) = event
            .map(|e| Cow::Borrowed(e.thread()))
            .or_else(|| rpc::thread_id(params))
        else {
            return false;
        };
        if self.following.moving_to(&thread, Some(worker)) {
            return true;
        }
        if method == "thread/tokenUsage/updated" {
            let replay = (thread.into_owned(), worker);
            return self.following.usage_replays.remove(&replay);
        }
        let status = match event {
            Some(Event::ThreadStatusChanged { status, .. }) => Some(status.as_ref()),
            _ => None,
        };
        rehome::is_move_echo(method.as_str(), status) && self.ctx.tenant.moves.quiet(&thread)
    }

    /// Whether a relayed broadcast is an echo of a move, held back like the same frame on a leg
    /// (the tenant read its thread and kind once: [`crate::tenants::Relayed::status_of`]).
    pub(super) fn holds_back_relayed(&self, relayed: &crate::tenants::Relayed) -> bool {
        let Some((thread, echo)) = &relayed.status_of else {
            return false;
        };
        self.following.moving_to(thread, Some(relayed.worker))
            || (*echo && self.ctx.tenant.moves.quiet(thread))
    }

    /// The tenant's order about a thread of a worker that ended.
    pub(super) async fn on_rehome(&mut self, order: &Rehome) -> Result<(), End> {
        let followed = self
            .following
            .threads
            .get_mut(&*order.thread)
            .filter(|f| f.worker == order.from);
        let Some(followed) = followed else {
            // Not following it: a moved thread never left; one that is gone is news, and so is
            // the end of the turn it was running (this client saw it active).
            if order.to.is_none() {
                return self.thread_closed(&order.thread);
            }
            if order.was_active && self.init.as_ref().is_some_and(|i| i.answered) {
                return self.notify_client(rehome::thread_idle_frame(&order.thread));
            }
            return Ok(());
        };
        match followed.turn.take().and_then(|p| started_turn(&p)) {
            Some(turn) => {
                let frames = rehome::turn_ended_frames(
                    &order.thread,
                    &turn,
                    order.cause.turn_message(),
                    rehome::now_ms(),
                );
                for frame in frames {
                    self.notify_client(frame)?;
                }
            }
            // A turn ran but its `turn/started` never reached this session: the worker died
            // before writing it to this leg (each connection has its own queue in app-server,
            // and a SIGKILL drops what is unwritten). The client may have seen the thread go
            // active through the relay; without the turn there is nothing to end, but the
            // thread must not stay active for it.
            None if order.was_active => {
                self.notify_client(rehome::thread_idle_frame(&order.thread))?;
            }
            None => {}
        }
        let Some(to) = order.to else {
            self.moved(&order.thread, order.cause, Outcome::NoWorker, None);
            self.unfollow(&order.thread);
            return self.thread_closed(&order.thread);
        };
        match self.send_resume(order, to).await {
            Ok(()) => Ok(()),
            Err(why) => {
                tracing::warn!(tenant = %self.ctx.tenant.id, thread = %crate::untrusted::Untrusted::text(&order.thread), worker = %to, why,
                    "cannot resume the thread of a worker that ended; closing it for this client");
                self.moved(&order.thread, order.cause, Outcome::ResumeFailed, None);
                self.unfollow(&order.thread);
                self.thread_closed(&order.thread)
            }
        }
    }

    async fn send_resume(&mut self, order: &Rehome, to: WorkerId) -> Result<(), &'static str> {
        if !self.legs.contains_key(&to) {
            let handle = self
                .ctx
                .tenant
                .pool
                .get(to)
                .ok_or("the chosen worker is gone")?;
            self.open_leg(handle)
                .await
                .map_err(|_| "no leg to the chosen worker")?;
        }
        self.following.next += 1;
        let id = RequestId::Str(format!("{REHOME_ID_PREFIX}{}", self.following.next));
        // Without the history: the client has it, and asking for it draws a deprecation notice.
        let params =
            serde_json::json!({ "threadId": &*order.thread, "excludeTurns": true }).to_string();
        let params = RawValue::from_string(params).map_err(|_| "unencodable thread id")?;
        let request = rpc::request(&id, Method::ThreadResume.as_str(), Some(&params));
        self.following.moving.insert(
            id.clone(),
            Moving {
                thread: order.thread.clone(),
                to,
                cause: order.cause,
                since: order.since,
            },
        );
        if !self.send_to_leg(to, request) {
            self.following.moving.remove(&id);
            return Err("the leg to the chosen worker closed");
        }
        Ok(())
    }

    /// The answer to one of the router's re-home resumes (never forwarded).
    pub(super) fn on_rehome_answer(
        &mut self,
        worker: WorkerId,
        id: &RequestId,
        ok: bool,
        text: &str,
    ) -> Result<(), End> {
        let Some(moving) = self.following.moving.remove(id) else {
            return Ok(());
        };
        if ok && worker == moving.to {
            self.ctx.tenant.pool.learn(&moving.thread, worker);
            self.follow(&moving.thread, worker);
            self.following
                .usage_replays
                .insert((moving.thread.to_string(), worker));
            self.moved(
                &moving.thread,
                moving.cause,
                Outcome::Rehomed,
                Some(moving.since),
            );
            tracing::info!(tenant = %self.ctx.tenant.id, thread = %crate::untrusted::Untrusted::text(&moving.thread), %worker,
                cause = moving.cause.as_str(), "thread re-homed after its worker ended");
            return Ok(());
        }
        tracing::warn!(tenant = %self.ctx.tenant.id, thread = %crate::untrusted::Untrusted::text(&moving.thread), %worker, response = text,
            "resume of the thread of a worker that ended failed; closing it for this client");
        self.moved(&moving.thread, moving.cause, Outcome::ResumeFailed, None);
        self.unfollow(&moving.thread);
        self.thread_closed(&moving.thread)
    }

    /// The re-home resumes that were on a leg that closed: those threads are lost for this
    /// client.
    pub(super) fn moves_lost(&mut self, worker: WorkerId) -> Result<(), End> {
        let lost: Vec<RequestId> = self
            .following
            .moving
            .iter()
            .filter(|(_, m)| m.to == worker)
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            self.on_rehome_answer(worker, &id, false, "leg closed")?;
        }
        Ok(())
    }

    fn thread_closed(&self, thread: &str) -> Result<(), End> {
        if self.init.as_ref().is_none_or(|i| !i.answered) {
            return Ok(());
        }
        for frame in rehome::thread_closed_frames(thread, "systemError") {
            self.notify_client(frame)?;
        }
        Ok(())
    }

    fn moved(&self, thread: &str, cause: Cause, outcome: Outcome, since: Option<Instant>) {
        self.ctx.tenant.moves.settle(thread);
        let tenant = self.ctx.tenant.id.as_str();
        self.ctx
            .metrics
            .thread_rehomes
            .with_label_values(&[tenant, cause.as_str(), outcome.as_str()])
            .inc();
        if let Some(since) = since {
            self.ctx
                .metrics
                .rehome_seconds
                .with_label_values(&[tenant])
                .observe(since.elapsed().as_secs_f64());
        }
    }
}

/// The turn object `turn/started` params carry (null if they have none).
fn started_turn(params: &RawValue) -> Option<Value> {
    let mut params = serde_json::from_str::<Value>(params.get()).ok()?;
    Some(params.get_mut("turn").map_or(Value::Null, Value::take))
}
