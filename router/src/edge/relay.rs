//! One relayed session at the edge, held to the bounds `serve` holds
//! (docs/decisions/0016-every-hop-holds-like-serve.md).
//!
//! Everything a session costs the edge lives in one future, run by the session's own task: the
//! client's socket, the link, the queue towards the client, the messages held while the
//! tenant's node starts, and the connection's admission ([`ConnectionGuard`]). The relay writes
//! to its client itself (no writer task, no channel), so when the session ends, for any reason,
//! its memory goes with it.
//!
//! Bounds, as in `serve` (see `session.rs` and `session/writer.rs`):
//! - The queue towards the client is bounded in frames (`client_queue`) and in bytes, per
//!   session (`client_queue_bytes`) and over all the tenant's sessions on this edge
//!   (`tenant_queue_bytes`). A frame counts until the socket has flushed it. Above half of any
//!   bound streaming deltas are dropped (`item/completed` carries the whole item); at a bound
//!   the client is too slow and is closed with 1008. Large frames go out in fragments, to the
//!   client and to the node ([`proto::ws::Fragments`]), so that neither socket's buffers keep
//!   their size.
//! - Every client frame, pings and pongs included, passes the connection's frame rate
//!   (`conn_fps`, `conn_burst`): a request over it is answered `-32001` and not forwarded; any
//!   other frame over it closes the session with 1008 and [`FLOOD_CLOSE_REASON`].
//! - While the tenant's node starts, what the client sends is held, bounded in messages and
//!   in bytes (against the same byte account as the queue), and the credential is watched; it
//!   is checked once more before the held messages leave.
//! - What goes towards the node is queued too ([`LinkOut`]), bounded as `serve` bounds a
//!   session's legs towards its workers: while it holds `client_queue_bytes` (or the tenant's
//!   sessions on this edge hold `tenant_queue_bytes`) the client is not read. A node that stops
//!   reading a session (its worker stopped) holds the client there, as `serve` would, and the
//!   relay's other work goes on: the node's frames, the client's queue, the credential.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{Sink, SinkExt, StreamExt};
use proto::rpc::{self, Message as Rpc, RequestId};
use proto::ws::Outgoing;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

use crate::admission::{Admission, ConnectionGuard, LegBudget, QueueBytes, ReadMeter, Rejection};
use crate::credentials::Lease;
use crate::end::End;
use crate::gate::Gate;
use crate::metrics::RouterMetrics;
use crate::offload::{self, LARGE_FRAME_BYTES};

/// Messages a client may send while its tenant's node starts, before it is closed (1008).
pub(super) const MAX_PENDING: usize = 256;
/// Close reason of a session that sent more than may be held while its node starts.
pub const PENDING_CLOSE_REASON: &str = "too many messages while the tenant's node starts";
/// How long a draining edge waits for a session's requests in flight before closing it.
const DRAIN_ANSWERS: Duration = Duration::from_secs(4);
/// How long the closing frames may take to reach the client and the node.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// A link the node has sent nothing on for this long is pinged; one silent for
/// [`LINK_SILENCE`] is lost (its machine gone, its process frozen: a TCP connection to a machine
/// that is gone neither answers nor closes), and the client is closed 1012. A link holding what
/// it has not taken is not judged by its silence (no ping could pass): see [`LINK_BLOCKED`].
const LINK_PING: Duration = Duration::from_secs(5);
const LINK_SILENCE: Duration = Duration::from_secs(10);
/// A link that has taken nothing of what it holds for this long is lost too. A node stops
/// reading a session while the session's worker does not read; the node's health check replaces
/// a worker that hangs within `health_interval_secs` + `health_timeout_secs` (15 s by default),
/// so a link held much longer is a node frozen (its kernel still acknowledging, its window shut)
/// or a machine gone with data unacknowledged (which TCP alone ends after about 15 minutes).
const LINK_BLOCKED: Duration = Duration::from_secs(120);
/// Frames from the node at least this large are queued as an exact-size copy.
const COPY_ABOVE: usize = 64 << 10;

