//! The task that runs one slot: start a worker, watch it, decide on restart, repeat.

use std::path::Path;
use std::sync::Arc;

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, Duration, Instant};
use tracing::{debug, info, info_span, warn, Instrument};

use super::state::{Live, Verdict};
use super::{Fault, Load, PoolEvent, Shared, WorkerState};
use crate::control::{ControlCommand, ControlEnd, ControlLeg, Health, Observed, COMMAND_CAPACITY};
use crate::error::StartError;
use crate::fleet::FleetPermit;
use crate::id::WorkerId;
use crate::load::{Lifecycle, ThreadView};
use crate::metrics::ExitReason;
use crate::process::{self, Spawn, WorkerProcess};
use crate::restart::{RestartDecision, RestartTracker};
use crate::run_as;

/// How one worker process ended.
struct Ended {
    id: WorkerId,
    reason: ExitReason,
    error: String,
    /// Exit status, if a process was spawned.
    status: Option<String>,
}

/// Runs slot `index` until the pool stops.
pub(super) async fn run(shared: Arc<Shared>, index: usize) {
    let mut restarts = RestartTracker::default();
    while wait_until_wanted(&shared, index).await {
        let Some(permit) = take_permit(&shared, index).await else {
            break;
        };
        let id = begin_start(&shared, index);
        let ended = run_worker(&shared, index, id)
            .instrument(info_span!("worker", worker = %id))
            .await;
        process::remove_socket_leftovers(
            &shared.cfg.socket_path(id.slot()),
            shared.cfg.worker_uid(),
        )
        .await;
        // The process is gone: its fleet slot is free again.
        drop(permit);
        let next = finish(&shared, index, ended, &mut restarts);
        sweep_tenant_uid(&shared).await;
        let Some(retry_at) = next else {
            break;
        };
        tokio::select! {
            () = sleep_until(retry_at) => {}
            () = shared.stop.cancelled() => break,
        }
    }
    shared.update(|state| state.enter(index, WorkerState::Stopped));
}

/// With a uid of the tenant's own, and no worker of the tenant left (none live, none starting):
/// kills every process still running under that uid, such as a daemon a command started with
/// `setsid`, which left the worker's process group and so outlived the group kill. Reading `/proc`
/// costs a file per process on the host (a tenant may run thousands: 32 ms for 3,000 here), so
/// it runs off the runtime, where it would stall every session the thread serves.
async fn sweep_tenant_uid(shared: &Arc<Shared>) {
    let Some(user) = shared.cfg.user else {
        return;
    };
    if user.uid == 0 || user.uid == nix::unistd::geteuid().as_raw() {
        return;
    }
    // The cheap check first: most worker ends leave others running, and /proc is not read.
    if busy(&shared.lock()) {
        return;
    }
    let pool = shared.clone();
    // The kills' log lines keep the slot's span (tenant, slot).
    let span = tracing::Span::current();
    let killed = tokio::task::spawn_blocking(move || {
        let _span = span.enter();
        let leftovers = crate::sweep::processes_of(user.uid);
        if leftovers.is_empty() {
            return 0;
        }
        // Again under the lock, so no slot can begin a start between the check and the kill; the
        // pids were read before, so a worker started later is never among them.
        let state = pool.lock();
        if busy(&state) {
            return 0;
        }
        crate::sweep::kill_all(&leftovers)
    })
    .await
    .unwrap_or(0);
    if killed > 0 {
        warn!(
            uid = user.uid,
            killed, "the tenant's last worker is gone; killed processes left under its uid"
        );
    }
}

/// Whether any of the pool's slots has a worker, live or starting.
fn busy(state: &super::PoolState) -> bool {
    state
        .slots
        .iter()
        .any(|s| s.live.is_some() || s.state == WorkerState::Starting)
}

/// Waits until the slot should run a worker: it is within `min_workers`, or an `acquire` asked.
/// Idle slots show as `Stopped`. Returns `false` once the pool stops.
async fn wait_until_wanted(shared: &Shared, index: usize) -> bool {
    let mut epoch = shared.epoch.subscribe();
    loop {
        epoch.borrow_and_update();
        let idle = {
            let mut state = shared.lock();
            if state.stopping {
                return false;
            }
            if index < state.sizes(&shared.cfg).min_workers || state.slots[index].requested {
                return true;
            }
            let idle = state.slots[index].state != WorkerState::Stopped;
            state.enter(index, WorkerState::Stopped);
            idle
        };
        if idle {
            shared.bump();
        }
        tokio::select! {
            changed = epoch.changed() => if changed.is_err() { return false },
            () = shared.stop.cancelled() => return false,
        }
    }
}

