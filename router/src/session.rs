//! One client connection, bound to one tenant: relays JSON-RPC between the client and the
//! tenant's workers through the session's legs, rewriting server-request ids on the way.
//!
//! Admission (docs/decisions/0007-admission-before-work.md) runs on every client frame, in the
//! order the admission module gives: the connection's frame rate, then for requests the tenant's
//! rates and turn cap, then the host-access policy and routing, then a slot among the worker's
//! requests in flight. A request that finds the worker full parks: the session stops reading *this*
//! client for at most `in_flight_wait_ms` while it keeps relaying worker output (which frees the
//! session's own slots), then forwards the request or answers `-32001` with scope `worker`. Other
//! sessions never wait on it: each session is its own task with its own legs.
//!
//! Slow readers (docs/decisions/0008-bounded-everything.md): above the soft mark of the client
//! queue, streaming deltas are dropped for this session only and counted (`item/completed` carries
//! the whole item); at the hard mark (the queue full) the session closes with 1008. The queue is
//! bounded twice, in frames and in bytes (`client_queue_bytes` per session, `tenant_queue_bytes`
//! over all the tenant's sessions): a client that never reads answers echoing megabytes must not
//! pin router memory, so either bound's half is a soft mark and either bound is a hard mark.
//!
//! Request ids: a request reusing the id of one still in flight, or using the id the router
//! keeps for its own requests on legs, is answered `-32600` and not forwarded; the first
//! request keeps its entry and its worker slot.
//!
//! Where each part is: this file holds the session's state and its loop; `inbound.rs` the
//! client's frames, `from_workers.rs` the workers', `legs.rs` the sockets to them, `writer.rs`
//! the client's queue, `routing.rs` where a request goes, `fanout.rs` requests every worker
//! answers, `broadcasts.rs` the tenant's broadcasts, `rehome.rs` threads moving off a dead
//! worker, `server_requests.rs` and `audit.rs` approvals, `turns.rs` the turn count.

mod audit;
mod broadcasts;
mod fanout;
mod from_workers;
mod inbound;
pub mod legs;
pub(crate) mod metrics;
mod rehome;
mod routing;
mod server_requests;
mod turns;
mod writer;

pub use crate::end::End;
use crate::end::TOO_BIG_LINGER;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{Sink, Stream, StreamExt};
use proto::rpc::RequestId;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};
use tokio_util::sync::CancellationToken;
use worker::WorkerId;

use crate::admission::{Admission, ConnectionGuard, InFlightPermit, QueueBytes, Rejection};
use crate::gate::Gate;
use crate::metrics::{ClientError, RouterMetrics};
use crate::tenants::Tenant;
use broadcasts::Relay;
pub(crate) use fanout::{Merge as FanOutMethod, Missing as FanOutMissing};
use legs::Leg;
use routing::Learn;
pub(crate) use routing::PER_CONNECTION;
use server_requests::ServerRequests;

/// A session's own maps (legs, requests in flight) are hashed on every frame, so with foldhash,
/// randomly seeded per map, rather than SipHash: about 60 fewer code lines per cold round trip
/// (BENCHMARKS.md, bench 1). The keys a client chooses (request ids) sit in a map capped at
/// `limits.max_in_flight_per_connection`, so colliding ids cannot make it slow beyond that cap.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// See [`Map`].
type Set<K> = HashSet<K, foldhash::fast::RandomState>;

/// Id of the `initialize` the router replays on a leg it opens after the first; its answer is swallowed.
const REPLAY_INIT_ID: &str = "codex-fleet:replay-initialize";
/// Notifications a session's legs ask their workers not to send (added to the client's own
/// `optOutNotificationMethods` in the initialize each leg sends): a worker sends them on its
/// control leg too, and the tenant's relay hands that copy to every session. Without this a
/// worker writes each of a turn's status changes once per leg and once more, and the session
/// reads its leg's copy besides the relayed one. Only status changes: app-server itself orders
/// them freely against a turn's items, while `thread/started` and the like follow the answer
/// that names their thread, which a relayed copy could overtake.
const LEG_OPT_OUTS: &[&str] = &["thread/status/changed"];
/// Protocol errors in a row that end a session.
const MAX_PROTOCOL_ERRORS: u32 = 32;
/// Leg frames handled in one go when they are ready together (one write and flush for all).
const LEG_BURST: usize = 64;
/// Relayed broadcasts handled in one go when they are ready together, likewise.
const RELAY_BURST: usize = 64;
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
    /// Its `result`'s text, unparsed (`None` for an error); see [`proto::rpc::result_head`] for when it
    /// has not been checked as JSON.
    result: Option<&'a str>,
    /// Its `error`'s text, unparsed.
    error: Option<&'a str>,
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
    /// The client socket's read buffer, counted against the tenant as it reads (shared with
    /// the socket: `door::ClientIo`).
    pub client_read: Arc<crate::admission::ReadMeter>,
}