/// What a relayed session needs from the listener: its admission and its bounds.
pub struct RelayCtx {
    /// The connection's slot under the connection caps, and its frame rate; held as long as
    /// the session.
    pub guard: ConnectionGuard,
    /// Router metrics (refusals, sessions closed, deltas dropped).
    pub metrics: RouterMetrics,
    /// Admission, for the tenant's byte account.
    pub admission: Arc<Admission>,
    /// Frames queued towards the client at most.
    pub client_queue: usize,
    /// Bytes queued towards the client at most.
    pub client_queue_bytes: usize,
    /// Bytes queued towards all the tenant's clients on this edge at most.
    pub tenant_queue_bytes: usize,
    /// Cancelled when the edge shuts down.
    pub shutdown: CancellationToken,
    /// The client socket's read buffer, counted against the tenant as it reads (shared with
    /// the socket: `door::ClientIo`).
    pub client_read: Arc<ReadMeter>,
}

/// How a relayed session ends: what each side is told.
#[derive(Debug)]
pub(super) struct Ending {
    /// The close frame for the client; `None` when the client closed or is gone.
    client: Option<Option<CloseFrame>>,
    /// What is queued for the client is dropped (a slow client gets its close frame next).
    skip_queue: bool,
    /// The close frame for the node (when the link is up).
    link: Option<CloseFrame>,
    /// The link broke: the node went away.
    pub(super) lost: bool,
    /// Why, as `serve` counts it (`codex_fleet_sessions_closed_total`).
    end: Option<End>,
}

impl Ending {
    /// The edge ends the session as `serve` would.
    pub(super) fn ours(end: End) -> Ending {
        Ending {
            client: Some(end.close_frame()),
            skip_queue: end == End::SlowClient,
            link: None,
            lost: false,
            end: Some(end),
        }
    }

    /// The edge closes the client with `code` and `reason` (after what is queued).
    pub(super) fn close(code: u16, reason: &str) -> Ending {
        Ending {
            client: Some(Some(CloseFrame {
                code: CloseCode::from(code),
                reason: reason.to_owned().into(),
            })),
            skip_queue: false,
            link: None,
            lost: false,
            end: None,
        }
    }

    fn client_closed(frame: Option<CloseFrame>) -> Ending {
        Ending {
            client: None,
            skip_queue: true,
            link: frame,
            lost: false,
            end: Some(End::ClientGone),
        }
    }

    fn node_closed(frame: Option<CloseFrame>) -> Ending {
        Ending {
            client: Some(frame),
            skip_queue: false,
            link: None,
            lost: false,
            end: None,
        }
    }

    fn node_lost() -> Ending {
        Ending {
            lost: true,
            ..Ending::close(super::NODE_LOST_CODE, super::NODE_LOST_REASON)
        }
    }
}

/// What waiting for the tenant's node came to.
pub(super) enum Waited<L> {
    /// The link is open; these messages go first.
    Linked(WebSocketStream<L>, Vec<Message>),
    /// No link; these requests were held.
    Failed(super::LinkError, Vec<Message>),
    /// The session ended while waiting.
    Ended(Ending),
}

/// Frames waiting for the client, bounded in frames and in bytes.
struct Out {
    queue: Outgoing,
    capacity: usize,
    soft_mark: usize,
    bytes: Arc<QueueBytes>,
}

/// Frames waiting for the node, bounded as a `serve` session's legs towards its workers are
/// ([`LegBudget`]: `client_queue_bytes` for the session, `tenant_queue_bytes` for the tenant's
/// sessions on this edge). While the budget is spent the client is not read (TCP backpressure,
/// as `serve` holds a client whose worker does not read); the link's other direction, the
/// client's queue and the credential go on. A link that holds what it has not taken is judged
/// by its progress ([`LINK_BLOCKED`]), not by its silence.
struct LinkOut {
    queue: Outgoing,
    budget: LegBudget,
    /// Bytes of `queue` counted in `budget`.
    held: usize,
}

impl LinkOut {
    fn new(budget: LegBudget) -> Self {
        LinkOut {
            queue: Outgoing::default(),
            budget,
            held: 0,
        }
    }

    fn push(&mut self, msg: Message) {
        let n = Outgoing::counted_len(&msg);
        self.budget.add(n);
        self.held += n;
        self.queue.frames.push_back(msg);
    }

