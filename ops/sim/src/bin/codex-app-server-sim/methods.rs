//! The simulator's requests: the subset of app-server's methods it serves, answered as
//! app-server answers them (`-32600` for what it does not know or cannot take).

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::watch;

use crate::state::{broadcast, error_frame, result_frame, send_to, ConnId, Sim, Thread};
use crate::turn::{arm_unload, run_turn};
use crate::{now_ms, uuid_v7, INVALID_REQUEST, VERSION};

pub(crate) fn handle(sim: &Arc<Sim>, conn: ConnId, v: Value) {
    let method = v.get("method").and_then(Value::as_str).map(str::to_owned);
    let id = v.get("id").cloned();
    match (method, id) {
        // A response to one of our server requests: first answer wins, later ones are ignored.
        (None, Some(id)) => {
            if let Some(n) = id.as_i64() {
                let waiter = sim.lock().pending.remove(&n);
                if let Some(w) = waiter {
                    let _ = w.send(v);
                }
            }
        }
        // Client notifications (`initialized`) are only logged by the real one.
        (Some(_), None) | (None, None) => {}
        (Some(method), Some(id)) => {
            if matches!(id, Value::Null) || (id.is_number() && id.as_i64().is_none()) {
                return; // `"id": null` / `3.5`: silence, like the real one
            }
            let Some(params) = v.get("params").cloned() else {
                let mut st = sim.lock();
                let f = error_frame(
                    &id,
                    INVALID_REQUEST,
                    "Invalid request: missing field `params`",
                    None,
                );
                send_to(&mut st, conn, f);
                return;
            };
            let answer = request(sim, conn, &method, &params);
            let frame = match answer {
                Ok(result) => result_frame(&id, result),
                Err((message, data)) => error_frame(&id, INVALID_REQUEST, &message, data),
            };
            let mut st = sim.lock();
            send_to(&mut st, conn, frame);
            for (method, params) in std::mem::take(&mut st.deferred) {
                broadcast(&mut st, method, params);
            }
        }
    }
}

pub(crate) type Answer = Result<Value, (String, Option<Value>)>;

pub(crate) fn invalid(message: impl Into<String>) -> Answer {
    Err((message.into(), None))
}

pub(crate) fn thread_id_param(params: &Value) -> Result<String, (String, Option<Value>)> {
    let Some(id) = params.get("threadId").and_then(Value::as_str) else {
        return Err(("Invalid request: missing field `threadId`".into(), None));
    };
    Ok(id.to_owned())
}

pub(crate) const METHODS: &[&str] = &[
    "initialize",
    "thread/start",
    "thread/resume",
    "thread/read",
    "thread/list",
    "thread/loaded/list",
    "thread/unsubscribe",
    "turn/start",
    "turn/interrupt",
    "account/read",
];

