//! Server→client request ids of one session: session-unique integers mapped to the worker that
//! asked and the worker's own id (app-server numbers them per process, facts §5).

use std::collections::{BTreeMap, HashMap};

use worker::WorkerId;

use super::MAX_SERVER_REQUESTS;
use crate::jsonrpc::RequestId;

/// Server→client requests in flight: session-unique ids mapped to (worker, the worker's id,
/// whether the client has answered). An answered request stays until its worker reports it
/// resolved, so the `serverRequest/resolved` that follows the client's own answer carries the
/// id the client knows.
#[derive(Default)]
pub(super) struct ServerRequests {
    pub(super) next: i64,
    pub(super) by_session: BTreeMap<i64, (WorkerId, RequestId, bool)>,
    pub(super) by_worker: HashMap<(WorkerId, RequestId), i64>,
}
// === impl ServerRequests ===

impl ServerRequests {
    pub(super) fn insert(&mut self, worker: WorkerId, id: RequestId) -> i64 {
        if let Some(&sid) = self.by_worker.get(&(worker, id.clone())) {
            return sid; // the same pending request replayed (e.g. after thread/resume)
        }
        if self.by_session.len() >= MAX_SERVER_REQUESTS {
            if let Some((_, (worker, id, _))) = self.by_session.pop_first() {
                self.by_worker.remove(&(worker, id));
            }
        }
        let sid = self.next;
        self.next += 1;
        self.by_session.insert(sid, (worker, id.clone(), false));
        self.by_worker.insert((worker, id), sid);
        sid
    }

    /// The client's answer to `sid`: where it goes, the first time only.
    pub(super) fn take(&mut self, sid: i64) -> Option<(WorkerId, RequestId)> {
        let (worker, id, answered) = self.by_session.get_mut(&sid)?;
        if std::mem::replace(answered, true) {
            return None;
        }
        Some((*worker, id.clone()))
    }

    pub(super) fn resolved(&mut self, worker: WorkerId, id: RequestId) -> Option<i64> {
        let sid = self.by_worker.remove(&(worker, id))?;
        self.by_session.remove(&sid);
        Some(sid)
    }

    pub(super) fn forget_worker(&mut self, worker: WorkerId) {
        self.by_session.retain(|_, (w, _, _)| *w != worker);
        self.by_worker.retain(|(w, _), _| *w != worker);
    }
}
