//! A tenant's pool of workers: load-aware placement, readiness, restart, idle stop and graceful
//! shutdown.

mod config;
mod slot;
mod state;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nix::sys::signal::Signal;
use tokio::sync::{broadcast, oneshot, watch};
use tokio::time::{timeout, timeout_at, Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::{error, info, info_span, warn, Instrument};

use crate::control::ControlCommand;
use crate::error::{ConfigError, PoolError};
use crate::fleet::FleetPermit;
use crate::id::{intern_tenant, WorkerId};
pub use crate::lifecycle::WorkerState;
use crate::metrics::WorkerMetrics;
use crate::process::{self, ExitReport};
use crate::restart::RestartPolicy;

pub use self::config::{PoolConfig, DEFAULT_LOAD_MARK, DEFAULT_WORKER_IDLE};
pub use self::state::Sizes;
use self::state::{Pick, PoolState, Start};

/// Socket paths must be shorter than this (the kernel allows 107 bytes; keep a margin).
pub use proto::names::MAX_SOCKET_PATH;
/// Upper bound on `max_workers` for one tenant.
pub const MAX_WORKERS_PER_POOL: usize = 256;
/// Capacity of a pool's event broadcast; a subscriber that falls this far behind skips events
/// (the router then reconciles). tokio allocates every slot up front, per pool.
pub const EVENT_CAPACITY: usize = 256;
/// After SIGKILL at shutdown, how long to wait for the processes to be reaped.
const KILL_WAIT: Duration = Duration::from_secs(5);
fn slot_number(index: usize) -> u32 {
    u32::try_from(index).unwrap_or(u32::MAX)
}

/// A snapshot of one slot, for `/readyz` detail and operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    /// The current (or last) worker of the slot.
    pub id: WorkerId,
    /// Slot index.
    pub slot: u32,
    /// Process id while a process exists.
    pub pid: Option<u32>,
    /// Slot state.
    pub state: WorkerState,
    /// Starts after the first one.
    pub restarts: u32,
    /// The most recent failure, if any.
    pub last_error: Option<String>,
    /// Handles outstanding for the current worker.
    pub handles: usize,
    /// Active threads (running a turn, or waiting on an approval or user input).
    pub active_turns: usize,
    /// Loaded threads.
    pub loaded_threads: usize,
    /// Resident memory at the last health ping.
    pub rss_bytes: Option<u64>,
}

/// What happens in a pool; delivered on a bounded broadcast.
#[derive(Debug, Clone)]
pub enum PoolEvent {
    /// A notification the worker sent to the control leg (e.g. `thread/started`, `thread/closed`,
    /// `thread/status/changed`), parsed once, with its text as received.
    Notification {
        /// The worker.
        worker: WorkerId,
        /// The notification.
        notice: Arc<proto::event::Notice>,
    },
    /// A worker answered `initialize` and takes work.
    WorkerReady {
        /// The worker.
        worker: WorkerId,
    },
    /// A worker's loaded threads, after each health ping and reconcile answer
    /// (`thread/loaded/list`: level-triggered truth).
    Loaded {
        /// The worker.
        worker: WorkerId,
        /// Its loaded thread ids.
        threads: Arc<Vec<String>>,
    },
    /// A worker process is gone.
    WorkerExited {
        /// The worker.
        worker: WorkerId,
        /// Like `exit status: 1` or `signal: 9 (SIGKILL)`.
        status: String,
        /// Why it ended, as counted in `codex_fleet_worker_exits_total` (`Stopped` when the pool
        /// itself is stopping).
        reason: crate::metrics::ExitReason,
        /// The threads it had loaded, each with whether it was active: no longer anyone's.
        threads: Arc<Vec<(String, bool)>>,
    },
}

/// Marker whose reference count is the number of outstanding handles of one worker.
#[derive(Debug)]
pub(crate) struct Load;

/// What a worker is acquired for ([`Pool::acquire_for`]).
#[derive(Debug, Clone, Copy)]
pub enum Purpose<'a> {
    /// A new thread: counted as a placement until the worker reports the thread. Of the workers
    /// loaded least, one the caller already holds a connection to (`prefer`) comes first, so a
    /// session's thread lands on its home leg's worker instead of opening a second connection
    /// (which would get every broadcast of that worker once more, for nothing).
    Thread { prefer: &'a [WorkerId] },
    /// A connection that places no thread (a session's home leg, for requests without one): the
    /// least-loaded worker, not counted as a placement, since no thread follows from it.
    Connection,
}

/// A ready worker, as handed to the router. Cloning counts as another outstanding handle.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    /// The worker.
    pub id: WorkerId,
    /// Its process id.
    pub pid: u32,
    /// Who must listen on `socket_path`: check it on every connection ([`crate::leg::connect`]).
    pub peer: crate::id::Peer,
    /// Where to open legs ([`crate::leg::connect`]).
    pub socket_path: PathBuf,
    fault: Arc<Fault>,
    exit: watch::Receiver<Option<ExitReport>>,
    _load: Arc<Load>,
}