    /// Writes what the link takes (a batch, see [`Outgoing::poll_send`]); the flushed bytes leave
    /// the budget. Cancel-safe.
    fn poll_write<Si>(&mut self, sink: &mut Si, cx: &mut Context<'_>) -> Poll<Result<(), WsError>>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        let n = ready!(self.queue.poll_send(sink, cx, |_| {}))?;
        if n > 0 {
            self.budget.release(n);
            self.held -= n;
        }
        Poll::Ready(Ok(()))
    }

    async fn write<Si>(&mut self, sink: &mut Si) -> Result<(), WsError>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        std::future::poll_fn(|cx| self.poll_write(sink, cx)).await
    }

    /// Writes what the link takes without waiting: a frame goes out in the pass that read it,
    /// and the loop's write branch finishes what the socket did not take.
    async fn write_now<Si>(&mut self, sink: &mut Si) -> Result<(), WsError>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        match std::future::poll_fn(|cx| Poll::Ready(self.poll_write(sink, cx))).await {
            Poll::Ready(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }
}

impl Drop for LinkOut {
    fn drop(&mut self) {
        self.budget.release(self.held);
    }
}

impl Out {
    fn busy(&self) -> bool {
        self.queue.busy()
    }

    /// Above the soft mark of any bound: streaming deltas go.
    fn behind(&self) -> bool {
        self.queue.frames.len() >= self.soft_mark || self.bytes.behind()
    }

    /// Queues a frame; a client whose queue is full (frames, or bytes of the session or the
    /// tenant) is too slow.
    fn push(&mut self, text: Utf8Bytes) -> Result<(), End> {
        if self.queue.frames.len() >= self.capacity || !self.bytes.try_add(text.len()) {
            tracing::info!(
                frames = self.queue.frames.len(),
                queued = self.bytes.session(),
                "closing a client over its queue's bound"
            );
            return Err(End::SlowClient);
        }
        self.queue.frames.push_back(Message::Text(text));
        Ok(())
    }

    fn drop_queue(&mut self) {
        self.bytes.release(self.queue.discard());
    }

    /// Writes what the socket takes (see [`Outgoing::poll_send`]); the flushed bytes leave the
    /// account. Ready(true) once the close frame is out.
    fn poll_write<Si>(&mut self, sink: &mut Si, cx: &mut Context<'_>) -> Poll<Result<bool, WsError>>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        let n = ready!(self.queue.poll_send(sink, cx, |_| {}))?;
        if n > 0 {
            self.bytes.release(n);
        }
        Poll::Ready(Ok(self.queue.closed()))
    }

    async fn write<Si>(&mut self, sink: &mut Si) -> Result<bool, WsError>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        std::future::poll_fn(|cx| self.poll_write(sink, cx)).await
    }
}

/// One session's relay: its client, its queue, its admission.
pub(super) struct Relay<C> {
    tx: SplitSink<WebSocketStream<C>, Message>,
    rx: SplitStream<WebSocketStream<C>>,
    out: Out,
    /// The client socket's read buffer, as large as the largest frame it read.
    client_read: Arc<ReadMeter>,
    guard: ConnectionGuard,
    metrics: RouterMetrics,
    shutdown: CancellationToken,
    /// Client requests not answered yet (a draining edge waits for them).
    in_flight: HashSet<RequestId>,
    /// What the link towards the node may hold ([`LinkOut`]).
    link_budget: LegBudget,
}

