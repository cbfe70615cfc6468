//! One client connection, bound to one tenant: relays JSON-RPC between the client and the
//! tenant's workers through the session's legs, rewriting server-request ids on the way.
//!
//! Admission (decision 7) runs on every client frame, in the order the admission module gives:
//! the connection's frame rate, then for requests the tenant's rates and turn cap, then the
//! host-access policy and routing, then a slot among the worker's requests in flight. A request
//! that finds the worker full parks: the session stops reading *this* client for at most
//! `in_flight_wait_ms` while it keeps relaying worker output (which frees the session's own
//! slots), then forwards the request or answers `-32001` with scope `worker`. Other sessions
//! never wait on it: each session is its own task with its own legs.
//!
//! Slow readers (decision 8): above the soft mark of the client queue, streaming deltas are
//! dropped for this session only and counted (`item/completed` carries the whole item); at the
//! hard mark (the queue full) the session closes with 1008. The queue is bounded twice, in
//! frames and in bytes (`client_queue_bytes` per session, `tenant_queue_bytes` over all the
//! tenant's sessions): a client that never reads answers echoing megabytes must not pin
//! router memory, so either bound's half is a soft mark and either bound is a hard mark.
//!
//! Request ids: a request reusing the id of one still in flight, or using the id the router
//! keeps for its own requests on legs, is answered `-32600` and not forwarded; the first
//! request keeps its entry and its worker slot.

mod fanout;
pub mod legs;
mod rehome;
mod routing;
mod server_requests;
mod turns;

use serde_json::json;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Sink, SinkExt, Stream, StreamExt};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;
use worker::WorkerId;

use crate::admission::{
    Admission, ConnectionGuard, InFlightPermit, QueueBytes, Reason, Rejection, Scope,
    FLOOD_CLOSE_REASON,
};
use crate::jsonrpc::{self, codes, Frame, Message as Rpc, Method, RequestId};
use crate::metrics::{ClientError, RouterMetrics};
use crate::policy::{self, Decision};
use crate::tenants::{Relayed, Tenant};
pub(crate) use fanout::{Merge as FanOutMethod, Missing as FanOutMissing};
use legs::{Leg, LegEvent};
use routing::Learn;
pub(crate) use routing::PER_CONNECTION;
use server_requests::ServerRequests;

/// Id of the `initialize` the router replays on a leg it opens after the first; its answer is swallowed.
const REPLAY_INIT_ID: &str = "codex-fleet:replay-initialize";
/// Protocol errors in a row that end a session.
const MAX_PROTOCOL_ERRORS: u32 = 32;
/// Server requests remembered per session (oldest forgotten first).
const MAX_SERVER_REQUESTS: usize = 4096;
/// Frames from legs buffered before legs wait.
const LEG_EVENTS: usize = 1024;
/// After a 1009 close, how long the socket stays open (unread) before it is dropped.
const TOO_BIG_LINGER: Duration = Duration::from_millis(500);
/// How long the closing frame may take to reach the client.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long after a turn was seen to start the workers' own count must include it.
const TURN_COUNT_SETTLED: Duration = Duration::from_secs(10);
/// `retryAfterMs` when this connection has `limits.max_in_flight_per_connection` requests
/// unanswered.
const SESSION_IN_FLIGHT_RETRY: Duration = Duration::from_millis(100);

/// A worker's response, read once from its parsed frame.
#[derive(Debug, Clone, Copy)]
struct Answer<'a> {
    /// Its `result`, unparsed (`None` for an error).
    result: Option<&'a serde_json::value::RawValue>,
    /// Its `error`, unparsed.
    error: Option<&'a serde_json::value::RawValue>,
    /// It is app-server's own `-32001`.
    overloaded: bool,
}

/// What a session needs from the rest of the router.
#[derive(Clone)]
pub struct SessionCtx {
    /// The tenant the client authenticated as.
    pub tenant: Arc<Tenant>,
    /// Router metrics.
    pub metrics: RouterMetrics,
    /// Largest message in either direction.
    pub max_message_bytes: usize,
    /// Frames queued towards the client before it counts as too slow (the hard mark); above
    /// half of it streaming deltas are dropped (the soft mark).
    pub client_queue: usize,
    /// Bytes queued towards the client before it counts as too slow.
    pub client_queue_bytes: usize,
    /// Bytes queued towards all the tenant's clients before the next that adds is too slow.
    pub tenant_queue_bytes: usize,
    /// Rates and caps shared by all sessions.
    pub admission: Arc<Admission>,
    /// Cancelled when codex-fleet shuts down.
    pub shutdown: CancellationToken,
    /// Ends the session with the credential that admitted it (expiry, reload).
    pub lease: crate::credentials::Lease,
    /// Who the client is (for the audit log).
    pub subject: String,
    /// The audit log.
    pub audit: crate::audit::Audit,
}

