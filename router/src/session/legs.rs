//! A session's legs: its own WebSocket connections to the workers it talks to.
//!
//! Nothing sits between a leg's socket and its session in either direction: the session task
//! polls every leg's socket for frames itself ([`LegFrames`]), and writes what it queued for a
//! worker itself ([`Leg::poll_write`], polled beside its other work), so a frame costs no task
//! switch and no channel either way. A session that stops reading backpressures its workers
//! through their sockets; towards the workers, what the legs hold is bounded in frames and in
//! bytes ([`LegBudget`], per session and per tenant): while the session's legs are over a bound
//! the session stops reading its client, so a client that floods a worker that does not read
//! pins no more than the bounds.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures_util::stream::SplitSink;
use futures_util::{Future, Sink, Stream, StreamExt};

use crate::admission::{HeldBuffer, LegBudget, WorkerSlots};
use crate::gate::Gate;
use proto::ws::WRITE_BATCH;
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use worker::{WorkerHandle, WorkerId};

/// Frames queued towards one worker at which the session stops reading its client.
const LEG_QUEUE: usize = 256;
/// Connect plus WebSocket handshake over the worker's socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a leg whose worker exited waits for its socket's end: the process is gone, so the
/// kernel already holds everything it sent and the end, and the runtime reports them within
/// microseconds; the wait only ends a leg whose socket something else still holds open.
const EXIT_GRACE: Duration = Duration::from_millis(500);

/// What a leg reports to its session.
#[derive(Debug)]
pub enum LegEvent {
    /// A text frame from the worker.
    Frame(WorkerId, Utf8Bytes),
    /// The leg is gone (worker exited, closed the connection, or sent something unusable).
    Closed(WorkerId, String),
    /// The worker sent a frame whose size the read buffers the tenant's sockets keep had no
    /// room for ([`HeldBuffer`]); the leg reads nothing more.
    LargeFrame(WorkerId),
}

/// One leg's frames from its worker, read by the session task itself: every frame, then
/// [`LegEvent::Closed`] if the worker goes; nothing more once the [`Leg`] is dropped.
pub type LegFrames = Pin<Box<dyn Stream<Item = LegEvent> + Send>>;

/// Every leg's frames, read by the session task with its own context: each leg's socket
/// registers the session task itself, and a wake-up polls the legs in turn from the one after
/// the leg that was served last (so a busy worker cannot starve the others). A leg whose
/// frames end leaves the set; an empty set is pending (legs join between the session loop's
/// turns).
///
/// Not `futures_util::stream::SelectAll`: its `FuturesUnordered` wakes its own task whenever
/// it has polled every stream it holds and all were pending (a yield, fair among many futures).
/// With a session's one or few legs that happened on every answer from a worker, and tokio
/// takes a task that woke itself for one that yielded: it queues it and wakes an idle runtime
/// thread for it, a futex wake and wait per round trip, and often the session moving to the
/// other core with cold caches (BENCHMARKS.md, bench 1, "A futex per round trip").
#[derive(Default)]
pub struct LegSet {
    legs: Vec<LegFrames>,
    /// Where the next poll starts.
    next: usize,
}

impl LegSet {
    /// Adds a leg's frames to the set.
    pub fn push(&mut self, frames: LegFrames) {
        self.legs.push(frames);
    }
}

impl Stream for LegSet {
    type Item = LegEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<LegEvent>> {
        let this = &mut *self;
        let len = this.legs.len();
        let mut ended = Vec::new();
        let mut event = None;
        for k in 0..len {
            let at = (this.next + k) % len;
            match this.legs[at].as_mut().poll_next(cx) {
                Poll::Ready(Some(ev)) => {
                    this.next = at + 1;
                    event = Some(ev);
                    break;
                }
                Poll::Ready(None) => ended.push(at),
                Poll::Pending => {}
            }
        }
        if !ended.is_empty() {
            // Highest first, so each index still names the leg it was taken for.
            ended.sort_unstable_by(|a, b| b.cmp(a));
            for at in ended {
                drop(this.legs.remove(at));
            }
            this.next = 0;
        }
        match event {
            Some(ev) => Poll::Ready(Some(ev)),
            None => Poll::Pending,
        }
    }
}

/// Why a leg could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LegError {
    /// Connecting or the handshake failed.
    #[error("cannot connect to worker {worker}: {reason}")]
    Connect {
        /// The worker.
        worker: WorkerId,
        /// What failed.
        reason: String,
    },
}

type LegSink = SplitSink<worker::LegStream, Message>;

/// One open leg: the writing half of its socket and what waits to be written.
pub struct Leg {
    /// Held so the pool counts this leg as a user of the worker (no idle stop under it).
    _handle: WorkerHandle,
    writer: Writer,
    /// Dropped with the leg: its [`LegFrames`] end without a word.
    _frames_end: oneshot::Sender<()>,
    /// The worker's in-flight slots, kept here so a request takes one without a lookup.
    slots: WorkerSlots,
}

