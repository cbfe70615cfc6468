//! WebSocket connections ("legs") over a worker's Unix socket.

use std::path::Path;

use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use crate::error::LegError;

/// A WebSocket connection to one worker over its Unix socket.
pub type LegStream = tokio_tungstenite::WebSocketStream<UnixStream>;

/// The request URI of the upgrade; app-server upgrades any path and ignores the host.
const LEG_URI: &str = "ws://localhost/";
/// Frames never need to be larger than tungstenite's default frame cap.
const MAX_FRAME_SIZE: usize = 16 << 20;
/// tungstenite's default write buffer target; the hard cap must exceed it by a message.
const WRITE_BUFFER_SIZE: usize = 128 << 10;

/// Opens a leg: connects to `socket_path` and performs the WebSocket upgrade,
/// with explicit message, frame and write-buffer limits derived from `max_message_size`.
pub async fn connect(socket_path: &Path, max_message_size: usize) -> Result<LegStream, LegError> {
    let stream = UnixStream::connect(socket_path)
        .await
        .map_err(|source| LegError::Connect {
            path: socket_path.to_path_buf(),
            source,
        })?;
    let (ws, _response) = tokio_tungstenite::client_async_with_config(
        LEG_URI,
        stream,
        Some(ws_config(max_message_size)),
    )
    .await
    .map_err(|source| LegError::Handshake {
        path: socket_path.to_path_buf(),
        source: Box::new(source),
    })?;
    Ok(ws)
}

/// Initial read buffer of a leg. tungstenite allocates its default (128 KiB) up front for every
/// connection, which made legs the largest per-session cost; frames larger than this still
/// arrive whole, the buffer grows for them.
const READ_BUFFER_SIZE: usize = 16 << 10;

/// The WebSocket limits used for every leg.
pub fn ws_config(max_message_size: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_SIZE)
        .write_buffer_size(WRITE_BUFFER_SIZE)
        .max_write_buffer_size(WRITE_BUFFER_SIZE.saturating_add(max_message_size))
        .max_message_size(Some(max_message_size))
        .max_frame_size(Some(max_message_size.min(MAX_FRAME_SIZE)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_explicit() {
        let c = ws_config(1 << 20);
        assert_eq!(c.max_message_size, Some(1 << 20));
        assert_eq!(c.max_frame_size, Some(1 << 20));
        assert!(c.max_write_buffer_size > c.write_buffer_size + (1 << 20) - 1);
        let big = ws_config(128 << 20);
        assert_eq!(big.max_frame_size, Some(MAX_FRAME_SIZE));
    }

    #[tokio::test]
    async fn missing_socket_is_not_listening() {
        let dir = tempfile::tempdir().unwrap();
        let err = connect(&dir.path().join("none.sock"), 1024)
            .await
            .unwrap_err();
        assert!(err.is_not_listening(), "{err}");
    }
}
