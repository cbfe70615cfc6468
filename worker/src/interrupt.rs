//! Interrupting a worker's running turns at the end of a drain, over a short-lived leg.

use std::path::Path;

use proto::client::Client;
use proto::initialize::InitializeParams;
use proto::Method;
use serde::Deserialize;
use serde_json::json;
use tokio::time::{timeout_at, Instant};
use tracing::{debug, warn};

use crate::control::{CLIENT_NAME, CONTROL_MAX_MESSAGE};
use crate::leg;

/// `thread/read` attempts to find a thread's turn in progress.
const READ_ATTEMPTS: u32 = 5;
/// Pause between them.
const READ_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// Asks the worker on `socket` to interrupt the running turn of each of `threads`
/// (`thread/read` with turns finds the turn in progress, then `turn/interrupt`). Subscribers then
/// get `turn/completed` with status `interrupted`. Returns how many interrupts were accepted;
/// gives up at `deadline`.
pub async fn interrupt_turns(
    socket: &Path,
    peer: crate::id::Peer,
    threads: &[String],
    deadline: Instant,
) -> usize {
    match timeout_at(deadline, interrupt_all(socket, peer, threads)).await {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            warn!(socket = %socket.display(), error = %e, "cannot interrupt turns");
            0
        }
        Err(_elapsed) => {
            warn!(socket = %socket.display(), "interrupting turns timed out");
            0
        }
    }
}

async fn interrupt_all(
    socket: &Path,
    peer: crate::id::Peer,
    threads: &[String],
) -> anyhow_like::Result<usize> {
    let ws = leg::connect(socket, peer, CONTROL_MAX_MESSAGE).await?;
    let mut rpc = Client::new(ws);
    rpc.initialize(&InitializeParams::experimental(
        CLIENT_NAME,
        env!("CARGO_PKG_VERSION"),
    ))
    .await?;
    let mut done = 0;
    for thread in threads {
        let mut turn = None;
        // The turn in progress may take a moment to show in the thread's history.
        for attempt in 0..READ_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(READ_RETRY).await;
            }
            let read = rpc
                .call(
                    &Method::ThreadRead,
                    json!({ "threadId": thread, "includeTurns": true }),
                )
                .await?;
            // A result of another shape has no turn in progress we could name.
            turn = read
                .result::<ThreadRead>()
                .ok()
                .and_then(ThreadRead::running_turn);
            if turn.is_some() {
                break;
            }
        }
        let Some(turn) = turn else {
            debug!(thread, "no turn in progress");
            continue;
        };
        match rpc
            .call(
                &Method::TurnInterrupt,
                json!({ "threadId": thread, "turnId": turn }),
            )
            .await
        {
            Ok(_) => done += 1,
            Err(e) => warn!(thread, turn, error = %e, "turn/interrupt failed"),
        }
    }
    let _closed = rpc.close().await;
    Ok(done)
}

/// The part of a `thread/read` result (with turns) that matters here.
#[derive(Deserialize)]
struct ThreadRead {
    thread: ThreadTurns,
}

#[derive(Deserialize)]
struct ThreadTurns {
    #[serde(default)]
    turns: Vec<TurnSummary>,
}

#[derive(Deserialize)]
struct TurnSummary {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    status: Option<String>,
}

// === impl ThreadRead ===

impl ThreadRead {
    /// The id of the last turn in progress.
    fn running_turn(self) -> Option<String> {
        self.thread
            .turns
            .into_iter()
            .rev()
            .find(|t| t.status.as_deref() == Some("inProgress"))
            .and_then(|t| t.id)
    }
}

/// A boxed error is enough here: every failure is only logged.
mod anyhow_like {
    pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_turn_in_progress() {
        let running_turn = |v: serde_json::Value| {
            serde_json::from_value::<ThreadRead>(v)
                .unwrap()
                .running_turn()
        };
        let read = json!({"thread": {"turns": [
            {"id": "a", "status": "completed"},
            {"id": "b", "status": "inProgress"},
            {"id": "c", "status": "failed"},
        ]}});
        assert_eq!(running_turn(read).as_deref(), Some("b"));
        assert_eq!(running_turn(json!({"thread": {"turns": []}})), None);
    }
}
