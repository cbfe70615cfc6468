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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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
}
