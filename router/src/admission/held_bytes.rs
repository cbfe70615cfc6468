//! The read buffers sockets keep after large frames, bounded per tenant.
//!
//! tungstenite reads a frame whole into its connection's read buffer and keeps that buffer at
//! its largest size for the connection's life. Frames codex-fleet writes are fragmented
//! (`proto::ws::Fragments`), but a peer that sends a frame whole sizes the buffer that receives
//! it: a client's own large request, and a worker's large answer on its leg (app-server does not
//! fragment). Each socket's buffer counts here from its first frame above [`HELD_FREE`], at the
//! size of its largest, until the socket is gone; a frame that would take the tenant over its
//! bound (`limits.tenant_queue_bytes`, the bound of its queued bytes, kept apart from them)
//! ends the session that read it, and with it the buffers it held. Without the bound, a tenant's
//! sessions (256 by default) could each pin a `max_message_bytes` answer in a process every
//! tenant shares, by reading a long thread once.
//!
//! A client's socket is counted as its bytes arrive, not only once a message is whole
//! ([`ReadMeter`]): tungstenite keeps what it has read of an unfinished frame (and of an
//! unfinished fragmented message) in memory, so a tenant that opens its connections and sends
//! each all but the last byte of a `max_message_bytes` frame would otherwise pin that much per
//! connection, uncounted, for as long as it likes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::queue_bytes::add_within;

/// Frames up to this size are not counted: every socket's buffer may grow this large.
pub const HELD_FREE: usize = proto::ws::FRAGMENT_SIZE;

/// One socket's read buffer, counted against its tenant's total while this lives.
#[derive(Debug)]
pub struct HeldBuffer {
    tenant: Arc<AtomicUsize>,
    bound: usize,
    held: usize,
}

// === impl HeldBuffer ===

impl HeldBuffer {
    /// A socket's buffer, counted in `tenant` (the tenant's total) up to `bound`.
    pub fn new(tenant: Arc<AtomicUsize>, bound: usize) -> HeldBuffer {
        HeldBuffer {
            tenant,
            bound,
            held: 0,
        }
    }

    /// The socket read a frame of `len` bytes, and its buffer is now at least that large.
    /// False when that growth would take the tenant over its bound (the growth is then not
    /// counted; the caller ends the session, which frees it).
    #[inline]
    pub fn read(&mut self, len: usize) -> bool {
        if len <= HELD_FREE || len <= self.held {
            return true;
        }
        if !add_within(&self.tenant, len - self.held, self.bound) {
            return false;
        }
        self.held = len;
        true
    }

    /// Bytes this socket's buffer counts.
    pub fn held(&self) -> usize {
        self.held
    }
}

/// A client socket's read buffer, counted as the socket reads: the bytes read since the session
/// last took a message belong to the message not yet whole, and count against the tenant once
/// past [`HELD_FREE`], as a whole frame of that size would. Shared by the socket's reads
/// (`door::ClientIo`) and the session that takes its messages, in one task.
#[derive(Debug)]
pub struct ReadMeter {
    /// Bytes read since the session last took a message (an upper bound on the unfinished
    /// message's: a read may also hold the start of the next frame).
    unfinished: AtomicUsize,
    /// A growth was refused: the socket's read fails, and the session ends as for a whole
    /// frame refused (`End::LargeFrames`).
    refused: AtomicBool,
    /// What `held` counts (read without its lock).
    charged: AtomicUsize,
    held: Mutex<HeldBuffer>,
}

/// Bytes a socket reads towards one message before they count: a frame of [`HELD_FREE`], its
/// head (up to 14 bytes) and one read of the next frame (`proto::ws::READ_BUFFER_SIZE`).
const UNFINISHED_SLACK: usize = HELD_FREE + proto::ws::READ_BUFFER_SIZE + 14;

/// An unfinished message is charged in steps of this size.
const CHARGE_STEP: usize = 64 << 10;

// === impl ReadMeter ===

impl ReadMeter {
    /// A meter for a socket whose buffer counts in `held`.
    pub fn new(held: HeldBuffer) -> ReadMeter {
        ReadMeter {
            unfinished: AtomicUsize::new(0),
            refused: AtomicBool::new(false),
            charged: AtomicUsize::new(0),
            held: Mutex::new(held),
        }
    }

    /// The socket read `n` more bytes. False when the unfinished message they belong to
    /// would take the tenant over its bound (remembered: [`ReadMeter::refused`]).
    ///
    /// Counted with `UNFINISHED_SLACK` free (a read may also hold a frame head and the start
    /// of the next frame), and charged in `CHARGE_STEP`s: the tenant's account is touched once
    /// per step of a large message's arrival, not once per read.
    #[inline]
    pub fn read(&self, n: usize) -> bool {
        let unfinished = self.unfinished.fetch_add(n, Ordering::Relaxed) + n;
        unfinished <= UNFINISHED_SLACK
            || unfinished <= self.charged.load(Ordering::Relaxed)
            || self.hold(unfinished.next_multiple_of(CHARGE_STEP))
    }

    /// The session took a data message (or a close) of `len` bytes from the socket, whose
    /// buffer held it whole; what the socket reads next belongs to the next message. False as
    /// [`ReadMeter::read`].
    #[inline]
    pub fn took(&self, len: usize) -> bool {
        self.unfinished.store(0, Ordering::Relaxed);
        len <= HELD_FREE || self.hold(len)
    }

