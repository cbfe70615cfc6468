//! Server→client request ids of one session: session-unique integers mapped to the worker that
//! asked and the worker's own id (app-server numbers them per process, docs/app-server-facts.md
//! §5), with what an approval asked, kept for the audit record of its decision.
//!
//! A request is forgotten when it is resolved (`serverRequest/resolved`) and when its worker's
//! leg closes. When its thread's turn ends on its worker it is withdrawn: no answer to it is
//! forwarded any more and its approval record goes, but its id stays mapped, since app-server
//! 0.171 sends the `serverRequest/resolved` of a prompt aborted by `turn/interrupt` only after
//! `turn/completed`. Withdrawn and answered requests are the first to make room; approvals still
//! awaiting the client's answer never are: at [`MAX_APPROVALS`] of them the next one is refused
//! ([`Full`]) and the session ends, so no decision passes unaudited.

use std::collections::BTreeMap;

use worker::WorkerId;

use proto::rpc::RequestId;

/// Server requests remembered per session; above it, the oldest that is not an approval awaiting
/// its answer is forgotten.
pub(super) const MAX_SERVER_REQUESTS: usize = 4096;
/// Approvals awaiting the client's answer, per session, at most.
pub(super) const MAX_APPROVALS: usize = 1024;

/// One server→client request the client was sent.
pub(super) struct Pending {
    pub(super) worker: WorkerId,
    pub(super) id: RequestId,
    /// The client has answered it, or it was withdrawn: no answer is forwarded any more.
    pub(super) answered: bool,
    /// The thread it is about, when it names one.
    pub(super) thread: Option<String>,
    /// An approval not answered yet: what it asked, for the audit record of its decision.
    pub(super) approval: Option<serde_json::Value>,
}

/// A request forgotten without the client's answer.
#[derive(Debug, PartialEq)]
pub(super) struct Withdrawn {
    /// The id the client knows.
    pub(super) sid: i64,
    /// The thread it was about.
    pub(super) thread: Option<String>,
    /// What it asked, if it was an approval.
    pub(super) approval: Option<serde_json::Value>,
}

/// The session already holds [`MAX_APPROVALS`] approvals awaiting an answer.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Full;

/// Server→client requests in flight: session-unique ids mapped to the worker and the worker's
/// id. An answered request stays until its worker reports it resolved (or its turn ends), so the
/// `serverRequest/resolved` that follows the client's own answer carries the id the client knows.
#[derive(Default)]
pub(super) struct ServerRequests {
    pub(super) next: i64,
    pub(super) by_session: BTreeMap<i64, Pending>,
    pub(super) by_worker: super::Map<(WorkerId, RequestId), i64>,
    /// Entries with `approval` set.
    approvals: usize,
}
// === impl ServerRequests ===

impl ServerRequests {
    /// Remembers a request; `approval` is what an approval asked. A request already known (a
    /// replay, e.g. after `thread/resume`) keeps its id.
    pub(super) fn insert(
        &mut self,
        worker: WorkerId,
        id: RequestId,
        thread: Option<String>,
        approval: Option<serde_json::Value>,
    ) -> Result<i64, Full> {
        if let Some(&sid) = self.by_worker.get(&(worker, id.clone())) {
            return Ok(sid);
        }
        if approval.is_some() && self.approvals >= MAX_APPROVALS {
            return Err(Full);
        }
        if self.by_session.len() >= MAX_SERVER_REQUESTS {
            // The oldest answered or withdrawn one, else the oldest that is no approval awaiting
            // its answer (at most MAX_APPROVALS of the entries are).
            let oldest = |dead: bool| {
                self.by_session
                    .iter()
                    .find(|(_, p)| p.approval.is_none() && (p.answered || !dead))
                    .map(|(sid, _)| *sid)
            };
            if let Some(old) = oldest(true).or_else(|| oldest(false)) {
                self.remove(old);
            }
        }
        let sid = self.next;
        self.next += 1;
        self.approvals += usize::from(approval.is_some());
        self.by_session.insert(
            sid,
            Pending {
                worker,
                id: id.clone(),
                answered: false,
                thread,
                approval,
            },
        );
        self.by_worker.insert((worker, id), sid);
        Ok(sid)
    }

    /// The client's answer to `sid`: where it goes (and what it answers, for an approval), the
    /// first time only.
    pub(super) fn take(
        &mut self,
        sid: i64,
    ) -> Option<(WorkerId, RequestId, Option<serde_json::Value>)> {
        let p = self.by_session.get_mut(&sid)?;
        if std::mem::replace(&mut p.answered, true) {
            return None;
        }
        let approval = p.approval.take();
        self.approvals -= usize::from(approval.is_some());
        Some((p.worker, p.id.clone(), approval))
    }

    /// The worker reports its request `id` resolved (answered by anyone, or aborted): its
    /// session id, and the approval if the client had not answered it.
    pub(super) fn resolved(
        &mut self,
        worker: WorkerId,
        id: RequestId,
    ) -> Option<(i64, Option<serde_json::Value>)> {
        let sid = *self.by_worker.get(&(worker, id))?;
        let p = self.remove(sid)?;
        Some((sid, p.approval))
    }

    /// A turn of `thread` on `worker` ended (app-server aborts its prompts): withdraws the
    /// thread's requests there that await an answer; their ids stay mapped for the
    /// `serverRequest/resolved` that may follow.
    pub(super) fn turn_ended(&mut self, worker: WorkerId, thread: &str) -> Vec<Withdrawn> {
        let mut withdrawn = Vec::new();
        for (sid, p) in &mut self.by_session {
            if p.worker != worker || p.thread.as_deref() != Some(thread) || p.answered {
                continue;
            }
            p.answered = true;
            let approval = p.approval.take();
            self.approvals -= usize::from(approval.is_some());
            withdrawn.push(Withdrawn {
                sid: *sid,
                thread: p.thread.clone(),
                approval,
            });
        }
        withdrawn
    }

    /// Forgets `worker`'s requests (its leg closed or it exited).
    pub(super) fn forget_worker(&mut self, worker: WorkerId) -> Vec<Withdrawn> {
        self.forget(|p| p.worker == worker)
    }

    /// Approvals awaiting the client's answer.
    pub(super) fn approvals(&self) -> usize {
        self.approvals
    }

    fn forget(&mut self, which: impl Fn(&Pending) -> bool) -> Vec<Withdrawn> {
        let gone: Vec<i64> = self
            .by_session
            .iter()
            .filter(|(_, p)| which(p))
            .map(|(sid, _)| *sid)
            .collect();
        gone.into_iter()
            .filter_map(|sid| {
                self.remove(sid).map(|p| Withdrawn {
                    sid,
                    thread: p.thread,
                    approval: p.approval,
                })
            })
            .collect()
    }

    fn remove(&mut self, sid: i64) -> Option<Pending> {
        let p = self.by_session.remove(&sid)?;
        self.by_worker.remove(&(p.worker, p.id.clone()));
        self.approvals -= usize::from(p.approval.is_some());
        Some(p)
    }
}
