//! A session's legs: its own WebSocket connections to the workers it talks to.
//!
//! Towards the worker, each leg has a writer task owned by the [`Leg`] (dropping the leg stops
//! it); its queue is bounded in bytes as well as in frames ([`LegBudget`]): a frame waits for room
//! in its session's budget and its tenant's, so a client that floods a worker that does not read
//! pins no more than the bounds.
//!
//! From the worker, nothing sits between the socket and the session: the session task polls
//! every leg's socket itself ([`LegFrames`]), so a worker frame costs no task switch and no
//! queue, and a session that stops reading backpressures its workers through their sockets.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, Stream, StreamExt};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use worker::{WorkerHandle, WorkerId};

/// Frames queued towards one worker before the session waits.
const LEG_QUEUE: usize = 256;
/// Connect plus WebSocket handshake over the worker's socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a leg reports to its session.
#[derive(Debug)]
pub enum LegEvent {
    /// A text frame from the worker.
    Frame(WorkerId, Utf8Bytes),
    /// The leg is gone (worker exited, closed the connection, or sent something unusable).
    Closed(WorkerId, String),
}

/// One leg's frames from its worker, read by the session task itself: every frame, then
/// [`LegEvent::Closed`] if the worker goes; nothing more once the [`Leg`] is dropped.
pub type LegFrames = Pin<Box<dyn Stream<Item = LegEvent> + Send>>;

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

/// Bytes one direction of a session's legs may hold: the session's own bound and its tenant's
/// total over all its sessions.
#[derive(Debug, Clone)]
pub struct LegBudget {
    session: Arc<Semaphore>,
    session_max: usize,
    tenant: Arc<Semaphore>,
    tenant_max: usize,
}

/// Room held by one frame in a [`LegBudget`]; dropping it gives the room back.
#[derive(Debug)]
pub struct LegBytes {
    _session: OwnedSemaphorePermit,
    _tenant: OwnedSemaphorePermit,
}

// === impl LegBudget ===

impl LegBudget {
    /// Semaphore permits for a bound in bytes (a semaphore holds fewer than `usize::MAX`).
    pub fn permits(bound: usize) -> usize {
        bound.clamp(1, Semaphore::MAX_PERMITS)
    }

    /// A session's budget of `session_bound` bytes, drawing also on `tenant` (of `tenant_bound`).
    pub fn new(session_bound: usize, tenant: Arc<Semaphore>, tenant_bound: usize) -> Self {
        let session_max = Self::permits(session_bound);
        Self {
            session: Arc::new(Semaphore::new(session_max)),
            session_max,
            tenant,
            tenant_max: Self::permits(tenant_bound),
        }
    }

    /// Waits for room for `len` bytes, first in the session's budget, then in the tenant's (one
    /// order everywhere). A frame larger than a bound takes all of it rather than waiting forever.
    pub async fn reserve(&self, len: usize) -> Option<LegBytes> {
        let take = |max: usize| u32::try_from(len.clamp(1, max)).unwrap_or(u32::MAX);
        let session = self
            .session
            .clone()
            .acquire_many_owned(take(self.session_max))
            .await
            .ok()?;
        let tenant = self
            .tenant
            .clone()
            .acquire_many_owned(take(self.tenant_max))
            .await
            .ok()?;
        Some(LegBytes {
            _session: session,
            _tenant: tenant,
        })
    }

    /// Bytes of the session's budget in use.
    pub fn session_used(&self) -> usize {
        self.session_max - self.session.available_permits()
    }
}

/// One open leg.
pub struct Leg {
    worker: WorkerId,
    /// Held so the pool counts this leg as a user of the worker (no idle stop under it).
    _handle: WorkerHandle,
    tx: mpsc::Sender<(Message, LegBytes)>,
    up: LegBudget,
    writer: JoinHandle<()>,
    /// Dropped with the leg: its [`LegFrames`] end without a word.
    _frames_end: oneshot::Sender<()>,
}

impl Leg {
    /// Connects to the worker and starts the leg's writer; the session reads the returned
    /// frames.
    pub async fn open(
        handle: WorkerHandle,
        max_message_bytes: usize,
        up: LegBudget,
    ) -> Result<(Leg, LegFrames), LegError> {
        let worker = handle.id;
        // Checks the listener is the worker itself; a mismatch is reported to the pool, which
        // replaces the worker. The session only sees this request fail.
        let connect = handle.connect(max_message_bytes);
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(s)) => s,
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
        let (mut sink, stream) = stream.split();
        let (tx, mut rx) = mpsc::channel::<(Message, LegBytes)>(LEG_QUEUE);
        let writer = tokio::spawn(async move {
            // The frame's room is given back once the worker's socket has it.
            while let Some((msg, _bytes)) = rx.recv().await {
                if let Err(e) = sink.send(msg).await {
                    tracing::debug!(%worker, error = %e, "leg write failed");
                    break;
                }
            }
            // Best effort: the worker treats a vanished connection like a close.
            let _closed = sink.close().await;
        });
        let (frames_end, dropped) = oneshot::channel();
        let exited = handle.clone();
        let frames = read_frames(
            worker,
            stream,
            Box::pin(async move { exited.exited().await }),
            dropped,
        );
        let leg = Leg {
            worker,
            _handle: handle,
            tx,
            up,
            writer,
            _frames_end: frames_end,
        };
        Ok((leg, frames))
    }

    /// The worker at the other end.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Queues a text frame; waits while the leg's queue or the session's (or tenant's) byte
    /// budget towards the workers is full. False if the leg is closed.
    pub async fn send(&self, text: String) -> bool {
        let Some(bytes) = self.up.reserve(text.len()).await else {
            return false;
        };
        self.tx.send((Message::text(text), bytes)).await.is_ok()
    }
}

