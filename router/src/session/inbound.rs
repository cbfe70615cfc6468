//! The inbound pipeline: a client frame is parsed once, passes one gate (the connection's frame
//! rate, the tenant's admission, the host-access policy), is routed and dispatched to its
//! worker's leg, or parks for a worker slot.

use std::borrow::Cow;
use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;
use serde_json::value::RawValue;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use super::routing::Learn;
use super::{
    fanout, rehome, turns, End, InFlight, Init, Parked, Session, MAX_PROTOCOL_ERRORS,
    REPLAY_INIT_ID, SESSION_IN_FLIGHT_RETRY, TURN_COUNT_SETTLED,
};
use proto::error::codes;
use proto::rpc::{self, Frame, Message as Rpc, RequestId};
use proto::Method;

use crate::admission::{InFlightPermit, Reason, Rejection, Scope};
use crate::metrics::{ClientError, CostlyStep, RouterMetrics};
use crate::offload::{self, LARGE_FRAME_BYTES};
use crate::policy::{self, Decision};
use crate::untrusted::Untrusted;

// === impl Session ===

impl Session {
    /// Answers a refused request with `-32001` and counts the refusal.
    pub(super) fn reject(&self, id: &RequestId, r: &Rejection) -> Result<(), End> {
        self.ctx.metrics.rejected_for(self.tenant(), r);
        self.to_client(r.to_error_response(id))
    }

    /// A cap-style refusal with the configured back-off.
    pub(super) fn cap(&self, scope: Scope, reason: Reason) -> Rejection {
        let back_off = Duration::from_millis(self.ctx.admission.config().cap_retry_after_ms);
        Rejection::cap(scope, reason, back_off)
    }

    /// At the active-turn cap, asks the workers' own view (their control legs see every
    /// thread) before refusing, so a turn that ended while no session of the tenant was there
    /// to see it does not hold a slot until `active_turn_ttl_secs`.
    pub(super) fn reconcile_turns(&self) {
        let admission = &self.ctx.admission;
        if admission.active_turns(self.tenant()) < admission.config().max_active_turns_per_tenant {
            return;
        }
        let running = self
            .ctx
            .tenant
            .pool
            .workers()
            .iter()
            .map(|w| w.active_turns)
            .sum();
        admission.reconcile_turns(self.tenant(), running, TURN_COUNT_SETTLED);
    }

    /// Records turn starts and ends for the tenant's active-turn cap (idempotent, so a turn
    /// seen on a leg and relayed from the control leg counts once).
    pub(super) fn track_turns(&self, event: Option<&proto::event::Event<'_>>) {
        if let Some((event, thread)) = event.and_then(turns::turn_of) {
            match event {
                turns::Event::Started => self.ctx.admission.turn_started(self.tenant(), thread),
                turns::Event::Ended => self.ctx.admission.turn_ended(self.tenant(), thread),
            }
        }
    }

    pub(super) fn reply_error(
        &self,
        id: Option<&RequestId>,
        code: i64,
        message: &str,
        data: Option<serde_json::Value>,
    ) -> Result<(), End> {
        self.to_client(rpc::error_response(id, code, message, data))
    }

