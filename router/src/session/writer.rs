//! The client writer: frames queued by the session are written in batches, one flush per batch;
//! the queue is bounded in frames and bytes, and a client too slow to keep it from filling is
//! closed (decision 8).

use std::sync::Arc;

use futures_util::{Sink, SinkExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::{End, Session};
use crate::admission::QueueBytes;

pub(super) async fn write_client<Si>(
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
        self.out.try_send(Message::text(text)).map_err(|_| {
            self.queued_bytes.release(n);
            End::SlowClient
        })
    }

    /// Frames waiting for the client.
    pub(super) fn queued(&self) -> usize {
        self.out.max_capacity() - self.out.capacity()
    }
}
