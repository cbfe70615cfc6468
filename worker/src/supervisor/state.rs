//! The pool's bookkeeping under one short sync lock: slots, their states, placement.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use super::{slot_number, Load, PoolConfig, WorkerHandle, WorkerInfo, WorkerState};
use crate::error::PoolError;
use crate::metrics::WorkerMetrics;
use crate::worker::{ExitReport, ProcessGroup, WorkerId};

/// The process currently running in a slot.
pub(super) struct Live {
    pub id: WorkerId,
    pub pid: u32,
    pub group: Arc<ProcessGroup>,
    pub exit: watch::Receiver<Option<ExitReport>>,
    pub load: Arc<Load>,
}

impl Live {
    fn handles(&self) -> usize {
        Arc::strong_count(&self.load) - 1
    }

    fn has_exited(&self) -> bool {
        self.exit.borrow().is_some()
    }
}

/// One place for a worker; it keeps its index across restarts.
pub(super) struct Slot {
    pub state: WorkerState,
    /// An `acquire` wants this slot running even though it is above `min_workers`.
    pub requested: bool,
    pub generation: u32,
    pub restarts: u32,
    pub last_error: Option<String>,
    /// When the current backoff or quarantine ends.
    pub retry_at: Option<Instant>,
    pub live: Option<Live>,
    pub task: Option<AbortOnDropHandle<()>>,
}

/// The outcome of one placement attempt.
pub(super) enum Pick {
    /// A ready worker.
    Ready(WorkerHandle),
    /// Something will change; `changed` if this attempt already changed state (wake the slots).
    Wait { changed: bool },
    /// Add a slot (the cap allows it), then wait.
    Grow,
    /// Nothing can become ready in time.
    Fail(PoolError),
}

/// Everything about a pool's slots.
pub(super) struct PoolState {
    tenant: &'static str,
    metrics: WorkerMetrics,
    /// Shutdown began (or the pool is dropped): no new starts.
    pub stopping: bool,
    /// The pool was dropped: its slots no longer count in the gauges.
    detached: bool,
    pub slots: Vec<Slot>,
}

// === impl PoolState ===

impl PoolState {
    pub fn new(tenant: &'static str, metrics: WorkerMetrics) -> Self {
        Self {
            tenant,
            metrics,
            stopping: false,
            detached: false,
            slots: Vec::new(),
        }
    }

    /// Appends a slot, wanted and about to start. Returns its index.
    pub fn push_slot(&mut self) -> usize {
        self.slots.push(Slot {
            state: WorkerState::Starting,
            requested: true,
            generation: 0,
            restarts: 0,
            last_error: None,
            retry_at: None,
            live: None,
            task: None,
        });
        if !self.detached {
            self.metrics
                .transition(self.tenant, None, Some(WorkerState::Starting));
        }
        self.slots.len() - 1
    }

    /// Moves a slot to `to`, keeping the gauge in step.
    pub fn enter(&mut self, index: usize, to: WorkerState) {
        let from = std::mem::replace(&mut self.slots[index].state, to);
        if from != to && !self.detached {
            self.metrics.transition(self.tenant, Some(from), Some(to));
        }
    }

    pub fn id(&self, index: usize) -> WorkerId {
        WorkerId::new(
            self.tenant,
            slot_number(index),
            self.slots[index].generation,
        )
    }

    /// Placement: the least-loaded ready worker; else wait for a start in progress; else wake an idle
    /// slot or grow; else wait for a backoff that ends before `deadline`; else fail.
    pub fn pick(&mut self, cfg: &PoolConfig, now: Instant, deadline: Instant) -> Pick {
        if self.stopping {
            return Pick::Fail(PoolError::ShuttingDown {
                tenant: self.tenant,
            });
        }
        if let Some(handle) = self.least_loaded(cfg) {
            return Pick::Ready(handle);
        }
        if self.slots.iter().any(|s| s.state == WorkerState::Starting) {
            return Pick::Wait { changed: false };
        }
        if let Some(idle) = self
            .slots
            .iter_mut()
            .find(|s| s.state == WorkerState::Stopped)
        {
            let changed = !idle.requested;
            idle.requested = true;
            return Pick::Wait { changed };
        }
        if self.slots.len() < cfg.max_workers {
            return Pick::Grow;
        }
        self.wait_for_retry(now, deadline)
    }