/// A fleet slot for the next start: the one placement reserved, or a free one; waits for one to be
/// returned otherwise. `None` once the pool stops.
async fn take_permit(shared: &Shared, index: usize) -> Option<FleetPermit> {
    let fleet = &shared.cfg.fleet;
    let mut returned = fleet.watch();
    loop {
        returned.borrow_and_update();
        let reserved = shared.lock().slots[index].permit.take();
        if let Some(permit) = reserved.or_else(|| fleet.try_take()) {
            return Some(permit);
        }
        debug!(max = fleet.max(), "waiting for a fleet-wide worker slot");
        tokio::select! {
            changed = returned.changed() => if changed.is_err() { return None },
            () = shared.stop.cancelled() => return None,
        }
    }
}

fn begin_start(shared: &Shared, index: usize) -> WorkerId {
    shared.update(|state| {
        let slot = &mut state.slots[index];
        slot.generation += 1;
        slot.retry_at = None;
        if slot.generation > 1 {
            slot.restarts += 1;
            shared.metrics.restarted(shared.tenant);
        }
        shared.metrics.started(shared.tenant);
        state.enter(index, WorkerState::Starting);
        state.id(index)
    })
}

async fn run_worker(shared: &Shared, index: usize, id: WorkerId) -> Ended {
    let socket = shared.cfg.socket_path(id.slot());
    let spawned_at = Instant::now();
    let process = match spawn(shared, id, &socket).await {
        Ok(process) => process,
        Err(e) => return Ended::start_failed(id, &e, None),
    };
    let (control_tx, mut commands) = mpsc::channel(COMMAND_CAPACITY);
    let fault = Arc::new(Fault::default());
    register(shared, index, &process, control_tx, fault.clone());
    let control = match process.wait_ready(&socket, shared.cfg.ready_timeout).await {
        Ok(control) => control,
        Err(e) => {
            process.kill();
            let report = process.exited().await;
            return Ended::start_failed(id, &e, Some(report.status));
        }
    };
    let elapsed = spawned_at.elapsed();
    // Book the start before `Ready` wakes acquirers, so metrics never lag a handed-out worker.
    shared.metrics.ready_after(shared.tenant, elapsed);
    shared.update(|state| {
        state.slots[index].requested = false;
        state.enter(index, WorkerState::Ready);
    });
    info!(pid = process.pid(), ?elapsed, "worker ready");
    shared.publish(PoolEvent::WorkerReady { worker: id });
    supervise(shared, index, &process, control, &mut commands, &fault).await
}

async fn spawn(shared: &Shared, id: WorkerId, socket: &Path) -> Result<WorkerProcess, StartError> {
    let cfg = &shared.cfg;
    let sockets = process::socket_tenant_dir(&cfg.socket_dir, &cfg.tenant);
    run_as::prepare_socket_root(&cfg.socket_dir, cfg.user.is_some()).await?;
    run_as::prepare_dir(&sockets, cfg.user, true).await?;
    run_as::prepare_dir(&cfg.codex_home, cfg.user, false).await?;
    run_as::prepare_dir(&cfg.cwd, cfg.user, false).await?;
    if let Some(user) = cfg.user {
        for dir in [&sockets, &cfg.codex_home, &cfg.cwd] {
            run_as::check_reachable(dir, user)?;
        }
    }
    process::clean_socket_path(socket, cfg.worker_uid()).await?;
    WorkerProcess::spawn(Spawn {
        id,
        program: &cfg.program,
        args: cfg.worker_args(socket),
        env: &cfg.env,
        codex_home: &cfg.codex_home,
        cwd: &cfg.cwd,
        user: cfg.user,
        rlimits: cfg.rlimits,
        nice: cfg.nice,
        log_lines_dropped: shared.metrics.log_lines_dropped(shared.tenant),
    })
    .await
}

/// Records the process in its slot, so shutdown and drop can signal it. If shutdown began while it
/// was spawning, it is told to stop at once.
fn register(
    shared: &Shared,
    index: usize,
    process: &WorkerProcess,
    control: mpsc::Sender<ControlCommand>,
    fault: Arc<Fault>,
) {
    let stopping = shared.update(|state| {
        state.slots[index].live = Some(Live {
            id: process.id(),
            pid: process.pid(),
            peer: process.peer(),
            fault,
            group: process.group().clone(),
            exit: process.exit_watch(),
            load: Arc::new(Load),
            control,
            threads: ThreadView::default(),
            rss: None,
            usage: crate::usage::Usage::default(),
            idle_since: None,
            retire: None,
            placed: Default::default(),
        });
        state.stopping
    });
    if stopping {
        process.group().signal(Signal::SIGTERM);
    }
}

