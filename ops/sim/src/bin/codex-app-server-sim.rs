//! `codex-app-server-sim`: a protocol SIMULATOR of `codex app-server` for load and fault tests of
//! codex-fleet at scales real workers cannot reach. It is not codex: no model, no tools, no disk.
//! It never replaces the real worker in the end-to-end suite.
//!
//! Invoked like the real one: `codex-app-server-sim app-server --listen unix://PATH [-c k=v]…`.
//! Unknown `-c` keys are ignored; `thread_unload_delay_secs` is honoured; `sim.*` keys (or the
//! environment variables `CODEX_SIM_<KEY>`, e.g. `CODEX_SIM_TURN_MS`) script timing and faults:
//!
//! | key | default | effect |
//! |---|---|---|
//! | `sim.turn_ms` | 20 | duration of a turn (deltas are spread over it; 0: as fast as it can) |
//! | `sim.deltas` | 4 | `item/agentMessage/delta` notifications per turn (at most one per character of the reply) |
//! | `sim.request_ms` | 0 | time the single request processor spends on each request |
//! | `sim.start_delay_ms` | 0 | delay before the socket is bound (slow start) |
//! | `sim.fail_start` | 0 | 1: exit 1 at once (a command that cannot start) |
//! | `sim.crash_after_ms` | – | abort (SIGABRT) this long after start |
//! | `sim.stall_after_ms` | – | SIGSTOP itself this long after start (a hung worker) |
//!
//! Magic words in a turn's user text: `RUNSHELL` (command approval server request, answered
//! before the reply), `CRASH` (abort at turn start), `STALL` (SIGSTOP at turn start), `SLOW`
//! (the turn takes 10× `sim.turn_ms`), `MANY<n>` (a reply of n 72-character words, room for
//! that many more deltas). The reply text is `mock_model::reply_text`.
//!
//! Faithful subset (docs/app-server-facts.md §1–§5, §11): one JSON-RPC message per text frame;
//! invalid JSON is ignored; `-32600` for unknown methods, missing params, "Not initialized",
//! "Already initialized"; one process-wide inbound queue of 128 answering `-32001` when full;
//! broadcasts to initialized connections only; per-process integer server-request ids; idle unload
//! with `thread/status/changed` notLoaded then `thread/closed`; SIGTERM drain (running turns
//! finish, new thread/turn starts are refused, exit 0 without close frames; a second SIGTERM exits
//! now). Simplifications: one turn at a time per thread (a second `turn/start` is refused), no
//! writer locks across processes, threads live in memory only ("disk" is this process's memory).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::tungstenite::Message;

const VERSION: &str = "0.171.0-sim";
/// The process-wide inbound queue (docs/app-server-facts.md §2: `CHANNEL_CAPACITY = 128`).
const INBOUND_CAPACITY: usize = 128;
/// Per-connection outbound queue; a connection that lets it fill is disconnected
/// (docs/app-server-facts.md §2).
const OUTBOUND_CAPACITY: usize = 32 * 1024;
const INVALID_REQUEST: i64 = -32600;
const OVERLOADED: i64 = -32001;

/// Settings from `-c` and `CODEX_SIM_*`.
#[derive(Debug, Clone)]
struct Settings {
    listen: PathBuf,
    unload_delay: Duration,
    turn_ms: u64,
    deltas: u64,
    request_ms: u64,
    start_delay_ms: u64,
    fail_start: bool,
    crash_after_ms: Option<u64>,
    stall_after_ms: Option<u64>,
}

