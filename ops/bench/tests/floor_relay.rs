//! The floor relay (`floor-relay`) as a process on loopback, in front of WebSocket servers on Unix
//! sockets that record what they receive: frames pass both ways unchanged (text that is no JSON,
//! binary), a client that goes away takes its upstream connection with it, a refused upstream
//! fails that client only, with `--upstream-dir` each client reaches the socket its request path
//! names and a path that would leave the directory reaches none, and bad arguments are a clear
//! error.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::UnixListener;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::Connector;

const WAIT: Duration = Duration::from_secs(10);

/// What the upstream saw: a frame, or one connection's end.
#[derive(Debug, PartialEq)]
enum Seen {
    Frame(Message),
    Closed,
}

/// A WebSocket server on `socket` that echoes every text or binary frame and reports each frame
/// and each connection's end on the channel.
fn upstream(socket: &Path) -> anyhow::Result<mpsc::UnboundedReceiver<Seen>> {
    let listener = UnixListener::bind(socket)?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(m)) = ws.next().await {
                    if m.is_text() || m.is_binary() {
                        let _ = tx.send(Seen::Frame(m.clone()));
                        if ws.send(m).await.is_err() {
                            break;
                        }
                    }
                }
                let _ = tx.send(Seen::Closed);
            });
        }
    });
    Ok(rx)
}

/// A certificate for localhost and its CA, as files in `dir`: (cert, key, ca).
fn pki(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
    let pki = router::cli::dev::generate_pki(&["localhost"])?;
    let (cert, key, ca) = (dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.pem"));
    std::fs::write(&cert, pki.cert_pem)?;
    std::fs::write(&key, pki.key_pem)?;
    std::fs::write(&ca, pki.ca_pem)?;
    Ok((cert, key, ca))
}

/// Starts the relay in front of the one socket `upstream`, with `extra` arguments; returns it
/// with its port.
async fn relay(
    cert: &Path,
    key: &Path,
    upstream: &Path,
    extra: &[&str],
) -> anyhow::Result<(Child, u16)> {
    relay_to(cert, key, "--upstream", upstream, extra).await
}

/// Starts the relay with `flag upstream` (`--upstream` or `--upstream-dir`) and `extra`
/// arguments; returns it with its port.
async fn relay_to(
    cert: &Path,
    key: &Path,
    flag: &str,
    upstream: &Path,
    extra: &[&str],
) -> anyhow::Result<(Child, u16)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_floor-relay"))
        .args(extra)
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .arg(flag)
        .arg(upstream)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("stdout")?;
    tokio::time::timeout(WAIT, BufReader::new(stdout).read_line(&mut line)).await??;
    let addr: std::net::SocketAddr = line
        .trim()
        .strip_prefix("floor-relay listening on ")
        .with_context(|| format!("printed {line:?}"))?
        .parse()?;
    Ok((child, addr.port()))
}

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(port: u16, ca: &Path) -> anyhow::Result<Client> {
    connect_path(port, ca, "/").await
}

/// A client whose upgrade asks for `path`.
async fn connect_path(port: u16, ca: &Path, path: &str) -> anyhow::Result<Client> {
    let req = format!("wss://localhost:{port}{path}").into_client_request()?;
    let tls = Connector::Rustls(testkit::client_tls(ca)?);
    let (ws, _) =
        tokio_tungstenite::connect_async_tls_with_config(req, None, true, Some(tls)).await?;
    Ok(ws)
}

async fn next_seen(rx: &mut mpsc::UnboundedReceiver<Seen>) -> anyhow::Result<Seen> {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .context("the upstream saw nothing")?
        .context("upstream gone")
}

async fn next_frame(ws: &mut Client) -> anyhow::Result<Message> {
    tokio::time::timeout(WAIT, ws.next())
        .await
        .context("no frame back")?
        .context("closed")?
        .map_err(Into::into)
}

#[tokio::test]
async fn frames_pass_unchanged_both_ways_and_a_gone_client_closes_its_upstream(
) -> anyhow::Result<()> {
    relays_unchanged_and_closes(&[]).await
}

#[tokio::test]
async fn the_same_on_one_runtime_thread() -> anyhow::Result<()> {
    relays_unchanged_and_closes(&["--worker-threads", "1"]).await
}

#[tokio::test]
async fn the_same_when_it_reads_frames_as_a_router() -> anyhow::Result<()> {
    relays_unchanged_and_closes(&["--route"]).await
}

