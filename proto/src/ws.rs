//! The WebSocket limits of codex-fleet's connections, defined once: [`leg_config`] for every leg
//! to a worker, [`client_config`] for clients' connections and the edge→node link.

use std::collections::VecDeque;
use std::task::{ready, Context, Poll};

use futures_util::{Sink, SinkExt};
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Bytes, Error as WsError, Message, Utf8Bytes};

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

/// Frames handed to a socket before one flush: a streaming turn queues many small deltas, and
/// flushing each one alone costs a TLS record and a system call apiece.
pub const WRITE_BATCH: usize = 64;

/// What a writer hands its socket next: the next fragment of `partial` (the large text being
/// written, kept there until its last fragment) or else the next of `frames`, a large text
/// split. With it, the bytes of the data message it completes (0 for a fragment before the
/// last, and for a control frame).
fn next_out(
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

/// Frames on their way to one WebSocket, written in batches with one flush per batch: whole
/// messages, and the rest of a large text going out in fragments ([`Fragments`]). Its owner
/// bounds and counts what it queues (a session's client queue, an edge's queues); this is the
/// writing they share.
#[derive(Default)]
pub struct Outgoing {
    /// Messages waiting, in order.
    pub frames: VecDeque<Message>,
    /// The rest of the large text being written, kept until its last fragment is taken.
    partial: Option<Fragments>,
    /// Bytes of the messages handed to the socket since its last flush, when any were.
    unflushed: Option<usize>,
    /// The close frame went out: nothing more is written.
    closed: bool,
    /// Frames handed to the socket so far.
    sent: u64,
}

impl Outgoing {
    /// Whether there is writing to do: frames waiting, or a flush owed.
    pub fn busy(&self) -> bool {
        !self.closed
            && (!self.frames.is_empty() || self.partial.is_some() || self.unflushed.is_some())
    }

    /// Whether the close frame was handed to the socket.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// The bytes a queued message counts in its owner's account: its data, the bytes
    /// [`Outgoing::poll_send`] reports once it is written (0 for a control frame).
    pub fn counted_len(msg: &Message) -> usize {
        match msg {
            Message::Text(t) => t.len(),
            Message::Binary(b) => b.len(),
            _ => 0,
        }
    }

    /// Drops what waits (the rest of a large text going out in fragments too, since a control
    /// frame may come between them) and returns the bytes it counted: what the owner gives back.
    /// A flush owed stays owed.
    pub fn discard(&mut self) -> usize {
        let queued: usize = self
            .frames
            .drain(..)
            .map(|m| Outgoing::counted_len(&m))
            .sum();
        queued + self.partial.take().map_or(0, |p| p.message_len())
    }

    /// Frames handed to the socket so far (fragments one each): a writer that took nothing in a
    /// while has not moved it.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Hands waiting frames to `sink` while it takes them (at most [`WRITE_BATCH`]), then
    /// flushes. `taken` hears the bytes of each message the sink took whole (0 for a fragment
    /// before the last and for a control frame), as it is taken; ready with the bytes of the
    /// messages that were flushed whole. The same bytes are reported both ways: an owner gives
    /// its account back by one of them, never both. Cancel-safe: a frame leaves the queue only
    /// once the sink has taken it, and what was taken is flushed (and counted) by the next call.
    pub fn poll_send<Si>(
        &mut self,
        sink: &mut Si,
        cx: &mut Context<'_>,
        mut taken: impl FnMut(usize),
    ) -> Poll<Result<usize, WsError>>
    where
        Si: Sink<Message, Error = WsError> + Unpin,
    {
        let mut batch = 0;
        while batch < WRITE_BATCH
            && !self.closed
            && (self.partial.is_some() || !self.frames.is_empty())
        {
            ready!(sink.poll_ready_unpin(cx))?;
            let Some((msg, done)) = next_out(&mut self.partial, &mut self.frames) else {
                break;
            };
            *self.unflushed.get_or_insert(0) += done;
            taken(done);
            self.closed = matches!(msg, Message::Close(_));
            sink.start_send_unpin(msg)?;
            self.sent += 1;
            batch += 1;
        }
        let Some(n) = self.unflushed else {
            return Poll::Ready(Ok(0));
        };
        ready!(sink.poll_flush_unpin(cx))?;
        self.unflushed = None;
        Poll::Ready(Ok(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;

    /// A socket that takes frames and flushes when told to.
    #[derive(Default)]
    struct Socket {
        taking: bool,
        flushing: bool,
        taken: Vec<Message>,
        flushes: usize,
    }

    impl Sink<Message> for Socket {
        type Error = WsError;
        fn poll_ready(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            if self.taking {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }
        fn start_send(mut self: Pin<&mut Self>, msg: Message) -> Result<(), WsError> {
            assert!(self.taking, "sent to a socket that was not ready");
            self.taken.push(msg);
            Ok(())
        }
        fn poll_flush(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            if self.flushing {
                self.flushes += 1;
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }
        fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            self.poll_flush(cx)
        }
    }

    /// One [`Outgoing::poll_send`]: what `taken` heard, and what it was ready with.
    fn send_once(out: &mut Outgoing, socket: &mut Socket) -> (usize, Poll<usize>) {
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        let mut heard = 0;
        let poll = out.poll_send(socket, &mut cx, |n| heard += n);
        (heard, poll.map(|r| r.expect("the socket does not fail")))
    }

    #[test]
    fn outgoing_writes_in_batches_with_one_flush_each_and_counts_what_was_taken_and_flushed() {
        let mut out = Outgoing::default();
        let mut socket = Socket {
            taking: true,
            flushing: true,
            ..Socket::default()
        };
        for n in 0..100 {
            out.frames.push_back(Message::text(format!("{n:03}")));
        }
        assert!(out.busy());
        assert_eq!(
            send_once(&mut out, &mut socket),
            (3 * WRITE_BATCH, Poll::Ready(3 * WRITE_BATCH))
        );
        assert_eq!(
            (socket.taken.len(), socket.flushes, out.sent()),
            (WRITE_BATCH, 1, WRITE_BATCH as u64)
        );
        assert_eq!(
            send_once(&mut out, &mut socket),
            (
                3 * (100 - WRITE_BATCH),
                Poll::Ready(3 * (100 - WRITE_BATCH))
            )
        );
        assert_eq!(
            (socket.taken.len(), socket.flushes, out.sent()),
            (100, 2, 100)
        );
        assert!(!out.busy());
        // In order.
        for (n, msg) in socket.taken.iter().enumerate() {
            assert_eq!(msg.to_text().unwrap(), format!("{n:03}"));
        }
        // Nothing to write: no flush.
        assert_eq!(send_once(&mut out, &mut socket), (0, Poll::Ready(0)));
        assert_eq!(socket.flushes, 2);
    }

    #[test]
    fn outgoing_is_cancel_safe_and_a_large_text_counts_with_its_last_fragment() {
        let mut out = Outgoing::default();
        let mut socket = Socket::default();
        let large = "x".repeat(FRAGMENT_SIZE * 2 + 1);
        out.frames.push_back(Message::text(large.clone()));
        out.frames.push_back(Message::text("after"));
        // A socket that takes nothing: nothing leaves the queue.
        assert_eq!(send_once(&mut out, &mut socket), (0, Poll::Pending));
        assert_eq!((out.frames.len(), out.sent()), (2, 0));
        // It takes, but does not flush: the fragments went, their message counted with its last.
        socket.taking = true;
        let (heard, poll) = send_once(&mut out, &mut socket);
        assert_eq!((heard, poll), (large.len() + 5, Poll::Pending));
        assert_eq!((socket.taken.len(), out.sent()), (4, 4));
        assert!(out.busy(), "a flush is owed");
        // The next call flushes what was taken and reports it once.
        socket.flushing = true;
        assert_eq!(
            send_once(&mut out, &mut socket),
            (0, Poll::Ready(large.len() + 5))
        );
        assert!(!out.busy());
        // The fragments join back into the message.
        let joined: Vec<u8> = socket.taken[..3]
            .iter()
            .flat_map(|m| match m {
                Message::Frame(f) => f.payload().to_vec(),
                other => panic!("not a fragment: {other:?}"),
            })
            .collect();
        assert_eq!(joined, large.as_bytes());
        // After the close frame nothing more goes.
        out.frames.push_back(Message::Close(None));
        out.frames.push_back(Message::text("too late"));
        assert_eq!(send_once(&mut out, &mut socket), (0, Poll::Ready(0)));
        assert!(out.closed() && !out.busy());
        assert_eq!(socket.taken.len(), 5);
        assert!(matches!(socket.taken[4], Message::Close(None)));
    }

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
