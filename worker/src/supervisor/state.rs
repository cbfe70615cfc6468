//! The pool's bookkeeping under one short sync lock: slots, their states, placement, load.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use super::{slot_number, Fault, Load, PoolConfig, Purpose, WorkerHandle, WorkerInfo, WorkerState};
use crate::control::ControlCommand;
use crate::error::PoolError;
use crate::fleet::FleetPermit;
use crate::id::Peer;
use crate::id::WorkerId;
use crate::load::{Misses, Owners, ThreadView};
use crate::metrics::{ExitReason, LoadGauges, WorkerMetrics};
use crate::process::{ExitReport, ProcessGroup};

/// The process currently running in a slot.
pub(super) struct Live {
    pub id: WorkerId,
    pub pid: u32,
    /// Who must listen on its socket.
    pub peer: Peer,
    /// Faults the router reports (its socket leads elsewhere); the slot replaces the worker.
    pub fault: Arc<Fault>,
    pub group: Arc<ProcessGroup>,
    pub exit: watch::Receiver<Option<ExitReport>>,
    pub load: Arc<Load>,
    /// Requests to the worker's control leg.
    pub control: mpsc::Sender<ControlCommand>,
    /// Loaded and active threads, from the control leg.
    pub threads: ThreadView,
    /// Resident memory at the last health ping.
    pub rss: Option<u64>,
    /// What its process group used at the last health ping (capacity metrics).
    pub usage: crate::usage::Usage,
    /// Since when the worker has had nothing loaded, nothing active and no handles.
    pub idle_since: Option<Instant>,
    /// The worker is being retired on purpose (idle, memory).
    pub retire: Option<Retire>,
    /// When placements chose this worker lately. The control leg reports a new thread a few
    /// milliseconds after its `thread/start` answer, so placements close together would all see
    /// the same counts and pile onto one worker; recent ones count as provisional load.
    pub placed: std::collections::VecDeque<Instant>,
}

/// How long a placement counts as load before the control leg's own counts take over.
const PLACEMENT_SETTLE: std::time::Duration = std::time::Duration::from_secs(2);
/// Placements remembered per worker (older ones no longer matter).
const MAX_RECENT_PLACEMENTS: usize = 64;

/// A worker on its way out on purpose: no restart, not a failure.
#[derive(Debug, Clone, Copy)]
pub(super) struct Retire {
    pub reason: ExitReason,
    /// SIGTERM sent (it waits for the worker to have no active turn).
    pub signalled: bool,
}

impl Retire {
    fn new(reason: ExitReason) -> Self {
        Self {
            reason,
            signalled: false,
        }
    }
}

impl Live {
    fn handles(&self) -> usize {
        Arc::strong_count(&self.load) - 1
    }

    fn has_exited(&self) -> bool {
        self.exit.borrow().is_some()
    }

    /// Placement order: fewest active turns, then fewest loaded threads (counting placements
    /// not yet reported), then fewest handles.
    fn load_key(&self, now: Instant) -> (usize, usize, usize) {
        let recent = self
            .placed
            .iter()
            .filter(|t| now.saturating_duration_since(**t) < PLACEMENT_SETTLE)
            .count();
        (
            self.threads.active(),
            self.threads.loaded() + recent,
            self.handles(),
        )
    }

    /// Remembers that placement chose this worker at `now`.
    fn placed_at(&mut self, now: Instant) {
        while self
            .placed
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= PLACEMENT_SETTLE)
            || self.placed.len() >= MAX_RECENT_PLACEMENTS
        {
            self.placed.pop_front();
        }
        self.placed.push_back(now);
    }

    fn is_idle(&self) -> bool {
        self.threads.loaded() == 0 && self.threads.active() == 0 && self.handles() == 0
    }
}

/// One place for a worker; it keeps its index across restarts.
pub(super) struct Slot {
    pub state: WorkerState,
    /// An `acquire` wants this slot running even though it is above `min_workers`.
    pub requested: bool,
    /// A fleet slot reserved by placement for the slot's next start.
    pub permit: Option<FleetPermit>,
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
    /// A ready worker; `start` if placement also began starting another (load above the mark).
    Ready {
        handle: WorkerHandle,
        start: Option<Start>,
    },
    /// Something will change; `changed` if this attempt already changed state (wake the slots).
    Wait { changed: bool },
    /// A start began (then wait).
    Start(Start),
    /// Nothing can become ready in time.
    Fail(PoolError),
}