async fn relays_unchanged_and_closes(extra: &[&str]) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca) = pki(dir.path())?;
    let socket = dir.path().join("w.sock");
    let mut seen = upstream(&socket)?;
    let (_relay, port) = relay(&cert, &key, &socket, extra).await?;

    let mut ws = connect(port, &ca).await?;
    // JSON-RPC (which `--route` reads: a request by its thread, answers by their ids), then not
    // JSON and a binary frame with bytes no text could hold (which a relay that parsed to
    // forward would change or refuse): every one passes as it came.
    let frames = [
        Message::text(r#"{"id":7,"method":"thread/read","params":{"threadId":"t-1"}}"#),
        Message::text(r#"{"id":7,"result":{"thread":{"id":"t-1"}}}"#),
        Message::text(r#"{ "id" : 8 , "error" : {"code":-32001,"message":"m"} }"#),
        Message::text("{\"id\": 1, not json at all"),
        Message::binary(vec![0u8, 255, 1, 254, b'{']),
        Message::text("ü".repeat(5000)),
    ];
    for f in &frames {
        ws.send(f.clone()).await?;
        assert_eq!(next_seen(&mut seen).await?, Seen::Frame(f.clone()));
        assert_eq!(&next_frame(&mut ws).await?, f);
    }

    // The client goes away without a closing handshake: the relay must end its upstream
    // connection too, not hold it open.
    drop(ws);
    assert_eq!(next_seen(&mut seen).await?, Seen::Closed);
    Ok(())
}

#[tokio::test]
async fn a_refused_upstream_fails_that_client_only() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca) = pki(dir.path())?;
    let socket = dir.path().join("w.sock");
    let (mut relay, port) = relay(&cert, &key, &socket, &[]).await?;

    // Nothing listens on the socket yet: this client's relay ends.
    let mut ws = connect(port, &ca).await?;
    let _ = ws.send(Message::text("lost")).await;
    let ended = tokio::time::timeout(WAIT, ws.next()).await?;
    assert!(
        !matches!(ended, Some(Ok(Message::Text(_)))),
        "a frame came back from no upstream: {ended:?}"
    );

    // The relay still runs, and serves the next client once the upstream is there.
    assert!(relay.try_wait()?.is_none(), "the relay exited");
    let mut seen = upstream(&socket)?;
    let mut ws = connect(port, &ca).await?;
    ws.send(Message::text("found")).await?;
    assert_eq!(
        next_seen(&mut seen).await?,
        Seen::Frame(Message::text("found"))
    );
    assert_eq!(next_frame(&mut ws).await?, Message::text("found"));
    Ok(())
}

/// Runs the relay with `args`, which it must refuse without a panic; its stderr.
async fn refused(args: &[&std::ffi::OsStr]) -> anyhow::Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_floor-relay"))
        .args(args)
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(stderr)
}

#[tokio::test]
async fn a_missing_certificate_or_zero_threads_is_a_clear_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key) = (dir.path().join("none.crt"), dir.path().join("none.key"));
    let stderr = refused(&[
        "--cert".as_ref(),
        cert.as_os_str(),
        "--key".as_ref(),
        key.as_os_str(),
        "--upstream".as_ref(),
        "w.sock".as_ref(),
    ])
    .await?;
    assert!(stderr.contains("none.crt"), "{stderr}");

    let zero = [
        "--worker-threads",
        "0",
        "--cert",
        "c",
        "--key",
        "k",
        "--upstream",
        "u",
    ];
    let stderr = refused(&zero.map(std::ffi::OsStr::new)).await?;
    assert!(stderr.contains("--worker-threads"), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn an_unnamed_doubly_named_or_missing_upstream_is_a_clear_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tls = ["--cert", "c", "--key", "k"].map(std::ffi::OsStr::new);
    let stderr = refused(&tls).await?;
    assert!(
        stderr.contains("--upstream") && stderr.contains("--upstream-dir"),
        "{stderr}"
    );

    let both = [
        tls.as_slice(),
        &["--upstream", "u", "--upstream-dir", "d"].map(std::ffi::OsStr::new),
    ]
    .concat();
    let stderr = refused(&both).await?;
    assert!(stderr.contains("cannot be used with"), "{stderr}");

    let none = dir.path().join("none");
    let stderr = refused(
        &[
            tls.as_slice(),
            &["--upstream-dir".as_ref(), none.as_os_str()],
        ]
        .concat(),
    )
    .await?;
    assert!(stderr.contains("not a directory"), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn each_client_reaches_the_socket_its_request_path_names() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca) = pki(dir.path())?;
    let up = dir.path().join("up");
    std::fs::create_dir_all(up.join("acme"))?;
    let mut seen_a = upstream(&up.join("acme/0.sock"))?;
    let mut seen_b = upstream(&up.join("1.sock"))?;
    let (_relay, port) = relay_to(&cert, &key, "--upstream-dir", &up, &[]).await?;

    // Both connected at once: each relay must keep its own upstream.
    let mut a = connect_path(port, &ca, "/acme/0").await?;
    let mut b = connect_path(port, &ca, "/1").await?;
    for (ws, seen, frames) in [
        (
            &mut a,
            &mut seen_a,
            [
                Message::text("to acme/0, not json"),
                Message::binary(vec![0u8, 255]),
            ],
        ),
        (
            &mut b,
            &mut seen_b,
            [Message::text("to 1"), Message::binary(vec![1u8, 254, b'{'])],
        ),
    ] {
        for f in frames {
            ws.send(f.clone()).await?;
            assert_eq!(next_seen(seen).await?, Seen::Frame(f.clone()));
            assert_eq!(next_frame(ws).await?, f);
        }
    }
    drop(a);
    assert_eq!(next_seen(&mut seen_a).await?, Seen::Closed);
    assert!(seen_b.try_recv().is_err(), "b's upstream saw a's end");
    drop(b);
    assert_eq!(next_seen(&mut seen_b).await?, Seen::Closed);
    Ok(())
}