/// Why a session ended; decides the close frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The client closed or vanished.
    ClientGone,
    /// codex-fleet is shutting down (1001).
    Shutdown,
    /// The client did not read fast enough (1008).
    SlowClient,
    /// A message over the size limit (1009).
    TooBig,
    /// Too many protocol errors in a row (1008).
    ProtocolErrors,
    /// Notifications or responses beyond the connection's frame rate (1008): they cannot be
    /// answered with `-32001` and are never dropped silently.
    Flooded,
    /// The credential that admitted the session expired (1008, [`EXPIRED_REASON`]).
    CredentialExpired,
    /// A reload removed the session's token, key or tenant (1008, [`REVOKED_REASON`]).
    CredentialRevoked,
}

/// Close reason of a session whose JWT expired.
pub const EXPIRED_REASON: &str = "codex-fleet: the credential expired; reconnect with a new token";
/// Close reason of a session whose credential or tenant a reload removed.
pub const REVOKED_REASON: &str = "codex-fleet: the credential was revoked";

impl From<crate::credentials::CredentialEnd> for End {
    fn from(e: crate::credentials::CredentialEnd) -> End {
        match e {
            crate::credentials::CredentialEnd::Expired => End::CredentialExpired,
            crate::credentials::CredentialEnd::Revoked => End::CredentialRevoked,
        }
    }
}

impl End {
    /// Every way a session ends, so each series exists (at zero) from the start.
    pub const ALL: [End; 8] = [
        End::ClientGone,
        End::Shutdown,
        End::SlowClient,
        End::TooBig,
        End::ProtocolErrors,
        End::Flooded,
        End::CredentialExpired,
        End::CredentialRevoked,
    ];

    /// The `reason` of `codex_fleet_sessions_closed_total`.
    pub fn label(&self) -> &'static str {
        match self {
            End::ClientGone => "client",
            End::Shutdown => "shutdown",
            End::SlowClient => "slow_client",
            End::TooBig => "too_big",
            End::ProtocolErrors => "protocol_errors",
            End::Flooded => "flooded",
            End::CredentialExpired => "credential_expired",
            End::CredentialRevoked => "credential_revoked",
        }
    }

    /// The close frame to send, if any.
    pub fn close_frame(&self) -> Option<CloseFrame> {
        let (code, reason) = match self {
            End::ClientGone => return None,
            End::Shutdown => (CloseCode::Away, "codex-fleet is shutting down"),
            End::SlowClient => (CloseCode::Policy, "client is not reading fast enough"),
            End::TooBig => (CloseCode::Size, "message too big"),
            End::ProtocolErrors => (CloseCode::Policy, "too many protocol errors"),
            End::Flooded => (CloseCode::Policy, FLOOD_CLOSE_REASON),
            End::CredentialExpired => (CloseCode::Policy, EXPIRED_REASON),
            End::CredentialRevoked => (CloseCode::Policy, REVOKED_REASON),
        };
        Some(CloseFrame {
            code,
            reason: reason.into(),
        })
    }
}

/// The client's `initialize`, kept to replay on every further leg.
struct Init {
    id: RequestId,
    text: String,
    answered: bool,
    initialized: bool,
}

struct InFlight {
    worker: WorkerId,
    since: Instant,
    learn: Learn,
    /// The request's slot among the worker's requests in flight; freed with the entry.
    _slot: Option<InFlightPermit>,
}

/// A client request routed to a worker that had no free slot: waits (the session stops reading
/// the client meanwhile) for at most `in_flight_wait_ms`.
struct Parked {
    id: RequestId,
    worker: WorkerId,
    text: String,
    learn: Learn,
    first_initialize: bool,
}

/// The bounded wait of a parked request for a worker slot.
type SlotWait = Pin<Box<dyn Future<Output = Result<InFlightPermit, Rejection>> + Send>>;