// === impl WorkerHandle ===

impl WorkerHandle {
    /// Resolves when the worker process is gone (reaped, its process group killed).
    pub async fn exited(&self) {
        process::wait_exit(self.exit.clone()).await;
    }

    /// Opens a leg to the worker ([`crate::leg::connect`], with the peer check). When something else
    /// listens on its socket path, the worker is reported faulty ([`Self::report_fault`]) before the
    /// error is returned.
    pub async fn connect(
        &self,
        max_message_size: usize,
    ) -> Result<crate::leg::LegStream, crate::LegError> {
        let result = crate::leg::connect(&self.socket_path, self.peer, max_message_size).await;
        if let Err(e) = &result {
            if e.is_peer_mismatch() {
                error!(worker = %self.id, error = %e, "worker socket leads to another listener");
                self.report_fault(e.to_string());
            }
        }
        result
    }

    /// Reports that the worker cannot be used safely (its socket path leads to another listener):
    /// the pool kills and replaces it, logs the reason and counts it as a `fault` exit. Sessions
    /// are not affected beyond the worker's end.
    pub fn report_fault(&self, reason: impl Into<String>) {
        self.fault.report(reason.into());
    }

    /// The exit status once the process is gone.
    pub fn exit_status(&self) -> Option<String> {
        self.exit
            .borrow()
            .as_ref()
            .map(|report| report.status.clone())
    }
}

/// A fault found outside the control leg, reported through a [`WorkerHandle`].
#[derive(Debug, Default)]
pub(crate) struct Fault {
    reported: CancellationToken,
    reason: Mutex<Option<String>>,
}

// === impl Fault ===

impl Fault {
    fn report(&self, reason: String) {
        self.reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(reason);
        self.reported.cancel();
    }

    /// Resolves with the first reason once a fault is reported.
    pub(crate) async fn reported(&self) -> String {
        self.reported.cancelled().await;
        self.reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_default()
    }
}

/// State shared by the pool and its slot tasks.
struct Shared {
    cfg: PoolConfig,
    tenant: &'static str,
    invalid: Option<ConfigError>,
    policy: RestartPolicy,
    metrics: WorkerMetrics,
    events: broadcast::Sender<PoolEvent>,
    /// Bumped after every change of [`PoolState`]; waiters re-check on change.
    epoch: watch::Sender<u64>,
    stop: CancellationToken,
    tracker: TaskTracker,
    state: Mutex<PoolState>,
}

// === impl Shared ===

impl Shared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.epoch
            .send_modify(|epoch| *epoch = epoch.wrapping_add(1));
    }

    /// Runs `f` under the lock, then wakes waiters.
    fn update<R>(&self, f: impl FnOnce(&mut PoolState) -> R) -> R {
        let result = f(&mut self.lock());
        self.bump();
        result
    }

    fn is_stopping(&self) -> bool {
        self.lock().stopping
    }

    fn publish(&self, event: PoolEvent) {
        // Without subscribers there is nobody to tell.
        self.events.send(event).ok();
    }

    /// Adds a slot and starts its task. Called under the lock, so caps hold.
    fn add_slot(self: &Arc<Self>, state: &mut PoolState, permit: Option<FleetPermit>) {
        let index = state.push_slot(permit);
        let span = info_span!("slot", tenant = self.tenant, slot = index);
        let task = self
            .tracker
            .spawn(slot::run(self.clone(), index).instrument(span));
        state.slots[index].task = Some(AbortOnDropHandle::new(task));
    }

    /// One placement attempt; see [`PoolState::pick`].
    fn pick(
        self: &Arc<Self>,
        purpose: Purpose<'_>,
        deadline: Instant,
    ) -> Result<Option<WorkerHandle>, PoolError> {
        let mut state = self.lock();
        let pick = state.pick(&self.cfg, purpose, Instant::now(), deadline);
        let (handle, start, changed) = match pick {
            Pick::Ready { handle, start } => (Some(handle), start, false),
            Pick::Wait { changed } => (None, None, changed),
            Pick::Start(start) => (None, Some(start), true),
            Pick::Fail(e) => return Err(e),
        };
        let started = start.is_some();
        if let Some(Start::Add(permit)) = start {
            self.add_slot(&mut state, Some(permit));
        }
        drop(state);
        if started || changed {
            self.bump();
        }
        Ok(handle)
    }
}

/// One tenant's workers. Dropping the pool kills every worker's process group.
pub struct Pool {
    shared: Arc<Shared>,
}

// === impl Pool ===

