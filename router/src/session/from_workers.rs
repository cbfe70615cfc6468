//! The worker side of a session: frames from its legs, read in bursts so what they make the
//! session queue for its client goes out in one flush (answers to requests, which the session
//! rewrites back to the client's ids and learns thread owners from; notifications; server
//! requests), and a leg that closes (its requests answered `-32002`, its turns ended).

use proto::error::codes;
use proto::event::Event;
use proto::rpc::{self, Frame, Message as Rpc, RequestId};
use proto::Method;
use serde_json::json;
use serde_json::value::RawValue;
use tokio_tungstenite::tungstenite::Utf8Bytes;
use worker::WorkerId;

use super::audit::is_approval;
use super::legs::{self, LegEvent};
use super::routing::Learn;
use super::{rehome, server_requests, turns, Answer, End, Session, LEG_BURST, REPLAY_INIT_ID};
use crate::admission::{Reason, Scope};
use crate::metrics::ClientError;
use futures_util::StreamExt;
use std::borrow::Cow;
use std::task::Poll;

// === impl Session ===

impl Session {
    /// A frame from a leg, and then whatever else the legs have ready (up to [`LEG_BURST`]), so
    /// that what they make the session queue for its client goes out in one batch and one flush.
    pub(super) async fn on_leg_events(
        &mut self,
        first: LegEvent,
        legs: &mut legs::LegSet,
    ) -> Result<(), End> {
        self.on_leg_event(first).await?;
        for _ in 1..LEG_BURST {
            // Polled with this task's own context, so a leg with nothing ready is left waiting
            // on its socket for this task (not for a throwaway waker).
            let ready = std::future::poll_fn(|cx| Poll::Ready(legs.poll_next_unpin(cx))).await;
            match ready {
                Poll::Ready(Some(ev)) => self.on_leg_event(ev).await?,
                _ => break,
            }
        }
        Ok(())
    }

    pub(super) async fn on_leg_event(&mut self, ev: LegEvent) -> Result<(), End> {
        match ev {
            LegEvent::Frame(worker, text) => self.on_worker_frame(worker, &text).await,
            LegEvent::Closed(worker, reason) => self.on_leg_closed(worker, &reason),
            LegEvent::LargeFrame(worker) => {
                tracing::info!(%worker, "a worker's frame found the tenant's read buffers full");
                Err(End::LargeFrames)
            }
        }
    }

    pub(super) async fn on_worker_frame(
        &mut self,
        worker: WorkerId,
        shared: &Utf8Bytes,
    ) -> Result<(), End> {
        let text = shared.as_str();
        // An answer as app-server writes it is read by its head: its result (a whole thread for
        // `thread/read`) is parsed only where its content is needed.
        let (message, answer) = match rpc::result_head(text) {
            Some((id, result)) => (
                Rpc::Response { id },
                Answer {
                    result: Some(result),
                    error: None,
                    overloaded: false,
                },
            ),
            None => match Frame::parse(text) {
                Ok(f) => {
                    let answer = Answer {
                        result: f.result.map(RawValue::get),
                        error: f.error.map(RawValue::get),
                        overloaded: f.error_code() == Some(codes::OVERLOADED),
                    };
                    (f.message, answer)
                }
                Err(e) => {
                    tracing::warn!(%worker, error = %e, "dropping unparseable frame from worker");
                    return Ok(());
                }
            },
        };
        if self.replayed.contains(&worker) && self.replay_echo(worker, &message) {
            return Ok(());
        }
        match message {
            Rpc::Response { id } => self.on_worker_response(worker, id, answer, shared).await,
            Rpc::Request { id, method, params } => {
                self.ctx.tenant.counted.server_request(
                    &self.ctx.metrics.usage,
                    self.tenant(),
                    worker,
                    &id,
                    &method,
                );
                let approval = is_approval(method.as_str())
                    .then(|| self.audit_approval_request(worker, method.as_str(), params));
                let sid = match self.server_requests.insert(
                    worker,
                    id,
                    rpc::thread_id(params).map(Cow::into_owned),
                    approval.clone(),
                ) {
                    Ok(sid) => sid,
                    Err(server_requests::Full) => {
                        // Forgetting a prompt would let its decision pass unaudited: the
                        // session ends instead, and the prompt stays for its other subscribers.
                        tracing::warn!(
                            %worker,
                            pending = self.server_requests.approvals(),
                            "closing a session with too many approvals awaiting an answer"
                        );
                        if let Some(asked) = approval {
                            self.audit_approval_withdrawn(asked, "too_many_pending");
                        }
                        return Err(End::TooManyPrompts);
                    }
                };
                match rpc::with_id(text, &RequestId::Int(sid)) {
                    Some(t) => self.to_client(t),
                    None => Ok(()),
                }
            }
            Rpc::Notification { method, params } => {
                // Parsed once for everything below that reads a lifecycle or turn event
                // (`None` without parsing for any other method, deltas included).
                let event = Event::parse(&method, params);
                self.track_turns(event.as_ref());
                self.forget_ended_turn(worker, event.as_ref());
                self.ctx.tenant.counted.notification(
                    &self.ctx.metrics.usage,
                    self.tenant(),
                    &method,
                    params,
                    event.as_ref(),
                );
                if method == Method::ThreadClosed {
                    self.audit(
                        "thread.closed",
                        json!({
                            "thread": event.as_ref().map(|e| Cow::Borrowed(e.thread())).or_else(|| rpc::thread_id(params)),
                            "worker": worker.to_string(),
                        }),
                    );
                }
                if self.follow_notification(worker, &method, params, event.as_ref()) {
                    return Ok(());
                }
                if method.is_delta()
                    && (self.queued() >= self.soft_mark || self.queued_bytes.behind())
                {
                    // Behind: item/completed will carry the whole item, so the delta can go.
                    self.ctx.metrics.deltas_dropped.inc();
                    return Ok(());
                }
                if method == Method::ServerRequestResolved {
                    if let Some((sid, unanswered)) = rpc::params_request_id(params)
                        .and_then(|rid| self.server_requests.resolved(worker, rid))
                    {
                        if let Some(asked) = unanswered {
                            self.audit_approval_withdrawn(asked, "resolved");
                        }
                        if let Some(t) = rpc::with_params_request_id(text, &RequestId::Int(sid)) {
                            return self.to_client(t);
                        }
                    }
                }
                self.to_client(self.for_client(shared))
            }
        }
    }

