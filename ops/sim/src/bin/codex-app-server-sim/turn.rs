//! A turn as app-server runs one: its notifications, its deltas (the mock model's reply cut into
//! pieces), an approval round trip when the prompt asks for one, and the idle unload of a thread
//! afterwards.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

use crate::state::{ask_subscribers, broadcast, to_subscribers, Sim, State};
use crate::{now_ms, stop_self, uuid_v7};

/// Starts the idle-unload timer of a thread left without subscribers and not active.
pub(crate) fn arm_unload(sim: &Arc<Sim>, thread: String, epoch: u64) {
    let sim = sim.clone();
    tokio::spawn(async move {
        tokio::time::sleep(sim.settings.unload_delay).await;
        let mut st = sim.lock();
        let Some(t) = st.threads.get_mut(&thread) else {
            return;
        };
        if t.unload_epoch != epoch || !t.loaded || !t.subscribers.is_empty() || t.active.is_some() {
            return;
        }
        t.loaded = false;
        // Pending server requests of the thread are dropped (docs/app-server-facts.md §4 step 2):
        // the turn task's receiver sees the sender gone. Turns are not active here, so none are
        // pending.
        broadcast(
            &mut st,
            "thread/status/changed",
            json!({"threadId": thread, "status": {"type": "notLoaded"}}),
        );
        broadcast(&mut st, "thread/closed", json!({"threadId": thread}));
    });
}

/// Emits one turn's stream to the thread's subscribers, and its status to everyone.
pub(crate) async fn run_turn(
    sim: Arc<Sim>,
    thread: String,
    turn: String,
    text: String,
    mut stop: watch::Receiver<bool>,
) {
    if text.contains("CRASH") || text.contains("STALL") {
        // Let the turn/start answer reach the client first.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if text.contains("CRASH") {
        eprintln!("codex-app-server-sim: CRASH in the prompt, aborting");
        std::process::abort();
    }
    if text.contains("STALL") {
        eprintln!("codex-app-server-sim: STALL in the prompt, stopping");
        stop_self();
    }
    let sub = |st: &mut State, method: &str, params: Value| {
        to_subscribers(st, &thread, method, params);
    };
    let started = std::time::Instant::now();
    {
        let mut st = sim.lock();
        broadcast(
            &mut st,
            "thread/status/changed",
            json!({"threadId": thread, "status": {"type": "active", "activeFlags": []}}),
        );
        sub(
            &mut st,
            "turn/started",
            json!({"threadId": thread, "turn": {"id": turn, "items": [], "status": "inProgress", "error": null}}),
        );
        let user = json!({"type": "userMessage", "id": uuid_v7(), "content": [{"type": "text", "text": text, "text_elements": []}]});
        sub(
            &mut st,
            "item/started",
            json!({"threadId": thread, "turnId": turn, "item": user}),
        );
        sub(
            &mut st,
            "item/completed",
            json!({"threadId": thread, "turnId": turn, "item": user}),
        );
    }
    let mut interrupted = false;
    if text.contains("RUNSHELL") {
        interrupted = approval(&sim, &thread, &turn, &mut stop).await;
    }
    let reply = mock_model::reply_text(&text);
    let item_id = uuid_v7();
    let mut turn_ms = sim.settings.turn_ms;
    if text.contains("SLOW") {
        turn_ms *= 10;
    }
    if !interrupted {
        let item = json!({"type": "agentMessage", "id": item_id, "text": ""});
        sub(
            &mut sim.lock(),
            "item/started",
            json!({"threadId": thread, "turnId": turn, "item": item}),
        );
        let n = sim.settings.deltas.max(1) as usize;
        let chars: Vec<char> = reply.chars().collect();
        let chunk = chars.len().div_ceil(n).max(1);
        let pause = Duration::from_millis(turn_ms) / n as u32;
        for piece in chars.chunks(chunk) {
            if pause.is_zero() {
                // As fast as it can: a timer would round every pause up to the next millisecond.
                tokio::task::yield_now().await;
                if *stop.borrow() {
                    interrupted = true;
                    break;
                }
            } else {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => { interrupted = true; break; }
                }
            }
            let delta: String = piece.iter().collect();
            sub(
                &mut sim.lock(),
                "item/agentMessage/delta",
                json!({"threadId": thread, "turnId": turn, "itemId": item_id, "delta": delta}),
            );
        }
        if !interrupted {
            let item = json!({"type": "agentMessage", "id": item_id, "text": reply});
            sub(
                &mut sim.lock(),
                "item/completed",
                json!({"threadId": thread, "turnId": turn, "item": item}),
            );
        }
    }
    let mut st = sim.lock();
    let status = if interrupted {
        "interrupted"
    } else {
        "completed"
    };
    // The turn's model usage, as app-server reports it (fixed: the simulator has no model).
    let usage = json!({"totalTokens": 1050, "inputTokens": 1000, "cachedInputTokens": 400,
        "outputTokens": 50, "reasoningOutputTokens": 10});
    sub(
        &mut st,
        "thread/tokenUsage/updated",
        json!({"threadId": thread, "turnId": turn, "tokenUsage": {"total": usage, "last": usage}}),
    );
    let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    sub(
        &mut st,
        "turn/completed",
        json!({"threadId": thread, "turn": {"id": turn, "items": [], "status": status, "error": null, "durationMs": duration_ms}}),
    );
    st.running_turns = st.running_turns.saturating_sub(1);
    let mut orphan = None;
    if let Some(t) = st.threads.get_mut(&thread) {
        t.active = None;
        if t.subscribers.is_empty() {
            t.unload_epoch += 1;
            orphan = Some(t.unload_epoch);
        }
    }
    broadcast(
        &mut st,
        "thread/status/changed",
        json!({"threadId": thread, "status": {"type": "idle"}}),
    );
    drop(st);
    if let Some(epoch) = orphan {
        arm_unload(&sim, thread, epoch);
    }
}

