//! The tenant table: which worker owns each loaded thread of a tenant.
//!
//! Ownership is learned from results (`thread/start`, `thread/fork`, `thread/resume`), from the
//! lifecycle broadcasts the control legs receive, and level-triggered from `thread/loaded/list`
//! answers, so a missed event or a lost entry heals within one reconciliation period.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use worker::WorkerId;

/// Entries kept per tenant at most; app-server's own limits are far below this.
const MAX_ROUTES: usize = 100_000;

/// Where one thread is loaded, and whether it was last seen `active` there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Route {
    worker: WorkerId,
    active: bool,
}

/// threadId → owning worker, for one tenant.
#[derive(Default)]
pub struct ThreadTable {
    routes: Mutex<HashMap<String, Route>>,
}

impl ThreadTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Route>> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The worker that has `thread` loaded, as far as the table knows.
    pub fn owner(&self, thread: &str) -> Option<WorkerId> {
        self.lock().get(thread).map(|r| r.worker)
    }

    /// Records that `worker` has `thread` loaded.
    pub fn learn(&self, thread: &str, worker: WorkerId) {
        let mut routes = self.lock();
        let full = routes.len() >= MAX_ROUTES;
        match routes.get_mut(thread) {
            Some(r) if r.worker == worker => {}
            Some(r) => {
                *r = Route {
                    worker,
                    active: false,
                }
            }
            // reconciliation still finds it on a miss; the bound protects memory
            None if full => {}
            None => {
                routes.insert(
                    thread.to_owned(),
                    Route {
                        worker,
                        active: false,
                    },
                );
            }
        }
    }

    /// Records that `worker` has `thread` loaded, running a turn (or waiting on the user) or not,
    /// as its last `thread/status/changed` said.
    pub fn learn_status(&self, thread: &str, worker: WorkerId, active: bool) {
        self.learn(thread, worker);
        if let Some(r) = self.lock().get_mut(thread).filter(|r| r.worker == worker) {
            r.active = active;
        }
    }

    /// Drops the route of `thread` if it still points at `worker`.
    pub fn forget(&self, thread: &str, worker: WorkerId) {
        let mut routes = self.lock();
        if routes.get(thread).is_some_and(|r| r.worker == worker) {
            routes.remove(thread);
        }
    }

    /// Drops every route to `worker` (it exited); returns the threads it held, each with
    /// whether it was active.
    pub fn forget_worker(&self, worker: WorkerId) -> Vec<(String, bool)> {
        let mut routes = self.lock();
        let gone: Vec<(String, bool)> = routes
            .iter()
            .filter(|(_, r)| r.worker == worker)
            .map(|(t, r)| (t.clone(), r.active))
            .collect();
        for (t, _) in &gone {
            routes.remove(t);
        }
        gone
    }

    /// Level-triggered update from `thread/loaded/list` on `worker`: exactly `loaded` route there.
    pub fn reconcile(&self, worker: WorkerId, loaded: &[String]) {
        let mut routes = self.lock();
        routes.retain(|t, r| r.worker != worker || loaded.contains(t));
        for t in loaded {
            if routes.len() < MAX_ROUTES || routes.contains_key(t) {
                let r = routes.entry(t.clone()).or_insert(Route {
                    worker,
                    active: false,
                });
                if r.worker != worker {
                    *r = Route {
                        worker,
                        active: false,
                    };
                }
            }
        }
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Test-only hook: removes a route whatever it points at, to prove reconciliation heals it.
    #[doc(hidden)]
    pub fn remove_for_tests(&self, thread: &str) -> Option<WorkerId> {
        self.lock().remove(thread).map(|r| r.worker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciliation_is_level_triggered() {
        let t = ThreadTable::default();
        let w1 = WorkerId::new("t", 0, 1);
        let w2 = WorkerId::new("t", 1, 1);
        t.learn("a", w1);
        t.learn("b", w1);
        t.learn("c", w2);
        t.reconcile(w1, &["b".into(), "d".into()]);
        assert_eq!(t.owner("a"), None, "unloaded on w1");
        assert_eq!(t.owner("b"), Some(w1));
        assert_eq!(t.owner("d"), Some(w1), "learned from the list");
        assert_eq!(t.owner("c"), Some(w2), "other workers untouched");
        t.forget("c", w1);
        assert_eq!(t.owner("c"), Some(w2), "forget only drops a matching route");
        t.learn_status("b", w1, true);
        assert_eq!(t.forget_worker(w2), vec![("c".to_owned(), false)]);
        assert_eq!(t.len(), 2);
        t.reconcile(w1, &["b".into()]);
        assert_eq!(
            t.forget_worker(w1),
            vec![("b".to_owned(), true)],
            "activity kept"
        );
    }
}
