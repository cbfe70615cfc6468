//! The WebSocket limits of codex-fleet's connections, defined once: [`leg_config`] for every leg
//! to a worker, [`client_config`] for clients' connections and the edge→node link.

use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// Frames never need to be larger than tungstenite's default frame cap.
pub const MAX_FRAME_SIZE: usize = 16 << 20;
/// tungstenite's default write buffer target; the hard cap must exceed it by a message.
pub const WRITE_BUFFER_SIZE: usize = 128 << 10;
/// Initial read buffer of a leg. tungstenite allocates its default (128 KiB) up front for every
/// connection, which made legs the largest per-session cost; frames larger than this still
/// arrive whole, the buffer grows for them.
pub const READ_BUFFER_SIZE: usize = 16 << 10;

/// The WebSocket limits used for every leg: explicit message, frame and write-buffer limits
/// derived from `max_message_size`.
pub fn leg_config(max_message_size: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_SIZE)
        .write_buffer_size(WRITE_BUFFER_SIZE)
        .max_write_buffer_size(WRITE_BUFFER_SIZE.saturating_add(max_message_size))
        .max_message_size(Some(max_message_size))
        .max_frame_size(Some(max_message_size.min(MAX_FRAME_SIZE)))
}

/// The WebSocket limits of a client's connection (and of the edge→node link, which carries a
/// client's frames): messages and frames up to `max_message_bytes`, a write buffer of twice that
/// (at least 1 MiB), and a small first read buffer that grows for large frames.
pub fn client_config(max_message_bytes: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_SIZE)
        .max_message_size(Some(max_message_bytes))
        .max_frame_size(Some(max_message_bytes))
        .max_write_buffer_size(max_message_bytes.saturating_mul(2).max(1 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_explicit() {
        let c = leg_config(1 << 20);
        assert_eq!(c.max_message_size, Some(1 << 20));
        assert_eq!(c.max_frame_size, Some(1 << 20));
        assert_eq!(c.read_buffer_size, READ_BUFFER_SIZE);
        assert!(c.max_write_buffer_size > c.write_buffer_size + (1 << 20) - 1);
        let big = leg_config(128 << 20);
        assert_eq!(big.max_frame_size, Some(MAX_FRAME_SIZE));
    }
}