impl<C> Relay<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    pub(super) fn new(client: WebSocketStream<C>, ctx: RelayCtx) -> Self {
        let bytes = ctx.admission.client_queue_bytes(
            ctx.guard.tenant(),
            ctx.client_queue_bytes,
            ctx.tenant_queue_bytes,
        );
        let link_budget = ctx.admission.leg_budget(
            ctx.guard.tenant(),
            ctx.client_queue_bytes,
            ctx.tenant_queue_bytes,
        );
        let (tx, rx) = client.split();
        Relay {
            tx,
            rx,
            client_read: ctx.client_read,
            out: Out {
                queue: Outgoing::default(),
                capacity: ctx.client_queue.max(1),
                soft_mark: crate::config::soft_mark(ctx.client_queue),
                bytes,
            },
            guard: ctx.guard,
            metrics: ctx.metrics,
            shutdown: ctx.shutdown,
            in_flight: HashSet::new(),
            link_budget,
        }
    }

    /// The frame rate for a frame that cannot be answered `-32001`: over it, the session ends.
    fn unanswerable(&self) -> Result<(), Ending> {
        self.guard.check_frame().map_err(|r| {
            self.metrics.rejected_for(self.guard.tenant(), &r);
            tracing::info!("closing a connection that floods frames");
            Ending::ours(End::Flooded)
        })
    }

    /// A client frame through the connection's frame rate: what goes on to the node, if
    /// anything.
    fn on_client_frame(
        &mut self,
        frame: Option<Result<Message, WsError>>,
    ) -> Result<Option<Message>, Ending> {
        // The client's socket keeps a read buffer as large as its largest frame (an unfinished
        // one is counted as it arrives).
        if let Some(Ok(m)) = &frame {
            if !crate::door::took(&self.client_read, m) {
                tracing::info!("a client's frame found the tenant's read buffers full");
                return Err(Ending::ours(End::LargeFrames));
            }
        }
        match frame {
            Some(Ok(Message::Text(text))) => {
                if let Ok(Rpc::Request { id, .. }) = parse(&text) {
                    if let Err(r) = self.guard.check_frame() {
                        self.metrics.rejected_for(self.guard.tenant(), &r);
                        self.out
                            .push(r.to_error_response(&id).into())
                            .map_err(Ending::ours)?;
                        return Ok(None);
                    }
                    self.in_flight.insert(id);
                } else {
                    self.unanswerable()?;
                }
                Ok(Some(Message::Text(text)))
            }
            // The node answers binary frames as codex-fleet does (an error, counted), whatever
            // they hold: an empty one goes on, so a large one grows no buffer of the link's.
            Some(Ok(Message::Binary(_))) => {
                self.unanswerable()?;
                Ok(Some(Message::Binary(Default::default())))
            }
            Some(Ok(Message::Close(frame))) => Err(Ending::client_closed(frame)),
            // Ping and pong are answered on each hop, and cost a write each: they count.
            Some(Ok(_)) => {
                self.unanswerable()?;
                Ok(None)
            }
            Some(Err(WsError::Capacity(_))) => Err(Ending::ours(End::TooBig)),
            Some(Err(_)) if self.client_read.refused() => {
                tracing::info!(
                    "a client's unfinished message found the tenant's read buffers full"
                );
                Err(Ending::ours(End::LargeFrames))
            }
            Some(Err(_)) | None => Err(Ending::client_closed(None)),
        }
    }

    /// A text frame from the node, queued for the client (a delta dropped when behind).
    fn on_node_text(&mut self, text: Utf8Bytes) -> Result<(), Ending> {
        match parse(&text) {
            Ok(Rpc::Response { id }) => {
                self.in_flight.remove(&id);
            }
            Ok(Rpc::Notification { method, .. }) if method.is_delta() && self.out.behind() => {
                self.metrics.deltas_dropped.inc();
                return Ok(());
            }
            _ => {}
        }
        // A large frame is a slice of the link's read buffer, whose allocation may be up to
        // twice its size: queued as its own copy, it holds what the byte bound counts.
        let text = if text.len() >= COPY_ABOVE {
            Utf8Bytes::from(text.as_str().to_owned())
        } else {
            text
        };
        self.out.push(text).map_err(Ending::ours)
    }

    /// Holds what the client sends while `connect` finds (or starts) its node, watching the
    /// credential and writing what is queued for the client (refusals over the frame rate).
    pub(super) async fn wait<L, F>(&mut self, connect: F, lease: &Lease) -> Waited<L>
    where
        F: Future<Output = Result<WebSocketStream<L>, super::LinkError>>,
    {
        let mut pending: Vec<Message> = Vec::new();
        tokio::pin!(connect);
        let credential_ended = lease.ended();
        tokio::pin!(credential_ended);
        let shutdown = self.shutdown.clone();
        let ended = loop {
            let writing = self.out.busy();
            tokio::select! {
                biased;
                end = &mut credential_ended => break Ending::ours(End::from(end)),
                () = shutdown.cancelled() => break Ending::ours(End::Shutdown),
                r = &mut connect => {
                    return match r {
                        Ok(link) => Waited::Linked(link, pending),
                        Err(e) => Waited::Failed(e, pending),
                    };
                }
                w = self.out.write(&mut self.tx), if writing => {
                    if w.is_err() {
                        break Ending::client_closed(None);
                    }
                }
                m = self.rx.next() => match self.on_client_frame(m) {
                    Ok(Some(m)) => {
                        if pending.len() >= MAX_PENDING || !self.out.bytes.try_add(Outgoing::counted_len(&m)) {
                            break Ending::close(1008, PENDING_CLOSE_REASON);
                        }
                        pending.push(m);
                    }
                    Ok(None) => {}
                    Err(ending) => break ending,
                },
            }
        };
        for m in &pending {
            self.out.bytes.release(Outgoing::counted_len(m));
        }
        Waited::Ended(ended)
    }

    /// The node could not take the session: each held request is answered with `answer` and
    /// counted as refused for `refusal`, then the client is closed with `code` and `reason`.
    /// With `linger`, a session that held no request yet waits that long for its first one and
    /// answers it too, so the client learns why rather than seeing a bare close.
    pub(super) async fn refuse(
        mut self,
        pending: Vec<Message>,
        refusal: &Rejection,
        answer: impl Fn(&RequestId) -> String,
        linger: Option<Duration>,
        code: u16,
        reason: &str,
    ) {
        let mut answered = false;
        let mut answering = true;
        let deadline = tokio::time::Instant::now() + CLOSE_GRACE;
        for m in pending {
            self.out.bytes.release(Outgoing::counted_len(&m));
            if let (true, Message::Text(text)) = (answering, &m) {
                if let Ok(Rpc::Request { id, .. }) = parse(text) {
                    answered = true;
                    self.metrics.rejected_for(self.guard.tenant(), refusal);
                    answering = self.push_in_time(answer(&id).into(), deadline).await;
                }
            }
        }
        if let (false, Some(linger)) = (answered, linger) {
            let rx = &mut self.rx;
            let first = tokio::time::timeout(linger, async {
                while let Some(Ok(m)) = rx.next().await {
                    match m {
                        Message::Text(text) => {
                            if let Ok(Rpc::Request { id, .. }) = parse(&text) {
                                return Some(id);
                            }
                        }
                        Message::Close(_) => return None,
                        _ => {}
                    }
                }
                None
            })
            .await;
            if let Ok(Some(id)) = first {
                self.metrics.rejected_for(self.guard.tenant(), refusal);
                let _queued = self.out.push(answer(&id).into());
            }
        }
        self.finish(Ending::close(code, reason), async {}).await;
    }

    /// Queues `text` for the client, first writing out what is queued while the queue is full
    /// in frames (a session may hold more requests while it waits than `client_queue` frames),
    /// until `deadline`. False when it could not be queued (the deadline passed, the client is
    /// gone, or its queue is full in bytes: a slow client, as anywhere else).
    async fn push_in_time(&mut self, text: Utf8Bytes, deadline: tokio::time::Instant) -> bool {
        while self.out.queue.frames.len() >= self.out.capacity {
            let written = tokio::time::timeout_at(deadline, self.out.write(&mut self.tx)).await;
            if !matches!(written, Ok(Ok(false))) {
                return false;
            }
        }
        self.out.push(text).is_ok()
    }

    /// Relays until either side ends, `pending` first (once the credential is checked); then
    /// calls `relayed` with whether the link was lost, and closes both sides.
    pub(super) async fn run<L>(
        mut self,
        link: WebSocketStream<L>,
        pending: Vec<Message>,
        lease: &Lease,
        relayed: impl FnOnce(bool),
    ) where
        L: AsyncRead + AsyncWrite + Unpin,
    {
        let (mut link_tx, mut link_rx) = link.split();
        let mut to_node = LinkOut::new(self.link_budget.clone());
        let ending = self
            .relay(&mut link_tx, &mut link_rx, &mut to_node, pending, lease)
            .await;
        let lost = ending.lost;
        // The session is over: counted now, not after the closing handshakes.
        relayed(lost);
        let frame = ending.link.clone();
        let node = async move {
            if !lost {
                // What the client sent before it closed goes first, then the close frame.
                to_node.queue.frames.push_back(Message::Close(frame));
                while to_node.queue.busy() {
                    if to_node.write(&mut link_tx).await.is_err() {
                        break;
                    }
                }
                let _closed = link_tx.close().await;
            }
        };
        self.finish(ending, node).await;
    }

    async fn relay<L>(
        &mut self,
        link_tx: &mut SplitSink<WebSocketStream<L>, Message>,
        link_rx: &mut SplitStream<WebSocketStream<L>>,
        to_node: &mut LinkOut,
        pending: Vec<Message>,
        lease: &Lease,
    ) -> Ending
    where
        L: AsyncRead + AsyncWrite + Unpin,
    {
        // The held messages move from the client's byte account to the link's.
        for m in &pending {
            self.out.bytes.release(Outgoing::counted_len(m));
        }
        // The credential may have ended while the node started: nothing held leaves then.
        if let Some(end) = lease.ended_now() {
            return Ending::ours(End::from(end));
        }
        for m in pending {
            to_node.push(m);
        }
        if to_node.write_now(link_tx).await.is_err() {
            return Ending::node_lost();
        }
        let credential_ended = lease.ended();
        tokio::pin!(credential_ended);
        let shutdown = self.shutdown.clone();
        let shut_down = shutdown.cancelled();
        tokio::pin!(shut_down);
        // The credential's end and shutdown are polled only when one of them woke the task:
        // every poll of them takes a lock, shutdown's shared by every session of the edge.
        let mut rare = Gate::new();
        let mut draining: Option<tokio::time::Instant> = None;
        let mut heard = tokio::time::Instant::now();
        // While the link holds what it has not taken: when it last took a frame, and how many
        // it had taken then.
        let mut taken = (heard, to_node.queue.sent());
        let mut keepalive = tokio::time::interval_at(heard + LINK_PING, LINK_PING);
        keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let budget = to_node.budget.clone();
        loop {
            if let Some(deadline) = draining {
                if self.in_flight.is_empty() || tokio::time::Instant::now() >= deadline {
                    return Ending::ours(End::Shutdown);
                }
            }
            let writing = self.out.busy();
            let linking = to_node.queue.busy();
            // While the link holds as much as it may, the client is not read; room in the
            // tenant's total comes from its other sessions' links.
            let link_full = budget.full();
            let tenant_full = link_full && budget.tenant_full();
            tokio::select! {
                m = self.rx.next(), if draining.is_none() && !link_full => match self.on_client_frame(m) {
                    Ok(Some(m)) => {
                        to_node.push(m);
                        if to_node.write_now(link_tx).await.is_err() {
                            return Ending::node_lost();
                        }
                    }
                    Ok(None) => {}
                    Err(ending) => return ending,
                },
                m = link_rx.next() => {
                    if matches!(m, Some(Ok(_))) {
                        heard = tokio::time::Instant::now();
                    }
                    match m {
                        Some(Ok(Message::Text(text))) => {
                            if let Err(ending) = self.on_node_text(text) {
                                return ending;
                            }
                        }
                        Some(Ok(Message::Close(frame))) => return Ending::node_closed(frame),
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => return Ending::node_lost(),
                    }
                }
                w = to_node.write(link_tx), if linking => {
                    if w.is_err() {
                        return Ending::node_lost();
                    }
                }
                () = budget.tenant_room(), if tenant_full => {}
                w = self.out.write(&mut self.tx), if writing => {
                    if w.is_err() {
                        return Ending::client_closed(None);
                    }
                }
                _ = keepalive.tick() => {
                    let now = tokio::time::Instant::now();
                    if !to_node.queue.busy() || to_node.queue.sent() != taken.1 {
                        taken = (now, to_node.queue.sent());
                    }
                    // A link that has not taken what was written to it is not judged by its
                    // silence: its node may be holding the bytes back (a worker of the tenant's
                    // that stopped reading holds this session there, as `serve` holds its
                    // client), and a ping could not pass them. It is judged by its progress.
                    if to_node.queue.busy() {
                        heard = now;
                        let stuck = now - taken.0;
                        if stuck >= LINK_BLOCKED {
                            tracing::warn!(?stuck, "the node's link has taken nothing (its node frozen?); closing the session");
                            return Ending::node_lost();
                        }
                        continue;
                    }
                    let silent = heard.elapsed();
                    if silent >= LINK_SILENCE {
                        tracing::warn!(?silent, "the node's link is silent (its machine lost?); closing the session");
                        return Ending::node_lost();
                    }
                    if silent >= LINK_PING {
                        to_node.push(Message::Ping(Default::default()));
                        if to_node.write_now(link_tx).await.is_err() {
                            return Ending::node_lost();
                        }
                    }
                }
                event = std::future::poll_fn(|cx| rare.poll(cx, |cx| {
                    if let Poll::Ready(end) = credential_ended.as_mut().poll(cx) {
                        return Poll::Ready(Some(end));
                    }
                    // Once it fired the edge drains, and it is not polled again.
                    if draining.is_none() && shut_down.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(None);
                    }
                    Poll::Pending
                })) => match event {
                    Some(end) => return Ending::ours(End::from(end)),
                    None => draining = Some(tokio::time::Instant::now() + DRAIN_ANSWERS),
                },
                () = tokio::time::sleep_until(draining.unwrap_or_else(tokio::time::Instant::now)), if draining.is_some() => {}
            }
        }
    }

    /// Ends a session that never had a link.
    pub(super) async fn end(self, ending: Ending) {
        self.finish(ending, async {}).await;
    }

    /// Tells both sides (within [`CLOSE_GRACE`]) and ends; everything the session held is
    /// freed when this returns.
    async fn finish(self, ending: Ending, node: impl Future<Output = ()>) {
        let Relay {
            mut tx,
            mut rx,
            mut out,
            guard,
            metrics,
            client_read,
            ..
        } = self;
        if let Some(end) = &ending.end {
            metrics
                .sessions_closed
                .with_label_values(&[end.label()])
                .inc();
        }
        // The rest of the message is still unread: too big, or refused as it arrived.
        let unread = ending.end == Some(End::TooBig)
            || (ending.end == Some(End::LargeFrames) && client_read.refused());
        if ending.skip_queue {
            out.drop_queue();
        }
        if let Some(frame) = ending.client {
            out.queue.frames.push_back(Message::Close(frame));
        }
        // Until the close frame is out, what the client still sends is read and discarded:
        // closing a socket with unread input resets it, and the reset would destroy the close
        // frame on its way.
        let client = async {
            let writer = async {
                while out.busy() {
                    if !matches!(out.write(&mut tx).await, Ok(false)) {
                        break;
                    }
                }
                let _closed = tx.close().await;
            };
            tokio::pin!(writer);
            let drain = async {
                while let Some(Ok(_)) = rx.next().await {
                    client_read.discarded();
                }
            };
            tokio::pin!(drain);
            tokio::select! {
                () = &mut writer => drain.await,
                () = &mut drain => writer.await,
            }
            if unread {
                // As serve: the rest of the message is unread, and closing now would reset the
                // socket before the client reads the close frame.
                tokio::time::sleep(crate::end::TOO_BIG_LINGER).await;
            }
        };
        let _in_time =
            tokio::time::timeout(CLOSE_GRACE, futures_util::future::join(client, node)).await;
        drop(guard);
    }
}

/// `rpc::parse`; a frame over [`LARGE_FRAME_BYTES`] with the runtime thread's other relays handed
/// to another thread first, one such parse at a time ([`offload::in_place_one_at_a_time`]): an
/// edge serves every tenant, and the largest frame takes tens of milliseconds to parse.
fn parse(text: &str) -> Result<Rpc<'_>, rpc::ParseError> {
    if text.len() > LARGE_FRAME_BYTES {
        offload::in_place_one_at_a_time(|| rpc::parse(text))
    } else {
        rpc::parse(text)
    }
}

#[cfg(test)]
mod tests;