/// The writing half of a leg, written by the session task.
struct Writer {
    worker: WorkerId,
    sink: LegSink,
    /// Frames waiting for the socket, each with the bytes it counts in the budget.
    /// A frame larger than [`proto::ws::FRAGMENT_SIZE`] waits as its fragments, so that the
    /// socket's write buffer stays about one fragment large.
    queue: VecDeque<(Message, usize)>,
    /// Bytes handed to the socket since its last flush; given back once flushed.
    unflushed: Option<usize>,
    /// A write failed: the leg takes nothing more (its reader reports the end).
    broken: bool,
    up: LegBudget,
}

impl Leg {
    /// Connects to the worker; the session reads the returned frames.
    pub async fn open(
        handle: WorkerHandle,
        max_message_bytes: usize,
        up: LegBudget,
        slots: WorkerSlots,
        held: HeldBuffer,
    ) -> Result<(Leg, LegFrames), LegError> {
        let worker = handle.id;
        // A leg leaves the descriptors above the reserve's line to what the process shares.
        let reserved = |e: std::io::Error| LegError::Connect {
            worker,
            reason: e.to_string(),
        };
        crate::descriptors::room().map_err(reserved)?;
        // Checks the listener is the worker itself; a mismatch is reported to the pool, which
        // replaces the worker. The session only sees this request fail.
        // Boxed: the handshake's state is kilobytes, and every future that may open a leg
        // (the request's and the answer's, on every round trip) would carry it and move it
        // whole at each `.await` (BENCHMARKS.md, bench 1, "Futures moved whole").
        let connect = Box::pin(handle.connect(max_message_bytes));
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(s)) => {
                // Another thread took the free descriptor in between: this leg is closed.
                crate::descriptors::check(s.get_ref().get_ref()).map_err(reserved)?;
                s
            }
            Ok(Err(e)) => {
                return Err(LegError::Connect {
                    worker,
                    reason: e.to_string(),
                })
            }
            Err(_) => {
                return Err(LegError::Connect {
                    worker,
                    reason: "timed out".into(),
                })
            }
        };
        let (sink, stream) = stream.split();
        let (frames_end, dropped) = oneshot::channel();
        let exited = handle.clone();
        let frames = read_frames(
            worker,
            stream,
            Box::pin(async move { exited.exited().await }),
            dropped,
            held,
        );
        let leg = Leg {
            _handle: handle,
            writer: Writer::new(worker, sink, up),
            _frames_end: frames_end,
            slots,
        };
        Ok((leg, frames))
    }

    /// The worker at the other end.
    pub fn worker(&self) -> WorkerId {
        self.writer.worker
    }

    /// The worker's in-flight slots.
    pub fn slots(&mut self) -> &mut WorkerSlots {
        &mut self.slots
    }

    /// Queues a text frame for the session to write; counted in the budget until the worker's
    /// socket has it. False if the leg is broken.
    pub fn send(&mut self, text: impl Into<Utf8Bytes>) -> bool {
        self.writer.send(text)
    }

    /// Queues a frame the session read from its client: shared with the client's read buffer
    /// (a reference count) while the leg's queue is short, as frames for the client are
    /// (`writer::shared_below`), so a worker that stops reading pins at most that many
    /// of the client's buffers; a copy beyond. False if the leg broke.
    pub fn send_shared(&mut self, text: &Utf8Bytes) -> bool {
        self.writer.send_shared(text)
    }

    /// Whether the session has writing to do on this leg.
    pub fn busy(&self) -> bool {
        self.writer.busy()
    }

    /// Whether this leg holds as many frames as it may.
    pub fn full(&self) -> bool {
        self.writer.full()
    }

    /// Hands what is queued to the socket while it takes it (a batch at most), then flushes and
    /// gives the bytes back to the budget. Ready once it made progress, or the leg broke;
    /// cancel-safe.
    pub fn poll_write(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.writer.poll_write(cx)
    }
}

// === impl Writer ===

impl Writer {
    fn new(worker: WorkerId, sink: LegSink, up: LegBudget) -> Self {
        Self {
            worker,
            sink,
            queue: VecDeque::new(),
            unflushed: None,
            broken: false,
            up,
        }
    }

    fn send(&mut self, text: impl Into<Utf8Bytes>) -> bool {
        if self.broken {
            return false;
        }
        let text = text.into();
        self.up.add(text.len());
        match proto::ws::Fragments::split(text) {
            Err(text) => {
                let len = text.len();
                self.queue.push_back((Message::Text(text), len));
            }
            // Queued as fragments here, so that writing stays as it is for every other frame.
            Ok(fragments) => self.queue.extend(fragments.map(|frame| {
                let len = frame.payload().len();
                (Message::Frame(frame), len)
            })),
        }
        true
    }

    fn send_shared(&mut self, text: &Utf8Bytes) -> bool {
        let text = super::writer::shared_below(text, self.queue.len());
        self.send(text)
    }

    fn busy(&self) -> bool {
        !self.broken && (!self.queue.is_empty() || self.unflushed.is_some())
    }

    fn full(&self) -> bool {
        self.queue.len() >= LEG_QUEUE
    }

