//! The WebSocket limits of codex-fleet's connections, defined once: [`leg_config`] for every leg
//! to a worker, [`client_config`] for clients' connections and the edge→node link.

use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// Frames never need to be larger than tungstenite's default frame cap.
pub const MAX_FRAME_SIZE: usize = 16 << 20;
/// tungstenite's default write buffer target; the hard cap must exceed it by a message.
pub const WRITE_BUFFER_SIZE: usize = 128 << 10;
/// The most tungstenite reads at once, and its first read buffer, on every connection (legs,
/// clients, the edge's link). tungstenite zero-fills this much of its buffer before every read
/// attempt, including the attempts that find nothing (a session's loop tries its client and its
/// legs on every wake-up): at its default (128 KiB) and at the 16 KiB this was, that zeroing was
/// the largest single share of a relayed frame's instructions (callgrind; BENCHMARKS.md, bench 1,
/// "The zeroed read buffer"). Frames larger than this still arrive whole: the buffer grows for them, and what is
/// below it reads in larger pieces (rustls's records on TLS, [`LEG_SOCKET_BUFFER`] on a leg).
pub const READ_BUFFER_SIZE: usize = 4 << 10;
/// The buffer under a leg's WebSocket that its Unix socket is read into (filled once per
/// system call, never zeroed again), so a large worker frame still takes one read per this many
/// bytes. With [`READ_BUFFER_SIZE`] it is the 16 KiB a leg read into before.
pub const LEG_SOCKET_BUFFER: usize = (16 << 10) - READ_BUFFER_SIZE;

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
