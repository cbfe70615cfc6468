//! The floor relay: what this stack (tokio, rustls, tungstenite) costs a WebSocket round trip with
//! no routing. It terminates TLS, accepts the client's WebSocket upgrade, opens a WebSocket to a
//! Unix socket and relays frames as they are, one task per direction: no JSON parsing, no
//! authentication, no admission, no policy; its WebSockets are configured as codex-fleet's
//! ([`MAX_MESSAGE_BYTES`]). Nagle is off on the client's TCP socket, as
//! codex-fleet's listener sets it.
//!
//! The upstream is one socket for every client (`--upstream`: the worker socket codex-fleet and
//! HAProxy front in `added-latency`), or one socket per client named by the upgrade's request
//! path under a directory (`--upstream-dir DIR`: `/acme/0` is `DIR/acme/0.sock`; `fleet-load`
//! sends each session to the simulator its direct path uses). Only the request line is read for
//! that, never a frame; a path that could leave the directory is refused with 400.
//!
//! It runs as its own process (`floor-relay`), like codex-fleet and HAProxy, so the proxies are
//! measured the same way: their own scheduler, their own threads, a process boundary on either
//! side. Its runtime is the same flavour codex-fleet runs (tokio's multi-thread default).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use proto::rpc::{self, RequestId};
use rustls::ServerConfig;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::process::{Child, Command};
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::Message;

/// The longest request path `--upstream-dir` takes, in bytes: far more than any bench names, and
/// short enough that the socket path stays within a Unix socket address with a short directory.
pub const MAX_REQUEST_PATH: usize = 64;

/// The largest message relayed: tungstenite's default. The connections are set up as
/// codex-fleet sets up its own (`proto::ws`: the same read buffers, the same socket buffer under
/// the upstream WebSocket), so the floor differs from codex-fleet only in what it skips.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Where a client is relayed to.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// Every client to this one socket; the request path is not looked at.
    Socket(PathBuf),
    /// The socket under this directory that the request path names ([`socket_in`]).
    Dir(PathBuf),
}

// === impl Upstream ===

impl Upstream {
    /// The socket for a client whose upgrade asked for `path`, or why there is none.
    pub fn socket_for(&self, path: &str) -> Result<PathBuf, String> {
        match self {
            Upstream::Socket(s) => Ok(s.clone()),
            Upstream::Dir(dir) => socket_in(dir, path),
        }
    }
}

/// The socket under `dir` that the request path `path` names: `/a/b` is `dir/a/b.sock`. Only
/// segments of ASCII letters, digits, `-`, `_` and `.` are taken, none empty, `.` or `..`, in at
/// most [`MAX_REQUEST_PATH`] bytes: so no path names anything outside `dir` (no `..`, no
/// absolute path from an empty segment, no percent-encoding, no NUL). Symbolic links inside `dir`
/// are followed; the bench makes none.
pub fn socket_in(dir: &Path, path: &str) -> Result<PathBuf, String> {
    if path.len() > MAX_REQUEST_PATH {
        return Err(format!(
            "request path is {} bytes, at most {MAX_REQUEST_PATH} are taken",
            path.len()
        ));
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(format!("request path {path:?} does not start with /"));
    };
    let mut socket = dir.to_path_buf();
    for segment in rest.split('/') {
        if segment.is_empty() || segment == "." || segment == ".." {
            return Err(format!(
                "request path {path:?} has an empty, . or .. segment"
            ));
        }
        if let Some(c) = segment
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        {
            return Err(format!("request path {path:?} holds {c:?}"));
        }
        socket.push(segment);
    }
    socket.as_mut_os_string().push(".sock");
    Ok(socket)
}

/// Accepts connections on `listener` forever, relaying each to a fresh WebSocket on its
/// upstream socket. A connection that fails (handshake, a refused path, upstream refused) is
/// reported on stderr and dropped; the others go on.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    upstream: Upstream,
    routing: Routing,
) -> anyhow::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let upstream = Arc::new(upstream);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: wait a moment rather than spin.
                eprintln!("floor-relay: accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            if let Err(e) = relay(acceptor, tcp, &upstream, routing).await {
                eprintln!("floor-relay: {peer}: {e:#}");
            }
        });
    }
}