    /// The session took a ping or a pong of `len` payload bytes. One may come between the
    /// fragments of a message, which stays unfinished: only the control frame's own bytes
    /// leave the count (a client frame's head and mask are 6 bytes).
    #[inline]
    pub fn took_control(&self, len: usize) {
        let frame = len + 6;
        let _counted = self
            .unfinished
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(frame))
            });
    }

    /// What the socket reads from now on is being discarded as the session closes: counted
    /// from nothing, per message (the closing reads are bounded in time).
    pub fn discarded(&self) {
        self.unfinished.store(0, Ordering::Relaxed);
    }

    /// Whether a growth was refused.
    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Bytes this socket's buffer counts.
    pub fn held(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .held()
    }

    fn hold(&self, len: usize) -> bool {
        let mut buffer = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let held = buffer.read(len);
        self.charged.store(buffer.held(), Ordering::Relaxed);
        if !held {
            self.refused.store(true, Ordering::Relaxed);
        }
        held
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        self.tenant.fetch_sub(self.held, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_counts_its_largest_frame_until_it_goes_and_a_tenant_is_bounded() {
        let tenant = Arc::new(AtomicUsize::new(0));
        let total = || tenant.load(Ordering::Acquire);
        let big = HELD_FREE + 1;
        let mut a = HeldBuffer::new(tenant.clone(), 3 * big);
        assert!(a.read(HELD_FREE), "a frame every socket may hold");
        assert_eq!(total(), 0);
        assert!(a.read(big));
        assert!(a.read(big - 1) && a.read(big), "no larger than its largest");
        assert_eq!(total(), big);
        assert!(a.read(2 * big), "grown: counted at its new size");
        assert_eq!((a.held(), total()), (2 * big, 2 * big));
        let mut b = HeldBuffer::new(tenant.clone(), 3 * big);
        assert!(b.read(big));
        assert!(!b.read(big + 1), "over the tenant's bound");
        assert_eq!(
            (b.held(), total()),
            (big, 3 * big),
            "a refused growth is not counted"
        );
        drop(a);
        assert_eq!(total(), big, "a socket's buffer leaves the total with it");
        assert!(b.read(2 * big));
        drop(b);
        assert_eq!(total(), 0);
    }

    #[test]
    fn a_message_is_counted_as_it_arrives_and_a_tenant_is_bounded_before_it_is_whole() {
        let tenant = Arc::new(AtomicUsize::new(0));
        let total = || tenant.load(Ordering::Acquire);
        let bound = 3 << 20;
        let a = ReadMeter::new(HeldBuffer::new(tenant.clone(), bound));
        // Small messages, however many, count nothing.
        for _ in 0..100 {
            assert!(a.read(4096) && a.took(4000));
        }
        assert_eq!(total(), 0);
        // A 2 MiB message not yet whole counts what has arrived of it.
        for _ in 0..256 {
            assert!(a.read(4096));
        }
        assert_eq!((a.held(), total()), (1 << 20, 1 << 20));
        for _ in 0..256 {
            assert!(a.read(4096));
        }
        assert!(a.took(2 << 20));
        assert_eq!(total(), 2 << 20, "counted at its size once whole");
        // Another socket's unfinished message finds room for 1 MiB, then none.
        let b = ReadMeter::new(HeldBuffer::new(tenant.clone(), bound));
        for _ in 0..256 {
            assert!(b.read(4096));
        }
        assert!(!b.refused());
        assert!(
            !b.read(4096),
            "over the tenant's bound before the message is whole"
        );
        assert!(b.refused());
        assert_eq!(total(), bound, "a refused growth is not counted");
        drop(b);
        assert_eq!(total(), 2 << 20, "the refused socket's bytes leave with it");
        // What a socket reads after a message starts the next one's count afresh.
        assert!(a.read(100_000) && a.took(90_000) && a.read(4096));
        assert_eq!(total(), 2 << 20);
    }

    #[test]
    fn pings_between_fragments_leave_the_message_unfinished_and_counted() {
        let tenant = Arc::new(AtomicUsize::new(0));
        let total = || tenant.load(Ordering::Acquire);
        let a = ReadMeter::new(HeldBuffer::new(tenant.clone(), 1 << 20));
        // A frame just under HELD_FREE read with the next one's head and start: free.
        assert!(a.read(HELD_FREE + 4096) && a.took(HELD_FREE - 1));
        assert_eq!(total(), 0);
        // 60 KiB fragments with a ping after each: the pings leave the count, the fragments
        // add up, and the message is bounded before it is whole.
        let mut refused_after = None;
        for n in 1..=32 {
            if !a.read((60 << 10) + 6) {
                refused_after = Some(n);
                break;
            }
            a.took_control(0);
        }
        assert_eq!(
            refused_after,
            Some(18),
            "1 MiB of fragments, counted in 64 KiB steps"
        );
        assert!(a.refused());
        assert!(total() <= 1 << 20);
        // A session closing discards what it reads: counted afresh per message.
        let b = ReadMeter::new(HeldBuffer::new(tenant.clone(), 1 << 20));
        for _ in 0..100 {
            assert!(b.read(4096));
            b.discarded();
        }
        assert_eq!(b.held(), 0);
    }
}