    pub(super) async fn on_client_frame(
        &mut self,
        frame: Option<Result<Message, WsError>>,
    ) -> Result<(), End> {
        // The client's socket read a message whole: its read buffer is at least that large for
        // as long as the session lives (an unfinished one is counted as it arrives).
        if let Some(Ok(m)) = &frame {
            if !crate::door::took(&self.client_read, m) {
                tracing::info!(
                    len = m.len(),
                    "a client's frame found the tenant's read buffers full"
                );
                return Err(End::LargeFrames);
            }
        }
        let text = match frame {
            None | Some(Ok(Message::Close(_))) => return Err(End::ClientGone),
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(Message::Binary(_))) => {
                self.check_unanswerable_frame()?;
                self.count_error(ClientError::BinaryFrame);
                self.reply_error(
                    None,
                    codes::INVALID_REQUEST,
                    "Invalid request: binary frames are not supported; send JSON-RPC as text frames",
                    None,
                )?;
                return self.protocol_error();
            }
            Some(Ok(_)) => {
                // Ping and pong (answered by the WebSocket layer) cost a write each: they count
                // against the frame rate like any frame that cannot get a `-32001`.
                return self.check_unanswerable_frame();
            }
            Some(Err(WsError::Capacity(_))) => {
                self.count_error(ClientError::TooBig);
                return Err(End::TooBig);
            }
            Some(Err(_)) if self.client_read.refused() => {
                tracing::info!(
                    "a client's unfinished message found the tenant's read buffers full"
                );
                return Err(End::LargeFrames);
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "client read error");
                return Err(End::ClientGone);
            }
        };
        self.counted.client_frames.inc();
        let parsed = if text.len() > LARGE_FRAME_BYTES {
            // Rare, so boxed: it adds little to every session's future.
            Box::pin(self.parse_large(&text)).await?
        } else {
            parse(&text)
        };
        let (msg, thread) = match parsed {
            Ok(parsed) => parsed,
            Err(e) => {
                self.check_unanswerable_frame()?;
                self.count_error(ClientError::InvalidMessage);
                self.reply_error(e.id(), e.code(), &e.to_string(), None)?;
                return self.protocol_error();
            }
        };
        self.protocol_errors = 0;
        if !matches!(msg, Rpc::Request { .. }) {
            self.check_unanswerable_frame()?;
        }
        match msg {
            Rpc::Request { id, method, params } => {
                if crate::admission::starts_a_turn(method.as_str()) {
                    self.reconcile_turns();
                }
                let admitted = self.guard.check_frame().and_then(|()| {
                    self.ctx.admission.check_request(
                        &mut self.guard,
                        method.as_str(),
                        thread.as_deref(),
                    )
                });
                if let Err(r) = admitted {
                    return self.reject(&id, &r);
                }
                let decision = match self.ctx.tenant.policy.check_inline(
                    method.as_str(),
                    params,
                    &self.ctx.tenant.roots,
                ) {
                    Some(decision) => decision,
                    // Rare, so boxed whole: it adds nothing to every session's future.
                    None => {
                        return Box::pin(self.on_costly_request(id, &method, params, thread, &text))
                            .await
                    }
                };
                let Some(text) = self.on_decided(decision, &id, &method, &text)? else {
                    return Ok(());
                };
                self.on_client_request(id, &method, thread, text).await
            }
            Rpc::Notification { method, .. } => self.on_client_notification(&method, &text).await,
            Rpc::Response { id } => self.on_client_response(id, &text).await,
        }
    }

    /// [`parse`] of a frame over [`LARGE_FRAME_BYTES`]: tens of milliseconds for the largest
    /// (about 110 ms for 32 MiB of escaped text, scaled from a 42 MB frame's 142 ms), which on a
    /// runtime thread every session it serves would wait out. The runtime thread's other work is
    /// handed to another thread first (`block_in_place`), as a costly step
    /// ([`Session::costly_permits`]), so a tenant sending large frames on many connections takes
    /// a core's share, not every runtime thread.
    async fn parse_large<'t>(&self, text: &'t str) -> Result<ParsedFrame<'t>, End> {
        let permits = self.costly_permits(CostlyStep::Parse).await?;
        let parsed = offload::in_place(|| parse(text));
        drop(permits);
        self.still_admitted()?;
        Ok(parsed)
    }

    /// The two permits a costly step of a request takes before it runs off the runtime: its
    /// tenant's (one at a time per tenant, so a tenant's costly steps wait for each other), then
    /// the process's ([`crate::admission::Admission::costly_work`], so all tenants' together take
    /// at most half the cores and the memory of that many at once; a tenant waits there with one
    /// step at most, so tenants take turns). The session waits for them, and for the step,
    /// itself: its client's next frames wait, and the tenant's other costly steps. The session
    /// ends instead if the fleet shuts down or its credential ends first
    /// ([`Session::until_ended`]). Counted, with the wait, in `codex_fleet_costly_steps_total`
    /// and `codex_fleet_costly_wait_seconds_total`.
    async fn costly_permits(&self, step: CostlyStep) -> Result<CostlyPermits, End> {
        let waiting = CostlyWait::start(&self.ctx.metrics, self.tenant());
        let permits = self
            .until_ended(async {
                let tenant = self.ctx.tenant.costly_work.clone().acquire_owned().await;
                let all = self.ctx.admission.costly_work().acquire_owned().await;
                tenant.ok().zip(all.ok())
            })
            .await?
            // Neither semaphore is ever closed; were one, the session would end as at shutdown.
            .ok_or(End::Shutdown)?;
        drop(waiting);
        self.ctx
            .metrics
            .costly_steps
            .with_label_values(&[self.tenant(), step.as_str()])
            .inc();
        Ok(permits)
    }

    /// `work`'s output, unless the fleet shuts down or the session's credential ends first
    /// (either wins over `work` when both are ready): a session waiting out a costly step
    /// ([`Session::costly_permits`]) reads nothing, so its run loop would not see either until
    /// the wait is over. (On a node the edge holds the credential: a request it passed on
    /// before the credential ended is, to the node, a request in flight.)
    async fn until_ended<T>(&self, work: impl std::future::Future<Output = T>) -> Result<T, End> {
        tokio::select! {
            biased;
            () = self.ctx.shutdown.cancelled() => Err(End::Shutdown),
            end = self.ctx.lease.ended() => Err(End::from(end)),
            out = work => Ok(out),
        }
    }

    /// `Err` if the session's credential ended, as its run loop would find: checked after a
    /// costly step (one that runs in place, [`Session::parse_large`], nothing interrupts; an
    /// expiry's timer may not have fired when the check's answer comes), so a request admitted
    /// before its credential ended does not go out after it.
    fn still_admitted(&self) -> Result<(), End> {
        self.ctx
            .lease
            .ended_now()
            .map_or(Ok(()), |end| Err(End::from(end)))
    }

    /// Acts on the host-access policy's decision: the frame to forward (the client's own bytes,
    /// shared, unless the policy rewrote them), or `None` once a refusal is answered.
    fn on_decided(
        &mut self,
        decision: Decision,
        id: &RequestId,
        method: &Method<'_>,
        text: &Utf8Bytes,
    ) -> Result<Option<Utf8Bytes>, End> {
        match decision {
            Decision::Allow => Ok(Some(text.clone())),
            Decision::Rewrite(p) => Ok(Some(
                policy::rewritten_request(id, method.as_str(), &p)
                    .map_or_else(|| text.clone(), Utf8Bytes::from),
            )),
            Decision::Deny(denial) => {
                self.count_error(ClientError::HostAccessDenied);
                let shown = Untrusted::method(method.as_str());
                // Logged and recorded at a bounded rate per tenant (`audit::denials`), counted
                // in `codex_fleet_client_errors_total` every time, and by this session until
                // one of its records carries the count.
                if self.ctx.tenant.denial_records.admit() {
                    let suppressed = std::mem::take(&mut self.denials_suppressed);
                    tracing::info!(method = %shown, policy = denial.class.as_str(), suppressed, "request denied by host-access policy");
                    let mut record =
                        json!({ "method": shown.json(), "policy": denial.class.as_str() });
                    if suppressed > 0 {
                        record["suppressed"] = json!(suppressed);
                    }
                    self.audit("access.denied", record);
                } else {
                    self.denials_suppressed += 1;
                }
                self.to_client(denial.to_error_response(id)).map(|()| None)
            }
            Decision::Invalid(message) => {
                // Malformed, as app-server would answer it: not a policy refusal.
                self.count_error(ClientError::InvalidMessage);
                self.to_client(proto::error::invalid_request_response(Some(id), &message))
                    .map(|()| None)
            }
        }
    }

    /// A request whose host-access check is too costly for a thread that serves other sessions:
    /// checked off the runtime ([`Session::check_off_runtime`]), then handled as any other.
    async fn on_costly_request(
        &mut self,
        id: RequestId,
        method: &Method<'_>,
        params: Option<&RawValue>,
        thread: Option<Cow<'_, str>>,
        text: &Utf8Bytes,
    ) -> Result<(), End> {
        let decision = self
            .check_off_runtime(text, method.as_str(), params)
            .await?;
        let Some(text) = self.on_decided(decision, &id, method, text)? else {
            return Ok(());
        };
        self.on_client_request(id, method, thread, text).await
    }

    /// The host-access check of a request too costly for a thread that serves other sessions
    /// ([`HostAccessPolicy::check_inline`](crate::policy::HostAccessPolicy::check_inline)), run
    /// on the blocking pool as a costly step ([`Session::costly_permits`]).
    async fn check_off_runtime(
        &self,
        text: &Utf8Bytes,
        method: &str,
        params: Option<&RawValue>,
    ) -> Result<Decision, End> {
        // The params are found again in the shared frame rather than copied (they can be 32 MiB);
        // they always lie in it, as the parse borrows them.
        let params = params.map(|p| place_in(text.as_str(), p.get()).ok_or_else(|| p.to_owned()));
        let (tenant, text, method) = (self.ctx.tenant.clone(), text.clone(), method.to_owned());
        let permits = self.costly_permits(CostlyStep::Check).await?;
        let checked = tokio::task::spawn_blocking(move || {
            let _permits = permits;
            let params = match &params {
                None => None,
                Some(Ok(at)) => match serde_json::from_str::<&RawValue>(&text.as_str()[at.clone()])
                {
                    Ok(p) => Some(p),
                    Err(_) => {
                        return Decision::Invalid("Invalid request: unreadable params".into())
                    }
                },
                Some(Err(copied)) => Some(&**copied),
            };
            tenant.policy.check(&method, params, &tenant.roots)
        });
        // A check already running ends on its own, and frees its permits then.
        match self.until_ended(checked).await? {
            // A credential that expired as the check ended: its timer may not have fired yet.
            Ok(decision) => self.still_admitted().map(|()| decision),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down.
            Err(_) => Err(End::Shutdown),
        }
    }

    /// The frame rate for frames that cannot get a `-32001` (notifications, responses, bad
    /// frames): over it, the connection is closed rather than the frame dropped silently.
    pub(super) fn check_unanswerable_frame(&self) -> Result<(), End> {
        self.guard.check_frame().map_err(|r| {
            self.ctx.metrics.rejected_for(self.tenant(), &r);
            tracing::info!("closing a connection that floods notifications or responses");
            End::Flooded
        })
    }

    pub(super) fn protocol_error(&mut self) -> Result<(), End> {
        self.protocol_errors += 1;
        if self.protocol_errors >= MAX_PROTOCOL_ERRORS {
            return Err(End::ProtocolErrors);
        }
        Ok(())
    }

    pub(super) async fn on_client_request(
        &mut self,
        id: RequestId,
        method: &Method<'_>,
        thread: Option<Cow<'_, str>>,
        mut text: Utf8Bytes,
    ) -> Result<(), End> {
        if let Some(why) = self.unusable_id(&id) {
            self.count_error(why);
            let message = match why {
                ClientError::DuplicateId => "Invalid request: duplicate request id; an earlier request with this id is still in flight",
                _ => "Invalid request: this request id is reserved by codex-fleet",
            };
            return self.reply_error(Some(&id), codes::INVALID_REQUEST, message, None);
        }
        let first_initialize = *method == Method::Initialize && self.init.is_none();
        if first_initialize {
            let params = serde_json::from_str::<serde_json::Value>(&text)
                .map(|mut v| v["params"].take())
                .unwrap_or_default();
            let info = &params["clientInfo"];
            self.audit(
                "session.initialized",
                json!({
                    "client_name": Untrusted::value(&info["name"]),
                    "client_version": Untrusted::value(&info["version"]),
                }),
            );
            // The client's own opt-outs, for what codex-fleet sends it; its legs send more.
            let opt_out = opt_outs(&params["capabilities"]["optOutNotificationMethods"]);
            if let Some(for_legs) = Self::initialize_for_legs(&text, params) {
                text = Utf8Bytes::from(for_legs);
            }
            self.init = Some(Init {
                id: id.clone(),
                text: text.to_string(),
                answered: false,
                initialized: false,
                opt_out,
            });
        } else if self.init.is_none() {
            self.count_error(ClientError::NotInitialized);
            return self.reply_error(Some(&id), codes::INVALID_REQUEST, "Not initialized", None);
        }
        if self.in_flight.len() >= self.ctx.admission.config().max_in_flight_per_connection {
            let r = Rejection::cap(
                Scope::Connection,
                Reason::TooManyRequestsInFlight,
                SESSION_IN_FLIGHT_RETRY,
            );
            return self.reject(&id, &r);
        }
        let target = self.target(method, thread.as_deref());
        // The leg at hand without a future; only opening one is awaited, boxed, so a request's
        // future does not carry the opening's state (see `Leg::open`).
        let worker = match self.leg_at_hand(&target) {
            Some(w) => Ok(w),
            None => Box::pin(self.leg_for(target, *method == Method::ThreadResume)).await,
        };
        let worker = match worker {
            Ok(w) => w,
            Err(reason) => {
                if first_initialize {
                    self.init = None;
                }
                self.count_error(ClientError::NoWorker);
                let scope = match reason {
                    Reason::FleetWorkerLimit => Scope::Fleet,
                    _ => Scope::Worker,
                };
                return self.reject(&id, &self.cap(scope, reason));
            }
        };
        let learn = match (method, thread) {
            (Method::ThreadStart | Method::ThreadFork, _) => Learn::NewThread,
            (Method::ThreadResume, Some(thread)) => Learn::Resume {
                thread: thread.into_owned(),
                retry: Some(text.to_string()),
            },
            (Method::ThreadUnsubscribe, Some(thread)) => Learn::Unsubscribe {
                thread: thread.into_owned(),
            },
            (m, _) => fanout::Merge::of(m).map_or(Learn::Nothing, Learn::FanOut),
        };
        let parked = Parked {
            id,
            worker,
            text,
            learn,
            first_initialize,
        };
        let slot = match self.legs.get_mut(&worker) {
            Some(leg) => self.ctx.admission.try_slot(leg.slots()),
            None => self.ctx.admission.try_worker_slot(worker),
        };
        match slot {
            Ok(slot) => self.dispatch(parked, slot).await,
            Err(_) => {
                self.parked = Some(parked);
                Ok(())
            }
        }
    }

    /// Why a client request's id cannot be used, as a `client_errors` reason: it is still in
    /// flight (its answer would be delivered to the wrong request, and a second entry would
    /// free the first one's worker slot), or it is the router's own id on legs (its answer
    /// would be swallowed and the request never answered).
    pub(super) fn unusable_id(&self, id: &RequestId) -> Option<ClientError> {
        if matches!(id, RequestId::Str(s) if s == REPLAY_INIT_ID || s.starts_with(fanout::ID_PREFIX))
            || rehome::Following::is_own(id)
        {
            Some(ClientError::ReservedId)
        } else if self.in_flight.contains_key(id) {
            Some(ClientError::DuplicateId)
        } else {
            None
        }
    }

    /// The parked request got a worker slot, or waited as long as it may.
    pub(super) async fn unpark(
        &mut self,
        slot: Result<InFlightPermit, Rejection>,
    ) -> Result<(), End> {
        let Some(parked) = self.parked.take() else {
            return Ok(());
        };
        match slot {
            Ok(slot) => self.dispatch(parked, slot).await,
            Err(r) => {
                if parked.first_initialize {
                    self.init = None;
                }
                self.reject(&parked.id, &r)
            }
        }
    }

    /// Sends an admitted request to its worker, holding its slot until the answer.
    pub(super) async fn dispatch(&mut self, req: Parked, slot: InFlightPermit) -> Result<(), End> {
        let Parked {
            id,
            worker,
            text,
            learn,
            first_initialize,
        } = req;
        let fan_out = learn.fan_out();
        self.in_flight.insert(
            id.clone(),
            InFlight {
                worker,
                since: Instant::now(),
                learn,
                _slot: Some(slot),
            },
        );
        if let Some(merge) = fan_out {
            // Boxed: rare, and the request's future would carry its state on every round trip
            // otherwise (see `Leg::open`).
            return Box::pin(self.fan_out(&id, worker, merge, &text)).await;
        }
        let sent = self
            .legs
            .get_mut(&worker)
            .is_some_and(|leg| leg.send_shared(&text));
        if !sent {
            self.in_flight.remove(&id);
            if first_initialize {
                self.init = None;
            }
            return self.worker_gone_reply(&id);
        }
        self.init_sent |= first_initialize;
        Ok(())
    }

    pub(super) async fn on_client_notification(
        &mut self,
        method: &Method<'_>,
        text: &str,
    ) -> Result<(), End> {
        let Some(init) = self.init.as_mut() else {
            // app-server ignores notifications before initialize; so do we.
            return Ok(());
        };
        if *method == Method::Initialized {
            init.initialized = true;
        }
        let shared = Utf8Bytes::from(text);
        for leg in self.legs.values_mut() {
            leg.send(shared.clone());
        }
        Ok(())
    }

    pub(super) async fn on_client_response(
        &mut self,
        id: RequestId,
        text: &str,
    ) -> Result<(), End> {
        let RequestId::Int(sid) = id else {
            self.count_error(ClientError::UnknownResponse);
            return Ok(());
        };
        let Some((worker, original, approval)) = self.server_requests.take(sid) else {
            // Never sent, or already answered: app-server would ignore it; we count and drop it.
            self.count_error(ClientError::UnknownResponse);
            return Ok(());
        };
        // Parsed once: the usage count and the audit log read the same result.
        let frame = Frame::parse(text).ok();
        let (result, error) = frame.as_ref().map_or((None, None), |f| (f.result, f.error));
        self.ctx.tenant.counted.answer(
            &self.ctx.metrics.usage,
            self.tenant(),
            worker,
            &original,
            result,
        );
        if let Some(asked) = approval {
            self.audit_approval_answer(asked, result, error).await;
        }
        if let Some(text) = rpc::with_id(text, &original) {
            self.send_to_leg(worker, text);
        }
        Ok(())
    }
}