/// Relays the control leg until the worker exits, hangs, drops its control leg or is retired.
async fn supervise(
    shared: &Shared,
    index: usize,
    process: &WorkerProcess,
    control: ControlLeg,
    commands: &mut mpsc::Receiver<ControlCommand>,
    fault: &Fault,
) -> Ended {
    let id = process.id();
    let health = Health {
        interval: shared.cfg.health_interval,
        timeout: shared.cfg.health_timeout,
    };
    let mut observe = |seen: Observed| observe(shared, index, process, seen);
    let end = tokio::select! {
        report = process.exited() => Err(report),
        end = control.run(health, commands, &mut observe) => Ok(end),
        reason = fault.reported() => return faulted(process, reason).await,
        never = sample_usage(shared, index, process, health.interval) => match never {},
    };
    if shared.is_stopping() {
        // Draining: the worker drops its connections and exits; shutdown kills it after the grace.
        let report = process.exited().await;
        return Ended::crashed(id, "stopped".to_owned(), report.status);
    }
    let retiring = shared.lock().retiring(index);
    if let Some(reason) = retiring {
        return retired(process, reason, shared.cfg.stop_grace).await;
    }
    match end {
        Err(report) => Ended::crashed(
            id,
            format!("worker exited unexpectedly ({})", report.status),
            report.status,
        ),
        Ok(ControlEnd::Hung) => {
            warn!(timeout = ?health.timeout, "worker missed its health deadline; killing its process group");
            process.kill();
            let report = process.exited().await;
            Ended {
                id,
                reason: ExitReason::Hang,
                error: format!(
                    "worker hung: no health answer within {:?}; killed ({})",
                    health.timeout, report.status
                ),
                status: Some(report.status),
            }
        }
        Ok(ControlEnd::Lost(e)) => lost_control(process, health.timeout, &e.to_string()).await,
    }
}

/// Books what the control leg saw: lifecycle broadcasts and loaded lists update the load view (and
/// may retire the worker); everything is published.
fn observe(shared: &Shared, index: usize, process: &WorkerProcess, seen: Observed) {
    let id = process.id();
    match seen {
        Observed::Notification(notice) => {
            if let Some(event) = notice.event.as_ref().and_then(Lifecycle::of) {
                let verdict = shared.lock().on_lifecycle(index, id, event);
                act(verdict);
            }
            shared.publish(PoolEvent::Notification {
                worker: id,
                notice: Arc::new(notice),
            });
        }
        Observed::Loaded(threads) => {
            let rss = process::rss_bytes(process.pid());
            let verdict = shared.update(|state| {
                state.on_loaded(index, id, &threads, rss, &shared.cfg, Instant::now())
            });
            act(verdict);
            shared.publish(PoolEvent::Loaded {
                worker: id,
                threads,
            });
        }
    }
}

/// Samples what the worker's process group uses, every `every` (the health interval), one sample
/// after another. A sample may scan `/proc`, which takes milliseconds where there are many
/// processes, and waits for a scan another pool started (crate::usage): it runs on the blocking
/// pool, never on the threads that serve sessions.
async fn sample_usage(
    shared: &Shared,
    index: usize,
    process: &WorkerProcess,
    every: Duration,
) -> std::convert::Infallible {
    let (id, pgid) = (process.id(), process.pid());
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match crate::usage::sample(pgid).await {
            Ok(usage) => shared.update(|state| state.on_usage(index, id, usage)),
            Err(e) => warn!(error = %e, "sampling the worker's usage failed"),
        }
    }
}

fn act(verdict: Verdict) {
    match verdict {
        Verdict::Keep => {}
        Verdict::Terminate(group) => {
            info!("retiring worker: SIGTERM");
            group.signal(Signal::SIGTERM);
        }
    }
}

/// The router found the worker unusable (its socket path leads to another listener): it is killed
/// and replaced like a crashed one, counted as a `fault`.
async fn faulted(process: &WorkerProcess, reason: String) -> Ended {
    warn!(%reason, "worker fault reported; killing its process group");
    process.kill();
    let report = process.exited().await;
    Ended {
        id: process.id(),
        reason: ExitReason::Fault,
        error: format!("worker fault: {reason}; killed ({})", report.status),
        status: Some(report.status),
    }
}

