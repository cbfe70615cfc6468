//! The `kubernetes` backend's metrics (names fixed by the chart's alerts and dashboard): tenant
//! pods by phase, starts and their failures, culls, upgrades, recreations and pod requests.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Pod phases, each a series of `codex_fleet_tenant_pods` from the start.
pub const PHASES: [&str; 5] = ["Pending", "Running", "Succeeded", "Failed", "Unknown"];

/// Why a node did not start: `timeout`; `failed` (the pod failed before ready); `api` (a
/// transient API error, retried); `forbidden` (403: quota or PodSecurity admission) and
/// `invalid` (400/404/422: a spec the API server refuses), which end the start at once.
/// `image`: the pod's image cannot be pulled (ImagePullBackOff, InvalidImageName).
pub const START_FAILURES: [&str; 6] = ["timeout", "failed", "api", "forbidden", "invalid", "image"];

/// Why a tenant's previous pod ended, when a new one is created for it: `stuck` (Pending past
/// the start timeout, deleted by an edge) and `image` (its image could not be pulled, deleted
/// by an edge) besides what ends a pod by itself.
/// `outdated`: a pod of an older template deleted past `max_pod_age_secs`; `upgraded`: one
/// deleted at an idle moment of its node; `lost`: a pod left Terminating past its grace period
/// (no kubelet confirms it: its machine is lost), force-deleted by an edge.
pub const RECREATIONS: [&str; 9] = [
    "idle", "evicted", "failed", "deleted", "stuck", "image", "outdated", "upgraded", "lost",
];

/// The backend's metrics (names fixed by the chart's alerts and dashboard).
#[derive(Clone)]
pub struct KubeMetrics {
    pub(super) pods: IntGaugeVec,
    pub(super) unschedulable: IntGauge,
    pub(super) starting: IntGauge,
    pub(super) start_seconds: Histogram,
    pub(super) start_failures: IntCounterVec,
    pub(super) culls: IntCounter,
    pub(super) upgrades: IntCounter,
    pub(super) recreations: IntCounterVec,
    pub(super) requests: GaugeVec,
}

impl KubeMetrics {
    pub(super) fn register(registry: &Registry) -> Result<KubeMetrics, prometheus::Error> {
        let m = KubeMetrics {
            pods: IntGaugeVec::new(
                Opts::new(
                    "codex_fleet_tenant_pods",
                    "Tenant pods this edge sees, by phase (every edge sees every pod: aggregate with max).",
                ),
                &["phase"],
            )?,
            unschedulable: IntGauge::new(
                "codex_fleet_tenant_pods_unschedulable",
                "Tenant pods the scheduler cannot place (PodScheduled=False, Unschedulable).",
            )?,
            starting: IntGauge::new(
                "codex_fleet_tenant_pods_starting",
                "Tenant pods created and not yet ready.",
            )?,
            start_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "codex_fleet_node_start_seconds",
                    "Tenant pod creation to ready, as seen by the edge that created it.",
                )
                .buckets(vec![
                    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                ]),
            )?,
            start_failures: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_node_start_failures_total",
                    "Tenant nodes that did not start: timeout (per session refused), failed (pod Failed before ready) and image (it cannot pull its image), per pod; api (transient API errors, retried), forbidden and invalid (refused by the API server, not retried), per create an edge sent.",
                ),
                &["reason"],
            )?,
            culls: IntCounter::new(
                "codex_fleet_tenant_pod_culls_total",
                "Completed (idle-exited) tenant pods this edge deleted.",
            )?,
            upgrades: IntCounter::new(
                "codex_fleet_tenant_pod_upgrades_total",
                "Tenant pods of an older template this edge deleted at an idle moment of their node (no session, running turn or loaded thread), so the next session gets the current template.",
            )?,
            recreations: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_tenant_pod_recreations_total",
                    "Pods created for a tenant whose previous pod ended, by why it ended.",
                ),
                &["reason"],
            )?,
            requests: GaugeVec::new(
                Opts::new(
                    "codex_fleet_tenant_pod_requests",
                    "A tenant pod's resource requests: cpu in cores, memory in bytes.",
                ),
                &["tenant", "resource"],
            )?,
        };
        registry.register(Box::new(m.pods.clone()))?;
        registry.register(Box::new(m.unschedulable.clone()))?;
        registry.register(Box::new(m.starting.clone()))?;
        registry.register(Box::new(m.start_seconds.clone()))?;
        registry.register(Box::new(m.start_failures.clone()))?;
        registry.register(Box::new(m.culls.clone()))?;
        registry.register(Box::new(m.upgrades.clone()))?;
        registry.register(Box::new(m.recreations.clone()))?;
        registry.register(Box::new(m.requests.clone()))?;
        for p in PHASES {
            m.pods.with_label_values(&[p]);
        }
        for r in START_FAILURES {
            m.start_failures.with_label_values(&[r]);
        }
        for r in RECREATIONS {
            m.recreations.with_label_values(&[r]);
        }
        Ok(m)
    }
}