/// The most notification methods a client's opt-out keeps (the pinned app-server sends 87; the
/// rest of a longer list is ignored), and the longest name it keeps (longer ones name no method):
/// the set lives as long as the session, so a client cannot make it large.
const MAX_OPT_OUTS: usize = 256;
const MAX_OPT_OUT_NAME: usize = 128;

/// `optOutNotificationMethods` of a client's initialize, as app-server reads it: exact names,
/// anything but a list of strings ignored.
fn opt_outs(list: &serde_json::Value) -> HashSet<Box<str>> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .filter(|name| name.len() <= MAX_OPT_OUT_NAME)
        .take(MAX_OPT_OUTS)
        .map(Box::from)
        .collect()
}

/// The permits a costly step holds while it runs: its tenant's, then the process's.
type CostlyPermits = (OwnedSemaphorePermit, OwnedSemaphorePermit);

/// A session's wait for a costly step's turn: in `codex_fleet_costly_waiting` while it lasts,
/// and in `codex_fleet_costly_wait_seconds_total` when it ends, however it ends.
struct CostlyWait {
    waiting: prometheus::IntGauge,
    waited: prometheus::Counter,
    since: Instant,
}

impl CostlyWait {
    fn start(metrics: &RouterMetrics, tenant: &str) -> CostlyWait {
        let waiting = metrics.costly_waiting.with_label_values(&[tenant]);
        waiting.inc();
        CostlyWait {
            waiting,
            waited: metrics.costly_wait_seconds.with_label_values(&[tenant]),
            since: Instant::now(),
        }
    }
}