/// A retired worker was sent SIGTERM: give it `grace` to drain and exit, then kill it.
async fn retired(process: &WorkerProcess, reason: ExitReason, grace: Duration) -> Ended {
    let id = process.id();
    let report = match timeout(grace, process.exited()).await {
        Ok(report) => report,
        Err(_elapsed) => {
            warn!(
                ?grace,
                "retired worker still running after the grace; killing its process group"
            );
            process.kill();
            process.exited().await
        }
    };
    Ended {
        id,
        reason,
        error: String::new(),
        status: Some(report.status),
    }
}

/// The control leg ended: normally because the process is exiting. Gives it `wait` to do so.
async fn lost_control(process: &WorkerProcess, wait: Duration, cause: &str) -> Ended {
    let id = process.id();
    match timeout(wait, process.exited()).await {
        Ok(report) => Ended::crashed(
            id,
            format!("worker exited unexpectedly ({})", report.status),
            report.status,
        ),
        Err(_elapsed) => {
            warn!(
                cause,
                "control leg lost but worker still running; killing its process group"
            );
            process.kill();
            let report = process.exited().await;
            Ended::crashed(
                id,
                format!("control leg lost ({cause}); killed ({})", report.status),
                report.status,
            )
        }
    }
}

/// Books the end of a worker and decides what comes next: `Some(retry_at)` to back off (or sit out a
/// quarantine) until then, `None` when the pool stops.
fn finish(
    shared: &Shared,
    index: usize,
    ended: Ended,
    restarts: &mut RestartTracker,
) -> Option<Instant> {
    let now = Instant::now();
    if ended.reason != ExitReason::StartFail {
        restarts.record_ready();
    }
    if matches!(ended.reason, ExitReason::Idle | ExitReason::Memory) {
        return Some(retire_done(shared, index, ended, now));
    }
    let mut reason = ended.reason;
    let mut threads = Vec::new();
    let next = shared.update(|state| {
        threads = state.end_live(index);
        state.publish_load();
        if state.stopping {
            reason = ExitReason::Stopped;
            shared.metrics.exited(shared.tenant, ExitReason::Stopped);
            state.enter(index, WorkerState::Stopped);
            return None;
        }
        shared.metrics.exited(shared.tenant, ended.reason);
        let (to, wait) = match restarts.record_failure(&shared.policy, now, rand::random::<f64>()) {
            RestartDecision::Backoff(wait) => (WorkerState::Backoff, wait),
            RestartDecision::Quarantine(wait) => (WorkerState::Quarantined, wait),
        };
        let slot = &mut state.slots[index];
        slot.last_error = Some(ended.error.clone());
        slot.retry_at = Some(now + wait);
        state.enter(index, to);
        Some((to, wait))
    });
    match next {
        Some((WorkerState::Quarantined, wait)) => {
            warn!(worker = %ended.id, error = %ended.error, ?wait, "worker slot quarantined after repeated failures");
        }
        Some((_, wait)) => {
            warn!(worker = %ended.id, reason = ended.reason.as_str(), error = %ended.error, ?wait, "worker failed; restarting after backoff");
        }
        None => info!(worker = %ended.id, "worker stopped"),
    }
    if let Some(status) = ended.status {
        shared.publish(PoolEvent::WorkerExited {
            worker: ended.id,
            status,
            reason,
            threads: Arc::new(threads),
        });
    }
    next.map(|(_, wait)| now + wait)
}

/// Books a retired worker: not a failure, no restart unless the slot is still wanted.
fn retire_done(shared: &Shared, index: usize, ended: Ended, now: Instant) -> Instant {
    let mut threads = Vec::new();
    shared.update(|state| {
        threads = state.end_live(index);
        state.slots[index].requested = false;
        state.publish_load();
        shared.metrics.exited(shared.tenant, ended.reason);
        state.enter(index, WorkerState::Stopped);
    });
    info!(worker = %ended.id, reason = ended.reason.as_str(), "worker retired");
    if let Some(status) = ended.status {
        shared.publish(PoolEvent::WorkerExited {
            worker: ended.id,
            status,
            reason: ended.reason,
            threads: Arc::new(threads),
        });
    }
    now
}

// === impl Ended ===

impl Ended {
    fn start_failed(id: WorkerId, error: &StartError, status: Option<String>) -> Self {
        Self {
            id,
            reason: ExitReason::StartFail,
            error: error.to_string(),
            status,
        }
    }

    fn crashed(id: WorkerId, error: String, status: String) -> Self {
        Self {
            id,
            reason: ExitReason::Crash,
            error,
            status: Some(status),
        }
    }
}