struct Session {
    ctx: SessionCtx,
    out: mpsc::Sender<Message>,
    legs: HashMap<WorkerId, Leg>,
    home: Option<WorkerId>,
    init: Option<Init>,
    in_flight: HashMap<RequestId, InFlight>,
    server_requests: ServerRequests,
    events_tx: mpsc::Sender<LegEvent>,
    protocol_errors: u32,
    /// Legs whose initialize was answered: they receive the worker's broadcasts themselves.
    live: HashSet<WorkerId>,
    /// Legs that got a replayed initialize and have sent nothing since its answer but the
    /// per-connection notifications app-server follows it with (dropped: the client has had
    /// them once, after its own initialize).
    replayed: HashSet<WorkerId>,
    /// The client's initialize went out on some leg, so any further leg needs it replayed.
    init_sent: bool,
    /// This connection's admission: its slot under the connection caps and its frame rate.
    guard: ConnectionGuard,
    /// A request waiting for a worker slot (at most one: the client is not read meanwhile).
    parked: Option<Parked>,
    /// Queued frames above which deltas are dropped.
    soft_mark: usize,
    /// Bytes queued towards the client, against the session's and the tenant's bounds.
    queued_bytes: Arc<QueueBytes>,
    /// Bytes on the legs, per direction, per session and per tenant.
    leg_budgets: legs::LegBudgets,
    /// The threads this client follows, and those being moved off a worker that ended.
    following: rehome::Following,
    /// Requests sent to every worker, waiting for their answers to merge.
    fanouts: fanout::FanOuts,
    /// Approval and user-input requests sent to the client, by the id it answers, for the
    /// audit log (bounded by [`AUDITED_APPROVALS`]).
    approvals: HashMap<i64, serde_json::Value>,
}

/// Approvals awaiting an answer that a session remembers for the audit log.
const AUDITED_APPROVALS: usize = 1024;

impl Session {
    /// Records an audit event with the session's tenant and subject.
    fn audit(&self, event: &str, mut fields: serde_json::Value) {
        fields["tenant"] = json!(self.ctx.tenant.id);
        fields["subject"] = json!(self.ctx.subject);
        self.ctx.audit.record(event, fields);
    }

    /// An approval or user-input request from a worker: recorded, and remembered until the
    /// client answers it.
    fn audit_approval_request(
        &mut self,
        worker: WorkerId,
        sid: i64,
        method: &str,
        params: Option<&serde_json::value::RawValue>,
    ) {
        let p = params
            .and_then(|p| serde_json::from_str::<serde_json::Value>(p.get()).ok())
            .unwrap_or_default();
        let asked = json!({
            "method": method,
            "thread": p.get("threadId"),
            "turn": p.get("turnId"),
            "item": p.get("itemId"),
            "command": crate::audit::summary(p.get("command")),
            "cwd": p.get("cwd"),
            "reason": crate::audit::summary(p.get("reason")),
            "worker": worker.to_string(),
        });
        self.audit("approval.requested", asked.clone());
        if self.approvals.len() < AUDITED_APPROVALS {
            self.approvals.insert(sid, asked);
        }
    }
}

/// Worker requests that ask the client to approve something or to answer the user's question.
fn is_approval(method: &str) -> bool {
    method.ends_with("requestApproval") || method.ends_with("requestUserInput")
}

