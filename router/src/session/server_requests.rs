//! Server→client request ids of one session: session-unique integers mapped to the worker that
//! asked and the worker's own id (app-server numbers them per process, facts §5).

use std::collections::{BTreeMap, HashMap};

use worker::WorkerId;

use super::MAX_SERVER_REQUESTS;
use crate::jsonrpc::RequestId;

/// Server→client requests in flight: session-unique ids mapped to (worker, the worker's id).
#[derive(Default)]
pub(super) struct ServerRequests {
    pub(super) next: i64,
    pub(super) by_session: BTreeMap<i64, (WorkerId, RequestId)>,
    /// The thread each request is about, when it names one.
    pub(super) threads: HashMap<i64, String>,
    pub(super) by_worker: HashMap<(WorkerId, RequestId), i64>,
}
// === impl ServerRequests ===

impl ServerRequests {
    pub(super) fn insert(
        &mut self,
        worker: WorkerId,
        id: RequestId,
        thread: Option<String>,
    ) -> i64 {
        if let Some(&sid) = self.by_worker.get(&(worker, id.clone())) {
            return sid; // the same pending request replayed (e.g. after thread/resume)
        }
        if self.by_session.len() >= MAX_SERVER_REQUESTS {
            if let Some((old, key)) = self.by_session.pop_first() {
                self.by_worker.remove(&key);
                self.threads.remove(&old);
            }
        }
        let sid = self.next;
        self.next += 1;
        self.by_session.insert(sid, (worker, id.clone()));
        self.by_worker.insert((worker, id), sid);
        if let Some(thread) = thread {
            self.threads.insert(sid, thread);
        }
        sid
    }

    pub(super) fn take(&mut self, sid: i64) -> Option<(WorkerId, RequestId)> {
        let key = self.by_session.remove(&sid)?;
        self.by_worker.remove(&key);
        self.threads.remove(&sid);
        Some(key)
    }

    pub(super) fn resolved(&mut self, worker: WorkerId, id: RequestId) -> Option<i64> {
        let sid = self.by_worker.remove(&(worker, id))?;
        self.by_session.remove(&sid);
        self.threads.remove(&sid);
        Some(sid)
    }

    /// Forgets `worker`'s requests (its leg closed); returns those about a thread, as
    /// (session id, thread), to be resolved for the client.
    pub(super) fn forget_worker(&mut self, worker: WorkerId) -> Vec<(i64, String)> {
        let gone: Vec<i64> = self
            .by_session
            .iter()
            .filter(|(_, (w, _))| *w == worker)
            .map(|(sid, _)| *sid)
            .collect();
        self.by_worker.retain(|(w, _), _| *w != worker);
        gone.into_iter()
            .filter_map(|sid| {
                self.by_session.remove(&sid);
                self.threads.remove(&sid).map(|t| (sid, t))
            })
            .collect()
    }
}
