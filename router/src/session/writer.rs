//! The client writer: frames the session queues for its client are written by the session task
//! itself, in batches with one flush per batch, whenever the client's socket takes them (the
//! session loop polls [`OutQueue::poll_write`] beside its other work: no writer task, no
//! channel, no wake-up per frame). The queue is bounded in frames and bytes, and a client too
//! slow to keep it from filling is closed (docs/decisions/0008-bounded-everything.md). A large
//! frame goes out in fragments ([`proto::ws::Fragments`]), so the socket's buffers stay small.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};

use futures_util::{Sink, SinkExt};
use proto::ws::{Outgoing, WRITE_BATCH};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use super::{End, Session};
use crate::admission::QueueBytes;

/// Queued frames up to which a worker frame is queued shared rather than copied (see
/// [`Session::for_client`]): one batch, which is all a client that keeps up has waiting.
pub(super) const SHARED_QUEUED: usize = WRITE_BATCH;

/// Frames waiting for the client, bounded in frames (`capacity`) and in bytes (`bytes`, the
/// session's and its tenant's bounds).
pub(super) struct OutQueue {
    /// A message's bytes leave `bytes` as the socket takes it (a large text's with its last
    /// fragment).
    queue: Outgoing,
    capacity: usize,
    bytes: Arc<QueueBytes>,
}

/// The session's [`OutQueue`], in a mutex only so that the session stays `Sync`; only the session
/// task touches it, so it is never contended.
pub(super) struct Out(Mutex<OutQueue>);

/// What one [`OutQueue::poll_write`] did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Written {
    /// Everything handed over so far is flushed; frames may remain (a batch is bounded).
    Flushed,
    /// The close frame was written and flushed.
    Closed,
}

// === impl Out ===

impl Out {
    pub(super) fn new(capacity: usize, bytes: Arc<QueueBytes>) -> Self {
        Self(Mutex::new(OutQueue {
            queue: Outgoing::default(),
            capacity: capacity.max(1),
            bytes,
        }))
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, OutQueue> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the loop has writing to do.
    pub(super) fn busy(&self) -> bool {
        self.lock().queue.busy()
    }

    /// Writes what the socket takes now; see [`OutQueue::poll_write`].
    pub(super) async fn write<Si>(&self, sink: &mut Si) -> Result<Written, WsError>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        std::future::poll_fn(|cx| self.poll_write(sink, cx)).await
    }

    /// One attempt at [`OutQueue::poll_write`] with the caller's context.
    pub(super) fn poll_write<Si>(
        &self,
        sink: &mut Si,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Written, WsError>>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        self.lock().poll_write(sink, cx)
    }

    /// Writes everything queued, the close frame included if one is, then closes the sink.
    pub(super) async fn finish<Si>(&self, sink: &mut Si)
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        while self.busy() {
            match self.write(sink).await {
                Ok(Written::Flushed) => {}
                Ok(Written::Closed) | Err(_) => break,
            }
        }
        let _flushed = sink.close().await;
    }
}

// === impl OutQueue ===

impl OutQueue {
    /// Frames waiting.
    pub(super) fn len(&self) -> usize {
        self.queue.frames.len()
    }

    fn push(&mut self, msg: Message) -> bool {
        if self.queue.frames.len() >= self.capacity {
            return false;
        }
        self.queue.frames.push_back(msg);
        true
    }

    /// Queues the close frame after what is queued; if the queue is full, or the client is too
    /// slow (`skip_queue`), what is queued is dropped and the close frame goes next.
    pub(super) fn close(&mut self, frame: CloseFrame, skip_queue: bool) {
        if skip_queue || self.queue.frames.len() >= self.capacity {
            self.bytes.release(self.queue.discard());
        }
        self.queue.frames.push_back(Message::Close(Some(frame)));
    }

    /// Hands queued frames to the socket while it takes them (at most [`WRITE_BATCH`]), then
    /// flushes ([`Outgoing::poll_send`]). Cancel-safe.
    fn poll_write<Si>(
        &mut self,
        sink: &mut Si,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Written, WsError>>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        let bytes = &self.bytes;
        ready!(self.queue.poll_send(sink, cx, |done| bytes.release(done)))?;
        Poll::Ready(Ok(if self.queue.closed() {
            Written::Closed
        } else {
            Written::Flushed
        }))
    }
}

