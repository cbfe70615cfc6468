//! Server→client request ids of one session: session-unique integers mapped to the worker that
//! asked and the worker's own id (app-server numbers them per process, facts §5).

use std::collections::{BTreeMap, HashMap};

use worker::WorkerId;

use super::MAX_SERVER_REQUESTS;
use crate::jsonrpc::RequestId;

/// One server→client request the client was sent.
pub(super) struct Pending {
    pub(super) worker: WorkerId,
    pub(super) id: RequestId,
    /// The client has answered it.
    pub(super) answered: bool,
    /// The thread it is about, when it names one.
    pub(super) thread: Option<String>,
}

/// Server→client requests in flight: session-unique ids mapped to the worker and the worker's
/// id. An answered request stays until its worker reports it resolved, so the
/// `serverRequest/resolved` that follows the client's own answer carries the id the client knows.
#[derive(Default)]
pub(super) struct ServerRequests {
    pub(super) next: i64,
    pub(super) by_session: BTreeMap<i64, Pending>,
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
            if let Some((_, old)) = self.by_session.pop_first() {
                self.by_worker.remove(&(old.worker, old.id));
            }
        }
        let sid = self.next;
        self.next += 1;
        self.by_session.insert(
            sid,
            Pending {
                worker,
                id: id.clone(),
                answered: false,
                thread,
            },
        );
        self.by_worker.insert((worker, id), sid);
        sid
    }

    /// The client's answer to `sid`: where it goes, the first time only.
    pub(super) fn take(&mut self, sid: i64) -> Option<(WorkerId, RequestId)> {
        let p = self.by_session.get_mut(&sid)?;
        if std::mem::replace(&mut p.answered, true) {
            return None;
        }
        Some((p.worker, p.id.clone()))
    }

    pub(super) fn resolved(&mut self, worker: WorkerId, id: RequestId) -> Option<i64> {
        let sid = self.by_worker.remove(&(worker, id))?;
        self.by_session.remove(&sid);
        Some(sid)
    }

    /// Forgets `worker`'s requests (its leg closed); returns those about a thread, as
    /// (session id, thread), to be resolved for the client.
    pub(super) fn forget_worker(&mut self, worker: WorkerId) -> Vec<(i64, String)> {
        let gone: Vec<i64> = self
            .by_session
            .iter()
            .filter(|(_, p)| p.worker == worker)
            .map(|(sid, _)| *sid)
            .collect();
        self.by_worker.retain(|(w, _), _| *w != worker);
        gone.into_iter()
            .filter_map(|sid| {
                self.by_session
                    .remove(&sid)
                    .and_then(|p| p.thread.map(|t| (sid, t)))
            })
            .collect()
    }
}