/// One client: TLS, the upgrade (answered 400 when the path names no socket), the upstream
/// WebSocket, then a task per direction until either side ends.
async fn relay(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    upstream: &Upstream,
    routing: Routing,
) -> anyhow::Result<()> {
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    let tls = acceptor.accept(tcp).await.context("TLS handshake")?;
    let mut chosen = Err(String::from("no upgrade request"));
    // tungstenite's `Callback` fixes the error type: an HTTP response, large by nature.
    #[allow(clippy::result_large_err)]
    let choose = |req: &Request, resp: Response| {
        chosen = upstream.socket_for(req.uri().path());
        match &chosen {
            Ok(_) => Ok(resp),
            Err(why) => {
                let mut refusal = ErrorResponse::new(Some(why.clone()));
                *refusal.status_mut() = StatusCode::BAD_REQUEST;
                Err(refusal)
            }
        }
    };
    let client = tokio_tungstenite::accept_hdr_async_with_config(
        tls,
        choose,
        Some(proto::ws::client_config(MAX_MESSAGE_BYTES)),
    )
    .await
    .context("WebSocket upgrade")?;
    let upstream = chosen.map_err(anyhow::Error::msg)?;
    let unix = UnixStream::connect(&upstream)
        .await
        .with_context(|| format!("connect {}", upstream.display()))?;
    let (worker, _) = tokio_tungstenite::client_async_with_config(
        "ws://localhost/",
        worker::leg::buffered(unix).context("register the upstream socket")?,
        Some(worker::leg::leg_config(MAX_MESSAGE_BYTES)),
    )
    .await
    .context("upstream WebSocket handshake")?;
    let (client_tx, client_rx) = client.split();
    let (worker_tx, worker_rx) = worker.split();
    // With `--route`, each frame is read as a router must read it to route it; the frames go
    // on unchanged either way.
    let table = Arc::new(RouteTable::default());
    let reads = table.clone();
    let client_rx = client_rx.inspect(move |m| {
        if let (Routing::Read, Ok(Message::Text(t))) = (routing, m) {
            std::hint::black_box(reads.request(t));
        }
    });
    let worker_rx = worker_rx.inspect(move |m| {
        if let (Routing::Read, Ok(Message::Text(t))) = (routing, m) {
            std::hint::black_box(table.answer(t));
        }
    });
    // `forward` hands over every frame that is ready and flushes once the source has no more:
    // a burst goes out as one write, a lone frame at once.
    // The client→worker direction is a task of its own, the worker→client one runs here; when
    // either ends, the other is dropped with its halves, which closes both sockets.
    let mut up = tokio::spawn(client_rx.forward(worker_tx));
    let ended = tokio::select! {
        r = worker_rx.forward(client_tx) => r,
        r = &mut up => r.unwrap_or(Ok(())),
    };
    up.abort();
    // A close from either side ends the relay; so does a peer that just goes away (the bench's
    // clients drop their connections): neither is a failure of the relay.
    use tokio_tungstenite::tungstenite::error::{Error, ProtocolError};
    match ended {
        Ok(())
        | Err(Error::ConnectionClosed)
        | Err(Error::AlreadyClosed)
        | Err(Error::Protocol(ProtocolError::ResetWithoutClosingHandshake)) => Ok(()),
        Err(Error::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// What the floor does with a frame besides relaying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// Nothing: the floor proper.
    #[default]
    None,
    /// Reads every frame as any router that routes by thread must (`--route`): a client's
    /// envelope and its `threadId` (the same `proto` readers codex-fleet uses), the thread
    /// looked up and the request id recorded in flight; a worker's answer read by its head (or
    /// in full) and its id taken out again. The frame is relayed unchanged: this measures the
    /// least a parsing router adds to this stack, not a router.
    Read,
}

/// A connection's routing state for [`Routing::Read`]: the threads it has named (standing in
/// for the table of which worker owns a thread) and its requests in flight.
#[derive(Default)]
struct RouteTable {
    state: std::sync::Mutex<(HashMap<String, u32>, HashSet<RequestId>)>,
}

impl RouteTable {
    /// A client's frame: its envelope read, its thread looked up (and learned), its id recorded.
    fn request(&self, text: &str) -> Option<u32> {
        let Ok(rpc::Message::Request { id, params, .. }) = rpc::parse(text) else {
            return None;
        };
        let thread = rpc::thread_id(params).map(std::borrow::Cow::into_owned);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.1.insert(id);
        let thread = thread?;
        let next = u32::try_from(state.0.len()).unwrap_or(u32::MAX);
        Some(*state.0.entry(thread).or_insert(next))
    }

    /// A worker's frame: an answer's id read and taken out of the requests in flight.
    fn answer(&self, text: &str) -> bool {
        let id = match rpc::result_head(text) {
            Some((id, _)) => id,
            None => match rpc::parse(text) {
                Ok(rpc::Message::Response { id }) => id,
                _ => return false,
            },
        };
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.1.remove(&id)
    }
}

/// Starts the built `floor-relay` (`FLOOR_RELAY_BIN`, or beside the running bench binary) with
/// the certificate `cert` and key `key`, in front of `upstream`, on `threads` runtime threads
/// (1: current-thread; none: tokio's multi-thread default), reading frames as `routing` says
/// (`--route` for [`Routing::Read`]), its stderr to `stderr`, killed on drop; returns it once it
/// accepts, with its address.
pub async fn spawn(
    cert: &Path,
    key: &Path,
    upstream: &Upstream,
    threads: Option<u16>,
    routing: Routing,
    stderr: Stdio,
) -> anyhow::Result<(Child, SocketAddr)> {
    let bin = crate::built_bin("floor-relay", "FLOOR_RELAY_BIN")?;
    let mut cmd = Command::new(&bin);
    if let Some(n) = threads {
        cmd.arg("--worker-threads").arg(n.to_string());
    }
    if routing == Routing::Read {
        cmd.arg("--route");
    }
    match upstream {
        Upstream::Socket(s) => cmd.arg("--upstream").arg(s),
        Upstream::Dir(d) => cmd.arg("--upstream-dir").arg(d),
    };
    let mut child = cmd
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let stdout = child.stdout.take().context("floor-relay's stdout")?;
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .context("floor-relay printed no address")??;
    let addr = line
        .trim()
        .strip_prefix("floor-relay listening on ")
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .with_context(|| format!("floor-relay printed {line:?}, not its address"))?;
    Ok((child, addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routing_floor_reads_threads_and_ids_as_a_router_would() {
        let table = RouteTable::default();
        let read = |t: &str| table.request(t);
        assert_eq!(
            read(r#"{"id":1,"method":"thread/read","params":{"threadId":"a"}}"#),
            Some(0)
        );
        assert_eq!(
            read(r#"{"id":2,"method":"thread/read","params":{"threadId":"b"}}"#),
            Some(1)
        );
        assert_eq!(
            read(r#"{"id":"x","method":"turn/start","params":{"threadId":"a"}}"#),
            Some(0)
        );
        assert_eq!(read(r#"{"id":3,"method":"model/list"}"#), None);
        assert_eq!(read(r#"{"method":"initialized"}"#), None);
        assert_eq!(read("not json"), None);
        // Answers take their request out of flight, by the head or the full parse.
        assert!(table.answer(r#"{"id":1,"result":{}}"#));
        assert!(table.answer(r#"{"error":{"code":1,"message":"m"},"id":"x"}"#));
        assert!(!table.answer(r#"{"id":1,"result":{}}"#), "answered once");
        assert!(!table.answer(r#"{"method":"turn/started","params":{}}"#));
        assert!(table.answer(r#"{"id":3,"result":[]}"#));
    }

    #[test]
    fn a_request_path_names_a_socket_inside_the_directory_or_none() {
        let dir = Path::new("/d");
        assert_eq!(socket_in(dir, "/0"), Ok(PathBuf::from("/d/0.sock")));
        assert_eq!(
            socket_in(dir, "/acme/w-1_x.y"),
            Ok(PathBuf::from("/d/acme/w-1_x.y.sock"))
        );
        let long = format!("/{}", "a".repeat(MAX_REQUEST_PATH));
        for bad in [
            "",
            "/",
            "0",
            "/..",
            "/../x",
            "/a/../../x",
            "/./x",
            "//etc/x",
            "/a//b",
            "/a/",
            "/%2e%2e/x",
            "/a\0b",
            "/a\\..\\b",
            "/ä",
            long.as_str(),
        ] {
            assert!(socket_in(dir, bad).is_err(), "{bad:?} was taken");
        }
    }
}