/// How placement starts another worker.
pub(super) enum Start {
    /// A stopped slot was asked to start (its task wakes on the epoch bump).
    Woke,
    /// Add a slot (the caps allow it) with this fleet slot.
    Add(FleetPermit),
}

/// What a slot's load observation asks the slot task to do.
pub(super) enum Verdict {
    /// Nothing.
    Keep,
    /// SIGTERM this group: the worker is retired.
    Terminate(Arc<ProcessGroup>),
}

/// Everything about a pool's slots.
pub(super) struct PoolState {
    tenant: &'static str,
    metrics: WorkerMetrics,
    /// The tenant's load and memory gauges, set on every lifecycle event.
    gauges: LoadGauges,
    /// Shutdown began (or the pool is dropped): no new starts.
    pub stopping: bool,
    /// The pool was dropped: its slots no longer count in the gauges.
    detached: bool,
    /// Pool sizes set by [`super::Pool::resize`]; `None`: the configuration's.
    pub sizes: Option<Sizes>,
    pub slots: Vec<Slot>,
    /// threadId → the worker that has it loaded, kept in step with the workers' views: the one
    /// record of where the tenant's threads live (the router reads it through
    /// [`super::Pool::owner`]).
    pub owners: Owners,
    /// Thread ids found neither in `owners` nor in any view, per generation of the views.
    pub misses: Misses,
}

/// The settings of a pool that a reload may change in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Workers started eagerly and kept running.
    pub min_workers: usize,
    /// Most workers.
    pub max_workers: usize,
    /// Active turns per worker at or above which placement starts another worker.
    pub load_mark: usize,
    /// Idle time after which a worker above `min_workers` is stopped.
    pub worker_idle: std::time::Duration,
}

impl Sizes {
    /// The sizes a configuration asks for.
    pub fn of(cfg: &PoolConfig) -> Self {
        Self {
            min_workers: cfg.min_workers,
            max_workers: cfg.max_workers,
            load_mark: cfg.load_mark,
            worker_idle: cfg.worker_idle,
        }
    }
}

// === impl PoolState ===

impl PoolState {
    pub fn new(tenant: &'static str, metrics: WorkerMetrics) -> Self {
        Self {
            tenant,
            gauges: metrics.load_gauges(tenant),
            metrics,
            stopping: false,
            detached: false,
            sizes: None,
            slots: Vec::new(),
            owners: Owners::default(),
            misses: Misses::default(),
        }
    }