fn parse_args() -> anyhow::Result<Settings> {
    let mut args = std::env::args().skip(1);
    let mut listen = None;
    let mut kv: BTreeMap<String, String> = BTreeMap::new();
    // Environment first, so `-c` wins.
    for (k, v) in std::env::vars() {
        if let Some(key) = k.strip_prefix("CODEX_SIM_") {
            kv.insert(format!("sim.{}", key.to_ascii_lowercase()), v);
        }
    }
    while let Some(a) = args.next() {
        match a.as_str() {
            "app-server" => {}
            "--listen" => listen = args.next(),
            "-c" | "--config" => {
                let pair = args.next().context("-c needs key=value")?;
                if let Some((k, v)) = pair.split_once('=') {
                    kv.insert(k.trim().to_owned(), v.trim().trim_matches('"').to_owned());
                }
            }
            other if other.starts_with("--listen=") => {
                listen = Some(other["--listen=".len()..].to_owned())
            }
            other => eprintln!("codex-app-server-sim: ignoring argument {other:?}"),
        }
    }
    let listen = listen.context("--listen unix://PATH is required")?;
    let Some(path) = listen.strip_prefix("unix://") else {
        bail!("the simulator only listens on unix://PATH, not {listen}");
    };
    let num = |k: &str| -> anyhow::Result<Option<u64>> {
        kv.get(k)
            .map(|v| {
                v.parse()
                    .with_context(|| format!("{k}={v} is not a number"))
            })
            .transpose()
    };
    Ok(Settings {
        listen: PathBuf::from(path),
        unload_delay: Duration::from_secs(num("thread_unload_delay_secs")?.unwrap_or(60)),
        turn_ms: num("sim.turn_ms")?.unwrap_or(20),
        deltas: num("sim.deltas")?.unwrap_or(4),
        request_ms: num("sim.request_ms")?.unwrap_or(0),
        start_delay_ms: num("sim.start_delay_ms")?.unwrap_or(0),
        fail_start: num("sim.fail_start")?.unwrap_or(0) != 0,
        crash_after_ms: num("sim.crash_after_ms")?,
        stall_after_ms: num("sim.stall_after_ms")?,
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A UUIDv7-shaped id: 48-bit millisecond timestamp, version 7, variant bits, random rest.
fn uuid_v7() -> String {
    let ms = now_ms() & 0xffff_ffff_ffff;
    let r: u128 = rand::random();
    let a = (r & 0xfff) as u16;
    let b = (((r >> 12) & 0x3fff) as u16) | 0x8000;
    let c = ((r >> 26) & 0xffff_ffff_ffff) as u64;
    format!(
        "{:08x}-{:04x}-7{:03x}-{:04x}-{:012x}",
        ms >> 16,
        ms & 0xffff,
        a,
        b,
        c
    )
}

fn stop_self() {
    let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGSTOP);
}

type ConnId = u64;

struct Conn {
    tx: mpsc::Sender<String>,
    initialized: bool,
}

struct Thread {
    id: String,
    created_at: u64,
    preview: String,
    turns: u64,
    loaded: bool,
    subscribers: HashSet<ConnId>,
    /// Running turn: its id and its interrupt switch.
    active: Option<(String, watch::Sender<bool>)>,
    /// Bumped whenever the thread stops being idle-without-subscribers; stale unload timers see it.
    unload_epoch: u64,
}

impl Thread {
    fn status(&self, waiting: bool) -> Value {
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

    fn summary(&self, codex_home: &str) -> Value {
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
struct State {
    conns: HashMap<ConnId, Conn>,
    /// Every thread this process created: loaded or not (the in-memory "disk").
    threads: HashMap<String, Thread>,
    /// Pending server requests by id.
    pending: HashMap<i64, oneshot::Sender<Value>>,
    next_server_request: i64,
    /// Who set the userAgent prefix (first initialize that is not the daemon's).
    originator: Option<String>,
    draining: bool,
    running_turns: usize,
    /// Broadcasts to send after the current request's response.
    deferred: Vec<(&'static str, Value)>,
}

struct Sim {
    settings: Settings,
    codex_home: String,
    state: Mutex<State>,
    /// Paths to remove at exit: the symlink and the real socket.
    paths: (PathBuf, PathBuf),
}

impl Sim {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn exit(&self, code: i32) -> ! {
        let _ = std::fs::remove_file(&self.paths.0);
        let _ = std::fs::remove_file(&self.paths.1);
        std::process::exit(code)
    }
}

/// Queues a text frame to a connection; a full queue disconnects it (slow consumer).
fn send_to(st: &mut State, conn: ConnId, text: String) {
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

fn notification(method: &str, params: Value) -> String {
    json!({"method": method, "params": params, "emittedAtMs": now_ms()}).to_string()
}

/// To every initialized connection.
fn broadcast(st: &mut State, method: &str, params: Value) {
    let text = notification(method, params);
    let ids: Vec<ConnId> = st
        .conns
        .iter()
        .filter(|(_, c)| c.initialized)
        .map(|(id, _)| *id)
        .collect();
    for id in ids {
        send_to(st, id, text.clone());
    }
}

/// To the thread's current subscribers (dropped when it has none).
fn to_subscribers(st: &mut State, thread: &str, text: String) {
    let ids: Vec<ConnId> = st
        .threads
        .get(thread)
        .map(|t| t.subscribers.iter().copied().collect())
        .unwrap_or_default();
    for id in ids {
        send_to(st, id, text.clone());
    }
}

fn drop_conn(st: &mut State, conn: ConnId) -> Vec<(String, u64)> {
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

fn error_frame(id: &Value, code: i64, message: &str, data: Option<Value>) -> String {
    let mut e = json!({"code": code, "message": message});
    if let Some(d) = data {
        e["data"] = d;
    }
    json!({"id": id, "error": e}).to_string()
}

fn result_frame(id: &Value, result: Value) -> String {
    json!({"id": id, "result": result}).to_string()
}

/// Starts the idle-unload timer of a thread left without subscribers and not active.
fn arm_unload(sim: &Arc<Sim>, thread: String, epoch: u64) {
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

enum Inbound {
    Message(ConnId, Value),
    Closed(ConnId),
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let settings = match parse_args() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("codex-app-server-sim: {e:#}");
            std::process::exit(2);
        }
    };
    if settings.fail_start {
        eprintln!("codex-app-server-sim: sim.fail_start=1, exiting");
        std::process::exit(1);
    }
    if let Err(e) = run(settings).await {
        eprintln!("codex-app-server-sim: {e:#}");
        std::process::exit(1);
    }
}

/// Binds the real socket in a private folder and makes `link` a symlink to it
/// (docs/app-server-facts.md §11).
fn bind(link: &Path) -> anyhow::Result<(UnixListener, PathBuf)> {
    let uid = nix::unistd::getuid();
    let dir = PathBuf::from(format!("/tmp/codex-sim-{uid}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    let digest = hex::encode(Sha256::digest(link.as_os_str().as_encoded_bytes()));
    let real = dir.join(&digest[..32]);
    // A live simulator on the same path refuses; a dead one's socket is replaced.
    if std::os::unix::net::UnixStream::connect(link).is_ok() {
        bail!("{} is already in use", link.display());
    }
    let _ = std::fs::remove_file(&real);
    match std::fs::symlink_metadata(link) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(link)?,
        Ok(_) => bail!("{} exists and is not a socket", link.display()),
        Err(_) => {}
    }
    let listener = UnixListener::bind(&real)?;
    std::fs::set_permissions(&real, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    std::os::unix::fs::symlink(&real, link)?;
    Ok((listener, real))
}

async fn run(settings: Settings) -> anyhow::Result<()> {
    if settings.start_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(settings.start_delay_ms)).await;
    }
    let (listener, real) = bind(&settings.listen)?;
    let sim = Arc::new(Sim {
        codex_home: std::env::var("CODEX_HOME").unwrap_or_else(|_| "/nonexistent".into()),
        paths: (settings.listen.clone(), real),
        settings,
        state: Mutex::new(State::default()),
    });
    if let Some(ms) = sim.settings.crash_after_ms {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            eprintln!("codex-app-server-sim: sim.crash_after_ms reached, aborting");
            std::process::abort();
        });
    }
    if let Some(ms) = sim.settings.stall_after_ms {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            eprintln!("codex-app-server-sim: sim.stall_after_ms reached, stopping");
            stop_self();
        });
    }
    let (in_tx, in_rx) = mpsc::channel::<Inbound>(INBOUND_CAPACITY);
    tokio::spawn(processor(sim.clone(), in_rx));
    tokio::spawn(drain_on_sigterm(sim.clone()));
    let next_conn = AtomicU64::new(1);
    loop {
        let (stream, _) = listener.accept().await?;
        let id = next_conn.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(connection(sim.clone(), id, stream, in_tx.clone()));
    }
}

async fn drain_on_sigterm(sim: Arc<Sim>) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    sim.lock().draining = true;
    loop {
        if sim.lock().running_turns == 0 {
            sim.exit(0);
        }
        tokio::select! {
            _ = term.recv() => sim.exit(0),
            _ = int.recv() => sim.exit(0),
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
}

async fn connection(sim: Arc<Sim>, id: ConnId, stream: UnixStream, inbound: mpsc::Sender<Inbound>) {
    let Ok(ws) = tokio_tungstenite::accept_async(stream).await else {
        return;
    };
    let (mut sink, mut source) = ws.split();
    let (tx, mut rx) = mpsc::channel::<String>(OUTBOUND_CAPACITY);
    sim.lock().conns.insert(
        id,
        Conn {
            tx: tx.clone(),
            initialized: false,
        },
    );
    drop(tx);
    let writer = tokio::spawn(async move {
        while let Some(text) = rx.recv().await {
            if sink.send(Message::text(text)).await.is_err() {
                break;
            }
        }
        // Like app-server: the connection just ends, no close frame.
    });
    while let Some(Ok(msg)) = source.next().await {
        let text = match msg {
            Message::Text(t) => t,
            Message::Close(_) => break,
            _ => continue,
        };
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            continue; // invalid JSON: logged only by the real one
        };
        let is_request = v.get("method").is_some() && v.get("id").is_some();
        match inbound.try_send(Inbound::Message(id, v)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(Inbound::Message(_, v))) if is_request => {
                let frame = error_frame(
                    &v["id"],
                    OVERLOADED,
                    "Server overloaded; retry later.",
                    None,
                );
                let mut st = sim.lock();
                send_to(&mut st, id, frame);
            }
            Err(mpsc::error::TrySendError::Full(m)) => {
                if inbound.send(m).await.is_err() {
                    break;
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => break,
        }
    }
    let _ = inbound.send(Inbound::Closed(id)).await;
    writer.abort();
}

/// The single request processor (app-server awaits each request's dispatch in turn).
async fn processor(sim: Arc<Sim>, mut rx: mpsc::Receiver<Inbound>) {
    while let Some(ev) = rx.recv().await {
        match ev {
            Inbound::Closed(conn) => {
                let orphaned = drop_conn(&mut sim.lock(), conn);
                for (t, epoch) in orphaned {
                    arm_unload(&sim, t, epoch);
                }
            }
            Inbound::Message(conn, v) => {
                if sim.settings.request_ms > 0 && v.get("method").is_some() && v.get("id").is_some()
                {
                    tokio::time::sleep(Duration::from_millis(sim.settings.request_ms)).await;
                }
                handle(&sim, conn, v);
            }
        }
    }
}

fn handle(sim: &Arc<Sim>, conn: ConnId, v: Value) {
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

type Answer = Result<Value, (String, Option<Value>)>;

fn invalid(message: impl Into<String>) -> Answer {
    Err((message.into(), None))
}

fn thread_id_param(params: &Value) -> Result<String, (String, Option<Value>)> {
    let Some(id) = params.get("threadId").and_then(Value::as_str) else {
        return Err(("Invalid request: missing field `threadId`".into(), None));
    };
    Ok(id.to_owned())
}

const METHODS: &[&str] = &[
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

fn request(sim: &Arc<Sim>, conn: ConnId, method: &str, params: &Value) -> Answer {
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

/// Emits one turn's stream to the thread's subscribers, and its status to everyone.
async fn run_turn(
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
        to_subscribers(st, &thread, notification(method, params));
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
async fn approval(
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
            notification(
                "item/started",
                json!({"threadId": thread, "turnId": turn, "item": item}),
            ),
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
        to_subscribers(&mut st, thread, req.to_string());
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
        notification(
            "serverRequest/resolved",
            json!({"threadId": thread, "requestId": request_id}),
        ),
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
        notification(
            "item/completed",
            json!({"threadId": thread, "turnId": turn, "item": item}),
        ),
    );
    broadcast(
        &mut st,
        "thread/status/changed",
        json!({"threadId": thread, "status": {"type": "active", "activeFlags": []}}),
    );
    false
}