/// `frame` itself (a reference count) with fewer than [`SHARED_QUEUED`] frames `queued`, else a
/// copy in its own allocation.
pub(super) fn shared_below(frame: &Utf8Bytes, queued: usize) -> Utf8Bytes {
    if queued < SHARED_QUEUED {
        frame.clone()
    } else {
        Utf8Bytes::from(frame.as_str())
    }
}

// === impl Session ===

impl Session {
    /// Whether the client asked not to get notifications of `method` (its initialize's
    /// `optOutNotificationMethods`). Its workers leave those out of what they send its legs;
    /// this is for what codex-fleet sends it on their behalf (relayed broadcasts, and what it
    /// writes for a worker that ended).
    pub(super) fn opted_out(&self, method: &str) -> bool {
        self.init
            .as_ref()
            .is_some_and(|i| i.opt_out.contains(method))
    }

    /// Queues a notification codex-fleet wrote itself, unless the client opted out of its
    /// method.
    pub(super) fn notify_client(&self, n: crate::tenants::rehome::Synthesized) -> Result<(), End> {
        if self.opted_out(n.method.as_str()) {
            return Ok(());
        }
        self.to_client(n.text)
    }

    /// Queues a frame for the client; a client whose queue is full (in frames, or in bytes for
    /// the session or its tenant) is too slow and is closed. A `String` moves in without a copy;
    /// a shared frame ([`Utf8Bytes`]) is queued by reference.
    pub(super) fn to_client(&self, text: impl Into<Utf8Bytes>) -> Result<(), End> {
        let text = text.into();
        let n = text.len();
        if !self.queued_bytes.try_add(n) {
            tracing::info!(
                queued = self.queued_bytes.session(),
                tenant_queued = self.ctx.admission.queued_bytes(self.tenant()),
                "closing a client over its queue's byte bound"
            );
            return Err(End::SlowClient);
        }
        if self.out.lock().push(Message::text(text)) {
            Ok(())
        } else {
            self.queued_bytes.release(n);
            Err(End::SlowClient)
        }
    }

    /// A worker frame as the client queue holds it: the leg's own bytes, shared (no copy) while
    /// the queue is short, which is whenever the client keeps up. A shared frame keeps the leg's
    /// read buffer it was read into (up to `proto::ws::READ_BUFFER_SIZE`, more for a larger
    /// frame) alive until it is written, so beyond [`SHARED_QUEUED`] queued frames each is copied
    /// into its own allocation: a client that stops reading pins at most that many buffers, on
    /// top of the bytes its queue's bounds count.
    pub(super) fn for_client(&self, frame: &Utf8Bytes) -> Utf8Bytes {
        shared_below(frame, self.queued())
    }

    /// Frames waiting for the client.
    pub(super) fn queued(&self) -> usize {
        self.out.lock().len()
    }
}

#[cfg(test)]
mod tests {
    //! The client writer alone, in memory: order, batching and flushes, byte accounting, a socket
    //! that stops taking, the close frame. What the hot-path work (fewer copies, shared frames,
    //! other batch sizes) must keep.

    use std::pin::Pin;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

    use super::*;

    /// A client socket that records what it takes and its flushes, and takes at most `room`
    /// frames before it stops (Pending) until given more.
    #[derive(Default)]
    struct Socket {
        taken: Vec<Message>,
        /// How many frames were taken when each flush happened.
        flushes: Vec<usize>,
        room: Option<usize>,
        waker: Option<std::task::Waker>,
    }

    impl Sink<Message> for Socket {
        type Error = WsError;

        fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            if self.room == Some(0) {
                self.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            Poll::Ready(Ok(()))
        }

        fn start_send(mut self: Pin<&mut Self>, msg: Message) -> Result<(), WsError> {
            if let Some(room) = self.room.as_mut() {
                *room -= 1;
            }
            self.taken.push(msg);
            Ok(())
        }

        fn poll_flush(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Result<(), WsError>> {
            let n = self.taken.len();
            self.flushes.push(n);
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            Poll::Ready(Ok(()))
        }
    }

