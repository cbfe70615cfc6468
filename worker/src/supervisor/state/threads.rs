//! Where the pool's threads are: the owner index over the workers' own views, misses
//! remembered until a view grows ([`crate::load::Misses`]), and the lifecycle broadcasts that keep both true.

use super::{slot_number, PoolState, Verdict};
use crate::id::{Peer, WorkerId};
use crate::load::Lifecycle;
use crate::supervisor::PoolConfig;

// === impl PoolState ===

impl PoolState {
    /// The worker that has `thread` loaded: the index, or on a miss the workers' own views (the
    /// index is repaired from them). An id found nowhere is remembered until a view gains a
    /// thread ([`Misses`]), so asking for it again looks at no view.
    pub fn owner(&mut self, thread: &str) -> Option<WorkerId> {
        if let Some(w) = self.owners.get(thread) {
            return Some(w);
        }
        if self.misses.contains(thread) {
            return None;
        }
        let Some(found) = self
            .slots
            .iter()
            .filter_map(|s| s.live.as_ref())
            .find(|live| !live.has_exited() && live.threads.contains(thread))
            .map(|live| live.id)
        else {
            self.misses.insert(thread);
            return None;
        };
        self.owners.set(thread, found);
        Some(found)
    }

    /// `thread` is loaded on worker `id` (a request's answer said so before its control leg did).
    pub fn learn(&mut self, thread: &str, id: WorkerId) {
        let Ok(index) = usize::try_from(id.slot()) else {
            return;
        };
        let Some(live) = self
            .slots
            .get_mut(index)
            .and_then(|s| s.live.as_mut())
            .filter(|l| l.id == id)
        else {
            return;
        };
        let before = live.threads.additions();
        live.threads.learn(thread);
        if live.threads.additions() != before {
            self.misses.views_grew();
        }
        if live.threads.contains(thread) {
            self.owners.set(thread, id);
        }
    }

    /// Each running worker's loaded threads.
    pub fn loaded_threads(&self) -> Vec<(WorkerId, Vec<String>)> {
        self.slots
            .iter()
            .filter_map(|s| s.live.as_ref())
            .filter(|live| !live.has_exited())
            .map(|live| (live.id, live.threads.ids()))
            .collect()
    }

    /// Each live worker's active threads (running a turn or waiting on a client).
    pub fn active_threads(
        &self,
        cfg: &PoolConfig,
    ) -> Vec<(WorkerId, std::path::PathBuf, Peer, Vec<String>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(index, s)| s.live.as_ref().map(|live| (index, live)))
            .filter(|(_, live)| !live.has_exited() && live.threads.active() > 0)
            .map(|(index, live)| {
                (
                    live.id,
                    cfg.socket_path(slot_number(index)),
                    live.peer,
                    live.threads.active_ids(),
                )
            })
            .collect()
    }

    /// A lifecycle broadcast from worker `id`'s control leg.
    pub fn on_lifecycle(&mut self, index: usize, id: WorkerId, event: Lifecycle) -> Verdict {
        let Some(live) = self.slots[index].live.as_mut().filter(|l| l.id == id) else {
            return Verdict::Keep;
        };
        match &event {
            Lifecycle::Started { thread, .. } | Lifecycle::Status { thread, .. } => {
                self.owners.set(thread, id);
            }
            Lifecycle::Unloaded { thread } => self.owners.release(thread, id),
        }
        let before = live.threads.additions();
        live.threads.apply(event);
        if live.threads.additions() != before {
            self.misses.views_grew();
        }
        let verdict = Self::finish_retire(live);
        self.publish_load();
        verdict
    }
}
