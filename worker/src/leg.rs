//! WebSocket connections ("legs") over a worker's Unix socket.

use std::path::Path;

use tokio::net::UnixStream;

use crate::error::LegError;
use crate::id::Peer;

mod unix_io;

pub use unix_io::UnixIo;

/// A WebSocket connection to one worker over its Unix socket.
pub type LegStream = tokio_tungstenite::WebSocketStream<LegSocket>;

/// A worker's Unix socket as a leg reads it: through a buffer of
/// [`proto::ws::LEG_SOCKET_BUFFER`] bytes, so tungstenite's small reads
/// ([`proto::ws::READ_BUFFER_SIZE`]) cost a copy, not a system call each; and watched for
/// writability only while a write waits ([`UnixIo`]), so a worker reading a request wakes
/// nobody.
pub type LegSocket = tokio::io::BufReader<UnixIo>;

/// `stream` as a leg reads it ([`LegSocket`]). Fails only if tokio cannot register it.
pub fn buffered(stream: UnixStream) -> std::io::Result<LegSocket> {
    Ok(tokio::io::BufReader::with_capacity(
        proto::ws::LEG_SOCKET_BUFFER,
        UnixIo::new(stream)?,
    ))
}

/// The request URI of the upgrade; app-server upgrades any path and ignores the host.
const LEG_URI: &str = "ws://localhost/";

/// Opens a leg: connects to `socket_path`, checks that `expected` is the listener, and performs
/// the WebSocket upgrade, with explicit message, frame and write-buffer limits derived from
/// `max_message_size`.
pub async fn connect(
    socket_path: &Path,
    expected: Peer,
    max_message_size: usize,
) -> Result<LegStream, LegError> {
    let stream = UnixStream::connect(socket_path)
        .await
        .map_err(|source| LegError::Connect {
            path: socket_path.to_path_buf(),
            source,
        })?;
    check_peer(&stream, socket_path, expected)?;
    let socket = buffered(stream).map_err(|source| LegError::Connect {
        path: socket_path.to_path_buf(),
        source,
    })?;
    let (ws, _response) = tokio_tungstenite::client_async_with_config(
        LEG_URI,
        socket,
        Some(leg_config(max_message_size)),
    )
    .await
    .map_err(|source| LegError::Handshake {
        path: socket_path.to_path_buf(),
        source: Box::new(source),
    })?;
    Ok(ws)
}

/// Fails unless the listener at the other end of `stream` is exactly `expected`.
pub fn check_peer(stream: &UnixStream, socket_path: &Path, expected: Peer) -> Result<(), LegError> {
    let cred = stream.peer_cred().map_err(|source| LegError::Connect {
        path: socket_path.to_path_buf(),
        source,
    })?;
    let pid = cred.pid().and_then(|pid| u32::try_from(pid).ok());
    if pid == Some(expected.pid) && cred.uid() == expected.uid {
        return Ok(());
    }
    Err(LegError::PeerMismatch {
        path: socket_path.to_path_buf(),
        expected,
        found: format!(
            "pid {} uid {}",
            pid.map_or_else(|| "unknown".to_owned(), |p| p.to_string()),
            cred.uid()
        ),
    })
}

/// The WebSocket limits used for every leg (defined in the protocol core).
pub use proto::ws::leg_config;

#[cfg(test)]
mod tests {
    use super::*;

    fn own_peer() -> Peer {
        Peer {
            pid: std::process::id(),
            uid: nix::unistd::geteuid().as_raw(),
        }
    }

    #[tokio::test]
    async fn a_listener_that_is_not_the_worker_is_refused_before_anything_is_sent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let accept = tokio::spawn(async move {
            let mut buf = Vec::new();
            for _ in 0..2 {
                let (mut conn, _) = listener.accept().await.unwrap();
                tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut buf)
                    .await
                    .unwrap();
            }
            buf
        });
        // This process listens, so its own credentials are the right ones; another pid is not.
        let other = Peer {
            pid: std::process::id() + 1,
            ..own_peer()
        };
        let err = connect(&path, other, 1024).await.unwrap_err();
        assert!(err.is_peer_mismatch(), "{err}");
        let other_uid = Peer {
            uid: own_peer().uid + 1,
            ..own_peer()
        };
        assert!(connect(&path, other_uid, 1024)
            .await
            .unwrap_err()
            .is_peer_mismatch());
        // Nothing at all reached the listener: not even the upgrade request.
        assert!(accept.await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn missing_socket_is_not_listening() {
        let dir = tempfile::tempdir().unwrap();
        let err = connect(&dir.path().join("none.sock"), own_peer(), 1024)
            .await
            .unwrap_err();
        assert!(err.is_not_listening(), "{err}");
    }
}