    /// Hands queued frames to the socket while it takes them (at most [`WRITE_BATCH`]), then
    /// flushes and gives their bytes back. Ready once it made progress (or the leg broke);
    /// cancel-safe: a frame leaves the queue only once the socket has taken it.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self.poll_write_inner(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(()),
            Poll::Ready(Err(e)) => {
                tracing::debug!(worker = %self.worker, error = %e, "leg write failed");
                self.break_off();
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_write_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), tokio_tungstenite::tungstenite::Error>> {
        let mut batch = 0;
        while batch < WRITE_BATCH && !self.queue.is_empty() {
            ready!(Pin::new(&mut self.sink).poll_ready(cx))?;
            let Some((msg, len)) = self.queue.pop_front() else {
                break;
            };
            *self.unflushed.get_or_insert(0) += len;
            Pin::new(&mut self.sink).start_send(msg)?;
            batch += 1;
        }
        if let Some(len) = self.unflushed {
            ready!(Pin::new(&mut self.sink).poll_flush(cx))?;
            self.unflushed = None;
            self.up.release(len);
        }
        Poll::Ready(Ok(()))
    }

    /// Gives up on the leg's writing half: what waits is dropped and its bytes given back.
    fn break_off(&mut self) {
        self.broken = true;
        let queued: usize = self.queue.drain(..).map(|(_, len)| len).sum();
        self.up
            .release(queued + self.unflushed.take().unwrap_or_default());
    }
}

/// Writes what the session's legs have queued, as their sockets take it: resolves once some leg
/// made progress, pending while none can.
pub fn write_legs<'a>(
    legs: impl Iterator<Item = &'a mut Leg> + 'a,
) -> impl Future<Output = ()> + 'a {
    let mut legs: Vec<&'a mut Leg> = legs.filter(|l| l.busy()).collect();
    std::future::poll_fn(move |cx| {
        if poll_write_legs(legs.iter_mut().map(|l| &mut **l), cx) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
}

/// One write attempt on every busy leg with the caller's context; whether any made progress.
pub fn poll_write_legs<'a>(legs: impl Iterator<Item = &'a mut Leg>, cx: &mut Context<'_>) -> bool {
    let mut progressed = false;
    for leg in legs.filter(|l| l.busy()) {
        progressed |= leg.poll_write(cx).is_ready();
    }
    progressed
}

/// A leg's frames as a stream of its own (see [`read_frames`]): polled in place by the session,
/// nothing allocated and no future built per frame.
struct LegReader {
    worker: WorkerId,
    /// `None` once the leg ended or was dropped.
    reading: Option<Reading>,
}

/// What a [`LegReader`] reads from and watches while its leg lives.
struct Reading {
    stream: futures_util::stream::SplitStream<worker::LegStream>,
    /// The worker's exit and the leg's drop are polled behind a waker of their own, only when
    /// one of them woke the session (not on every frame: the exit is a watch channel, a lock).
    rare: Gate,
    /// Until the worker exits: its exit. Then the wait for its socket's end ([`EXIT_GRACE`]).
    exit: Exit,
    dropped: oneshot::Receiver<()>,
    /// The socket's read buffer, as large as the largest frame it read.
    held: HeldBuffer,
}

/// A [`LegReader`]'s view of its worker's process.
enum Exit {
    /// Running, as far as the reader knows: this resolves when it is gone.
    Running(Pin<Box<dyn Future<Output = ()> + Send>>),
    /// Gone: what its socket still holds is read to the socket's end, or until this fires.
    /// (The exit can be reported before the runtime has seen the socket readable, so the
    /// socket's being pending then does not mean it is empty.)
    Gone(Pin<Box<tokio::time::Sleep>>),
}

/// A leg's frames: text frames as they come, then `Closed` with the reason the worker went (its
/// process exited, it closed the connection, a read failed); nothing once `dropped` fires.
fn read_frames(
    worker: WorkerId,
    stream: futures_util::stream::SplitStream<worker::LegStream>,
    exited: Pin<Box<dyn Future<Output = ()> + Send>>,
    dropped: oneshot::Receiver<()>,
    held: HeldBuffer,
) -> LegFrames {
    Box::pin(LegReader {
        worker,
        reading: Some(Reading {
            stream,
            rare: Gate::new(),
            exit: Exit::Running(exited),
            dropped,
            held,
        }),
    })
}