/// `item/commandExecution/requestApproval` to the subscribers; waits for the first answer.
/// Returns true when the turn was interrupted instead.
pub(crate) async fn approval(
    sim: &Arc<Sim>,
    thread: &str,
    turn: &str,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let item_id = format!("call-{}", uuid_v7());
    let (tx, rx) = oneshot::channel();
    let request_id;
    {
        let mut st = sim.lock();
        request_id = st.next_server_request;
        st.next_server_request += 1;
        st.pending.insert(request_id, tx);
        let item = json!({"type": "commandExecution", "id": item_id, "command": "/bin/bash -lc 'touch /tmp/x'", "cwd": "/", "status": "inProgress", "commandActions": []});
        to_subscribers(
            &mut st,
            thread,
            "item/started",
            json!({"threadId": thread, "turnId": turn, "item": item}),
        );
        let req = json!({
            "id": request_id,
            "method": "item/commandExecution/requestApproval",
            "params": {
                "kind": "command", "threadId": thread, "turnId": turn, "itemId": item_id,
                "startedAtMs": now_ms(), "environmentId": "local",
                "reason": "simulated command wants approval",
                "command": "/bin/bash -lc 'touch /tmp/x'", "cwd": "/", "commandActions": [],
                "availableDecisions": ["accept", "decline", "cancel"],
            }
        });
        ask_subscribers(&mut st, thread, req.to_string());
        broadcast(
            &mut st,
            "thread/status/changed",
            json!({"threadId": thread, "status": {"type": "active", "activeFlags": ["waitingOnApproval"]}}),
        );
    }
    let outcome = tokio::select! {
        answer = rx => answer.ok(),
        _ = stop.wait_for(|s| *s) => None,
    };
    let mut st = sim.lock();
    st.pending.remove(&request_id);
    to_subscribers(
        &mut st,
        thread,
        "serverRequest/resolved",
        json!({"threadId": thread, "requestId": request_id}),
    );
    let Some(answer) = outcome else {
        return true;
    };
    let decision = answer["result"]["decision"]
        .as_str()
        .unwrap_or("decline")
        .to_owned();
    let status = if decision == "accept" {
        "completed"
    } else {
        "declined"
    };
    let item = json!({"type": "commandExecution", "id": item_id, "command": "/bin/bash -lc 'touch /tmp/x'", "cwd": "/", "status": status, "exitCode": if status == "completed" { json!(0) } else { Value::Null }, "commandActions": []});
    to_subscribers(
        &mut st,
        thread,
        "item/completed",
        json!({"threadId": thread, "turnId": turn, "item": item}),
    );
    broadcast(
        &mut st,
        "thread/status/changed",
        json!({"threadId": thread, "status": {"type": "active", "activeFlags": []}}),
    );
    false
}
