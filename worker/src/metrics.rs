//! Prometheus metrics of the worker supervisor, registered on an explicit registry.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};
use tokio::time::Duration;

use crate::lifecycle::WorkerState;

const STARTS_TOTAL: &str = "codex_fleet_worker_starts_total";
const EXITS_TOTAL: &str = "codex_fleet_worker_exits_total";
const RESTARTS_TOTAL: &str = "codex_fleet_worker_restarts_total";
const WORKERS: &str = "codex_fleet_workers";
const START_SECONDS: &str = "codex_fleet_worker_start_seconds";
const ACTIVE_TURNS: &str = "codex_fleet_worker_active_turns";
const LOADED_THREADS: &str = "codex_fleet_worker_loaded_threads";
const RESIDENT_BYTES: &str = "codex_fleet_worker_resident_bytes";
const LARGEST_RSS_BYTES: &str = "codex_fleet_worker_largest_rss_bytes";
const CPU_SECONDS: &str = "codex_fleet_worker_cpu_seconds_total";
const LOG_LINES_DROPPED: &str = "codex_fleet_worker_log_lines_dropped_total";

const LABEL_TENANT: &str = "tenant";
const LABEL_REASON: &str = "reason";
const LABEL_STATE: &str = "state";

const START_BUCKETS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Why a worker process ended; the `reason` label of `codex_fleet_worker_exits_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitReason {
    /// It exited (or lost its control leg) while it was expected to run.
    Crash,
    /// It missed a health deadline and was killed.
    Hang,
    /// It was stopped on purpose (shutdown).
    Stopped,
    /// It never became ready.
    StartFail,
    /// It was idle for `worker_idle` and was drained.
    Idle,
    /// Its memory went above `max_worker_rss` and it was drained.
    Memory,
    /// Its socket led to another listener (the peer check failed); it was killed and replaced.
    Fault,
}

impl ExitReason {
    /// Every reason, so a tenant's series exist (at zero) before the first exit.
    pub const ALL: [ExitReason; 7] = [
        ExitReason::Crash,
        ExitReason::Hang,
        ExitReason::Stopped,
        ExitReason::StartFail,
        ExitReason::Idle,
        ExitReason::Memory,
        ExitReason::Fault,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ExitReason::Crash => "crash",
            ExitReason::Hang => "hang",
            ExitReason::Stopped => "stopped",
            ExitReason::StartFail => "startfail",
            ExitReason::Idle => "idle",
            ExitReason::Memory => "memory",
            ExitReason::Fault => "fault",
        }
    }
}

/// Metrics of every worker pool; cheap to clone, labelled by configured tenant id.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    starts: IntCounterVec,
    exits: IntCounterVec,
    restarts: IntCounterVec,
    workers: IntGaugeVec,
    start_seconds: HistogramVec,
    active_turns: IntGaugeVec,
    loaded_threads: IntGaugeVec,
    resident: IntGaugeVec,
    largest_rss: IntGaugeVec,
    cpu: prometheus::CounterVec,
    log_lines_dropped: IntCounterVec,
}

/// A tenant's load and memory gauges, looked up by label once. A pool sets them on every
/// lifecycle event its workers broadcast (several a turn, each on the tenant's lock), and each
/// lookup by label hashed and compared the tenant's id under the vector's lock (BENCHMARKS.md,
/// "The 1.7× behind the floor", "Kept: a pool's load gauges looked up once").
#[derive(Debug, Clone)]
pub(crate) struct LoadGauges {
    active_turns: IntGauge,
    loaded_threads: IntGauge,
    resident: IntGauge,
    largest_rss: IntGauge,
}

impl LoadGauges {
    /// Sets the tenant's load totals (summed over its workers, to keep labels bounded).
    pub(crate) fn load(&self, active_turns: usize, loaded_threads: usize) {
        self.active_turns.set(gauge(active_turns));
        self.loaded_threads.set(gauge(loaded_threads));
    }

    /// Sets the tenant's memory totals: all its workers' process groups, and its largest worker.
    pub(crate) fn resources(&self, resident: u64, largest: u64) {
        self.resident.set(gauge(resident));
        self.largest_rss.set(gauge(largest));
    }
}

/// A count as a gauge's value, saturating.
fn gauge(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

// === impl WorkerMetrics ===

impl WorkerMetrics {
    /// Creates the metrics and registers them on `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let starts = IntCounterVec::new(
            Opts::new(STARTS_TOTAL, "Worker processes spawned."),
            &[LABEL_TENANT],
        )?;
        let exits = IntCounterVec::new(
            Opts::new(EXITS_TOTAL, "Worker processes that ended, by reason."),
            &[LABEL_TENANT, LABEL_REASON],
        )?;
        let restarts = IntCounterVec::new(
            Opts::new(
                RESTARTS_TOTAL,
                "Worker processes started in a slot that had run one before.",
            ),
            &[LABEL_TENANT],
        )?;
        let workers = IntGaugeVec::new(
            Opts::new(WORKERS, "Worker slots by state."),
            &[LABEL_TENANT, LABEL_STATE],
        )?;
        let start_seconds = HistogramVec::new(
            HistogramOpts::new(
                START_SECONDS,
                "Time from spawn to the initialize answer on the control leg.",
            )
            .buckets(START_BUCKETS.to_vec()),
            &[LABEL_TENANT],
        )?;
        let active_turns = IntGaugeVec::new(
            Opts::new(
                ACTIVE_TURNS,
                "Active threads (running a turn or waiting on an approval) on a tenant's workers.",
            ),
            &[LABEL_TENANT],
        )?;
        let loaded_threads = IntGaugeVec::new(
            Opts::new(LOADED_THREADS, "Threads loaded on a tenant's workers."),
            &[LABEL_TENANT],
        )?;
        let resident = IntGaugeVec::new(
            Opts::new(
                RESIDENT_BYTES,
                "Resident memory of a tenant's workers' process groups (app-servers and the \
                 commands they run), at the last health pings.",
            ),
            &[LABEL_TENANT],
        )?;
        let largest_rss = IntGaugeVec::new(
            Opts::new(
                LARGEST_RSS_BYTES,
                "Resident memory of a tenant's largest worker process: what the memory guard \
                 (workers.max_worker_rss_bytes) compares.",
            ),
            &[LABEL_TENANT],
        )?;
        let cpu = prometheus::CounterVec::new(
            Opts::new(
                CPU_SECONDS,
                "CPU time used by a tenant's workers' process groups, sampled at health pings.",
            ),
            &[LABEL_TENANT],
        )?;
        let log_lines_dropped = IntCounterVec::new(
            Opts::new(
                LOG_LINES_DROPPED,
                "stderr lines of a tenant's workers over the log budget: read, not logged.",
            ),
            &[LABEL_TENANT],
        )?;
        registry.register(Box::new(log_lines_dropped.clone()))?;
        registry.register(Box::new(resident.clone()))?;
        registry.register(Box::new(largest_rss.clone()))?;
        registry.register(Box::new(cpu.clone()))?;
        registry.register(Box::new(starts.clone()))?;
        registry.register(Box::new(exits.clone()))?;
        registry.register(Box::new(restarts.clone()))?;
        registry.register(Box::new(workers.clone()))?;
        registry.register(Box::new(start_seconds.clone()))?;
        registry.register(Box::new(active_turns.clone()))?;
        registry.register(Box::new(loaded_threads.clone()))?;
        Ok(Self {
            starts,
            exits,
            restarts,
            workers,
            start_seconds,
            active_turns,
            loaded_threads,
            resident,
            largest_rss,
            cpu,
            log_lines_dropped,
        })
    }

    /// Creates every series of `tenant` whose labels are known (starts, restarts, exits by every
    /// reason), at zero, so dashboards and alerts see 0 rather than no data before the first event.
    pub fn init_tenant(&self, tenant: &str) {
        self.starts.with_label_values(&[tenant]);
        self.restarts.with_label_values(&[tenant]);
        self.resident.with_label_values(&[tenant]);
        self.largest_rss.with_label_values(&[tenant]);
        self.cpu.with_label_values(&[tenant]);
        self.log_lines_dropped.with_label_values(&[tenant]);
        for state in WorkerState::ALL {
            self.workers.with_label_values(&[tenant, state.as_str()]);
        }
        for reason in ExitReason::ALL {
            self.exits.with_label_values(&[tenant, reason.as_str()]);
        }
    }

    /// The tenant's count of worker stderr lines left out of the log, for a worker's forwarder.
    pub(crate) fn log_lines_dropped(&self, tenant: &str) -> prometheus::IntCounter {
        self.log_lines_dropped.with_label_values(&[tenant])
    }

    pub(crate) fn started(&self, tenant: &str) {
        self.starts.with_label_values(&[tenant]).inc();
    }

    pub(crate) fn restarted(&self, tenant: &str) {
        self.restarts.with_label_values(&[tenant]).inc();
    }

    pub(crate) fn exited(&self, tenant: &str, reason: ExitReason) {
        self.exits
            .with_label_values(&[tenant, reason.as_str()])
            .inc();
    }

    pub(crate) fn ready_after(&self, tenant: &str, elapsed: Duration) {
        self.start_seconds
            .with_label_values(&[tenant])
            .observe(elapsed.as_secs_f64());
    }

    /// `tenant`'s load and memory gauges, looked up once for a pool to set as often as it
    /// likes.
    pub(crate) fn load_gauges(&self, tenant: &str) -> LoadGauges {
        LoadGauges {
            active_turns: self.active_turns.with_label_values(&[tenant]),
            loaded_threads: self.loaded_threads.with_label_values(&[tenant]),
            resident: self.resident.with_label_values(&[tenant]),
            largest_rss: self.largest_rss.with_label_values(&[tenant]),
        }
    }

    /// Adds CPU time a tenant's workers used.
    pub(crate) fn cpu_spent(&self, tenant: &str, secs: f64) {
        self.cpu.with_label_values(&[tenant]).inc_by(secs);
    }

    /// Moves one slot between states in the `codex_fleet_workers` gauge.
    pub(crate) fn transition(
        &self,
        tenant: &str,
        from: Option<WorkerState>,
        to: Option<WorkerState>,
    ) {
        if let Some(from) = from {
            self.workers
                .with_label_values(&[tenant, from.as_str()])
                .dec();
        }
        if let Some(to) = to {
            self.workers.with_label_values(&[tenant, to.as_str()]).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `name`'s series labelled `tenant` in `registry`.
    fn value(registry: &Registry, name: &str, tenant: &str) -> Option<i64> {
        registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .find(|m| m.get_label().iter().any(|l| l.value() == tenant))
            .map(|m| m.get_gauge().get_value() as i64)
    }

    #[test]
    fn a_pools_gauges_set_its_own_tenants_series_and_no_other() {
        let registry = Registry::new();
        let metrics = WorkerMetrics::register(&registry).unwrap();
        let acme = metrics.load_gauges("acme");
        let globex = metrics.load_gauges("globex");
        acme.load(3, 7);
        acme.resources(1 << 20, 1 << 19);
        globex.load(1, 2);
        for (name, want_acme, want_globex) in [
            (ACTIVE_TURNS, 3, 1),
            (LOADED_THREADS, 7, 2),
            (RESIDENT_BYTES, 1 << 20, 0),
            (LARGEST_RSS_BYTES, 1 << 19, 0),
        ] {
            assert_eq!(value(&registry, name, "acme"), Some(want_acme), "{name}");
            assert_eq!(
                value(&registry, name, "globex"),
                Some(want_globex),
                "{name}"
            );
        }
        // Counts beyond a gauge's range saturate rather than wrap.
        acme.resources(u64::MAX, 0);
        assert_eq!(value(&registry, RESIDENT_BYTES, "acme"), Some(i64::MAX));
    }
}