/// Serves one upgraded client connection until it ends; generic over the transport so tests
/// can drive it through channels.
pub async fn serve<Si, St>(sink: Si, mut stream: St, ctx: SessionCtx, guard: ConnectionGuard) -> End
where
    Si: Sink<Message, Error = WsError> + Send + Unpin + 'static,
    St: Stream<Item = Result<Message, WsError>> + Unpin,
{
    let tenant = ctx.tenant.id.clone();
    let metrics = ctx.metrics.clone();
    metrics.sessions.with_label_values(&[&tenant]).inc();
    let ctx_client_queue = ctx.client_queue;
    let (out, out_rx) = mpsc::channel(ctx.client_queue);
    let queued_bytes =
        ctx.admission
            .client_queue_bytes(&tenant, ctx.client_queue_bytes, ctx.tenant_queue_bytes);
    // The close frame of a client that is too slow skips its full queue.
    let (urgent, urgent_rx) = mpsc::channel(1);
    let writer = tokio::spawn(write_client(sink, out_rx, urgent_rx, queued_bytes.clone()));
    let (events_tx, mut events_rx) = mpsc::channel(LEG_EVENTS);
    let leg_budgets =
        ctx.admission
            .leg_budgets(&tenant, ctx.client_queue_bytes, ctx.tenant_queue_bytes);
    let mut session = Session {
        ctx,
        out,
        legs: HashMap::new(),
        home: None,
        init: None,
        in_flight: HashMap::new(),
        server_requests: ServerRequests::default(),
        events_tx,
        protocol_errors: 0,
        live: HashSet::new(),
        replayed: HashSet::new(),
        init_sent: false,
        guard,
        parked: None,
        soft_mark: crate::config::soft_mark(ctx_client_queue),
        queued_bytes,
        leg_budgets,
        following: rehome::Following::default(),
        fanouts: fanout::FanOuts::default(),
        approvals: HashMap::new(),
    };
    let shutdown = session.ctx.shutdown.clone();
    let lease = session.ctx.lease.clone();
    let credential_ended = lease.ended();
    tokio::pin!(credential_ended);
    let admission = session.ctx.admission.clone();
    let mut relay = Some(session.ctx.tenant.subscribe());
    let mut slot: Option<SlotWait> = None;
    let end = loop {
        if slot.is_none() {
            if let Some(worker) = session.parked.as_ref().map(|p| p.worker) {
                let admission = admission.clone();
                slot = Some(Box::pin(async move { admission.worker_slot(worker).await }));
            }
        }
        let fanout_deadline = fanout::sleep_until(session.fanouts.next_deadline());
        // While a request is parked the client is not read; worker output still flows.
        let step = match slot.as_mut() {
            Some(wait) => tokio::select! {
                permit = wait => Ok(Some(permit)),
                Some(ev) = events_rx.recv() => session.on_leg_event(ev).await.map(|()| None),
                r = recv_relay(&mut relay) => session.on_relayed(r).await.map(|()| None),
                () = fanout_deadline => session.fanouts_expired().map(|()| None),
                () = shutdown.cancelled() => Err(End::Shutdown),
                e = &mut credential_ended => Err(End::from(e)),
            },
            None => tokio::select! {
                frame = stream.next() => session.on_client_frame(frame).await.map(|()| None),
                Some(ev) = events_rx.recv() => session.on_leg_event(ev).await.map(|()| None),
                r = recv_relay(&mut relay) => session.on_relayed(r).await.map(|()| None),
                () = fanout_deadline => session.fanouts_expired().map(|()| None),
                () = shutdown.cancelled() => Err(End::Shutdown),
                e = &mut credential_ended => Err(End::from(e)),
            },
        };
        let step = match step {
            Ok(Some(permit)) => {
                slot = None;
                session.unpark(permit).await
            }
            Ok(None) => Ok(()),
            Err(end) => Err(end),
        };
        if let Err(end) = step {
            break end;
        }
    };
    session.legs.clear();
    if let Some(frame) = end.close_frame() {
        // Normally the close frame follows what is queued (e.g. the errors that led to it); a
        // slow client's queue is dropped instead, and it gets the close frame next.
        let queued = end != End::SlowClient
            && session
                .out
                .try_send(Message::Close(Some(frame.clone())))
                .is_ok();
        if !queued {
            let _sent = urgent.try_send(frame);
        }
    }
    drop(session);
    drop(urgent);
    // Until the close frame is out, and then until the client answers it, what the client
    // still sends is read and discarded: closing a socket with unread input resets it, and the
    // reset would destroy the close frame (and whatever preceded it) on its way to the client.
    let mut writer = writer;
    let closing = async {
        let drain = async { while let Some(Ok(_)) = stream.next().await {} };
        tokio::pin!(drain);
        let drained = tokio::select! {
            _written = &mut writer => false,
            () = &mut drain => true,
        };
        if drained {
            let _written = (&mut writer).await;
            if end == End::TooBig {
                // The rest of the oversized message is still unread and cannot be parsed away:
                // give the client a moment to read the 1009 before our close resets the socket.
                tokio::time::sleep(TOO_BIG_LINGER).await;
            }
        } else {
            drain.await;
        }
    };
    if tokio::time::timeout(CLOSE_GRACE, closing).await.is_err() {
        writer.abort();
    }
    metrics.sessions.with_label_values(&[&tenant]).dec();
    metrics
        .sessions_closed
        .with_label_values(&[end.label()])
        .inc();
    end
}