    fn least_loaded(&self, cfg: &PoolConfig) -> Option<WorkerHandle> {
        let (index, live) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == WorkerState::Ready)
            .filter_map(|(i, s)| s.live.as_ref().map(|live| (i, live)))
            .filter(|(_, live)| !live.has_exited())
            .min_by_key(|(_, live)| live.handles())?;
        Some(WorkerHandle {
            id: live.id,
            pid: live.pid,
            socket_path: cfg.socket_path(slot_number(index)),
            exit: live.exit.clone(),
            _load: live.load.clone(),
        })
    }

    /// Every slot failed recently: mark them wanted, and wait if one retries before `deadline`.
    fn wait_for_retry(&mut self, now: Instant, deadline: Instant) -> Pick {
        let mut changed = false;
        for slot in &mut self.slots {
            if matches!(slot.state, WorkerState::Backoff | WorkerState::Quarantined) {
                changed |= !slot.requested;
                slot.requested = true;
            }
        }
        let soonest = |state: WorkerState| {
            self.slots
                .iter()
                .filter(|s| s.state == state)
                .filter_map(|s| s.retry_at.map(|at| (at, s.last_error.clone())))
                .min_by_key(|(at, _)| *at)
        };
        if let Some((at, last_error)) = soonest(WorkerState::Backoff) {
            if at <= deadline {
                return Pick::Wait { changed };
            }
            return Pick::Fail(PoolError::Unavailable {
                tenant: self.tenant,
                retry_in: at.saturating_duration_since(now),
                last_error,
            });
        }
        if let Some((at, last_error)) = soonest(WorkerState::Quarantined) {
            if at > deadline {
                return Pick::Fail(PoolError::Quarantined {
                    tenant: self.tenant,
                    retry_in: at.saturating_duration_since(now),
                    last_error,
                });
            }
        }
        Pick::Wait { changed }
    }

    /// The most recent failure message of any slot (for timeouts).
    pub fn last_error(&self) -> Option<String> {
        self.slots.iter().rev().find_map(|s| s.last_error.clone())
    }

    pub fn infos(&self) -> Vec<WorkerInfo> {
        self.slots
            .iter()
            .enumerate()
            .map(|(index, slot)| WorkerInfo {
                id: slot
                    .live
                    .as_ref()
                    .map_or_else(|| self.id(index), |live| live.id),
                slot: slot_number(index),
                pid: slot.live.as_ref().map(|live| live.pid),
                state: slot.state,
                restarts: slot.restarts,
                last_error: slot.last_error.clone(),
                handles: slot.live.as_ref().map_or(0, Live::handles),
            })
            .collect()
    }

    pub fn live_groups(&self) -> Vec<Arc<ProcessGroup>> {
        self.slots
            .iter()
            .filter_map(|s| s.live.as_ref().map(|live| live.group.clone()))
            .collect()
    }

    /// Starts shutdown. Returns the groups to SIGTERM the first time, `None` afterwards.
    pub fn begin_stop(&mut self) -> Option<Vec<Arc<ProcessGroup>>> {
        if self.stopping {
            return None;
        }
        self.stopping = true;
        for index in 0..self.slots.len() {
            if self.slots[index].live.is_some() {
                self.enter(index, WorkerState::Draining);
            }
        }
        Some(self.live_groups())
    }

    /// The pool is dropped: stop everything, leave the gauges, hand back groups to kill and tasks to
    /// abort.
    pub fn detach(&mut self) -> (Vec<Arc<ProcessGroup>>, Vec<AbortOnDropHandle<()>>) {
        self.stopping = true;
        if !self.detached {
            for slot in &self.slots {
                self.metrics.transition(self.tenant, Some(slot.state), None);
            }
            self.detached = true;
        }
        let tasks = self
            .slots
            .iter_mut()
            .filter_map(|s| s.task.take())
            .collect();
        (self.live_groups(), tasks)
    }
}
