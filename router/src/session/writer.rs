//! The client writer: frames the session queues for its client are written by the session task
//! itself, in batches with one flush per batch, whenever the client's socket takes them (the
//! session loop polls [`OutQueue::poll_write`] beside its other work: no writer task, no
//! channel, no wake-up per frame). The queue is bounded in frames and bytes, and a client too
//! slow to keep it from filling is closed (decision 8).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};

use futures_util::{Sink, SinkExt};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::{End, Session};
use crate::admission::QueueBytes;

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

/// Frames waiting for the client, bounded in frames (`capacity`) and in bytes (`bytes`, the
/// session's and its tenant's bounds).
pub(super) struct OutQueue {
    frames: VecDeque<Message>,
    capacity: usize,
    bytes: Arc<QueueBytes>,
    /// Frames were handed to the socket since its last flush.
    unflushed: bool,
    /// The close frame went out: nothing more is written.
    closed: bool,
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
            frames: VecDeque::new(),
            capacity: capacity.max(1),
            bytes,
            unflushed: false,
            closed: false,
        }))
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, OutQueue> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the loop has writing to do.
    pub(super) fn busy(&self) -> bool {
        let q = self.lock();
        !q.closed && (!q.frames.is_empty() || q.unflushed)
    }

    /// Writes what the socket takes now; see [`OutQueue::poll_write`].
    pub(super) async fn write<Si>(&self, sink: &mut Si) -> Result<Written, WsError>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        std::future::poll_fn(|cx| self.lock().poll_write(sink, cx)).await
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
        self.frames.len()
    }

    fn push(&mut self, msg: Message) -> bool {
        if self.frames.len() >= self.capacity {
            return false;
        }
        self.frames.push_back(msg);
        true
    }

    /// Queues the close frame after what is queued; if the queue is full, or the client is too
    /// slow (`skip_queue`), what is queued is dropped and the close frame goes next.
    pub(super) fn close(&mut self, frame: CloseFrame, skip_queue: bool) {
        if skip_queue || self.frames.len() >= self.capacity {
            for msg in self.frames.drain(..) {
                self.bytes.release(queued_len(&msg));
            }
        }
        self.frames.push_back(Message::Close(Some(frame)));
    }

    /// Hands queued frames to the socket while it takes them (at most [`WRITE_BATCH`]), then
    /// flushes. Cancel-safe: a frame leaves the queue only once the sink has taken it.
    fn poll_write<Si>(
        &mut self,
        sink: &mut Si,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Written, WsError>>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        let mut batch = 0;
        while batch < WRITE_BATCH && !self.closed && !self.frames.is_empty() {
            ready!(sink.poll_ready_unpin(cx))?;
            let Some(msg) = self.frames.pop_front() else {
                break;
            };
            self.bytes.release(queued_len(&msg));
            self.closed = matches!(msg, Message::Close(_));
            sink.start_send_unpin(msg)?;
            self.unflushed = true;
            batch += 1;
        }
        if self.unflushed {
            ready!(sink.poll_flush_unpin(cx))?;
            self.unflushed = false;
        }
        Poll::Ready(Ok(if self.closed {
            Written::Closed
        } else {
            Written::Flushed
        }))
    }
}

// === impl Session ===

impl Session {
    /// Queues a frame for the client; a client whose queue is full (in frames, or in bytes for
    /// the session or its tenant) is too slow and is closed.
    pub(super) fn to_client(&self, text: String) -> Result<(), End> {
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

    /// Frames waiting for the client.
    pub(super) fn queued(&self) -> usize {
        self.out.lock().len()
    }
}
