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
//! broadcasts to initialized connections only; `optOutNotificationMethods` (exact names, for
//! targeted and broadcast notifications alike); per-process integer server-request ids; idle unload
//! with `thread/status/changed` notLoaded then `thread/closed`; SIGTERM drain (running turns
//! finish, new thread/turn starts are refused, exit 0 without close frames; a second SIGTERM exits
//! now). Simplifications: one turn at a time per thread (a second `turn/start` is refused), no
//! writer locks across processes, threads live in memory only ("disk" is this process's memory).

mod methods;
mod state;
mod turn;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use methods::handle;
use state::{drop_conn, error_frame, send_to, Conn, ConnId, Sim, State};
use turn::arm_unload;

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
            opt_out: Default::default(),
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