async fn write_client<Si>(
    mut sink: Si,
    mut rx: mpsc::Receiver<Message>,
    mut urgent: mpsc::Receiver<CloseFrame>,
    queued_bytes: Arc<QueueBytes>,
) where
    Si: Sink<Message, Error = WsError> + Unpin,
{
    let mut urgent_open = true;
    loop {
        tokio::select! {
            biased;
            close = urgent.recv(), if urgent_open => match close {
                Some(frame) => {
                    let _sent = sink.send(Message::Close(Some(frame))).await;
                    break;
                }
                None => urgent_open = false,
            },
            msg = rx.recv() => {
                let Some(msg) = msg else { break };
                queued_bytes.release(queued_len(&msg));
                match write_batch(&mut sink, msg, &mut rx, &queued_bytes).await {
                    Ok(false) => {}
                    Ok(true) | Err(_) => break,
                }
            }
        }
    }
    let _flushed = sink.close().await;
}

/// Frames written before one flush: a streaming turn queues many small deltas, and flushing
/// each one alone costs a TLS record and a syscall apiece.
const WRITE_BATCH: usize = 64;

/// The bytes a queued frame counts against the queue's byte bounds.
fn queued_len(msg: &Message) -> usize {
    match msg {
        Message::Text(t) => t.len(),
        _ => 0,
    }
}

/// Writes `first` and whatever else is already queued (up to [`WRITE_BATCH`]), then flushes
/// once. `Ok(true)` when a close frame was written.
async fn write_batch<Si>(
    sink: &mut Si,
    first: Message,
    rx: &mut mpsc::Receiver<Message>,
    queued_bytes: &QueueBytes,
) -> Result<bool, WsError>
where
    Si: Sink<Message, Error = WsError> + Unpin,
{
    let mut next = Some(first);
    let mut written = 0;
    while let Some(msg) = next.take() {
        let closing = matches!(msg, Message::Close(_));
        sink.feed(msg).await?;
        written += 1;
        if closing {
            sink.flush().await?;
            return Ok(true);
        }
        if written < WRITE_BATCH {
            next = rx.try_recv().ok();
            if let Some(msg) = &next {
                queued_bytes.release(queued_len(msg));
            }
        }
    }
    sink.flush().await?;
    Ok(false)
}

/// The next relayed broadcast; pending forever once the relay is closed.
async fn recv_relay(relay: &mut Option<broadcast::Receiver<Relayed>>) -> Option<Relayed> {
    let Some(rx) = relay.as_mut() else {
        return std::future::pending().await;
    };
    match rx.recv().await {
        Ok(r) => Some(r),
        Err(broadcast::error::RecvError::Lagged(n)) => {
            tracing::warn!(missed = n, "session lagged behind the tenant's broadcasts");
            None
        }
        Err(broadcast::error::RecvError::Closed) => {
            *relay = None;
            std::future::pending().await
        }
    }
}

// === impl Session ===

impl Session {
    fn tenant(&self) -> &str {
        &self.ctx.tenant.id
    }

