//! What the simulator holds: its connections, its threads (in memory: "disk" is this process's
//! memory) and the frames it sends to one connection, a thread's subscribers or every
//! initialized connection.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::{now_ms, Settings, VERSION};

pub(crate) type ConnId = u64;

pub(crate) struct Conn {
    pub(crate) tx: mpsc::Sender<String>,
    pub(crate) initialized: bool,
    /// The notification methods it opted out of at initialize (`optOutNotificationMethods`):
    /// exact names, left out of what it is sent, targeted or broadcast, as app-server does.
    pub(crate) opt_out: HashSet<String>,
}

pub(crate) struct Thread {
    pub(crate) id: String,
    pub(crate) created_at: u64,
    pub(crate) preview: String,
    pub(crate) turns: u64,
    pub(crate) loaded: bool,
    pub(crate) subscribers: HashSet<ConnId>,
    /// Running turn: its id and its interrupt switch.
    pub(crate) active: Option<(String, watch::Sender<bool>)>,
    /// Bumped whenever the thread stops being idle-without-subscribers; stale unload timers see it.
    pub(crate) unload_epoch: u64,
}

impl Thread {
    pub(crate) fn status(&self, waiting: bool) -> Value {
        if !self.loaded {
            json!({"type": "notLoaded"})
        } else if self.active.is_some() {
            let flags: Vec<&str> = if waiting {
                vec!["waitingOnApproval"]
            } else {
                vec![]
            };
            json!({"type": "active", "activeFlags": flags})
        } else {
            json!({"type": "idle"})
        }
    }

    pub(crate) fn summary(&self, codex_home: &str) -> Value {
        json!({
            "id": self.id,
            "sessionId": self.id,
            "preview": self.preview,
            "ephemeral": false,
            "modelProvider": "sim",
            "createdAt": self.created_at / 1000,
            "updatedAt": self.created_at / 1000,
            "status": self.status(false),
            "path": format!("{codex_home}/sessions/sim/rollout-{}.jsonl", self.id),
            "cwd": std::env::current_dir().map(|p| p.display().to_string()).unwrap_or_default(),
            "cliVersion": VERSION,
            "source": "appServer",
            "gitInfo": null,
            "name": null,
            "turns": [],
        })
    }
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) conns: HashMap<ConnId, Conn>,
    /// Every thread this process created: loaded or not (the in-memory "disk").
    pub(crate) threads: HashMap<String, Thread>,
    /// Pending server requests by id.
    pub(crate) pending: HashMap<i64, oneshot::Sender<Value>>,
    pub(crate) next_server_request: i64,
    /// Who set the userAgent prefix (first initialize that is not the daemon's).
    pub(crate) originator: Option<String>,
    pub(crate) draining: bool,
    pub(crate) running_turns: usize,
    /// Broadcasts to send after the current request's response.
    pub(crate) deferred: Vec<(&'static str, Value)>,
}

pub(crate) struct Sim {
    pub(crate) settings: Settings,
    pub(crate) codex_home: String,
    pub(crate) state: Mutex<State>,
    /// Paths to remove at exit: the symlink and the real socket.
    pub(crate) paths: (PathBuf, PathBuf),
}

impl Sim {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn exit(&self, code: i32) -> ! {
        let _ = std::fs::remove_file(&self.paths.0);
        let _ = std::fs::remove_file(&self.paths.1);
        std::process::exit(code)
    }
}

/// Queues a text frame to a connection; a full queue disconnects it (slow consumer).
pub(crate) fn send_to(st: &mut State, conn: ConnId, text: String) {
    let failed = match st.conns.get(&conn) {
        Some(c) => c.tx.try_send(text).err(),
        None => None,
    };
    match failed {
        None => {}
        Some(mpsc::error::TrySendError::Full(_)) => {
            eprintln!("codex-app-server-sim: disconnecting slow connection {conn}");
            drop_conn(st, conn);
        }
        // The connection is going away; its Closed event will clean up.
        Some(mpsc::error::TrySendError::Closed(_)) => {}
    }
}

pub(crate) fn notification(method: &str, params: Value) -> String {
    json!({"method": method, "params": params, "emittedAtMs": now_ms()}).to_string()
}

/// To every initialized connection that did not opt out of `method`.
pub(crate) fn broadcast(st: &mut State, method: &str, params: Value) {
    let text = notification(method, params);
    let ids: Vec<ConnId> = st
        .conns
        .iter()
        .filter(|(_, c)| c.initialized && !c.opt_out.contains(method))
        .map(|(id, _)| *id)
        .collect();
    for id in ids {
        send_to(st, id, text.clone());
    }
}

/// A notification to the thread's current subscribers that did not opt out of `method`
/// (dropped when it has none).
pub(crate) fn to_subscribers(st: &mut State, thread: &str, method: &str, params: Value) {
    let text = notification(method, params);
    let ids = subscribers(st, thread, |c| !c.opt_out.contains(method));
    for id in ids {
        send_to(st, id, text.clone());
    }
}

/// A server request to the thread's current subscribers (opt-outs are for notifications only).
pub(crate) fn ask_subscribers(st: &mut State, thread: &str, text: String) {
    for id in subscribers(st, thread, |_| true) {
        send_to(st, id, text.clone());
    }
}

fn subscribers(st: &State, thread: &str, wants: impl Fn(&Conn) -> bool) -> Vec<ConnId> {
    st.threads
        .get(thread)
        .into_iter()
        .flat_map(|t| t.subscribers.iter().copied())
        .filter(|id| st.conns.get(id).is_some_and(&wants))
        .collect()
}

pub(crate) fn drop_conn(st: &mut State, conn: ConnId) -> Vec<(String, u64)> {
    st.conns.remove(&conn);
    let mut orphaned = Vec::new();
    for t in st.threads.values_mut() {
        if t.subscribers.remove(&conn) && t.subscribers.is_empty() && t.active.is_none() {
            t.unload_epoch += 1;
            orphaned.push((t.id.clone(), t.unload_epoch));
        }
    }
    orphaned
}

pub(crate) fn error_frame(id: &Value, code: i64, message: &str, data: Option<Value>) -> String {
    let mut e = json!({"code": code, "message": message});
    if let Some(d) = data {
        e["data"] = d;
    }
    json!({"id": id, "error": e}).to_string()
}

pub(crate) fn result_frame(id: &Value, result: Value) -> String {
    json!({"id": id, "result": result}).to_string()
}
