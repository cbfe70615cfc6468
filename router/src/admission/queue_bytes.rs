//! Bytes queued towards clients, bounded per session and per tenant: a frame bound alone lets
//! a client that never reads pin `client_queue` × `max_message_bytes` of router memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The bytes one session has queued towards its client, and its tenant's total; shared by
/// the session (which adds) and its writer (which releases what it takes off the queue).
#[derive(Debug)]
pub struct QueueBytes {
    session: AtomicUsize,
    tenant: Arc<AtomicUsize>,
    session_bound: usize,
    tenant_bound: usize,
}

/// Adds `n` to `total` unless that takes it over `bound`; whether it did.
pub(super) fn add_within(total: &AtomicUsize, n: usize, bound: usize) -> bool {
    total
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            let after = t.saturating_add(n);
            (after <= bound).then_some(after)
        })
        .is_ok()
}

// === impl QueueBytes ===

impl QueueBytes {
    /// A session's account against `tenant`, the tenant's shared total.
    pub fn new(tenant: Arc<AtomicUsize>, session_bound: usize, tenant_bound: usize) -> Arc<Self> {
        Arc::new(QueueBytes {
            session: AtomicUsize::new(0),
            tenant,
            session_bound,
            tenant_bound,
        })
    }

    /// Reserves room for `n` more bytes; false, and nothing reserved, when the session or its
    /// tenant would go over its bound (the session is then a slow reader).
    pub fn try_add(&self, n: usize) -> bool {
        // Only the session adds, so its own count cannot grow between this check and the add.
        if self.session.load(Ordering::Acquire).saturating_add(n) > self.session_bound {
            return false;
        }
        if !add_within(&self.tenant, n, self.tenant_bound) {
            return false;
        }
        self.session.fetch_add(n, Ordering::AcqRel);
        true
    }

    /// Gives back `n` bytes taken off the queue (written, or handed to the socket's buffer).
    pub fn release(&self, n: usize) {
        // The writer gives back every frame it hands over, fragments and control frames (0) too.
        if n == 0 {
            return;
        }
        self.session.fetch_sub(n, Ordering::AcqRel);
        self.tenant.fetch_sub(n, Ordering::AcqRel);
    }

    /// Bytes this session has queued.
    pub fn session(&self) -> usize {
        self.session.load(Ordering::Acquire)
    }

    /// Above half of the session's or the tenant's bound (the soft mark): streaming deltas go.
    pub fn behind(&self) -> bool {
        self.session() > self.session_bound / 2
            || self.tenant.load(Ordering::Acquire) > self.tenant_bound / 2
    }
}

impl Drop for QueueBytes {
    /// What was still queued when the session and its writer ended leaves the tenant's total.
    fn drop(&mut self) {
        self.tenant
            .fetch_sub(*self.session.get_mut(), Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_and_its_tenant_are_bounded_in_bytes() {
        let tenant = Arc::new(AtomicUsize::new(0));
        let a = QueueBytes::new(tenant.clone(), 100, 150);
        let b = QueueBytes::new(tenant.clone(), 100, 150);
        assert!(a.try_add(40));
        assert!(
            !a.behind(),
            "40 of 100 and 40 of 150 are under the soft marks"
        );
        assert!(a.try_add(60));
        assert!(!a.try_add(1), "the session is at its bound");
        assert!(a.behind());
        assert!(b.try_add(50));
        assert!(!b.try_add(1), "the tenant is at its bound");
        assert_eq!(tenant.load(Ordering::Acquire), 150);
        a.release(30);
        assert!(
            b.try_add(30),
            "released bytes are free for the tenant's other sessions"
        );
        drop(a);
        assert_eq!(
            tenant.load(Ordering::Acquire),
            80,
            "a session's unwritten bytes leave the tenant's total with it"
        );
        drop(b);
        assert_eq!(tenant.load(Ordering::Acquire), 0);
    }
}