/// Where a request goes.
#[derive(Debug)]
enum Target {
    /// The session's home leg (global methods, unknown threads).
    Home,
    /// The worker that owns the request's thread.
    Owner(WorkerId),
    /// The least-loaded worker of the tenant (new threads).
    Place,
}

/// The client's `initialize`, kept to replay on every further leg.
struct Init {
    id: RequestId,
    text: String,
    answered: bool,
    initialized: bool,
    /// The notification methods the client opted out of (`optOutNotificationMethods`: exact
    /// names, as app-server matches them).
    opt_out: HashSet<Box<str>>,
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
    text: Utf8Bytes,
    learn: Learn,
    first_initialize: bool,
}

/// The bounded wait of a parked request for a worker slot.
type SlotWait = Pin<Box<dyn Future<Output = Result<InFlightPermit, Rejection>> + Send>>;

struct Session {
    ctx: SessionCtx,
    out: Arc<writer::Out>,
    legs: Map<WorkerId, Leg>,
    home: Option<WorkerId>,
    init: Option<Init>,
    in_flight: Map<RequestId, InFlight>,
    server_requests: ServerRequests,
    /// Legs opened since the session loop last looked: their frames join the ones it reads.
    /// (In a mutex only so that the session stays `Sync`; never contended.)
    new_legs: std::sync::Mutex<Vec<legs::LegFrames>>,
    protocol_errors: u32,
    /// This session's host-access denials that got no audit record of their own since its
    /// last one (`audit::denials`): in its next record, or in one of their own when it ends.
    denials_suppressed: u64,
    /// Legs whose initialize was answered: they receive the worker's broadcasts themselves
    /// (all but [`LEG_OPT_OUTS`]).
    live: Set<WorkerId>,
    /// Legs that got a replayed initialize and have sent nothing since its answer but the
    /// per-connection notifications app-server follows it with (dropped: the client has had
    /// them once, after its own initialize).
    replayed: Set<WorkerId>,
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
    /// Bytes queued on the legs towards the workers, per session and per tenant.
    leg_budget: crate::admission::LegBudget,
    /// The client socket's read buffer, as large as the largest frame it read.
    client_read: Arc<crate::admission::ReadMeter>,
    /// The threads this client follows, and those being moved off a worker that ended.
    following: rehome::Following,
    /// Requests sent to every worker, waiting for their answers to merge.
    fanouts: fanout::FanOuts,
    /// This session's children of the per-tenant metrics counted on every frame, looked up
    /// once (a lookup hashes the labels under the vector's lock).
    counted: Counted,
}

/// The tenant's children of the metrics a session counts per frame.
struct Counted {
    client_frames: prometheus::IntCounter,
    request_seconds: prometheus::Histogram,
}

/// Serves one upgraded client connection until it ends; generic over the transport so tests
/// can drive it through channels.
pub async fn serve<Si, St>(sink: Si, stream: St, ctx: SessionCtx, guard: ConnectionGuard) -> End
where
    Si: Sink<Message, Error = WsError> + Send + Unpin + 'static,
    St: Stream<Item = Result<Message, WsError>> + Unpin,
{
    run(Session::new(ctx, guard), sink, stream).await
}

// === impl Session ===

