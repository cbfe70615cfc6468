//! A session's legs: its own WebSocket connections to the workers it talks to.
//!
//! Each leg has a reader and a writer task owned by the [`Leg`]; dropping the leg stops both.
//! Frames from every leg arrive on the session's one bounded event channel, so a session
//! that stops reading backpressures its workers instead of buffering without bound.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;
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

/// One open leg.
pub struct Leg {
    worker: WorkerId,
    /// Held so the pool counts this leg as a user of the worker (no idle stop under it).
    _handle: WorkerHandle,
    tx: mpsc::Sender<Message>,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Leg {
    /// Connects to the worker and starts the leg's tasks.
    pub async fn open(
        handle: WorkerHandle,
        max_message_bytes: usize,
        events: mpsc::Sender<LegEvent>,
    ) -> Result<Leg, LegError> {
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
        let (mut sink, mut stream) = stream.split();
        let (tx, mut rx) = mpsc::channel::<Message>(LEG_QUEUE);
        let writer = tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                if let Err(e) = sink.send(msg).await {
                    tracing::debug!(%worker, error = %e, "leg write failed");
                    break;
                }
            }
            // Best effort: the worker treats a vanished connection like a close.
            let _closed = sink.close().await;
        });
        let exited = handle.clone();
        let reader = tokio::spawn(async move {
            let reason = tokio::select! {
                r = read_frames(worker, &mut stream, &events) => r,
                () = exited.exited() => "worker exited".to_owned(),
            };
            // The session may be gone already; then nobody needs to hear it.
            let _sent = events.send(LegEvent::Closed(worker, reason)).await;
        });
        Ok(Leg {
            worker,
            _handle: handle,
            tx,
            reader,
            writer,
        })
    }

    /// The worker at the other end.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Queues a text frame; waits while the leg's queue is full. False if the leg is closed.
    pub async fn send(&self, text: String) -> bool {
        self.tx.send(Message::text(text)).await.is_ok()
    }
}

async fn read_frames(
    worker: WorkerId,
    stream: &mut futures_util::stream::SplitStream<worker::LegStream>,
    events: &mpsc::Sender<LegEvent>,
) -> String {
    while let Some(frame) = stream.next().await {
        match frame {
            Ok(Message::Text(text)) => {
                if events.send(LegEvent::Frame(worker, text)).await.is_err() {
                    return "session ended".into();
                }
            }
            Ok(Message::Close(frame)) => {
                return format!("worker closed the connection ({frame:?})");
            }
            Ok(_) => {}
            Err(e) => return format!("read error: {e}"),
        }
    }
    "connection ended".into()
}

impl Drop for Leg {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}
