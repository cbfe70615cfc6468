//! The fleet-wide cap on worker processes, shared by every tenant's pool.

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

/// A cap on running worker processes across all pools. Cheap to clone; clones share the count.
///
/// Starting a worker takes a slot; the slot is returned once that process is gone.
#[derive(Clone)]
pub struct FleetCap {
    max: usize,
    /// Slots in use; a `watch` so pools waiting for a slot wake when one is returned.
    used: Arc<watch::Sender<usize>>,
}

// === impl FleetCap ===

impl FleetCap {
    /// A cap of `max_total` worker processes.
    pub fn new(max_total: usize) -> Self {
        Self {
            max: max_total,
            used: Arc::new(watch::Sender::new(0)),
        }
    }

    /// No fleet-wide cap (each pool's `max_workers` still applies).
    pub fn unlimited() -> Self {
        Self::new(usize::MAX)
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Slots in use now.
    pub fn in_use(&self) -> usize {
        *self.used.borrow()
    }

    /// Takes a slot if one is free.
    pub(crate) fn try_take(&self) -> Option<FleetPermit> {
        let max = self.max;
        let taken = self.used.send_if_modified(|used| {
            if *used < max {
                *used += 1;
                true
            } else {
                false
            }
        });
        taken.then(|| FleetPermit { cap: self.clone() })
    }

    /// A receiver that changes whenever a slot is taken or returned.
    pub(crate) fn watch(&self) -> watch::Receiver<usize> {
        self.used.subscribe()
    }
}

impl Default for FleetCap {
    fn default() -> Self {
        Self::unlimited()
    }
}

impl fmt::Debug for FleetCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetCap")
            .field("max", &self.max)
            .field("in_use", &self.in_use())
            .finish()
    }
}

/// One taken fleet slot; dropping it returns the slot.
#[derive(Debug)]
pub(crate) struct FleetPermit {
    cap: FleetCap,
}

impl Drop for FleetPermit {
    fn drop(&mut self) {
        self.cap
            .used
            .send_modify(|used| *used = used.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_count_and_return() {
        let cap = FleetCap::new(2);
        let other_pool = cap.clone();
        let a = cap.try_take().unwrap();
        let b = other_pool.try_take().unwrap();
        assert!(cap.try_take().is_none());
        assert_eq!(cap.in_use(), 2);
        drop(a);
        assert_eq!(other_pool.in_use(), 1);
        let _c = other_pool.try_take().unwrap();
        drop(b);
        assert_eq!(cap.in_use(), 1);
    }

    #[tokio::test]
    async fn watchers_wake_on_return() {
        let cap = FleetCap::new(1);
        let permit = cap.try_take().unwrap();
        let mut watch = cap.watch();
        watch.borrow_and_update();
        drop(permit);
        watch.changed().await.unwrap();
        assert!(cap.try_take().is_some());
    }
}