/// What [`read_frames`] carries from one frame to the next.
struct Reading {
    stream: futures_util::stream::SplitStream<worker::LegStream>,
    exited: Pin<Box<dyn Future<Output = ()> + Send>>,
    dropped: oneshot::Receiver<()>,
}

/// A leg's frames: text frames as they come, then `Closed` with the reason the worker went (its
/// process exited, it closed the connection, a read failed); nothing once `dropped` fires.
fn read_frames(
    worker: WorkerId,
    stream: futures_util::stream::SplitStream<worker::LegStream>,
    exited: Pin<Box<dyn Future<Output = ()> + Send>>,
    dropped: oneshot::Receiver<()>,
) -> LegFrames {
    let start = Reading {
        stream,
        exited,
        dropped,
    };
    Box::pin(futures_util::stream::unfold(
        Some(start),
        move |reading| async move {
            let mut r = reading?;
            let reason = loop {
                tokio::select! {
                    biased;
                    _ = &mut r.dropped => return None,
                    frame = r.stream.next() => match frame {
                        Some(Ok(Message::Text(text))) => {
                            return Some((LegEvent::Frame(worker, text), Some(r)));
                        }
                        Some(Ok(Message::Close(frame))) => {
                            break format!("worker closed the connection ({frame:?})");
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => break format!("read error: {e}"),
                        None => break "connection ended".to_owned(),
                    },
                    () = &mut r.exited => break "worker exited".to_owned(),
                }
            };
            Some((LegEvent::Closed(worker, reason), None))
        },
    ))
}

impl Drop for Leg {
    fn drop(&mut self) {
        self.writer.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(session: usize, tenant: &Arc<Semaphore>, tenant_bound: usize) -> LegBudget {
        LegBudget::new(session, tenant.clone(), tenant_bound)
    }

    #[tokio::test(start_paused = true)]
    async fn frames_wait_for_room_in_the_session_and_the_tenant() {
        let tenant = Arc::new(Semaphore::new(150));
        let a = budget(100, &tenant, 150);
        let b = budget(100, &tenant, 150);
        let first = a.reserve(60).await.unwrap();
        assert_eq!(a.session_used(), 60);
        // The session's bound: 60 + 50 > 100 waits until the first frame is written.
        let waiting = tokio::time::timeout(Duration::from_secs(1), a.reserve(50)).await;
        assert!(waiting.is_err(), "over the session's bound must wait");
        // The tenant's bound: 60 (a) + 90 (b) = 150, so one more byte for b waits.
        let b_room = b.reserve(90).await.unwrap();
        assert!(tokio::time::timeout(Duration::from_secs(1), b.reserve(1))
            .await
            .is_err());
        drop(first);
        assert!(a.reserve(50).await.is_some(), "room given back is reusable");
        drop(b_room);
        // A frame larger than every bound takes the whole budget rather than waiting forever.
        let huge = a.reserve(10_000).await.unwrap();
        assert_eq!(a.session_used(), 100);
        drop(huge);
        assert_eq!(a.session_used(), 0);
        assert_eq!(tenant.available_permits(), 150);
    }

    /// A leg's socket pair in memory: (the worker's end, the frames the session reads, the
    /// worker's exit, the leg's drop).
    async fn leg_pair() -> (
        worker::LegStream,
        LegFrames,
        oneshot::Sender<()>,
        oneshot::Sender<()>,
    ) {
        use tokio_tungstenite::tungstenite::protocol::Role;
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let worker_end =
            tokio_tungstenite::WebSocketStream::from_raw_socket(theirs, Role::Server, None).await;
        let leg_end =
            tokio_tungstenite::WebSocketStream::from_raw_socket(ours, Role::Client, None).await;
        let (_sink, stream) = leg_end.split();
        let (exit, exited) = oneshot::channel::<()>();
        let (drop_leg, dropped) = oneshot::channel();
        let frames = read_frames(
            WorkerId::new("t", 1, 1),
            stream,
            Box::pin(async move {
                let _ = exited.await;
            }),
            dropped,
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
    async fn a_leg_ends_when_its_worker_exits_or_its_socket_ends() {
        // The process exited with its socket still open: the leg says so.
        let (_worker, mut frames, exit, _drop) = leg_pair().await;
        exit.send(()).unwrap();
        assert_eq!(closed(frames.next().await), "worker exited");
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
}