    fn texts(msgs: &[Message]) -> Vec<String> {
        msgs.iter()
            .map(|m| match m {
                Message::Text(t) => t.to_string(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    /// A queue of `capacity` frames, bounded at `bound` bytes; and the bytes account.
    fn queue(capacity: usize, bound: usize) -> (Out, Arc<QueueBytes>) {
        let bytes = QueueBytes::new(Arc::new(AtomicUsize::new(0)), bound, bound);
        (Out::new(capacity, bytes.clone()), bytes)
    }

    /// Queues `text` as the session does: counted in bytes, then pushed.
    fn queue_text(out: &Out, bytes: &QueueBytes, text: String) -> bool {
        if !bytes.try_add(text.len()) {
            return false;
        }
        let n = text.len();
        let pushed = out.lock().push(Message::text(text));
        if !pushed {
            bytes.release(n);
        }
        pushed
    }

    #[test]
    fn a_worker_frame_is_shared_while_the_queue_is_short_and_copied_behind_it() {
        let frame = Utf8Bytes::from(r#"{"method":"item/agentMessage/delta"}"#.to_owned());
        let short = shared_below(&frame, 0);
        assert_eq!(
            short.as_ptr(),
            frame.as_ptr(),
            "no copy for a client that keeps up"
        );
        let behind = shared_below(&frame, SHARED_QUEUED);
        assert_ne!(
            behind.as_ptr(),
            frame.as_ptr(),
            "its own allocation behind a batch"
        );
        assert_eq!(behind.as_str(), frame.as_str());
    }

    #[tokio::test]
    async fn frames_leave_in_order_in_batches_with_one_flush_each_and_give_their_bytes_back() {
        let (out, bytes) = queue(1000, 1 << 20);
        let sent: Vec<String> = (0..150).map(|n| format!("{{\"n\":{n}}}")).collect();
        for t in &sent {
            assert!(queue_text(&out, &bytes, t.clone()));
        }
        assert!(bytes.session() > 0);
        let mut socket = Socket::default();
        let mut writes = 0;
        while out.busy() {
            assert_eq!(out.write(&mut socket).await.unwrap(), Written::Flushed);
            writes += 1;
        }
        assert_eq!(texts(&socket.taken), sent, "every frame once, in order");
        // 150 frames: 64 + 64 + 22, each batch flushed once.
        assert_eq!(socket.flushes, vec![64, 128, 150]);
        assert_eq!(writes, 3);
        assert_eq!(bytes.session(), 0, "written frames give their bytes back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_socket_that_stops_taking_keeps_the_rest_queued_counted_and_in_order() {
        let (out, bytes) = queue(1000, 1 << 20);
        for n in 0..10 {
            assert!(queue_text(&out, &bytes, format!("f{n}")));
        }
        let mut socket = Socket {
            room: Some(4),
            ..Socket::default()
        };
        // The socket takes four and stops: the write is pending, and cancelling it loses nothing.
        let pending = tokio::time::timeout(Duration::from_millis(50), out.write(&mut socket)).await;
        assert!(
            pending.is_err(),
            "a socket that takes nothing more holds the write"
        );
        assert_eq!(texts(&socket.taken), ["f0", "f1", "f2", "f3"]);
        assert_eq!(out.lock().len(), 6);
        assert_eq!(
            bytes.session(),
            6 * 2,
            "what is still queued is still counted"
        );
        // Unflushed frames are flushed on the next write, before more goes out.
        socket.room = None;
        out.finish(&mut socket).await;
        let want: Vec<String> = (0..10).map(|n| format!("f{n}")).collect();
        assert_eq!(texts(&socket.taken), want, "nothing lost or repeated");
        assert_eq!(bytes.session(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_frame_goes_out_in_fragments_counted_until_its_last_and_a_close_may_cut_it() {
        use proto::ws::FRAGMENT_SIZE;
        use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};

        let (out, bytes) = queue(1000, 1 << 30);
        let big = "x".repeat(10 * FRAGMENT_SIZE + 7);
        assert!(queue_text(&out, &bytes, "before".into()));
        assert!(queue_text(&out, &bytes, big.clone()));
        assert!(queue_text(&out, &bytes, "after".into()));
        // The socket takes the small frame and five fragments, then stops.
        let mut socket = Socket {
            room: Some(6),
            ..Socket::default()
        };
        let pending = tokio::time::timeout(Duration::from_millis(50), out.write(&mut socket)).await;
        assert!(pending.is_err());
        assert_eq!(socket.taken.len(), 6);
        assert_eq!(
            bytes.session(),
            big.len() + "after".len(),
            "a message part-written is counted whole"
        );
        socket.room = None;
        out.finish(&mut socket).await;
        assert_eq!(bytes.session(), 0);
        // One frame, eleven fragments joining to the message, one frame; in that order.
        let mut joined = Vec::new();
        let mut kinds = Vec::new();
        for m in &socket.taken[1..socket.taken.len() - 1] {
            let Message::Frame(f) = m else {
                panic!("not a fragment: {m:?}");
            };
            assert!(f.payload().len() <= FRAGMENT_SIZE);
            joined.extend_from_slice(f.payload());
            kinds.push((f.header().opcode, f.header().is_final));
        }
        assert_eq!(joined, big.as_bytes());
        assert_eq!(kinds.len(), 11);
        assert_eq!(kinds[0], (OpCode::Data(Data::Text), false));
        assert_eq!(kinds[10], (OpCode::Data(Data::Continue), true));
        assert_eq!(texts(&socket.taken[..1]), ["before"]);
        assert_eq!(texts(&socket.taken[12..]), ["after"]);

        // A slow client's close cuts a message part-written: its bytes go back, the close next.
        let (out, bytes) = queue(1000, 1 << 30);
        assert!(queue_text(&out, &bytes, big.clone()));
        let mut socket = Socket {
            room: Some(2),
            ..Socket::default()
        };
        let pending = tokio::time::timeout(Duration::from_millis(50), out.write(&mut socket)).await;
        assert!(pending.is_err());
        out.lock().close(
            CloseFrame {
                code: CloseCode::Policy,
                reason: "slow".into(),
            },
            true,
        );
        assert_eq!(bytes.session(), 0, "the cut message's bytes went back");
        socket.room = None;
        out.finish(&mut socket).await;
        assert_eq!(socket.taken.len(), 3);
        assert!(matches!(socket.taken[2], Message::Close(_)));
    }

    #[tokio::test]
    async fn the_bounds_refuse_the_next_frame_and_a_slow_client_s_close_skips_its_queue() {
        // In frames: the third of a two-frame queue is refused.
        let (out, bytes) = queue(2, 1 << 20);
        assert!(queue_text(&out, &bytes, "a".into()));
        assert!(queue_text(&out, &bytes, "b".into()));
        assert!(!queue_text(&out, &bytes, "c".into()));
        assert_eq!(bytes.session(), 2, "a refused frame is not counted");
        // In bytes: a frame over the byte bound is refused even with frames to spare.
        let (small, small_bytes) = queue(100, 10);
        assert!(queue_text(&small, &small_bytes, "12345678".into()));
        assert!(!queue_text(&small, &small_bytes, "123".into()));

        // A close for a slow client drops what is queued (its bytes too) and goes next.
        let frame = |reason: &str| CloseFrame {
            code: CloseCode::Policy,
            reason: reason.into(),
        };
        out.lock().close(frame("too slow"), true);
        assert_eq!(bytes.session(), 0);
        let mut socket = Socket::default();
        assert_eq!(out.write(&mut socket).await.unwrap(), Written::Closed);
        assert_eq!(socket.taken.len(), 1);
        assert!(matches!(&socket.taken[0], Message::Close(Some(f)) if f.reason == "too slow"));
        assert!(!out.busy(), "nothing is written after the close frame");

        // A close otherwise follows what is queued.
        let (out, bytes) = queue(10, 1 << 20);
        assert!(queue_text(&out, &bytes, "last words".into()));
        out.lock().close(frame("bye"), false);
        let mut socket = Socket::default();
        out.finish(&mut socket).await;
        assert_eq!(texts(&socket.taken)[0], "last words");
        assert!(matches!(&socket.taken[1], Message::Close(Some(f)) if f.reason == "bye"));
    }
}