    fn count_error(&self, reason: ClientError) {
        self.ctx
            .metrics
            .client_errors
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// Queues a frame for the client; a client whose queue is full (in frames, or in bytes for
    /// the session or its tenant) is too slow and is closed.
    fn to_client(&self, text: String) -> Result<(), End> {
        let n = text.len();
        if !self.queued_bytes.try_add(n) {
            tracing::info!(
                queued = self.queued_bytes.session(),
                tenant_queued = self.ctx.admission.queued_bytes(self.tenant()),
                "closing a client over its queue's byte bound"
            );
            return Err(End::SlowClient);
        }
        self.out.try_send(Message::text(text)).map_err(|_| {
            self.queued_bytes.release(n);
            End::SlowClient
        })
    }

    /// Frames waiting for the client.
    fn queued(&self) -> usize {
        self.out.max_capacity() - self.out.capacity()
    }

    /// Answers a refused request with `-32001` and counts the refusal.
    fn reject(&self, id: &RequestId, r: &Rejection) -> Result<(), End> {
        self.ctx.metrics.rejected_for(self.tenant(), r);
        self.to_client(r.to_error_response(id))
    }

    /// A cap-style refusal with the configured back-off.
    fn cap(&self, scope: Scope, reason: Reason) -> Rejection {
        let back_off = Duration::from_millis(self.ctx.admission.config().cap_retry_after_ms);
        Rejection::cap(scope, reason, back_off)
    }

    /// At the active-turn cap, asks the workers' own view (their control legs see every
    /// thread) before refusing, so a turn that ended while no session of the tenant was there
    /// to see it does not hold a slot until `active_turn_ttl_secs`.
    fn reconcile_turns(&self) {
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
    fn track_turns(&self, method: &Method<'_>, params: Option<&serde_json::value::RawValue>) {
        if let Some((event, thread)) = turns::event_of(method, params) {
            match event {
                turns::Event::Started => self.ctx.admission.turn_started(self.tenant(), &thread),
                turns::Event::Ended => self.ctx.admission.turn_ended(self.tenant(), &thread),
            }
        }
    }

    fn reply_error(
        &self,
        id: Option<&RequestId>,
        code: i64,
        message: &str,
        data: Option<serde_json::Value>,
    ) -> Result<(), End> {
        self.to_client(jsonrpc::error_response(id, code, message, data))
    }

    async fn on_client_frame(
        &mut self,
        frame: Option<Result<Message, WsError>>,
    ) -> Result<(), End> {
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
            Some(Err(e)) => {
                tracing::debug!(error = %e, "client read error");
                return Err(End::ClientGone);
            }
        };
        self.ctx
            .metrics
            .client_frames
            .with_label_values(&[self.tenant()])
            .inc();
        let msg = match jsonrpc::parse(&text) {
            Ok(msg) => msg,
            Err(e) => {
                self.check_unanswerable_frame()?;
                self.count_error(ClientError::InvalidMessage);
                self.reply_error(None, e.code(), &e.to_string(), None)?;
                return self.protocol_error();
            }
        };
        self.protocol_errors = 0;
        if !matches!(msg, Rpc::Request { .. }) {
            self.check_unanswerable_frame()?;
        }
        match msg {
            Rpc::Request { id, method, params } => {
                let thread = jsonrpc::thread_id(params);
                if method == Method::TurnStart {
                    self.reconcile_turns();
                }
                let admitted = self.guard.check_frame().and_then(|()| {
                    self.ctx.admission.check_request(
                        self.tenant(),
                        method.as_str(),
                        thread.as_deref(),
                    )
                });
                if let Err(r) = admitted {
                    return self.reject(&id, &r);
                }
                let rewritten = match self.ctx.tenant.policy.check(
                    method.as_str(),
                    params,
                    &self.ctx.tenant.roots,
                ) {
                    Decision::Allow => None,
                    Decision::Rewrite(p) => policy::rewritten_request(&id, method.as_str(), &p),
                    Decision::Deny(denial) => {
                        self.count_error(ClientError::HostAccessDenied);
                        tracing::info!(method = %method, policy = denial.class.as_str(), "request denied by host-access policy");
                        self.audit(
                            "access.denied",
                            json!({ "method": method.as_str(), "policy": denial.class.as_str() }),
                        );
                        return self.to_client(denial.to_error_response(&id));
                    }
                    Decision::Invalid(message) => {
                        // Malformed, as app-server would answer it: not a policy refusal.
                        self.count_error(ClientError::InvalidMessage);
                        return self.to_client(proto::error::invalid_request_response(
                            Some(&id),
                            &message,
                        ));
                    }
                };
                let text = rewritten.as_deref().unwrap_or(&text);
                self.on_client_request(id, &method, thread, text).await
            }
            Rpc::Notification { method, .. } => self.on_client_notification(&method, &text).await,
            Rpc::Response { id } => self.on_client_response(id, &text).await,
        }
    }

    /// The frame rate for frames that cannot get a `-32001` (notifications, responses, bad
    /// frames): over it, the connection is closed rather than the frame dropped silently.
    fn check_unanswerable_frame(&self) -> Result<(), End> {
        self.guard.check_frame().map_err(|r| {
            self.ctx.metrics.rejected_for(self.tenant(), &r);
            tracing::info!("closing a connection that floods notifications or responses");
            End::Flooded
        })
    }

    fn protocol_error(&mut self) -> Result<(), End> {
        self.protocol_errors += 1;
        if self.protocol_errors >= MAX_PROTOCOL_ERRORS {
            return Err(End::ProtocolErrors);
        }
        Ok(())
    }

    async fn on_client_request(
        &mut self,
        id: RequestId,
        method: &Method<'_>,
        thread: Option<String>,
        text: &str,
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
            let info = serde_json::from_str::<serde_json::Value>(text)
                .map(|v| v["params"]["clientInfo"].clone())
                .unwrap_or_default();
            self.audit(
                "session.initialized",
                json!({ "client_name": info["name"], "client_version": info["version"] }),
            );
            self.init = Some(Init {
                id: id.clone(),
                text: text.to_owned(),
                answered: false,
                initialized: false,
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
        let worker = match self.leg_for(target, *method == Method::ThreadResume).await {
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
                thread,
                retry: Some(text.to_owned()),
            },
            (Method::ThreadUnsubscribe, Some(thread)) => Learn::Unsubscribe { thread },
            (m, _) => fanout::Merge::of(m).map_or(Learn::Nothing, Learn::FanOut),
        };
        let parked = Parked {
            id,
            worker,
            text: text.to_owned(),
            learn,
            first_initialize,
        };
        match self.ctx.admission.try_worker_slot(worker) {
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
    fn unusable_id(&self, id: &RequestId) -> Option<ClientError> {
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
    async fn unpark(&mut self, slot: Result<InFlightPermit, Rejection>) -> Result<(), End> {
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
    async fn dispatch(&mut self, req: Parked, slot: InFlightPermit) -> Result<(), End> {
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
            return self.fan_out(&id, worker, merge, &text).await;
        }
        if !self.send_to_leg(worker, text).await {
            self.in_flight.remove(&id);
            if first_initialize {
                self.init = None;
            }
            return self.worker_gone_reply(&id);
        }
        self.init_sent |= first_initialize;
        Ok(())
    }

    async fn on_client_notification(&mut self, method: &Method<'_>, text: &str) -> Result<(), End> {
        let Some(init) = self.init.as_mut() else {
            // app-server ignores notifications before initialize; so do we.
            return Ok(());
        };
        if *method == Method::Initialized {
            init.initialized = true;
        }
        for leg in self.legs.values() {
            leg.send(text.to_owned()).await;
        }
        Ok(())
    }

    async fn on_client_response(&mut self, id: RequestId, text: &str) -> Result<(), End> {
        let RequestId::Int(sid) = id else {
            self.count_error(ClientError::UnknownResponse);
            return Ok(());
        };
        let Some((worker, original)) = self.server_requests.take(sid) else {
            // Never sent, or already answered: app-server would ignore it; we count and drop it.
            self.count_error(ClientError::UnknownResponse);
            return Ok(());
        };
        let result = Frame::parse(text).ok().and_then(|f| f.result);
        self.ctx.tenant.counted.answer(
            &self.ctx.metrics.usage,
            self.tenant(),
            worker,
            &original,
            result,
        );
        if let Some(mut asked) = self.approvals.remove(&sid) {
            // The decision is in the audit log before the worker acts on it.
            let answer = serde_json::from_str::<serde_json::Value>(text).unwrap_or_default();
            asked["decision"] = match answer.get("result") {
                Some(r) => r.get("decision").cloned().unwrap_or_else(|| r.clone()),
                None => json!({ "error": answer.get("error") }),
            };
            asked["tenant"] = json!(self.ctx.tenant.id);
            asked["subject"] = json!(self.ctx.subject);
            self.ctx
                .audit
                .record_written("approval.answered", asked)
                .await;
        }
        if let Some(text) = jsonrpc::with_id(text, &original) {
            self.send_to_leg(worker, text).await;
        }
        Ok(())
    }

    async fn on_leg_event(&mut self, ev: LegEvent) -> Result<(), End> {
        match ev {
            // The frame's room in the leg budget is given back when this arm ends.
            LegEvent::Frame(worker, text, _bytes) => self.on_worker_frame(worker, &text).await,
            LegEvent::Closed(worker, reason) => self.on_leg_closed(worker, &reason),
        }
    }

    async fn on_worker_frame(&mut self, worker: WorkerId, text: &str) -> Result<(), End> {
        let frame = match Frame::parse(text) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(%worker, error = %e, "dropping unparseable frame from worker");
                return Ok(());
            }
        };
        if self.replayed.contains(&worker) && self.replay_echo(worker, &frame.message) {
            return Ok(());
        }
        let answer = Answer {
            result: frame.result,
            error: frame.error,
            overloaded: frame.error_code() == Some(codes::OVERLOADED),
        };
        match frame.message {
            Rpc::Response { id } => self.on_worker_response(worker, id, answer, text).await,
            Rpc::Request { id, method, params } => {
                self.ctx.tenant.counted.server_request(
                    &self.ctx.metrics.usage,
                    self.tenant(),
                    worker,
                    &id,
                    &method,
                );
                let sid = self
                    .server_requests
                    .insert(worker, id, jsonrpc::thread_id(params));
                if is_approval(method.as_str()) {
                    self.audit_approval_request(worker, sid, method.as_str(), params);
                }
                match jsonrpc::with_id(text, &RequestId::Int(sid)) {
                    Some(t) => self.to_client(t),
                    None => Ok(()),
                }
            }
            Rpc::Notification { method, params } => {
                self.track_turns(&method, params);
                self.ctx.tenant.counted.notification(
                    &self.ctx.metrics.usage,
                    self.tenant(),
                    &method,
                    params,
                );
                if method == Method::ThreadClosed {
                    self.audit(
                        "thread.closed",
                        json!({ "thread": jsonrpc::thread_id(params), "worker": worker.to_string() }),
                    );
                }
                if self.follow_notification(worker, &method, params) {
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
                    if let Some(sid) = jsonrpc::params_request_id(params)
                        .and_then(|rid| self.server_requests.resolved(worker, rid))
                    {
                        if let Some(t) = jsonrpc::with_params_request_id(text, &RequestId::Int(sid))
                        {
                            return self.to_client(t);
                        }
                    }
                }
                self.to_client(text.to_owned())
            }
        }
    }

    async fn on_worker_response(
        &mut self,
        worker: WorkerId,
        id: RequestId,
        answer: Answer<'_>,
        text: &str,
    ) -> Result<(), End> {
        if id == RequestId::Str(REPLAY_INIT_ID.into()) {
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
        let text: Cow<'_, str> = rewritten.map_or(Cow::Borrowed(text), Cow::Owned);
        let text = text.as_ref();
        let flight = self.in_flight.remove(&id);
        if let Some(f) = &flight {
            self.ctx
                .metrics
                .request_seconds
                .with_label_values(&[&self.ctx.tenant.id])
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
                let result =
                    serde_json::from_str::<serde_json::Value>(result.get()).unwrap_or_default();
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
        self.to_client(text.to_owned())
    }

    /// A broadcast from a worker's control leg: forwarded unless this session's own live leg
    /// to that worker delivers it (so each broadcast arrives once).
    async fn on_relayed(&mut self, relayed: Option<Relayed>) -> Result<(), End> {
        let Some(r) = relayed else { return Ok(()) };
        // Only the end of a turn is taken from the relay: it lags the legs, and a late relayed
        // "active" after the leg's turn/completed would count a finished turn as running.
        if let Some(thread) = &r.turn_ended {
            self.ctx.admission.turn_ended(self.tenant(), thread);
        }
        if let Some(order) = &r.rehome {
            return self.on_rehome(order).await;
        }
        if self.init.as_ref().is_none_or(|i| !i.answered) || self.holds_back_relayed(&r) {
            return Ok(());
        }
        if r.to_all || !self.live.contains(&r.worker) {
            return self.to_client(r.text.to_string());
        }
        Ok(())
    }

    fn on_leg_closed(&mut self, worker: WorkerId, reason: &str) -> Result<(), End> {
        tracing::info!(%worker, reason, "leg closed");
        self.legs.remove(&worker);
        self.live.remove(&worker);
        self.replayed.remove(&worker);
        self.ctx.tenant.reconcile_soon();
        if self.home == Some(worker) {
            self.home = None;
        }
        // The worker's prompts can no longer be answered through this session.
        for (sid, thread) in self.server_requests.forget_worker(worker) {
            self.to_client(crate::rehome::request_resolved_frame(&thread, sid))?;
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

    fn worker_gone_reply(&self, id: &RequestId) -> Result<(), End> {
        self.count_error(ClientError::WorkerExited);
        self.to_client(proto::error::worker_exited_response(id))
    }

    async fn send_to_leg(&mut self, worker: WorkerId, text: String) -> bool {
        match self.legs.get(&worker) {
            Some(leg) => leg.send(text).await,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests;