impl Session {
    fn new(ctx: SessionCtx, guard: ConnectionGuard) -> Session {
        let tenant = ctx.tenant.id.clone();
        let queued_bytes = ctx.admission.client_queue_bytes(
            &tenant,
            ctx.client_queue_bytes,
            ctx.tenant_queue_bytes,
        );
        let out = Arc::new(writer::Out::new(ctx.client_queue, queued_bytes.clone()));
        let leg_budget =
            ctx.admission
                .leg_budget(&tenant, ctx.client_queue_bytes, ctx.tenant_queue_bytes);
        let soft_mark = crate::config::soft_mark(ctx.client_queue);
        let client_read = ctx.client_read.clone();
        let counted = Counted {
            client_frames: ctx.metrics.client_frames.with_label_values(&[&tenant]),
            request_seconds: ctx.metrics.request_seconds.with_label_values(&[&tenant]),
        };
        Session {
            ctx,
            out,
            legs: Map::default(),
            home: None,
            init: None,
            in_flight: Map::default(),
            server_requests: ServerRequests::default(),
            new_legs: std::sync::Mutex::default(),
            protocol_errors: 0,
            denials_suppressed: 0,
            live: Set::default(),
            replayed: Set::default(),
            init_sent: false,
            guard,
            parked: None,
            soft_mark,
            queued_bytes,
            leg_budget,
            client_read,
            following: rehome::Following::default(),
            fanouts: fanout::FanOuts::default(),
            counted,
        }
    }
}

/// Hands what the last step queued to the sockets now, in the wake-up that produced it (a
/// request reaches its worker, an answer its client, without waiting for the next turn of the
/// loop); what a socket does not take now is written by the loop as it takes it.
async fn write_now<Si>(session: &mut Session, sink: &mut Si) -> Result<(), End>
where
    Si: Sink<Message, Error = WsError> + Unpin,
{
    std::future::poll_fn(|cx| {
        let _progress = legs::poll_write_legs(session.legs.values_mut(), cx);
        if session.out.busy() {
            if let std::task::Poll::Ready(Err(_)) = session.out.poll_write(sink, cx) {
                return std::task::Poll::Ready(Err(End::ClientGone));
            }
        }
        std::task::Poll::Ready(Ok(()))
    })
    .await
}

/// Shutdown or the credential's end, whichever came (polled behind the session's `rare` [`Gate`]).
fn poll_rare(
    cx: &mut Context<'_>,
    shut_down: Pin<&mut impl Future<Output = ()>>,
    credential_ended: Pin<&mut impl Future<Output = crate::credentials::CredentialEnd>>,
) -> Poll<End> {
    if shut_down.poll(cx).is_ready() {
        return Poll::Ready(End::Shutdown);
    }
    credential_ended.poll(cx).map(End::from)
}

/// The parked request's wait for a worker slot; pending while none is parked.
async fn slot_wait(slot: &mut Option<SlotWait>) -> Result<InFlightPermit, Rejection> {
    match slot.as_mut() {
        Some(wait) => wait.await,
        None => std::future::pending().await,
    }
}