    /// Appends a slot, wanted and about to start. Returns its index.
    pub fn push_slot(&mut self, permit: Option<FleetPermit>) -> usize {
        self.slots.push(Slot {
            state: WorkerState::Starting,
            requested: true,
            permit,
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

    /// Placement of a new thread (or of a connection, [`Purpose`]): the least-loaded ready worker
    /// (starting another in the background when all are at or above `load_mark`); else wait for a
    /// start in progress; else start one; else wait for a backoff that ends before `deadline`;
    /// else fail.
    pub fn pick(
        &mut self,
        cfg: &PoolConfig,
        purpose: Purpose<'_>,
        now: Instant,
        deadline: Instant,
    ) -> Pick {
        let sizes = self.sizes(cfg);
        if self.stopping {
            return Pick::Fail(PoolError::ShuttingDown {
                tenant: self.tenant,
            });
        }
        let prefer = match purpose {
            Purpose::Thread { prefer } => prefer,
            Purpose::Connection => &[],
        };
        if let Some((handle, busy)) = self.least_loaded(cfg, sizes, prefer, now) {
            let live = self
                .slots
                .iter_mut()
                .filter_map(|s| s.live.as_mut())
                .find(|l| l.id == handle.id);
            if let (Some(live), Purpose::Thread { .. }) = (live, purpose) {
                live.placed_at(now);
            }
            let start = if busy && !self.start_pending() {
                // Best effort: at a cap, the ready worker takes the thread anyway.
                self.start_one(cfg, sizes).ok().flatten()
            } else {
                None
            };
            return Pick::Ready { handle, start };
        }
        if self.start_pending() {
            return Pick::Wait { changed: false };
        }
        match self.start_one(cfg, sizes) {
            Ok(Some(start)) => return Pick::Start(start),
            Ok(None) => {}
            Err(e) => return Pick::Fail(e),
        }
        self.wait_for_retry(now, deadline)
    }

    /// The ready worker to place on, and whether even it is at or above `load_mark`: the least
    /// loaded, and of those loaded alike one in `prefer` before the one with fewest handles.
    fn least_loaded(
        &self,
        cfg: &PoolConfig,
        sizes: Sizes,
        prefer: &[WorkerId],
        now: Instant,
    ) -> Option<(WorkerHandle, bool)> {
        let (index, key) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == WorkerState::Ready)
            .filter_map(|(i, s)| s.live.as_ref().map(|live| (i, live)))
            .filter(|(_, live)| !live.has_exited() && live.retire.is_none())
            .map(|(i, live)| {
                let (active, loaded, handles) = live.load_key(now);
                let elsewhere = !prefer.contains(&live.id);
                (i, (active, loaded, elsewhere, handles))
            })
            .min_by_key(|(_, key)| *key)?;
        Some((self.handle(index, cfg)?, key.0 >= sizes.load_mark))
    }

    /// A start is under way or asked for.
    fn start_pending(&self) -> bool {
        self.slots.iter().any(|s| {
            s.state == WorkerState::Starting || (s.state == WorkerState::Stopped && s.requested)
        })
    }

    /// Starts another worker if the pool's and the fleet's caps allow: wakes a stopped slot or adds
    /// one. `Ok(None)` at the pool's cap; an error when only the fleet cap stands in the way.
    fn start_one(&mut self, cfg: &PoolConfig, sizes: Sizes) -> Result<Option<Start>, PoolError> {
        let stopped = self
            .slots
            .iter()
            .take(sizes.max_workers)
            .position(|s| s.state == WorkerState::Stopped && !s.requested && s.live.is_none());
        if stopped.is_none() && self.slots.len() >= sizes.max_workers {
            return Ok(None);
        }
        let permit = cfg.fleet.try_take().ok_or(PoolError::FleetFull {
            tenant: self.tenant,
            max: cfg.fleet.max(),
        })?;
        Ok(Some(match stopped {
            Some(index) => {
                let slot = &mut self.slots[index];
                slot.requested = true;
                slot.permit = Some(permit);
                Start::Woke
            }
            None => Start::Add(permit),
        }))
    }

    /// A handle to the worker in slot `index`, if it has a live process.
    fn handle(&self, index: usize, cfg: &PoolConfig) -> Option<WorkerHandle> {
        let live = self.slots[index].live.as_ref()?;
        Some(WorkerHandle {
            id: live.id,
            pid: live.pid,
            peer: live.peer,
            socket_path: cfg.socket_path(slot_number(index)),
            fault: live.fault.clone(),
            exit: live.exit.clone(),
            _load: live.load.clone(),
        })
    }

    /// A handle to exactly `id`, while it runs and takes requests (ready, or retiring but not yet
    /// told to stop: it still owns its loaded threads).
    pub fn get(&self, id: WorkerId, cfg: &PoolConfig) -> Option<WorkerHandle> {
        let index = usize::try_from(id.slot()).ok()?;
        let slot = self.slots.get(index)?;
        let live = slot.live.as_ref().filter(|live| live.id == id)?;
        let serving = match slot.state {
            WorkerState::Ready => true,
            WorkerState::Draining => live.retire.is_some_and(|r| !r.signalled) && !self.stopping,
            _ => false,
        };
        if !serving || live.has_exited() {
            return None;
        }
        self.handle(index, cfg)
    }

    /// Slot `index`'s worker ended: its record goes, and so do the threads it owned, which are
    /// returned (each with whether it was active) so the router can decide their fate.
    pub fn end_live(&mut self, index: usize) -> Vec<(String, bool)> {
        let Some(live) = self.slots[index].live.take() else {
            return Vec::new();
        };
        self.owners.sync(live.id, None);
        live.threads.entries()
    }

    /// Control-leg senders of the workers that are ready or draining.
    pub fn controls(&self) -> Vec<(WorkerId, mpsc::Sender<ControlCommand>)> {
        self.slots
            .iter()
            .filter(|s| matches!(s.state, WorkerState::Ready | WorkerState::Draining))
            .filter_map(|s| s.live.as_ref())
            .map(|live| (live.id, live.control.clone()))
            .collect()
    }

    /// The sizes in force.
    pub fn sizes(&self, cfg: &PoolConfig) -> Sizes {
        self.sizes.unwrap_or_else(|| Sizes::of(cfg))
    }

    /// Why no worker can be had at all, if so: an invalid command that keeps failing leaves every
    /// possible slot quarantined.
    pub fn unavailable(&self, cfg: &PoolConfig) -> Option<String> {
        let sizes = self.sizes(cfg);
        let quarantined = self
            .slots
            .iter()
            .take(sizes.max_workers)
            .filter(|s| s.state == WorkerState::Quarantined)
            .count();
        if quarantined < sizes.max_workers {
            return None;
        }
        let last = self.last_error().unwrap_or_default();
        Some(format!(
            "every worker slot is quarantined after repeated failures: {last}"
        ))
    }

    fn live_mut(&mut self, index: usize, id: WorkerId) -> Option<&mut Live> {
        self.slots[index].live.as_mut().filter(|live| live.id == id)
    }

    /// A `thread/loaded/list` answer (and the RSS sampled with it): resets the view, then checks the
    /// memory guard and the idle stop.
    pub fn on_loaded(
        &mut self,
        index: usize,
        id: WorkerId,
        loaded: &[String],
        rss: Option<u64>,
        cfg: &PoolConfig,
        now: Instant,
    ) -> Verdict {
        let sizes = self.sizes(cfg);
        let protected = index < sizes.min_workers || self.stopping;
        let ready = self.slots[index].state == WorkerState::Ready;
        let Some(live) = self.slots[index].live.as_mut().filter(|l| l.id == id) else {
            return Verdict::Keep;
        };
        // Events newer than the request (at most one health timeout old) outrank the list.
        let before = live.threads.additions();
        live.threads.reset(loaded, cfg.health_timeout);
        if live.threads.additions() != before {
            self.misses.views_grew();
        }
        self.owners.sync(id, Some(&live.threads));
        live.rss = rss.or(live.rss);
        let mut draining = false;
        if ready && live.retire.is_none() {
            if let (Some(max), Some(rss)) = (cfg.max_worker_rss, rss) {
                if rss > max {
                    live.retire = Some(Retire::new(ExitReason::Memory));
                    draining = true;
                }
            }
        }
        if !live.is_idle() || protected || !ready {
            live.idle_since = None;
        } else if live.retire.is_none() {
            let since = *live.idle_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= sizes.worker_idle {
                live.retire = Some(Retire::new(ExitReason::Idle));
                draining = true;
            }
        }
        let verdict = Self::finish_retire(live);
        if draining {
            self.enter(index, WorkerState::Draining);
        }
        self.publish_load();
        verdict
    }

    /// A retiring worker is told to stop once it has no active turn.
    fn finish_retire(live: &mut Live) -> Verdict {
        match &mut live.retire {
            Some(retire) if !retire.signalled && live.threads.active() == 0 => {
                retire.signalled = true;
                Verdict::Terminate(live.group.clone())
            }
            _ => Verdict::Keep,
        }
    }

    /// Why slot `index`'s worker was told to stop on purpose, if it was.
    pub fn retiring(&self, index: usize) -> Option<ExitReason> {
        self.slots[index]
            .live
            .as_ref()
            .and_then(|live| live.retire.filter(|r| r.signalled).map(|r| r.reason))
    }

    /// Sets the tenant's load gauges from every live worker.
    pub fn publish_load(&self) {
        if self.detached {
            return;
        }
        let (active, loaded) = self
            .slots
            .iter()
            .filter_map(|s| s.live.as_ref())
            .fold((0, 0), |(a, l), live| {
                (a + live.threads.active(), l + live.threads.loaded())
            });
        self.gauges.load(active, loaded);
        let live = self.slots.iter().filter_map(|s| s.live.as_ref());
        let resident: u64 = live.clone().map(|l| l.usage.rss_bytes).sum();
        let largest = live.filter_map(|l| l.rss).max().unwrap_or(0);
        self.gauges.resources(resident, largest);
    }

    /// What worker `id`'s process group used at a health ping: its CPU time since the last
    /// sample is added to the tenant's, and its memory replaces the last sample's.
    pub fn on_usage(&mut self, index: usize, id: WorkerId, usage: crate::usage::Usage) {
        let Some(live) = self.live_mut(index, id) else {
            return;
        };
        let spent = usage.cpu_secs - live.usage.cpu_secs;
        live.usage = usage;
        if spent > 0.0 && !self.detached {
            self.metrics.cpu_spent(self.tenant, spent);
        }
        self.publish_load();
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
                active_turns: slot.live.as_ref().map_or(0, |l| l.threads.active()),
                loaded_threads: slot.live.as_ref().map_or(0, |l| l.threads.loaded()),
                rss_bytes: slot.live.as_ref().and_then(|l| l.rss),
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
            // Fleet slots reserved for starts that will not happen go back now.
            self.slots[index].permit = None;
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
            self.gauges.load(0, 0);
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

mod threads;

#[cfg(test)]
mod tests;