impl Drop for CostlyWait {
    fn drop(&mut self) {
        self.waiting.dec();
        self.waited.inc_by(self.since.elapsed().as_secs_f64());
    }
}

/// A client frame parsed: the message, and a request's `threadId`.
type ParsedFrame<'t> = Result<(Rpc<'t>, Option<Cow<'t, str>>), rpc::ParseError>;

/// Parses a client frame: its envelope, and a request's `threadId` (each a pass over the params).
fn parse(text: &str) -> ParsedFrame<'_> {
    let msg = rpc::parse(text)?;
    let thread = match &msg {
        Rpc::Request { params, .. } => rpc::thread_id(*params),
        _ => None,
    };
    Ok((msg, thread))
}

/// Where `part`, a slice of `whole`, lies in it.
fn place_in(whole: &str, part: &str) -> Option<std::ops::Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    whole.get(start..end).is_some().then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opt_outs_are_exact_names_and_a_long_list_stays_bounded() {
        let read = opt_outs(&json!(["thread/status/changed", 7, null, "item/*"]));
        let want: HashSet<Box<str>> = ["thread/status/changed", "item/*"]
            .into_iter()
            .map(Box::from)
            .collect();
        assert_eq!(read, want);
        assert!(opt_outs(&json!(null)).is_empty());
        assert!(opt_outs(&json!("thread/status/changed")).is_empty());
        let flood: Vec<String> = (0..10_000).map(|n| format!("m/{n}")).collect();
        assert_eq!(opt_outs(&json!(flood)).len(), MAX_OPT_OUTS);
        assert!(opt_outs(&json!(["x".repeat(MAX_OPT_OUT_NAME + 1)])).is_empty());
    }

    #[test]
    fn a_part_is_placed_in_its_whole_and_nothing_else_is() {
        let whole = String::from(r#"{"id":1,"params":{"path":"a"}}"#);
        let at = place_in(&whole, &whole[17..29]).unwrap();
        assert_eq!(&whole[at], r#"{"path":"a"}"#);
        let elsewhere = whole.clone();
        assert_eq!(place_in(&whole, &elsewhere[17..29]), None);
        assert_eq!(place_in(&whole[..10], &whole[17..29]), None);
    }
}
