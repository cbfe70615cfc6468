//! Interrupting a worker's running turns at the end of a drain, over a short-lived leg.

use std::path::Path;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::time::{timeout_at, Instant};
use tokio_tungstenite::tungstenite::Message;
use tracing::{debug, warn};

use crate::control::{CLIENT_NAME, CONTROL_MAX_MESSAGE};
use crate::leg::{self, LegStream};

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
    peer: leg::Peer,
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
    peer: leg::Peer,
    threads: &[String],
) -> anyhow_like::Result<usize> {
    let ws = leg::connect(socket, peer, CONTROL_MAX_MESSAGE).await?;
    let mut rpc = Rpc { ws, next_id: 0 };
    rpc.call(
        "initialize",
        json!({
            "clientInfo": { "name": CLIENT_NAME, "title": null, "version": env!("CARGO_PKG_VERSION") },
            "capabilities": { "experimentalApi": true }
        }),
    )
    .await?;
    rpc.ws
        .send(Message::text(json!({"method": "initialized"}).to_string()))
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
                    "thread/read",
                    json!({ "threadId": thread, "includeTurns": true }),
                )
                .await?;
            turn = running_turn(&read);
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
                "turn/interrupt",
                json!({ "threadId": thread, "turnId": turn }),
            )
            .await
        {
            Ok(_) => done += 1,
            Err(e) => warn!(thread, turn, error = %e, "turn/interrupt failed"),
        }
    }
    let _closed = rpc.ws.close(None).await;
    Ok(done)
}

/// The id of the last turn in progress in a `thread/read` result.
fn running_turn(read: &Value) -> Option<String> {
    read["thread"]["turns"]
        .as_array()?
        .iter()
        .rev()
        .find(|t| t["status"] == "inProgress")
        .and_then(|t| t["id"].as_str())
        .map(str::to_owned)
}

struct Rpc {
    ws: LegStream,
    next_id: u64,
}

impl Rpc {
    /// Sends a request and reads until its answer (notifications on the way are skipped).
    async fn call(&mut self, method: &str, params: Value) -> anyhow_like::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let req = json!({ "id": id, "method": method, "params": params });
        self.ws.send(Message::text(req.to_string())).await?;
        loop {
            let text = match self.ws.next().await {
                None | Some(Ok(Message::Close(_))) => return Err("connection closed".into()),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(_)) => continue,
            };
            let v: Value = serde_json::from_str(text.as_str())?;
            if v.get("method").is_some() || v["id"] != id {
                continue;
            }
            if let Some(e) = v.get("error") {
                return Err(format!("{method}: {e}").into());
            }
            return Ok(v["result"].clone());
        }
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
        let read = json!({"thread": {"turns": [
            {"id": "a", "status": "completed"},
            {"id": "b", "status": "inProgress"},
        ]}});
        assert_eq!(running_turn(&read).as_deref(), Some("b"));
        assert_eq!(running_turn(&json!({"thread": {"turns": []}})), None);
    }
}