pub(crate) fn request(sim: &Arc<Sim>, conn: ConnId, method: &str, params: &Value) -> Answer {
    let mut st = sim.lock();
    let initialized = st.conns.get(&conn).is_some_and(|c| c.initialized);
    if method == "initialize" {
        if initialized {
            return invalid("Already initialized");
        }
        let name = params["clientInfo"]["name"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned();
        if st.originator.is_none() && name != "codex_app_server_daemon" && name != "codex-backend" {
            st.originator = Some(name.clone());
        }
        let prefix = st
            .originator
            .clone()
            .unwrap_or_else(|| "codex_app_server_daemon".into());
        if let Some(c) = st.conns.get_mut(&conn) {
            c.initialized = true;
            c.opt_out = params["capabilities"]["optOutNotificationMethods"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m.as_str().map(str::to_owned))
                .collect();
        }
        return Ok(json!({
            "userAgent": format!("{prefix}/{VERSION} (codex-app-server-sim; {}) ({name}; sim)", std::env::consts::ARCH),
            "codexHome": sim.codex_home,
            "platformFamily": std::env::consts::FAMILY,
            "platformOs": std::env::consts::OS,
        }));
    }
    if !METHODS.contains(&method) {
        return invalid(format!(
            "Invalid request: unknown variant `{method}`, expected one of {} (codex-app-server-sim implements a subset)",
            METHODS.iter().map(|m| format!("`{m}`")).collect::<Vec<_>>().join(", ")
        ));
    }
    if !initialized {
        return invalid("Not initialized");
    }
    let draining_error = || {
        Err((
            "Server is draining; retry after reconnecting".to_owned(),
            Some(json!({"reason": "serverShuttingDown"})),
        ))
    };
    match method {
        "account/read" => Ok(json!({"account": null, "requiresOpenaiAuth": false})),
        "thread/start" => {
            if st.draining {
                return draining_error();
            }
            let id = uuid_v7();
            let mut t = Thread {
                id: id.clone(),
                created_at: now_ms(),
                preview: String::new(),
                turns: 0,
                loaded: true,
                subscribers: HashSet::new(),
                active: None,
                unload_epoch: 0,
            };
            t.subscribers.insert(conn);
            let summary = t.summary(&sim.codex_home);
            st.threads.insert(id, t);
            // Broadcast after the response is queued, as the real server does.
            st.deferred
                .push(("thread/started", json!({"thread": summary.clone()})));
            Ok(json!({
                "thread": summary,
                "model": "sim-model",
                "modelProvider": "sim",
                "cwd": std::env::current_dir().map(|p| p.display().to_string()).unwrap_or_default(),
                "approvalPolicy": "on-request",
                "sandbox": {"type": "readOnly"},
                "reasoningEffort": null,
            }))
        }
        "thread/resume" => {
            let id = thread_id_param(params)?;
            let home = sim.codex_home.clone();
            let Some(t) = st.threads.get_mut(&id) else {
                return invalid(format!("no rollout found for thread id {id}"));
            };
            let was_loaded = t.loaded;
            t.loaded = true;
            t.subscribers.insert(conn);
            t.unload_epoch += 1;
            let summary = t.summary(&home);
            if !was_loaded {
                st.deferred.push((
                    "thread/status/changed",
                    json!({"threadId": id, "status": {"type": "idle"}}),
                ));
            }
            Ok(json!({"thread": summary, "model": "sim-model", "modelProvider": "sim"}))
        }
        "thread/read" => {
            let id = thread_id_param(params)?;
            match st.threads.get(&id) {
                Some(t) => Ok(json!({"thread": t.summary(&sim.codex_home)})),
                None => invalid(format!("thread not found: {id}")),
            }
        }
        "thread/list" => {
            let mut data: Vec<Value> = st
                .threads
                .values()
                .map(|t| t.summary(&sim.codex_home))
                .collect();
            data.sort_by(|a, b| b["id"].as_str().cmp(&a["id"].as_str()));
            Ok(json!({"data": data, "nextCursor": null}))
        }
        "thread/loaded/list" => {
            let data: Vec<&String> = st
                .threads
                .values()
                .filter(|t| t.loaded)
                .map(|t| &t.id)
                .collect();
            Ok(json!({"data": data, "nextCursor": null}))
        }
        "thread/unsubscribe" => {
            let id = thread_id_param(params)?;
            let Some(t) = st.threads.get_mut(&id).filter(|t| t.loaded) else {
                return Ok(json!({"status": "notLoaded"}));
            };
            if !t.subscribers.remove(&conn) {
                return Ok(json!({"status": "notSubscribed"}));
            }
            if t.subscribers.is_empty() && t.active.is_none() {
                t.unload_epoch += 1;
                let epoch = t.unload_epoch;
                drop(st);
                arm_unload(sim, id, epoch);
            }
            Ok(json!({"status": "unsubscribed"}))
        }
        "turn/start" => {
            if st.draining {
                return draining_error();
            }
            let id = thread_id_param(params)?;
            let text: Vec<&str> = params["input"]
                .as_array()
                .map(|a| a.iter().filter_map(|i| i["text"].as_str()).collect())
                .unwrap_or_default();
            let text = text.join("\n");
            let Some(t) = st.threads.get_mut(&id).filter(|t| t.loaded) else {
                return invalid(format!("thread not found: {id}"));
            };
            if t.active.is_some() {
                return invalid(format!(
                    "thread {id} already has an active turn (simulator: one turn at a time)"
                ));
            }
            let turn_id = uuid_v7();
            let (stop_tx, stop_rx) = watch::channel(false);
            t.active = Some((turn_id.clone(), stop_tx));
            t.turns += 1;
            t.unload_epoch += 1;
            if t.preview.is_empty() {
                t.preview = text.chars().take(80).collect();
            }
            st.running_turns += 1;
            let turn = json!({"id": turn_id, "items": [], "status": "inProgress", "error": null});
            tokio::spawn(run_turn(sim.clone(), id, turn_id, text, stop_rx));
            Ok(json!({"turn": turn}))
        }
        "turn/interrupt" => {
            let id = thread_id_param(params)?;
            let Some(t) = st.threads.get(&id) else {
                return invalid(format!("thread not found: {id}"));
            };
            if let Some((_, stop)) = &t.active {
                let _ = stop.send(true);
            }
            Ok(json!({}))
        }
        _ => invalid(format!("Invalid request: unknown variant `{method}`")),
    }
}
