//! The WebSocket limits of codex-fleet's connections, defined once: [`leg_config`] for every leg
//! to a worker, [`client_config`] for clients' connections and the edge→node link.

use std::collections::VecDeque;

use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Bytes, Message, Utf8Bytes};

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

/// Text messages larger than this are written as fragments of about this size (RFC 6455
/// §5.4; see [`Fragments`]).
pub const FRAGMENT_SIZE: usize = 64 << 10;

/// A large text message written as fragments of about [`FRAGMENT_SIZE`], each cut on a
/// character boundary.
///
/// tungstenite copies a whole frame into its write buffer before any of it reaches the socket,
/// and the receiving side reads a whole frame into its read buffer; both buffers keep their
/// largest size for the connection's life. Written whole, one large answer (a `thread/read` of a
/// long thread) left every connection it crossed holding two copies of it until the connection
/// closed, outside every byte bound: a tenant's idle sessions could pin gigabytes of a process
/// all tenants share. In fragments, each side's buffers stay about one fragment large; the
/// receiver assembles the message in an allocation the message owns and frees.
pub struct Fragments {
    rest: Bytes,
    /// The message's length.
    len: usize,
    started: bool,
}

impl Fragments {
    /// `text` as fragments when it is larger than [`FRAGMENT_SIZE`]; `text` back otherwise.
    pub fn split(text: Utf8Bytes) -> Result<Fragments, Utf8Bytes> {
        if text.len() <= FRAGMENT_SIZE {
            return Err(text);
        }
        Ok(Fragments {
            len: text.len(),
            rest: Bytes::from(text),
            started: false,
        })
    }

    /// The whole message's length in bytes.
    pub fn message_len(&self) -> usize {
        self.len
    }

    /// Every fragment has been taken.
    pub fn done(&self) -> bool {
        self.rest.is_empty()
    }
}

impl Iterator for Fragments {
    type Item = Frame;

    /// The next fragment (the last one is final).
    fn next(&mut self) -> Option<Frame> {
        if self.rest.is_empty() {
            return None;
        }
        let mut cut = self.rest.len().min(FRAGMENT_SIZE);
        // The message is UTF-8 (it came from a `Utf8Bytes`), so a character boundary lies
        // within the three bytes before any cut.
        while cut < self.rest.len() && (self.rest[cut] & 0xC0) == 0x80 {
            cut -= 1;
        }
        let piece = self.rest.split_to(cut);
        let last = self.rest.is_empty();
        let opcode = if self.started {
            Data::Continue
        } else {
            Data::Text
        };
        self.started = true;
        Some(Frame::message(piece, OpCode::Data(opcode), last))
    }
}

/// What a writer hands its socket next: the next fragment of `partial` (the large text being
/// written, kept there until its last fragment) or else the next of `frames`, a large text
/// split. With it, the bytes of the data message it completes (0 for a fragment before the
/// last, and for a control frame).
pub fn next_out(
    partial: &mut Option<Fragments>,
    frames: &mut VecDeque<Message>,
) -> Option<(Message, usize)> {
    let mut fragments = match partial.take() {
        Some(fragments) => fragments,
        None => match frames.pop_front()? {
            Message::Text(text) => match Fragments::split(text) {
                Ok(fragments) => fragments,
                Err(text) => {
                    let len = text.len();
                    return Some((Message::Text(text), len));
                }
            },
            Message::Binary(bytes) => {
                let len = bytes.len();
                return Some((Message::Binary(bytes), len));
            }
            msg => return Some((msg, 0)),
        },
    };
    let frame = fragments.next()?;
    let done = if fragments.done() {
        fragments.message_len()
    } else {
        *partial = Some(fragments);
        0
    };
    Some((Message::Frame(frame), done))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_text_goes_in_fragments_cut_on_characters_that_join_back_whole() {
        // Two-, three- and four-byte characters across every cut.
        let text: String = "aé€😀".repeat(FRAGMENT_SIZE / 3);
        let Ok(f) = Fragments::split(Utf8Bytes::from(text.clone())) else {
            panic!("not split");
        };
        assert_eq!(f.message_len(), text.len());
        let (mut joined, mut frames) = (Vec::new(), Vec::new());
        for frame in f {
            assert!(frame.payload().len() <= FRAGMENT_SIZE);
            assert!(
                std::str::from_utf8(frame.payload()).is_ok(),
                "cut inside a character"
            );
            joined.extend_from_slice(frame.payload());
            frames.push((frame.header().opcode, frame.header().is_final));
        }
        assert_eq!(joined, text.as_bytes());
        assert!(frames.len() >= 4, "{} frames", frames.len());
        assert_eq!(frames[0], (OpCode::Data(Data::Text), false));
        for mid in &frames[1..frames.len() - 1] {
            assert_eq!(*mid, (OpCode::Data(Data::Continue), false));
        }
        assert_eq!(
            frames[frames.len() - 1],
            (OpCode::Data(Data::Continue), true)
        );
        let small = Utf8Bytes::from("x".repeat(FRAGMENT_SIZE));
        assert!(
            Fragments::split(small).is_err(),
            "a message of one fragment is split"
        );
    }

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
