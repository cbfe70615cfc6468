//! The tenant table: which worker owns each loaded thread of a tenant.
//!
//! The pool keeps the one record (`worker::Pool::owner`): it learns from the lifecycle broadcasts
//! its control legs receive and, level-triggered, from their `thread/loaded/list` answers, so a
//! missed event or a lost entry heals within one health period. Sessions add what answers to
//! `thread/start`, `thread/fork` and `thread/resume` say, which can arrive before the broadcast.
//! This is the router's handle on that record, nothing more.

use std::sync::Arc;

use worker::{Pool, WorkerId};

/// threadId → owning worker, for one tenant: a view of its pool's record.
#[derive(Clone)]
pub struct ThreadTable {
    pool: Arc<Pool>,
}

impl ThreadTable {
    /// The table of `pool`'s threads.
    pub fn new(pool: Arc<Pool>) -> Self {
        Self { pool }
    }

    /// The worker that has `thread` loaded, as far as the pool knows.
    pub fn owner(&self, thread: &str) -> Option<WorkerId> {
        self.pool.owner(thread)
    }

    /// Records that `worker` has `thread` loaded (an answer said so).
    pub fn learn(&self, thread: &str, worker: WorkerId) {
        self.pool.learn(thread, worker);
    }

    /// Number of threads with a known owner.
    pub fn len(&self) -> usize {
        self.pool.owned_threads()
    }

    /// Whether no thread has a known owner.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Test-only hook: removes a route whatever it points at, to prove reconciliation heals it.
    #[doc(hidden)]
    pub fn remove_for_tests(&self, thread: &str) -> Option<WorkerId> {
        self.pool.forget_owner_for_tests(thread)
    }
}