/// Runs a session until it ends, then closes its client connection.
async fn run<Si, St>(mut session: Session, sink: Si, mut stream: St) -> End
where
    Si: Sink<Message, Error = WsError> + Send + Unpin + 'static,
    St: Stream<Item = Result<Message, WsError>> + Unpin,
{
    let tenant = session.ctx.tenant.id.clone();
    let metrics = session.ctx.metrics.clone();
    metrics.sessions.with_label_values(&[&tenant]).inc();
    let mut sink = sink;
    // Every leg's frames, read by this task itself (no reader task, no queue in between).
    let mut from_workers = legs::LegSet::default();
    let shutdown = session.ctx.shutdown.clone();
    let shut_down = shutdown.cancelled();
    tokio::pin!(shut_down);
    let lease = session.ctx.lease.clone();
    let credential_ended = lease.ended();
    tokio::pin!(credential_ended);
    let admission = session.ctx.admission.clone();
    let mut relay = Relay::new(session.ctx.tenant.subscribe());
    // Shutdown and the credential's end (one gate), and the tenant's broadcasts (another), are
    // polled only when they woke the task, not on every pass: each poll takes a lock, and the
    // shutdown token's is shared by every session, so a broadcast does not poll it.
    let mut rare = Gate::new();
    let mut relayed = Gate::new();
    let mut slot: Option<SlotWait> = None;
    let end = loop {
        let new_legs = session
            .new_legs
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for frames in new_legs.drain(..) {
            from_workers.push(frames);
        }
        if slot.is_none() {
            if let Some(worker) = session.parked.as_ref().map(|p| p.worker) {
                let admission = admission.clone();
                slot = Some(Box::pin(async move { admission.worker_slot(worker).await }));
            }
        }
        let fanout_deadline = fanout::sleep_until(session.fanouts.next_deadline());
        // What this session queued for its client and its workers is written by this task, as
        // the sockets take it.
        let writing = session.out.busy();
        let writing_legs = session.legs.values().any(Leg::busy);
        // While the legs hold as much as they may, the client is not read (worker output and
        // writes still flow); room in the tenant's total comes from other sessions.
        let legs_full = session.leg_budget.full() || session.legs.values().any(Leg::full);
        let tenant_full = legs_full && session.leg_budget.tenant_full();
        // While a request is parked the client is not read; worker output still flows.
        let waiting = slot.is_some() && !legs_full;
        let reading = slot.is_none() && !legs_full;
        let step = tokio::select! {
            permit = slot_wait(&mut slot), if waiting => Ok(Some(permit)),
            frame = stream.next(), if reading => session.on_client_frame(frame).await.map(|()| None),
            () = legs::write_legs(session.legs.values_mut()), if writing_legs => Ok(None),
            () = session.leg_budget.tenant_room(), if tenant_full => Ok(None),
            Some(ev) = from_workers.next() => session.on_leg_events(ev, &mut from_workers).await.map(|()| None),
            end = std::future::poll_fn(|cx| {
                rare.poll(cx, |cx| poll_rare(cx, shut_down.as_mut(), credential_ended.as_mut()))
            }) => Err(end),
            first = std::future::poll_fn(|cx| relayed.poll(cx, |cx| relay.poll_recv(cx))) => {
                session.on_relayed_burst(first, &mut relayed, &mut relay).await.map(|()| None)
            }
            () = fanout_deadline => session.fanouts_expired().map(|()| None),
            w = session.out.write(&mut sink), if writing => w.map(|_| None).map_err(|_| End::ClientGone),
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
        if let Err(end) = write_now(&mut session, &mut sink).await {
            break end;
        }
    };
    session.legs.clear();
    if session.denials_suppressed > 0 {
        // One record per session at most: bounded as its connections are.
        session.audit(
            "access.denied.suppressed",
            serde_json::json!({ "count": session.denials_suppressed }),
        );
    }
    if let Some(frame) = end.close_frame() {
        // Normally the close frame follows what is queued (e.g. the errors that led to it); a
        // slow client's queue is dropped instead, and it gets the close frame next.
        session.out.lock().close(frame, end == End::SlowClient);
    }
    // Everything else the session holds (legs, requests in flight and their worker slots, its
    // relay) goes now; only what is queued for the client stays, to be written.
    let out = session.out.clone();
    let client_read = session.client_read.clone();
    drop(session);
    // Until the close frame is out, and then until the client answers it, what the client
    // still sends is read and discarded: closing a socket with unread input resets it, and the
    // reset would destroy the close frame (and whatever preceded it) on its way to the client.
    let closing = async {
        let writer = out.finish(&mut sink);
        tokio::pin!(writer);
        let drain = async {
            while let Some(Ok(_)) = stream.next().await {
                client_read.discarded();
            }
        };
        tokio::pin!(drain);
        let drained = tokio::select! {
            () = &mut writer => false,
            () = &mut drain => true,
        };
        if drained {
            writer.await;
        } else {
            drain.await;
        }
        if end == End::TooBig || (end == End::LargeFrames && client_read.refused()) {
            // The rest of the oversized (or refused, as it arrived) message is still unread and
            // cannot be parsed away (whichever of the two ended first): give the client a
            // moment to read the close frame before our close resets the socket.
            tokio::time::sleep(TOO_BIG_LINGER).await;
        }
    };
    let _in_time = tokio::time::timeout(CLOSE_GRACE, closing).await;
    metrics.sessions.with_label_values(&[&tenant]).dec();
    metrics
        .sessions_closed
        .with_label_values(&[end.label()])
        .inc();
    end
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

    /// Queues a frame for `worker`'s leg (written by the session loop); false if there is no
    /// such leg or it broke.
    fn send_to_leg(&mut self, worker: WorkerId, text: impl Into<Utf8Bytes>) -> bool {
        match self.legs.get_mut(&worker) {
            Some(leg) => leg.send(text),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests;