impl Stream for LegReader {
    type Item = LegEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<LegEvent>> {
        let worker = self.worker;
        let Some(r) = self.reading.as_mut() else {
            return Poll::Ready(None);
        };
        let dropped = r.rare.poll(cx, |cx| {
            if Pin::new(&mut r.dropped).poll(cx).is_ready() {
                return Poll::Ready(true);
            }
            let Exit::Running(exited) = &mut r.exit else {
                return Poll::Pending;
            };
            ready!(exited.as_mut().poll(cx));
            r.exit = Exit::Gone(Box::pin(tokio::time::sleep(EXIT_GRACE)));
            Poll::Ready(false)
        });
        // A dropped leg says nothing more, whatever its socket still holds.
        if dropped == Poll::Ready(true) {
            self.reading = None;
            return Poll::Ready(None);
        }
        let reason = loop {
            let gone = match &mut r.exit {
                Exit::Running(_) => None,
                Exit::Gone(grace) => Some(grace),
            };
            match r.stream.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(Message::Text(text)))) => {
                    if !r.held.read(text.len()) {
                        self.reading = None;
                        return Poll::Ready(Some(LegEvent::LargeFrame(worker)));
                    }
                    return Poll::Ready(Some(LegEvent::Frame(worker, text)));
                }
                Poll::Ready(Some(Ok(Message::Close(frame)))) if gone.is_none() => {
                    break format!("worker closed the connection ({frame:?})");
                }
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(Some(Err(e))) if gone.is_none() => break format!("read error: {e}"),
                Poll::Ready(None) if gone.is_none() => break "connection ended".to_owned(),
                Poll::Pending => {
                    ready!(gone.map_or(Poll::Pending, |grace| grace.as_mut().poll(cx)));
                    break "worker exited".to_owned();
                }
                // Whatever ends the socket of a worker that exited ends the leg for that reason.
                _ => break "worker exited".to_owned(),
            }
        };
        self.reading = None;
        Poll::Ready(Some(LegEvent::Closed(worker, reason)))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // What is still queued is lost with the leg; its room in the budget is not.
        self.break_off();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::admission::{Admission, AdmissionConfig, TenantLegBytes, HELD_FREE};
    use futures_util::SinkExt;

    /// A WebSocket over a socket pair in memory: (the worker's end, the leg's end).
    async fn socket_pair() -> (worker::LegStream, worker::LegStream) {
        use tokio_tungstenite::tungstenite::protocol::Role;
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let worker_end = tokio_tungstenite::WebSocketStream::from_raw_socket(
            worker::leg::buffered(theirs).unwrap(),
            Role::Server,
            None,
        )
        .await;
        // As `worker::connect` sets a leg up: its buffered socket, its limits.
        let leg_end = tokio_tungstenite::WebSocketStream::from_raw_socket(
            worker::leg::buffered(ours).unwrap(),
            Role::Client,
            Some(worker::leg::leg_config(1 << 20)),
        )
        .await;
        (worker_end, leg_end)
    }

    /// A writer on one end of a socket pair, and the worker's end.
    async fn writer_pair(budget: LegBudget) -> (Writer, worker::LegStream) {
        let (worker_end, leg_end) = socket_pair().await;
        let (sink, _stream) = leg_end.split();
        (
            Writer::new(WorkerId::new("t", 1, 1), sink, budget),
            worker_end,
        )
    }

    /// A writer on one end of a socket pair, with a leg's limits for `max_message_bytes`, and
    /// the worker's end raw (to see the frames as written).
    async fn raw_writer_pair(
        budget: LegBudget,
        max_message_bytes: usize,
    ) -> (Writer, tokio::net::UnixStream) {
        use tokio_tungstenite::tungstenite::protocol::Role;
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let leg_end = tokio_tungstenite::WebSocketStream::from_raw_socket(
            worker::leg::buffered(ours).unwrap(),
            Role::Client,
            Some(worker::leg::leg_config(max_message_bytes)),
        )
        .await;
        let (sink, _stream) = leg_end.split();
        (Writer::new(WorkerId::new("t", 1, 1), sink, budget), theirs)
    }

    /// A large request reaches the worker in fragments (so the leg's write buffer stays about one
    /// fragment large), whole once joined, and its bytes count until the last is flushed.
    #[tokio::test]
    async fn a_large_request_goes_to_the_worker_in_fragments_and_arrives_whole() {
        let tenant = Arc::new(TenantLegBytes::new(8 << 20));
        let budget = LegBudget::new(8 << 20, tenant.clone());
        let (mut writer, mut theirs) = raw_writer_pair(budget.clone(), 4 << 20).await;
        let request = format!(
            r#"{{"id":1,"method":"turn/start","params":{{"pad":"{}"}}}}"#,
            "é".repeat(300 << 10)
        );
        assert!(writer.send(request.clone()));
        // The worker's end, raw: each frame's head, unmasked payloads joined.
        let read = crate::raw_ws::raw_message(&mut theirs);
        let write = async {
            while writer.busy() {
                std::future::poll_fn(|cx| writer.poll_write(cx)).await;
            }
        };
        let ((frames, joined), ()) = tokio::join!(read, write);
        assert_eq!(joined, request.as_bytes());
        assert!(frames.len() > 4, "{} frames", frames.len());
        crate::raw_ws::assert_text_fragments(&frames);
        assert_eq!(budget.session_used(), 0);
        assert_eq!(tenant.used(), 0);
    }

    /// A client's frames queued for a worker that does not read share the client's read buffer
    /// only while the queue is short: beyond that each is a copy, so a stalled worker pins a
    /// bounded number of the client's buffers, whatever the byte budget lets through.
    #[tokio::test]
    async fn a_stalled_leg_shares_only_a_short_queue_of_the_client_s_frames() {
        let tenant = Arc::new(TenantLegBytes::new(1 << 20));
        let budget = LegBudget::new(1 << 20, tenant);
        // The worker's end is never read; the socket pair holds little, so the queue grows.
        let (mut writer, _worker) = writer_pair(budget).await;
        let client_buffer = Utf8Bytes::from("x".repeat(16 << 10));
        let sent = 3 * super::super::writer::SHARED_QUEUED;
        for _ in 0..sent {
            assert!(writer.send_shared(&client_buffer));
            std::future::poll_fn(|cx| {
                let _pending = writer.poll_write(cx);
                Poll::Ready(())
            })
            .await;
        }
        let shared = writer
            .queue
            .iter()
            .filter(|(m, _)| matches!(m, Message::Text(t) if t.as_str().as_ptr() == client_buffer.as_str().as_ptr()))
            .count();
        assert!(
            writer.queue.len() > super::super::writer::SHARED_QUEUED,
            "the worker's socket should have filled: {} queued",
            writer.queue.len()
        );
        assert!(
            shared <= super::super::writer::SHARED_QUEUED,
            "{shared} of {} queued frames share the client's buffer",
            writer.queue.len()
        );
        assert!(shared > 0, "a short queue shares the client's buffer");
    }

    #[tokio::test]
    async fn the_session_writes_a_leg_in_order_and_its_bytes_come_back_once_written() {
        let tenant = Arc::new(TenantLegBytes::new(1 << 20));
        let budget = LegBudget::new(1 << 20, tenant.clone());
        let (mut writer, mut worker) = writer_pair(budget.clone()).await;
        let sent: Vec<String> = (0..150).map(|n| format!("{{\"n\":{n}}}")).collect();
        for t in &sent {
            assert!(writer.send(t.clone()));
        }
        assert_eq!(
            budget.session_used(),
            sent.iter().map(String::len).sum::<usize>()
        );
        while writer.busy() {
            std::future::poll_fn(|cx| writer.poll_write(cx)).await;
        }
        assert_eq!(
            budget.session_used(),
            0,
            "written frames give their bytes back"
        );
        for want in &sent {
            match worker.next().await {
                Some(Ok(Message::Text(t))) => assert_eq!(t.as_str(), want),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_worker_that_does_not_read_fills_the_budget_and_a_dropped_leg_gives_it_back() {
        let tenant = Arc::new(TenantLegBytes::new(8 << 20));
        let budget = LegBudget::new(4 << 20, tenant.clone());
        let (mut writer, _worker) = writer_pair(budget.clone()).await;
        // The worker reads nothing: the socket and tungstenite take some, then nothing more,
        // and the budget fills; the session would stop reading its client here.
        let frame = "x".repeat(256 << 10);
        let mut rounds = 0;
        while !budget.full() {
            assert!(writer.send(frame.clone()));
            let _ = futures_util::FutureExt::now_or_never(std::future::poll_fn(|cx| {
                writer.poll_write(cx)
            }));
            rounds += 1;
            assert!(rounds < 100, "the budget never filled");
        }
        assert!(writer.busy(), "frames wait for the worker");
        drop(writer);
        assert_eq!(budget.session_used(), 0);
        assert_eq!(tenant.used(), 0);
    }

    /// A request of more fragments than a leg queues keeps the leg full (the session stops
    /// reading its client) while its worker does not read, and until enough of it has drained;
    /// it arrives whole, in fragments, and its bytes come back once written.
    #[tokio::test]
    async fn a_request_of_more_fragments_than_a_leg_queues_keeps_it_full_until_drained() {
        let tenant = Arc::new(TenantLegBytes::new(32 << 20));
        let budget = LegBudget::new(32 << 20, tenant.clone());
        let (mut writer, mut worker) = raw_writer_pair(budget.clone(), 1 << 20).await;
        let request = format!(
            r#"{{"id":1,"method":"turn/start","params":{{"pad":"{}"}}}}"#,
            "x".repeat(17 << 20)
        );
        assert!(request.len() > LEG_QUEUE * proto::ws::FRAGMENT_SIZE);
        assert!(!writer.full());
        assert!(writer.send(request.clone()));
        assert!(writer.full(), "{} frames queued", writer.queue.len());
        assert_eq!(budget.session_used(), request.len());
        // The worker reads nothing: its socket takes a few fragments, then nothing more.
        let mut polls = 0;
        while futures_util::FutureExt::now_or_never(std::future::poll_fn(|cx| {
            writer.poll_write(cx)
        }))
        .is_some()
        {
            polls += 1;
            assert!(polls < 100, "the worker's socket never filled");
        }
        assert!(writer.full(), "{} frames queued", writer.queue.len());
        assert!(budget.session_used() > 0);
        // The worker reads: the leg drains, and is full no more once it holds fewer frames.
        let read = crate::raw_ws::raw_message(&mut worker);
        let mut full = Vec::new();
        let write = async {
            while writer.busy() {
                std::future::poll_fn(|cx| writer.poll_write(cx)).await;
                full.push(writer.full());
            }
        };
        let ((frames, joined), ()) = tokio::join!(read, write);
        let drained = full
            .iter()
            .position(|&f| !f)
            .expect("the leg is full no more once drained");
        assert!(
            full[drained..].iter().all(|&f| !f),
            "full again while draining: {full:?}"
        );
        assert!(!writer.full() && !writer.busy());
        assert!(joined == request.as_bytes(), "the request arrives whole");
        assert_eq!(
            frames.len(),
            request.len().div_ceil(proto::ws::FRAGMENT_SIZE)
        );
        crate::raw_ws::assert_text_fragments(&frames);
        assert_eq!(budget.session_used(), 0);
        assert_eq!(tenant.used(), 0);
    }

    /// A leg's socket pair in memory: (the worker's end, the frames the session reads, the
    /// worker's exit, the leg's drop).
    async fn leg_pair() -> (
        worker::LegStream,
        LegFrames,
        oneshot::Sender<()>,
        oneshot::Sender<()>,
    ) {
        leg_pair_of(
            WorkerId::new("t", 1, 1),
            HeldBuffer::new(Default::default(), usize::MAX),
        )
        .await
    }

    /// [`leg_pair`] to `worker`, its socket's read buffer counted in `held`.
    async fn leg_pair_of(
        worker: WorkerId,
        held: HeldBuffer,
    ) -> (
        worker::LegStream,
        LegFrames,
        oneshot::Sender<()>,
        oneshot::Sender<()>,
    ) {
        let (worker_end, leg_end) = socket_pair().await;
        let (_sink, stream) = leg_end.split();
        let (exit, exited) = oneshot::channel::<()>();
        let (drop_leg, dropped) = oneshot::channel();
        let frames = read_frames(
            worker,
            stream,
            Box::pin(async move {
                let _ = exited.await;
            }),
            dropped,
            held,
        );
        (worker_end, frames, exit, drop_leg)
    }

    fn text(e: Option<LegEvent>) -> String {
        match e {
            Some(LegEvent::Frame(_, t)) => t.to_string(),
            other => panic!("a frame, not {other:?}"),
        }
    }

    fn closed(e: Option<LegEvent>) -> String {
        match e {
            Some(LegEvent::Closed(_, why)) => why,
            other => panic!("closed, not {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_leg_reads_text_frames_in_order_skips_others_and_ends_with_the_workers_close() {
        let (mut worker, mut frames, _exit, _drop) = leg_pair().await;
        worker.send(Message::text("one")).await.unwrap();
        worker.send(Message::binary(vec![1, 2])).await.unwrap();
        worker
            .send(Message::Ping(Default::default()))
            .await
            .unwrap();
        worker.send(Message::text("two")).await.unwrap();
        worker.close(None).await.unwrap();
        assert_eq!(text(frames.next().await), "one");
        assert_eq!(
            text(frames.next().await),
            "two",
            "binary and ping are skipped"
        );
        let why = closed(frames.next().await);
        assert!(why.contains("worker closed the connection"), "{why}");
        assert!(frames.next().await.is_none(), "nothing after Closed");
    }

    #[tokio::test]
    async fn frames_larger_than_the_read_buffers_arrive_whole_and_in_order() {
        // tungstenite reads at most `READ_BUFFER_SIZE` at once, out of a socket buffer of
        // `LEG_SOCKET_BUFFER`: a frame many times both, between small ones, still arrives whole.
        let (mut worker, mut frames, _exit, _drop) = leg_pair().await;
        let big: String = (0..200_000)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        assert!(big.len() > 10 * (proto::ws::READ_BUFFER_SIZE + proto::ws::LEG_SOCKET_BUFFER));
        let sender = tokio::spawn(async move {
            for t in ["small", big.as_str(), "between", big.as_str(), "last"] {
                worker.send(Message::text(t)).await.unwrap();
            }
            (worker, big)
        });
        let mut got = Vec::new();
        for _ in 0..5 {
            got.push(text(frames.next().await));
        }
        let (_worker, big) = sender.await.unwrap();
        assert_eq!(
            got,
            ["small", big.as_str(), "between", big.as_str(), "last"]
        );
    }

    #[tokio::test]
    async fn a_leg_ends_when_its_worker_exits_or_its_socket_ends() {
        // The process exited with its socket still open (held by something else): the leg says
        // so once the grace is out.
        let (_worker, mut frames, exit, _drop) = leg_pair().await;
        exit.send(()).unwrap();
        let started = std::time::Instant::now();
        assert_eq!(closed(frames.next().await), "worker exited");
        assert!(started.elapsed() >= EXIT_GRACE, "{:?}", started.elapsed());
        // The socket ended without a close frame.
        let (worker, mut frames, _exit, _drop) = leg_pair().await;
        drop(worker);
        let why = closed(frames.next().await);
        assert!(
            why == "connection ended" || why.starts_with("read error"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn a_dropped_leg_ends_its_frames_without_a_word() {
        let (mut worker, mut frames, _exit, drop_leg) = leg_pair().await;
        worker.send(Message::text("before")).await.unwrap();
        assert_eq!(text(frames.next().await), "before");
        drop(drop_leg);
        worker.send(Message::text("after")).await.unwrap();
        assert!(
            frames.next().await.is_none(),
            "a dropped leg reports nothing more, not even Closed"
        );
    }

    /// The leg's next event, within 5 s.
    async fn within(frames: &mut LegFrames) -> Option<LegEvent> {
        tokio::time::timeout(Duration::from_secs(5), frames.next())
            .await
            .expect("the leg says something within 5 s")
    }

    #[tokio::test]
    async fn a_worker_that_exits_while_the_session_waits_wakes_it_after_its_last_frames() {
        let (mut worker, mut frames, exit, _drop) = leg_pair().await;
        worker.send(Message::text("one")).await.unwrap();
        assert_eq!(text(within(&mut frames).await), "one");
        // Nothing ready: the session waits on the socket and (behind the leg's gate) the exit.
        assert!(futures_util::FutureExt::now_or_never(frames.next()).is_none());
        worker.send(Message::text("two")).await.unwrap();
        assert_eq!(text(within(&mut frames).await), "two");
        // The exit comes while the session waits: it must wake it.
        let exiting = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            exit.send(()).unwrap();
        });
        assert_eq!(closed(within(&mut frames).await), "worker exited");
        assert!(within(&mut frames).await.is_none());
        exiting.await.unwrap();
        // An exit reported before the runtime has seen the socket readable: what the worker
        // sent before it went is still read, then its socket's end ends the leg (as a process's
        // exit closes it) without waiting out the grace.
        let (mut worker, mut frames, exit, _drop) = leg_pair().await;
        assert!(futures_util::FutureExt::now_or_never(frames.next()).is_none());
        worker.send(Message::text("last")).await.unwrap();
        exit.send(()).unwrap();
        assert!(
            futures_util::FutureExt::now_or_never(frames.next()).is_none(),
            "the runtime has not yet seen the frame: the leg waits for it, it does not end"
        );
        drop(worker);
        let started = std::time::Instant::now();
        assert_eq!(text(within(&mut frames).await), "last");
        assert_eq!(closed(within(&mut frames).await), "worker exited");
        assert!(started.elapsed() < EXIT_GRACE, "{:?}", started.elapsed());
    }

    /// The leg's next event while `worker` sends `text` (read as it is written: a large frame
    /// does not fit in the socket pair's buffers).
    async fn sent_and_read(
        worker: &mut worker::LegStream,
        frames: &mut LegFrames,
        text: &str,
    ) -> Option<LegEvent> {
        let (sent, got) = tokio::join!(worker.send(Message::text(text)), within(frames));
        sent.unwrap();
        got
    }

    /// Whether a frame from `worker` with `want` (compared here: a failed `assert_eq!` would
    /// print hundreds of kilobytes).
    fn is_frame(e: Option<LegEvent>, worker: WorkerId, want: &str) -> bool {
        match e {
            Some(LegEvent::Frame(w, t)) => w == worker && t.as_str() == want,
            other => panic!("a frame, not {other:?}"),
        }
    }

    /// Whether a leg's frames have ended: they say so at once, without reading the socket.
    fn ended(frames: &mut LegFrames) -> bool {
        matches!(
            futures_util::FutureExt::now_or_never(frames.next()),
            Some(None)
        )
    }

    /// A worker's frame that the tenant's sockets' read buffers have no room for ends its leg:
    /// the leg says so, reads nothing more, and the refused growth counts nothing. A frame that
    /// fits is delivered, and its socket's buffer counts at its size until the leg goes.
    #[tokio::test]
    async fn a_worker_s_frame_beyond_the_tenant_s_read_buffers_ends_its_leg() {
        let admission = Admission::new(AdmissionConfig::default()).unwrap();
        let held = || admission.held_bytes("acme");
        // Room for 300 KiB of the tenant's read buffers.
        let bound = 300 << 10;
        let (one, two, three) = (
            WorkerId::new("acme", 1, 1),
            WorkerId::new("acme", 2, 1),
            WorkerId::new("acme", 3, 1),
        );
        let (mut first, mut first_frames, _first_exit, first_drop) =
            leg_pair_of(one, admission.held_buffer("acme", bound)).await;
        // A frame every socket's buffer may grow to counts nothing.
        let free = "f".repeat(HELD_FREE);
        let got = sent_and_read(&mut first, &mut first_frames, &free).await;
        assert!(is_frame(got, one, &free));
        assert_eq!(held(), 0);
        // Above that, a frame that fits is delivered and counts at its size.
        let fits = "a".repeat(200 << 10);
        let got = sent_and_read(&mut first, &mut first_frames, &fits).await;
        assert!(is_frame(got, one, &fits));
        assert_eq!(held(), 200 << 10);
        // Another leg's 150 KiB would take the tenant over its bound: that leg ends.
        let (mut second, mut second_frames, _second_exit, _second_drop) =
            leg_pair_of(two, admission.held_buffer("acme", bound)).await;
        let too_large = "b".repeat(150 << 10);
        match sent_and_read(&mut second, &mut second_frames, &too_large).await {
            Some(LegEvent::LargeFrame(w)) => assert_eq!(w, two),
            other => panic!("a large frame, not {other:?}"),
        }
        assert!(ended(&mut second_frames), "the leg reads nothing more");
        assert_eq!(held(), 200 << 10, "a refused growth is not counted");
        // The first leg reads on; dropped, its socket's buffer leaves the count with it.
        let got = sent_and_read(&mut first, &mut first_frames, "small").await;
        assert!(is_frame(got, one, "small"));
        assert_eq!(held(), 200 << 10);
        drop(first_drop);
        assert!(within(&mut first_frames).await.is_none());
        assert_eq!(held(), 0);
        // A leg whose own frame outgrows the bound ends too, and what it counted goes with its
        // reader (its socket is gone), while the leg itself still lives.
        let (mut third, mut third_frames, _third_exit, _third_drop) =
            leg_pair_of(three, admission.held_buffer("acme", bound)).await;
        let got = sent_and_read(&mut third, &mut third_frames, &fits).await;
        assert!(is_frame(got, three, &fits));
        assert_eq!(held(), 200 << 10);
        let too_large = "c".repeat(400 << 10);
        match sent_and_read(&mut third, &mut third_frames, &too_large).await {
            Some(LegEvent::LargeFrame(w)) => assert_eq!(w, three),
            other => panic!("a large frame, not {other:?}"),
        }
        assert!(ended(&mut third_frames), "the leg reads nothing more");
        assert_eq!(held(), 0);
    }

    /// A leg whose frames come from a channel the test holds.
    fn channel_leg(n: u32) -> (tokio::sync::mpsc::UnboundedSender<&'static str>, LegFrames) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
        let frames = futures_util::stream::unfold(rx, move |mut rx| async move {
            let t = rx.recv().await?;
            Some((LegEvent::Frame(WorkerId::new("t", n, 1), t.into()), rx))
        });
        (tx, Box::pin(frames))
    }

    /// Counts the wake-ups of the task that polls.
    #[derive(Default)]
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl futures_util::task::ArcWake for Wakes {
        fn wake_by_ref(arc_self: &Arc<Self>) {
            arc_self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn from(e: Poll<Option<LegEvent>>) -> (u32, String) {
        match e {
            Poll::Ready(Some(LegEvent::Frame(w, t))) => (w.slot(), t.to_string()),
            other => panic!("a frame, not {other:?}"),
        }
    }

    #[test]
    fn a_leg_set_never_wakes_its_own_task() {
        let wakes = Arc::new(Wakes::default());
        let waker = futures_util::task::waker(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut set = LegSet::default();
        let (a, frames) = channel_leg(1);
        set.push(frames);
        let (_b, frames) = channel_leg(2);
        set.push(frames);
        a.send("one").unwrap();
        assert_eq!(from(set.poll_next_unpin(&mut cx)), (1, "one".into()));
        // Every leg polled and pending: the set waits for a socket, and does not wake itself
        // (a self-wake costs the session a trip through the runtime's queue).
        assert!(set.poll_next_unpin(&mut cx).is_pending());
        assert!(set.poll_next_unpin(&mut cx).is_pending());
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 0);
        // A frame wakes it, and the next poll has it.
        a.send("two").unwrap();
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(from(set.poll_next_unpin(&mut cx)), (1, "two".into()));
    }

    #[test]
    fn a_leg_set_serves_its_legs_in_turn() {
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut set = LegSet::default();
        let mut senders = Vec::new();
        for n in 1..=3 {
            let (tx, frames) = channel_leg(n);
            for _ in 0..4 {
                tx.send("x").unwrap();
            }
            senders.push(tx);
            set.push(frames);
        }
        let order: Vec<u32> = (0..12)
            .map(|_| from(set.poll_next_unpin(&mut cx)).0)
            .collect();
        assert_eq!(order, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]);
        assert!(set.poll_next_unpin(&mut cx).is_pending());
    }

    #[test]
    fn a_leg_whose_frames_end_leaves_the_set_and_every_other_leg_is_still_read() {
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut set = LegSet::default();
        let (a, frames) = channel_leg(1);
        set.push(frames);
        let (b, frames) = channel_leg(2);
        set.push(frames);
        let (c, frames) = channel_leg(3);
        set.push(frames);
        // Served leg 2 last, so the next poll starts at leg 3 and wraps round to 1 and 2.
        b.send("b").unwrap();
        assert_eq!(from(set.poll_next_unpin(&mut cx)).0, 2);
        // Leg 1 ends during the turn that must still reach leg 2's frame.
        drop(a);
        b.send("b2").unwrap();
        assert_eq!(from(set.poll_next_unpin(&mut cx)), (2, "b2".into()));
        assert_eq!(set.legs.len(), 2, "the ended leg left");
        c.send("c").unwrap();
        assert_eq!(from(set.poll_next_unpin(&mut cx)).0, 3);
        drop((b, c));
        // Every leg gone: the set stays pending (legs join between the loop's turns).
        assert!(set.poll_next_unpin(&mut cx).is_pending());
        assert!(set.legs.is_empty());
        let (d, frames) = channel_leg(4);
        set.push(frames);
        d.send("d").unwrap();
        assert_eq!(from(set.poll_next_unpin(&mut cx)).0, 4);
    }
}
