//! Bytes a tenant's sessions hold on their legs towards its workers, bounded per session and
//! over all of the tenant's sessions: the budget a session's legs draw on
//! ([`crate::session::legs`]), kept here with the other bounds that [`super::Admission`]
//! shares between a tenant's sessions ([`super::queue_bytes`] is the other direction's).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Bytes all of one tenant's legs hold towards its workers, against the tenant's bound; a
/// session waiting for room is woken when the total drops below it.
#[derive(Debug)]
pub struct TenantLegBytes {
    used: AtomicUsize,
    max: usize,
    room: Notify,
}

/// Bytes one session's legs hold towards the workers: the session's own bound and its tenant's
/// total over all its sessions. Frames are always taken (a session never waits inside a
/// handler); a session whose legs are over either bound stops reading its client until they are
/// not ([`LegBudget::full`]), so the bounds are exceeded by at most what one client frame makes
/// the session send.
#[derive(Debug, Clone)]
pub struct LegBudget {
    session: Arc<AtomicUsize>,
    session_max: usize,
    tenant: Arc<TenantLegBytes>,
}

// === impl TenantLegBytes ===

impl TenantLegBytes {
    /// A tenant's total, bounded at `bound` bytes.
    pub fn new(bound: usize) -> Self {
        Self {
            used: AtomicUsize::new(0),
            max: bound.max(1),
            room: Notify::new(),
        }
    }

    fn full(&self) -> bool {
        self.used() >= self.max
    }

    /// Bytes all of the tenant's legs hold now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

// === impl LegBudget ===

impl LegBudget {
    /// A session's budget of `session_bound` bytes, drawing also on `tenant`'s.
    pub fn new(session_bound: usize, tenant: Arc<TenantLegBytes>) -> Self {
        Self {
            session: Arc::default(),
            session_max: session_bound.max(1),
            tenant,
        }
    }

    pub(crate) fn add(&self, len: usize) {
        self.session.fetch_add(len, Ordering::AcqRel);
        self.tenant.used.fetch_add(len, Ordering::AcqRel);
    }

    pub(crate) fn release(&self, len: usize) {
        if len == 0 {
            return;
        }
        self.session.fetch_sub(len, Ordering::AcqRel);
        let before = self.tenant.used.fetch_sub(len, Ordering::AcqRel);
        if before >= self.tenant.max && before - len < self.tenant.max {
            self.tenant.room.notify_waiters();
        }
    }

    /// The session's legs or its tenant's hold as much as they may: the client waits.
    pub fn full(&self) -> bool {
        self.session_full() || self.tenant.full()
    }

    pub(crate) fn session_full(&self) -> bool {
        self.session.load(Ordering::Acquire) >= self.session_max
    }

    /// Whether only the tenant's total is full (room comes from other sessions' writes).
    pub fn tenant_full(&self) -> bool {
        self.tenant.full()
    }

    /// Resolves once the tenant's total is below its bound.
    pub async fn tenant_room(&self) {
        loop {
            let notified = self.tenant.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.tenant.full() {
                return;
            }
            notified.await;
        }
    }

    /// Bytes of the session's budget in use.
    pub fn session_used(&self) -> usize {
        self.session.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_budget_fills_per_session_and_per_tenant_and_wakes_a_session_when_room_returns() {
        let tenant = Arc::new(TenantLegBytes::new(150));
        let a = LegBudget::new(100, tenant.clone());
        let b = LegBudget::new(100, tenant.clone());
        a.add(60);
        assert!(!a.full());
        // The session's bound: 60 + 50 > 100 holds a's client, not b's.
        a.add(50);
        assert!(a.full() && !b.full());
        a.release(50);
        assert!(!a.full(), "room given back is reusable");
        // The tenant's bound: 60 (a) + 90 (b) = 150 holds both.
        b.add(90);
        assert!(a.full() && b.full() && a.tenant_full());
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.tenant_room().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "no room yet");
        b.release(90);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("woken when the tenant's total drops below its bound")
            .unwrap();
        a.release(60);
        assert_eq!(a.session_used(), 0);
        assert_eq!(tenant.used.load(Ordering::Acquire), 0);
    }
}