    pub(super) async fn on_worker_response(
        &mut self,
        worker: WorkerId,
        id: RequestId,
        answer: Answer<'_>,
        shared: &Utf8Bytes,
    ) -> Result<(), End> {
        let text = shared.as_str();
        if matches!(&id, RequestId::Str(s) if s == REPLAY_INIT_ID) {
            if answer.result.is_some() {
                self.live.insert(worker);
            } else {
                tracing::warn!(%worker, response = text, "replayed initialize refused");
            }
            return Ok(());
        }
        if rehome::Following::is_own(&id) {
            return self.on_rehome_answer(worker, &id, answer.result.is_some(), text);
        }
        if let Some(merged) = self.fanout_answer(worker, &id, text) {
            return merged;
        }
        let rewritten = answer
            .overloaded
            .then(|| self.ctx.admission.rewrite_worker_overload(text))
            .flatten();
        if rewritten.is_some() {
            self.ctx
                .metrics
                .admission_rejections
                .with_label_values(&[Scope::Worker.as_str(), Reason::WorkerOverloaded.as_str()])
                .inc();
        }
        let flight = self.in_flight.remove(&id);
        if let Some(f) = &flight {
            self.counted
                .request_seconds
                .observe(f.since.elapsed().as_secs_f64());
        }
        if let Some(init) = self.init.as_mut().filter(|i| !i.answered && i.id == id) {
            if answer.result.is_some() {
                init.answered = true;
                self.live.insert(worker);
            } else {
                self.init = None; // refused: the client may try again
            }
        }
        if let Some(f) = flight {
            let event = match f.learn {
                Learn::NewThread => Some("thread.created"),
                Learn::Resume { .. } => Some("thread.resumed"),
                _ => None,
            };
            if let (Some(event), Some(result)) = (event, answer.result) {
                let result = rpc::first_value::<serde_json::Value>(result).unwrap_or_default();
                self.audit(
                    event,
                    json!({
                        "thread": result["thread"]["id"],
                        "forked_from": result["thread"].get("forkedFromId"),
                        "worker": worker.to_string(),
                    }),
                );
            }
            if let Some(retried) = self.learn(worker, &id, f, &answer).await {
                return retried;
            }
        }
        match rewritten {
            Some(t) => self.to_client(t),
            None => self.to_client(self.for_client(shared)),
        }
    }

    pub(super) fn on_leg_closed(&mut self, worker: WorkerId, reason: &str) -> Result<(), End> {
        tracing::info!(%worker, reason, "leg closed");
        self.legs.remove(&worker);
        self.live.remove(&worker);
        self.replayed.remove(&worker);
        self.ctx.tenant.reconcile_soon();
        if self.home == Some(worker) {
            self.home = None;
        }
        // The worker's prompts can no longer be answered through this session.
        for w in self.server_requests.forget_worker(worker) {
            if let Some(asked) = w.approval {
                self.audit_approval_withdrawn(asked, "worker_lost");
            }
            if let Some(thread) = w.thread {
                self.notify_client(crate::tenants::rehome::request_resolved_frame(
                    &thread, w.sid,
                ))?;
            }
        }
        self.moves_lost(worker)?;
        self.fanout_leg_closed(worker)?;
        let lost: Vec<RequestId> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.worker == worker)
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            self.in_flight.remove(&id);
            self.worker_gone_reply(&id)?;
        }
        if self.init.as_ref().is_some_and(|i| !i.answered) {
            self.init = None;
        }
        Ok(())
    }

    /// A turn of a thread on `worker` ended (app-server aborts its pending requests, and says so
    /// with `serverRequest/resolved` first): whatever of them is still remembered is forgotten.
    pub(super) fn forget_ended_turn(&mut self, worker: WorkerId, event: Option<&Event<'_>>) {
        if self.server_requests.by_session.is_empty() {
            return; // the common case, deltas included: nothing to look up
        }
        let Some((turns::Event::Ended, thread)) = event.and_then(turns::turn_of) else {
            return;
        };
        for w in self.server_requests.turn_ended(worker, thread) {
            if let Some(asked) = w.approval {
                self.audit_approval_withdrawn(asked, "turn_ended");
            }
        }
    }

    pub(super) fn worker_gone_reply(&self, id: &RequestId) -> Result<(), End> {
        self.count_error(ClientError::WorkerExited);
        self.to_client(proto::error::worker_exited_response(id))
    }
}