impl Pool {
    /// Creates the pool and starts `min_workers` workers in the background. Must be called within a
    /// Tokio runtime. An invalid configuration starts nothing; `acquire` then reports it.
    pub fn new(cfg: PoolConfig, metrics: WorkerMetrics) -> Arc<Pool> {
        let invalid = cfg.validate().err();
        let tenant = intern_tenant(&cfg.tenant);
        if let Some(e) = &invalid {
            error!(tenant, error = %e, "invalid worker pool configuration; no worker will start");
        }
        metrics.init_tenant(tenant);
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let shared = Arc::new(Shared {
            policy: cfg.restart_policy(),
            state: Mutex::new(PoolState::new(tenant, metrics.clone())),
            cfg,
            tenant,
            invalid,
            metrics,
            events,
            epoch: watch::Sender::new(0),
            stop: CancellationToken::new(),
            tracker: TaskTracker::new(),
        });
        if shared.invalid.is_none() {
            let mut state = shared.lock();
            for _ in 0..shared.cfg.min_workers {
                // The slot takes its fleet slot when it starts (it may wait for one).
                shared.add_slot(&mut state, None);
            }
        }
        Arc::new(Pool { shared })
    }

    /// The tenant this pool serves.
    pub fn tenant(&self) -> &'static str {
        self.shared.tenant
    }

    /// The configuration the pool was created with (e.g. `stop_grace` for [`Pool::shutdown`]).
    pub fn config(&self) -> &PoolConfig {
        &self.shared.cfg
    }

    /// Placement for a new thread: the least-loaded ready worker, by (active turns, loaded threads,
    /// outstanding handles). When even that one is at or above `load_mark`, another worker starts in
    /// the background (caps allowing) and the ready one is returned at once. With none ready, starts
    /// one (caps allowing) and waits at most `ready_timeout`; fails early when no start can succeed
    /// in time.
    pub async fn acquire(&self) -> Result<WorkerHandle, PoolError> {
        self.acquire_for(Purpose::Thread { prefer: &[] }).await
    }

    /// As [`Pool::acquire`], for `purpose`: a new thread (preferring, of the workers loaded
    /// least, one the caller is already connected to) or a connection that places none.
    pub async fn acquire_for(&self, purpose: Purpose<'_>) -> Result<WorkerHandle, PoolError> {
        if let Some(e) = &self.shared.invalid {
            return Err(PoolError::Config {
                tenant: self.shared.cfg.tenant.clone(),
                source: e.clone(),
            });
        }
        let ready_timeout = self.shared.cfg.ready_timeout;
        let deadline = Instant::now() + ready_timeout;
        let mut epoch = self.shared.epoch.subscribe();
        loop {
            epoch.borrow_and_update();
            if let Some(handle) = self.shared.pick(purpose, deadline)? {
                return Ok(handle);
            }
            if !matches!(timeout_at(deadline, epoch.changed()).await, Ok(Ok(()))) {
                return Err(PoolError::Timeout {
                    tenant: self.shared.tenant,
                    after: ready_timeout,
                    last_error: self.shared.lock().last_error(),
                });
            }
        }
    }

    /// A handle to exactly worker `id` (the owner of a thread), if it is live and takes requests:
    /// ready, or retiring for memory but not yet told to stop.
    pub fn get(&self, id: WorkerId) -> Option<WorkerHandle> {
        self.shared.lock().get(id, &self.shared.cfg)
    }

    /// The worker that has `thread` loaded: the pool's one record, from its workers' lifecycle
    /// broadcasts, their loaded lists and what [`Pool::learn`] was told.
    pub fn owner(&self, thread: &str) -> Option<WorkerId> {
        self.shared.lock().owner(thread)
    }

    /// Records that worker `id` has `thread` loaded: an answer to `thread/start`, `thread/fork`
    /// or `thread/resume` says so before the worker's control leg does. Ignored if `id` no longer
    /// runs.
    pub fn learn(&self, thread: &str, id: WorkerId) {
        self.shared.lock().learn(thread, id);
    }

    /// Test-only hook: forgets where `thread` lives, to prove the next loaded list restores it.
    #[doc(hidden)]
    pub fn forget_owner_for_tests(&self, thread: &str) -> Option<WorkerId> {
        self.shared.lock().owners.remove(thread)
    }

    /// The current view of each live worker's loaded threads (sorted ids), from lifecycle
    /// broadcasts and the last health ping.
    pub fn loaded_threads(&self) -> Vec<(WorkerId, Vec<String>)> {
        self.shared.lock().loaded_threads()
    }

    /// Asks every ready (or draining) worker's control leg for `thread/loaded/list` now, and returns
    /// the answers; each is also published as [`PoolEvent::Loaded`]. Workers that do not answer
    /// within `health_timeout` are left out.
    pub async fn reconcile(&self) -> Vec<(WorkerId, Vec<String>)> {
        let controls = self.shared.lock().controls();
        let deadline = Instant::now() + self.shared.cfg.health_timeout;
        let asks = controls.into_iter().map(|(id, control)| async move {
            let (reply, answer) = oneshot::channel();
            timeout_at(deadline, control.send(ControlCommand::Reconcile(reply)))
                .await
                .ok()?
                .ok()?;
            let loaded = timeout_at(deadline, answer).await.ok()?.ok()?;
            Some((id, loaded.as_ref().clone()))
        });
        futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// The sizes in force (the configuration's until [`Pool::resize`]).
    pub fn sizes(&self) -> Sizes {
        self.shared.lock().sizes(&self.shared.cfg)
    }

    /// Changes the pool's sizes in place (a reload): running workers stay. More `min_workers` start
    /// at once; workers beyond a lower `max_workers` or `min_workers` stop when idle, as usual.
    pub fn resize(self: &Arc<Self>, sizes: Sizes) -> Result<(), ConfigError> {
        let mut check = self.shared.cfg.clone();
        check.min_workers = sizes.min_workers;
        check.max_workers = sizes.max_workers;
        check.load_mark = sizes.load_mark;
        check.worker_idle = sizes.worker_idle;
        check.validate()?;
        let shared = &self.shared;
        let added = shared.update(|state| {
            state.sizes = Some(sizes);
            let mut added = 0;
            if shared.invalid.is_none() && !state.stopping {
                while state.slots.len() < sizes.min_workers {
                    shared.add_slot(state, None);
                    added += 1;
                }
            }
            added
        });
        info!(tenant = shared.tenant, ?sizes, added, "pool resized");
        Ok(())
    }

    /// Active threads (a turn running, or waiting on a client) over every live worker.
    pub fn active_turns(&self) -> usize {
        self.shared
            .lock()
            .active_threads(&self.shared.cfg)
            .iter()
            .map(|(_, _, _, threads)| threads.len())
            .sum()
    }

    /// Interrupts every running turn (`turn/interrupt`, end of a drain); returns how many were
    /// interrupted. Gives up at `deadline`.
    pub async fn interrupt_active_turns(&self, deadline: Instant) -> usize {
        let active = self.shared.lock().active_threads(&self.shared.cfg);
        let asks = active.iter().map(|(id, socket, peer, threads)| async move {
            info!(worker = %id, threads = threads.len(), "interrupting running turns");
            crate::interrupt::interrupt_turns(socket, *peer, threads, deadline).await
        });
        futures_util::future::join_all(asks).await.into_iter().sum()
    }

    /// Why this pool cannot provide any worker now, if so (an invalid configuration, or every
    /// possible slot quarantined).
    pub fn unavailable(&self) -> Option<String> {
        if let Some(e) = &self.shared.invalid {
            return Some(format!("invalid worker configuration: {e}"));
        }
        self.shared.lock().unavailable(&self.shared.cfg)
    }

    /// A snapshot of every slot.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.shared.lock().infos()
    }

    /// Subscribes to pool events (bounded; a lagging receiver skips).
    pub fn subscribe(&self) -> broadcast::Receiver<PoolEvent> {
        self.shared.events.subscribe()
    }

    /// Graceful stop: SIGTERM every worker's process group, wait up to `grace` for them to exit, then
    /// SIGKILL the groups and wait for the reaps. No worker starts afterwards. Idempotent: a later
    /// call only waits (a second SIGTERM would force app-server out of its drain).
    pub async fn shutdown(&self, grace: Duration) {
        let shared = &self.shared;
        let first = shared.update(PoolState::begin_stop);
        shared.stop.cancel();
        shared.tracker.close();
        if let Some(groups) = first {
            info!(
                tenant = shared.tenant,
                workers = groups.len(),
                "stopping workers"
            );
            for group in &groups {
                group.signal(Signal::SIGTERM);
            }
        }
        if timeout(grace, shared.tracker.wait()).await.is_ok() {
            return;
        }
        let groups = shared.lock().live_groups();
        warn!(
            tenant = shared.tenant,
            workers = groups.len(),
            ?grace,
            "grace expired; killing workers"
        );
        for group in &groups {
            group.signal(Signal::SIGKILL);
        }
        if timeout(KILL_WAIT, shared.tracker.wait()).await.is_err() {
            error!(tenant = shared.tenant, "workers not reaped after SIGKILL");
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.cancel();
        let (groups, tasks) = self.shared.lock().detach();
        for group in &groups {
            group.signal(Signal::SIGKILL);
        }
        // Aborts the slot tasks; their processes' own Drop kills again (a no-op by then).
        drop(tasks);
    }
}

#[cfg(test)]
mod tests;