/// Hostile request paths: each is answered 400 and reaches no socket, inside or outside the
/// directory, and the relay goes on serving the next client.
#[tokio::test]
async fn a_request_path_that_would_leave_the_directory_reaches_no_socket() -> anyhow::Result<()> {
    use tokio_tungstenite::tungstenite::Error;
    let dir = tempfile::tempdir()?;
    let (cert, key, ca) = pki(dir.path())?;
    let base = dir.path();
    let up = base.join("up");
    std::fs::create_dir_all(up.join("in"))?;
    std::fs::create_dir_all(base.join("out"))?;
    let mut inside = upstream(&up.join("in/0.sock"))?;
    // Sockets beside the directory, where `..` would lead.
    let mut outside = upstream(&base.join("outside.sock"))?;
    let mut out_x = upstream(&base.join("out/x.sock"))?;
    let (mut relay, port) = relay_to(&cert, &key, "--upstream-dir", &up, &[]).await?;

    let abs = base.join("outside");
    let abs = format!("/{}", abs.display());
    let long = format!("/in/{}", "a".repeat(100));
    let hostile = [
        "/../outside",
        "/../out/x",
        "/in/../../outside",
        "/in/../../out/x",
        "/./../outside",
        abs.as_str(),
        "/%2e%2e/outside",
        "/..%2foutside",
        "/in/0%00",
        "/in//0",
        "/",
        long.as_str(),
    ];
    let mut taken = Vec::new();
    for path in hostile {
        match connect_path(port, &ca, path).await {
            Err(e) => match e.downcast_ref::<Error>() {
                Some(Error::Http(resp)) if resp.status() == 400 => {}
                _ => taken.push(format!("{path}: failed otherwise: {e:#}")),
            },
            Ok(mut ws) => {
                // Upgraded: find out whether a socket answers behind it.
                let _ = ws.send(Message::text("escaped")).await;
                let back = tokio::time::timeout(WAIT, ws.next()).await;
                taken.push(format!("{path}: upgraded, then {back:?}"));
            }
        }
    }

    // Every attempt is over (answered, or its frame echoed or lost): none may have reached a
    // socket beside the directory.
    assert!(outside.try_recv().is_err(), "a client reached outside.sock");
    assert!(out_x.try_recv().is_err(), "a client reached out/x.sock");
    assert!(
        taken.is_empty(),
        "hostile paths not refused with 400: {taken:#?}"
    );

    // The relay still runs and still serves a path inside the directory, which saw nothing
    // before.
    assert!(relay.try_wait()?.is_none(), "the relay exited");
    let mut ws = connect_path(port, &ca, "/in/0").await?;
    ws.send(Message::text("inside")).await?;
    assert_eq!(
        next_seen(&mut inside).await?,
        Seen::Frame(Message::text("inside"))
    );
    assert_eq!(next_frame(&mut ws).await?, Message::text("inside"));
    Ok(())
}
