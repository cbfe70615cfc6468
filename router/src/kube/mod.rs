//! The `kubernetes` nodes backend (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md): each
//! tenant's node is a pod of its own, with a volume of its own, created by the edge when the tenant
//! first connects.
//!
//! Names are derived from the tenant id ([`spec::Names`]), so the API server's name uniqueness
//! is what guarantees a tenant at most one node: two edges racing both create the same pod, and
//! the loser's `409 AlreadyExists` is success. One watch (list, then watch from its
//! `resourceVersion`, relisted on `410 Gone`, backed off on errors) keeps this edge's view of
//! every tenant pod; a session waits on that view until its tenant's pod is ready (bounded by
//! `start_timeout_secs`). Pods that end (the node's idle exit, eviction, deletion) are seen
//! there; completed ones are deleted by whichever edge sees them first (uid precondition, so
//! never a newer pod), and the next session creates a new one on the same volume. Edges share
//! nothing but the API server.

pub mod idle;
pub mod node;
pub mod quantity;
pub mod spec;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use ::kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use ::kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use ::kube::runtime::watcher::{self, Event};
use ::kube::runtime::WatchStreamExt;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim, Pod};
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};
use serde_json::json;
use tokio::time::Instant;

use crate::config::Tenant;
use crate::edge::config::KubernetesNodes;
use spec::{Names, Template, TENANT_LABEL};

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
/// Container waiting reasons that no wait will mend: the pod is deleted (and a waiting session
/// told why), so a fixed image in the values reaches the tenant's next pod.
const PULL_FAILURES: [&str; 3] = ["ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"];
/// How long a waiting session sleeps between looks when the watch says nothing (a missed
/// event, an API error being retried).
const RECHECK: Duration = Duration::from_millis(500);
/// Back-off between creates failed by a transient API error while a session waits: doubling
/// from the first to the most, each with up to half again of random jitter, so the edges
/// refused together do not return together.
const CREATE_BACKOFF_FIRST: Duration = Duration::from_millis(250);
const CREATE_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often pods of an older template are looked for (`max_pod_age_secs`).
const SWEEP: Duration = Duration::from_secs(1);
/// How long past its grace period a pod may stay Terminating before an edge force-deletes it:
/// a kubelet removes a pod within seconds of killing it; one that does not is out of reach
/// (its machine lost) and would keep the tenant's pod name taken for good.
const FORCE_DELETE_AFTER: Duration = Duration::from_secs(10);
/// How often, at most, an edge asks the node of a pod of an older template whether it is idle,
/// and how long it waits for the answer.
const UPGRADE_LOOK: Duration = Duration::from_secs(2);
const UPGRADE_ASK: Duration = Duration::from_secs(2);
/// How long the readiness probe waits for the API server.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest cause a refused client is told (the API server's message, bounded).
const CAUSE_MAX: usize = 300;

/// Where a tenant's node is, for the link.
#[derive(Debug, Clone)]
pub struct PodTarget {
    /// The pod's name.
    pub pod: String,
    /// `podIP:link_port`.
    pub addr: SocketAddr,
}

/// Why no pod could be offered.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The pod was not ready within `start_timeout_secs`.
    #[error("the tenant's node is still starting after {0:?}")]
    Timeout(Duration),
    /// The API server refused the tenant's volume or pod for a reason retrying cannot change
    /// (a full quota, PodSecurity admission, an invalid spec).
    #[error("the tenant's node cannot start ({reason}): {cause}")]
    Refused {
        /// `forbidden` or `invalid` (a series of `codex_fleet_node_start_failures_total`).
        reason: &'static str,
        /// What the API server said, bounded and without control characters.
        cause: String,
    },
}

/// What a failed API request means for a waiting session.
#[derive(Debug, PartialEq, Eq)]
enum Failure {
    /// Retrying may succeed (5xx, 429, 401, a connection error, a timeout).
    Transient,
    /// It will not (`forbidden`: 403; `invalid`: 400, 404, 422), with its cause.
    Permanent(&'static str, String),
}

/// Sorts an API error: what a retry can change and what it cannot.
fn classify(e: &::kube::Error) -> Failure {
    match e {
        ::kube::Error::Api(s) => {
            let reason = match s.code {
                403 => "forbidden",
                400 | 404 | 422 => "invalid",
                _ => return Failure::Transient,
            };
            Failure::Permanent(reason, cause(&format!("{} {}", s.code, s.message)))
        }
        // Connection errors, timeouts, an answer that did not parse: another try may do.
        _ => Failure::Transient,
    }
}

/// Why a tenant's volume or pod was not created.
#[derive(Debug, thiserror::Error)]
enum CreateError {
    /// The API server's answer, or no answer.
    #[error("{0}")]
    Api(#[from] ::kube::Error),
    /// The spec could not be built from the template (our side: no retry mends it).
    #[error("the tenant's pod spec: {0:#}")]
    Spec(anyhow::Error),
    /// No answer within the session's deadline.
    #[error("no answer from the API server before the start timeout")]
    Timeout,
}

impl CreateError {
    fn failure(&self) -> Failure {
        match self {
            CreateError::Api(e) => classify(e),
            CreateError::Spec(e) => Failure::Permanent("invalid", cause(&format!("{e:#}"))),
            CreateError::Timeout => Failure::Transient,
        }
    }
}

/// An API server's message as a client may read it: control characters as spaces, at most
/// [`CAUSE_MAX`] bytes (cut on a character boundary, marked).
fn cause(message: &str) -> String {
    let clean: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.len() <= CAUSE_MAX {
        return clean;
    }
    let mut end = CAUSE_MAX;
    while !clean.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &clean[..end])
}

/// The next back-off after `prev` (none yet: the first), with its jitter.
fn create_backoff(prev: Option<Duration>) -> (Duration, Duration) {
    use rand::Rng;
    let base = prev.map_or(CREATE_BACKOFF_FIRST, |p| (p * 2).min(CREATE_BACKOFF_MAX));
    let jitter_ms = rand::rng().random_range(0..=base.as_millis() as u64 / 2);
    (base, base + Duration::from_millis(jitter_ms))
}

/// The backend's metrics (names fixed by the chart's alerts and dashboard).
#[derive(Clone)]
pub struct KubeMetrics {
    pods: IntGaugeVec,
    unschedulable: IntGauge,
    starting: IntGauge,
    start_seconds: Histogram,
    start_failures: IntCounterVec,
    culls: IntCounter,
    upgrades: IntCounter,
    recreations: IntCounterVec,
    requests: GaugeVec,
}

impl KubeMetrics {
    fn register(registry: &Registry) -> Result<KubeMetrics, prometheus::Error> {
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
                    "Tenant nodes that did not start: timeout, failed (pod Failed before ready), api (transient API errors, retried), forbidden and invalid (refused by the API server, not retried).",
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

/// What this edge knows of one tenant pod, from the watch.
#[derive(Debug, Clone)]
struct PodView {
    uid: String,
    phase: String,
    ready: bool,
    ip: Option<IpAddr>,
    deleting: bool,
    unschedulable: bool,
    evicted: bool,
    /// Its image cannot be pulled: the kubelet's reason and message.
    pull_failure: Option<String>,
    /// Its `codex-fleet.io/template-hash` label.
    template_hash: Option<String>,
    /// Its `deletionGracePeriodSeconds`, while it is Terminating.
    deletion_grace: Option<u64>,
}

impl PodView {
    fn of(pod: &Pod) -> PodView {
        let status = pod.status.as_ref();
        let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or(&[]);
        let condition = |t: &str| conditions.iter().find(|c| c.type_ == t);
        PodView {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            phase: status
                .and_then(|s| s.phase.clone())
                .unwrap_or_else(|| "Pending".into()),
            ready: condition("Ready").is_some_and(|c| c.status == "True"),
            ip: status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse().ok()),
            deleting: pod.metadata.deletion_timestamp.is_some(),
            deletion_grace: pod
                .metadata
                .deletion_grace_period_seconds
                .and_then(|g| u64::try_from(g).ok()),
            unschedulable: condition("PodScheduled").is_some_and(|c| {
                c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
            }),
            evicted: status.and_then(|s| s.reason.as_deref()) == Some("Evicted"),
            template_hash: pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(spec::TEMPLATE_HASH_LABEL))
                .cloned(),
            pull_failure: status
                .and_then(|s| s.container_statuses.as_deref())
                .unwrap_or(&[])
                .iter()
                .filter_map(|c| c.state.as_ref()?.waiting.as_ref())
                .find(|w| {
                    w.reason
                        .as_deref()
                        .is_some_and(|r| PULL_FAILURES.contains(&r))
                })
                .map(|w| {
                    format!(
                        "{}: {}",
                        w.reason.as_deref().unwrap_or(""),
                        w.message.as_deref().unwrap_or("")
                    )
                }),
        }
    }

    fn ended(&self) -> bool {
        self.phase == "Succeeded" || self.phase == "Failed"
    }

    /// Why a pod in this state went away, for the recreation counter.
    fn end_reason(&self) -> &'static str {
        match self.phase.as_str() {
            "Succeeded" => "idle",
            "Failed" if self.evicted => "evicted",
            "Failed" => "failed",
            _ => "deleted",
        }
    }
}

#[derive(Default)]
struct State {
    /// Tenant → its pod, as the watch last said.
    pods: HashMap<String, PodView>,
    /// Pods listed since the watch (re)started, replacing `pods` when the list is complete.
    relist: Option<HashMap<String, PodView>>,
    /// Tenants whose pod this edge created and has not seen ready: since when.
    created: HashMap<String, Instant>,
    /// Why each tenant's last pod went away (taken by the next creation).
    ended: HashMap<String, &'static str>,
    /// Pods (uid) this edge is deleting.
    deleting: HashSet<String>,
    /// Pods (uid) this edge deletes to replace them, and why (for the recreation counter).
    replacing: HashMap<String, &'static str>,
    /// When this edge first saw each pod (uid): a pod Pending longer than the start timeout is
    /// stuck.
    first_seen: HashMap<String, Instant>,
    /// When this edge first saw each pod (uid) Terminating (its own clock: no skew with the API
    /// server's `deletionTimestamp`).
    terminating_since: HashMap<String, Instant>,
    /// Pods (uid) of an older template: when this edge last asked their node whether it is
    /// idle (an entry without a time: asking now).
    upgrade_asked: HashMap<String, Option<Instant>>,
}

/// The backend.
pub struct KubeNodes {
    pods: Api<Pod>,
    pvcs: Api<PersistentVolumeClaim>,
    settings: KubernetesNodes,
    namespace: String,
    api_url: String,
    template: Template,
    /// The tenant pods' admin port (the template's readiness probe's): where an edge asks a
    /// node whether it is idle.
    admin_port: Option<u16>,
    tenants: RwLock<HashMap<String, Tenant>>,
    /// Each tenant's current template hash (what its next pod is made from).
    hashes: RwLock<HashMap<String, String>>,
    state: Mutex<State>,
    changes: tokio::sync::watch::Sender<u64>,
    /// The watch has listed every tenant pod and follows them (false again after `410 Gone`
    /// until it has listed anew).
    synced: AtomicBool,
    /// The watch has listed every tenant pod at least once: the view can serve tenants.
    listed_once: AtomicBool,
    /// The last look at the API server (the prober's) got an answer.
    reachable: AtomicBool,
    last_error: Mutex<Option<String>>,
    metrics: KubeMetrics,
    /// Writes Kubernetes Events about tenant pods (`kubectl describe pod` shows them).
    events: Recorder,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl KubeNodes {
    /// Connects to the API server (`api_url`, else in-cluster) and registers the metrics; the
    /// watch starts with [`KubeNodes::spawn_watch`].
    pub fn build(
        k: &KubernetesNodes,
        tenants: &[Tenant],
        registry: &Registry,
    ) -> anyhow::Result<Arc<KubeNodes>> {
        let template = Template::load(&k.pod_template)?;
        let mut kcfg = match &k.api_url {
            Some(url) => ::kube::Config::new(
                url.parse()
                    .map_err(|e| anyhow::anyhow!("nodes.kubernetes.api_url {url:?}: {e}"))?,
            ),
            None => ::kube::Config::incluster().map_err(|e| {
                anyhow::anyhow!("no nodes.kubernetes.api_url and not in a cluster: {e}")
            })?,
        };
        // kube's own retry of 429/503/504 (up to 15 times, delays growing to minutes) would hold
        // a session's create, and the readiness probe, far past the start timeout while the API
        // server is down: the backend retries itself, within the session's deadline.
        kcfg.default_retry = false;
        let namespace = spec::namespace(k).unwrap_or_else(|| kcfg.default_namespace.clone());
        kcfg.default_namespace = namespace.clone();
        let api_url = kcfg.cluster_url.to_string();
        // kube builds its TLS client with the process-wide provider: ring, as everywhere here.
        crate::tls::install_crypto_provider();
        let client = ::kube::Client::try_from(kcfg)?;
        let metrics = KubeMetrics::register(registry)?;
        let (changes, _) = tokio::sync::watch::channel(0);
        let events = Recorder::new(
            client.clone(),
            Reporter {
                controller: "codex-fleet-edge".into(),
                // The edge's pod name (the hostname in a pod), else kube's own default.
                instance: std::env::var("HOSTNAME").ok(),
            },
        );
        let nodes = KubeNodes {
            pods: Api::namespaced(client.clone(), &namespace),
            pvcs: Api::namespaced(client, &namespace),
            events,
            settings: k.clone(),
            namespace,
            api_url,
            admin_port: template.admin_port(),
            template,
            tenants: RwLock::new(HashMap::new()),
            hashes: RwLock::new(HashMap::new()),
            state: Mutex::new(State::default()),
            changes,
            synced: AtomicBool::new(false),
            listed_once: AtomicBool::new(false),
            reachable: AtomicBool::new(true),
            last_error: Mutex::new(None),
            metrics,
        };
        nodes.reload(tenants)?;
        Ok(Arc::new(nodes))
    }

    /// Puts a configuration's tenants in force (their pod specs and requests gauges).
    pub fn reload(&self, configured: &[Tenant]) -> anyhow::Result<()> {
        let mut tenants = HashMap::new();
        let mut hashes = HashMap::new();
        for t in configured {
            let pod = spec::tenant_pod(&self.template, &self.settings, &self.namespace, t)?;
            if let Some(h) = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(spec::TEMPLATE_HASH_LABEL))
            {
                hashes.insert(t.id.clone(), h.clone());
            }
            for (resource, v) in spec::requests(&pod) {
                self.metrics
                    .requests
                    .with_label_values(&[&t.id, resource])
                    .set(v);
            }
            tenants.insert(t.id.clone(), t.clone());
        }
        *self.hashes.write().unwrap_or_else(PoisonError::into_inner) = hashes;
        let old = std::mem::replace(
            &mut *self.tenants.write().unwrap_or_else(PoisonError::into_inner),
            tenants,
        );
        let current = self.tenants.read().unwrap_or_else(PoisonError::into_inner);
        for id in old.keys().filter(|id| !current.contains_key(*id)) {
            for resource in ["cpu", "memory"] {
                let _gone = self.metrics.requests.remove_label_values(&[id, resource]);
            }
        }
        Ok(())
    }

    /// The pod name of `tenant`.
    pub fn pod_name(&self, tenant: &str) -> String {
        Names::of(&self.settings.name_prefix, tenant).pod
    }

    /// The name every tenant node's certificate carries.
    pub fn server_name(&self) -> &str {
        &self.settings.server_name
    }

    /// Whether `tenant` is one this edge serves.
    pub fn knows(&self, tenant: &str) -> bool {
        self.tenants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(tenant)
    }

    /// How long a refused session should wait before trying again.
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(2)
    }

    /// The tenant's node: its ready pod, created (volume first) when there is none, waited
    /// for up to `start_timeout_secs`.
    pub async fn locate(&self, tenant: &str) -> Result<PodTarget, StartError> {
        let timeout = Duration::from_secs(self.settings.start_timeout_secs);
        let deadline = Instant::now() + timeout;
        let mut changes = self.changes.subscribe();
        let mut created_here = false;
        let mut backoff: Option<Duration> = None;
        loop {
            let (view, shared, replacing) = {
                let s = lock(&self.state);
                let view = s.pods.get(tenant).cloned();
                let replacing = view
                    .as_ref()
                    .is_some_and(|v| s.replacing.contains_key(&v.uid));
                // Another tenant's live pod at the same address: never dial it for this one.
                let shared = view.as_ref().and_then(|v| v.ip).is_some_and(|ip| {
                    s.pods
                        .iter()
                        .any(|(t, o)| t != tenant && !o.ended() && o.ip == Some(ip))
                });
                (view, shared, replacing)
            };
            match view {
                Some(v) if shared => {
                    tracing::error!(tenant, ip = ?v.ip, "the tenant's pod reports another tenant's pod address; not dialling it");
                }
                Some(v) if v.ready && v.phase == "Running" && !v.deleting && !replacing => {
                    if let Some(ip) = v.ip {
                        return Ok(PodTarget {
                            pod: self.pod_name(tenant),
                            addr: SocketAddr::new(ip, self.settings.link_port),
                        });
                    }
                }
                Some(v) if v.ended() && !v.deleting => self.delete_ended(tenant, &v).await,
                Some(v) if v.pull_failure.is_some() && !v.deleting => {
                    let cause = cause(v.pull_failure.as_deref().unwrap_or(""));
                    self.metrics
                        .start_failures
                        .with_label_values(&["image"])
                        .inc();
                    tracing::warn!(tenant, %cause, "the tenant's pod cannot pull its image; deleting it");
                    self.note_error(format!("image: {cause}"));
                    self.event(tenant, Some(&v.uid), true, "ImagePullFailed", cause.clone());
                    self.replace(tenant, &v, "image").await;
                    return Err(StartError::Refused {
                        reason: "image",
                        cause,
                    });
                }
                Some(v) if self.stuck(&v) => {
                    tracing::warn!(tenant, pod = %self.pod_name(tenant), ?timeout, "the tenant's pod is Pending past the start timeout; replacing it");
                    self.replace(tenant, &v, "stuck").await;
                }
                Some(v) if self.stranded(&v) => {
                    tracing::warn!(tenant, pod = %self.pod_name(tenant), "the tenant's pod is still Terminating past its grace period (no kubelet confirms it: its machine is lost); force-deleting it");
                    self.force_delete(tenant, &v).await;
                }
                Some(_) => {} // starting, or going away: the watch will tell
                None => match tokio::time::timeout(
                    deadline.saturating_duration_since(Instant::now()),
                    self.create(tenant),
                )
                .await
                .unwrap_or(Err(CreateError::Timeout))
                {
                    Ok(()) => created_here = true,
                    Err(e) => match e.failure() {
                        Failure::Permanent(reason, cause) => {
                            self.metrics
                                .start_failures
                                .with_label_values(&[reason])
                                .inc();
                            tracing::warn!(tenant, reason, error = %e, "the API server refused the tenant's node; not retrying");
                            self.note_error(format!("create: {}", chain(&e)));
                            let action = if reason == "forbidden" {
                                "CreateForbidden"
                            } else {
                                "CreateInvalid"
                            };
                            self.event_of(
                                tenant,
                                None,
                                true,
                                "FailedCreate",
                                action,
                                cause.clone(),
                            );
                            return Err(StartError::Refused { reason, cause });
                        }
                        Failure::Transient => {
                            self.metrics
                                .start_failures
                                .with_label_values(&["api"])
                                .inc();
                            let (base, sleep) = create_backoff(backoff);
                            backoff = Some(base);
                            tracing::warn!(tenant, error = %e, retry_in = ?sleep, "cannot create the tenant's pod; retrying");
                            self.note_error(format!("create: {}", chain(&e)));
                            let left = deadline.saturating_duration_since(Instant::now());
                            tokio::time::sleep(sleep.min(left)).await;
                        }
                    },
                },
            }
            let now = Instant::now();
            if now >= deadline {
                self.metrics
                    .start_failures
                    .with_label_values(&["timeout"])
                    .inc();
                tracing::warn!(
                    tenant,
                    created_here,
                    ?timeout,
                    "the tenant's node is not ready in time"
                );
                let uid = lock(&self.state).pods.get(tenant).map(|v| v.uid.clone());
                self.event(
                    tenant,
                    uid.as_deref(),
                    true,
                    "StartTimeout",
                    format!("not ready within nodes.kubernetes.start_timeout_secs ({timeout:?}); the waiting session was refused nodeStarting"),
                );
                return Err(StartError::Timeout(timeout));
            }
            let wait = (deadline - now).min(RECHECK);
            let _changed = tokio::time::timeout(wait, changes.changed()).await;
        }
    }

    /// Creates the tenant's volume claim (once) and pod; `AlreadyExists` is success for both
    /// (another edge, or an earlier session, created them).
    async fn create(&self, tenant: &str) -> Result<(), CreateError> {
        let t = self
            .tenants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(tenant)
            .cloned();
        let Some(t) = t else {
            return Ok(());
        };
        self.ensure_claim(tenant).await?;
        let pod = spec::tenant_pod(&self.template, &self.settings, &self.namespace, &t)
            .map_err(CreateError::Spec)?;
        match self.pods.create(&PostParams::default(), &pod).await {
            Ok(created) => {
                tracing::info!(tenant, pod = %self.pod_name(tenant), "created the tenant's pod");
                self.event(
                    tenant,
                    created.metadata.uid.as_deref(),
                    false,
                    "Created",
                    "created by an edge for the tenant's session".into(),
                );
                let mut s = lock(&self.state);
                s.created.insert(tenant.to_owned(), Instant::now());
                if let Some(reason) = s.ended.remove(tenant) {
                    self.metrics.recreations.with_label_values(&[reason]).inc();
                }
                // Until the watch reports it, the answer stands for it (no second create).
                s.pods
                    .entry(tenant.to_owned())
                    .or_insert_with(|| PodView::of(&created));
                self.publish(&s);
            }
            Err(e) if already_exists(&e) => {
                tracing::info!(
                    tenant,
                    "the tenant's pod exists already (another edge created it)"
                );
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// The tenant's volume claim exists: looked up first, created when it does not. A create
    /// answered `409 AlreadyExists` (another edge won) or `403 Forbidden` for a claim that does
    /// exist is success: with the namespace's storage quota used up, quota admission refuses
    /// even the create of an existing claim, before any exists check, and that must not stop
    /// a tenant whose volume is there from starting.
    async fn ensure_claim(&self, tenant: &str) -> Result<(), CreateError> {
        let pvc = spec::tenant_pvc(&self.template, &self.settings, &self.namespace, tenant)
            .map_err(CreateError::Spec)?;
        let name = pvc.metadata.name.clone().unwrap_or_default();
        if self.pvcs.get_opt(&name).await?.is_some() {
            return Ok(());
        }
        match self.pvcs.create(&PostParams::default(), &pvc).await {
            Ok(_) => tracing::info!(tenant, "created the tenant's volume claim"),
            Err(e) if already_exists(&e) => {}
            Err(::kube::Error::Api(s)) if s.code == 403 => {
                if self.pvcs.get_opt(&name).await?.is_none() {
                    return Err(::kube::Error::Api(s).into());
                }
                tracing::info!(
                    tenant,
                    "the volume claim exists (its create was refused: {})",
                    s.message
                );
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Whether a pod has been Pending (unscheduled, or its volume or image not there) for
    /// longer than the start timeout, as this edge has seen it.
    fn stuck(&self, v: &PodView) -> bool {
        let timeout = Duration::from_secs(self.settings.start_timeout_secs);
        v.phase == "Pending"
            && !v.deleting
            && lock(&self.state)
                .first_seen
                .get(&v.uid)
                .is_some_and(|at| at.elapsed() > timeout)
    }

    /// Whether a pod has been Terminating, as this edge has seen it, for longer than its grace
    /// period and [`FORCE_DELETE_AFTER`]: no kubelet carries its deletion out.
    fn stranded(&self, v: &PodView) -> bool {
        let grace = Duration::from_secs(v.deletion_grace.unwrap_or(30));
        v.deleting
            && lock(&self.state)
                .terminating_since
                .get(&v.uid)
                .is_some_and(|at| at.elapsed() > grace + FORCE_DELETE_AFTER)
    }

    /// Force-deletes (grace period 0) a pod stranded Terminating, so the tenant's next pod can
    /// take its name (only that pod: uid precondition); counted as recreation `lost`.
    async fn force_delete(&self, tenant: &str, v: &PodView) {
        if lock(&self.state).replacing.insert(v.uid.clone(), "lost") == Some("lost") {
            return;
        }
        let name = self.pod_name(tenant);
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            ..only_this_pod(&v.uid)
        };
        match self.pods.delete(&name, &dp).await {
            Ok(_) => {
                tracing::info!(tenant, pod = %name, "force-deleted the tenant's pod stranded Terminating");
                self.event(
                    tenant,
                    Some(&v.uid),
                    true,
                    "ForceDeleted",
                    "Terminating past its grace period with no kubelet to confirm it (its machine is lost); force-deleted, a new one is created for the next session".into(),
                );
            }
            Err(::kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => {
                tracing::warn!(tenant, pod = %name, error = %e, "cannot force-delete the stranded pod");
                self.note_error(format!("delete: {e}"));
                lock(&self.state).replacing.remove(&v.uid);
            }
        }
    }

    /// Ready pods made from an older template than their tenant's current one (a changed
    /// template or entry), seen by this edge for longer than `max_pod_age_secs`.
    fn outdated(&self) -> Vec<(String, PodView)> {
        let Some(max) = self.settings.max_pod_age_secs.map(Duration::from_secs) else {
            return Vec::new();
        };
        let hashes = self.hashes.read().unwrap_or_else(PoisonError::into_inner);
        let s = lock(&self.state);
        s.pods
            .iter()
            .filter(|(t, v)| {
                outdated(v, t, &hashes, &s.deleting)
                    && s.first_seen
                        .get(&v.uid)
                        .is_some_and(|at| at.elapsed() > max)
            })
            .map(|(t, v)| (t.clone(), v.clone()))
            .collect()
    }

    /// Ready pods made from an older template than their tenant's current one whose node this
    /// edge has not asked within [`UPGRADE_LOOK`] whether it is idle (marked as being asked).
    fn upgradable(&self) -> Vec<(String, PodView, std::net::SocketAddr)> {
        let Some(port) = self.admin_port else {
            return Vec::new();
        };
        let hashes = self.hashes.read().unwrap_or_else(PoisonError::into_inner);
        let mut s = lock(&self.state);
        let live: HashSet<String> = s.pods.values().map(|v| v.uid.clone()).collect();
        s.upgrade_asked.retain(|uid, _| live.contains(uid));
        let due: Vec<(String, PodView, std::net::SocketAddr)> = s
            .pods
            .iter()
            .filter(|(t, v)| {
                v.phase == "Running"
                    && outdated(v, t, &hashes, &s.deleting)
                    && match s.upgrade_asked.get(&v.uid) {
                        None => true,
                        Some(None) => false,
                        Some(Some(at)) => at.elapsed() >= UPGRADE_LOOK,
                    }
            })
            .filter_map(|(t, v)| Some((t.clone(), v.clone(), SocketAddr::new(v.ip?, port))))
            .collect();
        for (_, v, _) in &due {
            s.upgrade_asked.insert(v.uid.clone(), None);
        }
        due
    }

    /// Replaces a pod of an older template if its node is idle (by the idle cull's rule, see
    /// [`idle::node_is_idle`]); a node that is busy or does not answer keeps its pod. This
    /// edge's own sessions stop being given the pod before it is deleted; a session another
    /// edge opens in between is closed by the node's drain, after any turn it started.
    async fn replace_if_idle(&self, tenant: &str, v: &PodView, admin: SocketAddr) {
        let idle = idle::node_is_idle(admin, UPGRADE_ASK).await;
        lock(&self.state)
            .upgrade_asked
            .insert(v.uid.clone(), Some(Instant::now()));
        match idle {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::debug!(tenant, error = %format!("{e:#}"), "cannot ask the node of an older template whether it is idle; keeping it");
                return;
            }
        }
        let current = lock(&self.state).pods.get(tenant).map(|p| p.uid.clone());
        if current.as_deref() != Some(v.uid.as_str()) {
            return;
        }
        tracing::info!(tenant, pod = %self.pod_name(tenant), "the tenant's pod is of an older template and its node is idle; replacing it");
        self.metrics.upgrades.inc();
        self.replace(tenant, v, "upgraded").await;
    }

    /// Deletes a pod that cannot become ready so the next creation replaces it (on the same
    /// volume); `why` is counted when the new pod is created.
    async fn replace(&self, tenant: &str, v: &PodView, why: &'static str) {
        lock(&self.state).replacing.insert(v.uid.clone(), why);
        self.delete_ended(tenant, v).await;
    }

    /// Deletes a completed or failed pod so a new one can be created (only that pod: a uid
    /// precondition keeps a newer pod of the same name safe).
    async fn delete_ended(&self, tenant: &str, v: &PodView) {
        // Why, read before the delete: the watch may see the pod gone (and forget why) before
        // the delete's answer arrives.
        let why = {
            let mut s = lock(&self.state);
            if !s.deleting.insert(v.uid.clone()) {
                return;
            }
            s.replacing.get(&v.uid).copied()
        };
        let name = self.pod_name(tenant);
        let dp = only_this_pod(&v.uid);
        match self.pods.delete(&name, &dp).await {
            Ok(_) => {
                tracing::info!(tenant, pod = %name, phase = %v.phase, "deleted the tenant's ended pod");
                if v.phase == "Succeeded" {
                    self.metrics.culls.inc();
                    self.event(
                        tenant,
                        Some(&v.uid),
                        false,
                        "Culled",
                        "the node exited when idle; deleted (its volume stays for the next session)".into(),
                    );
                } else {
                    let why = why.unwrap_or_else(|| v.end_reason());
                    // An upgrade is routine; a pod that failed is worth a warning.
                    self.event(
                        tenant,
                        Some(&v.uid),
                        !matches!(why, "upgraded" | "outdated"),
                        "Replaced",
                        replaced_note(why),
                    );
                }
            }
            Err(::kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => {
                tracing::warn!(tenant, pod = %name, error = %e, "cannot delete the ended pod");
                self.note_error(format!("delete: {}", chain(&e)));
                let mut s = lock(&self.state);
                s.deleting.remove(&v.uid);
                s.replacing.remove(&v.uid);
            }
        }
    }

    /// Writes an Event about the tenant's pod (by name, and uid when known), in the
    /// background: an Event is for `kubectl describe`, never a reason to delay a session.
    ///
    /// kube's recorder makes a repeat of the same (reason, action, pod) within minutes a series
    /// of the first Event (count and time, the first note), so `action` tells apart what must
    /// not merge (a 403 and a 422).
    fn event(&self, tenant: &str, uid: Option<&str>, warning: bool, reason: &str, note: String) {
        self.event_of(tenant, uid, warning, reason, reason, note);
    }

    fn event_of(
        &self,
        tenant: &str,
        uid: Option<&str>,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(self.pod_name(tenant)),
            namespace: Some(self.namespace.clone()),
            uid: uid.filter(|u| !u.is_empty()).map(str::to_owned),
            ..ObjectReference::default()
        };
        let ev = KubeEvent {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(note),
            action: action.to_owned(),
            secondary: None,
        };
        let recorder = self.events.clone();
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::debug!(error = %e, reason = %ev.reason, "cannot write a tenant pod event");
            }
        });
    }

    fn note_error(&self, e: String) {
        *lock(&self.last_error) = Some(e);
    }

    /// Recomputes the gauges from the view and wakes waiting sessions.
    fn publish(&self, s: &State) {
        let mut by_phase: HashMap<&str, i64> = PHASES.iter().map(|p| (*p, 0)).collect();
        let (mut unschedulable, mut starting) = (0, 0);
        for v in s.pods.values() {
            let phase = if PHASES.contains(&v.phase.as_str()) {
                v.phase.as_str()
            } else {
                "Unknown"
            };
            *by_phase.entry(phase).or_default() += 1;
            unschedulable += i64::from(v.unschedulable);
            starting += i64::from(!v.ended() && !v.ready);
        }
        for (p, n) in by_phase {
            self.metrics.pods.with_label_values(&[p]).set(n);
        }
        self.metrics.unschedulable.set(unschedulable);
        self.metrics.starting.set(starting);
        self.changes.send_modify(|n| *n += 1);
    }

    /// The tenant of a pod, when it is one of ours: labelled with a tenant this edge serves
    /// and named as that tenant's pod.
    fn tenant_of(&self, pod: &Pod) -> Option<String> {
        let tenant = pod.metadata.labels.as_ref()?.get(TENANT_LABEL)?;
        (pod.metadata.name.as_deref() == Some(self.pod_name(tenant).as_str()))
            .then(|| tenant.clone())
    }

    /// One pod's new state, from the watch.
    fn apply(&self, s: &mut State, pod: &Pod) {
        let Some(tenant) = self.tenant_of(pod) else {
            return;
        };
        let v = PodView::of(pod);
        s.first_seen
            .entry(v.uid.clone())
            .or_insert_with(Instant::now);
        if v.deleting {
            s.terminating_since
                .entry(v.uid.clone())
                .or_insert_with(Instant::now);
        }
        if v.ready {
            if let Some(at) = s.created.remove(&tenant) {
                self.metrics
                    .start_seconds
                    .observe(at.elapsed().as_secs_f64());
            }
        } else if v.phase == "Failed" && s.created.remove(&tenant).is_some() {
            self.metrics
                .start_failures
                .with_label_values(&["failed"])
                .inc();
            self.event(
                &tenant,
                Some(&v.uid),
                true,
                "StartFailed",
                "the node ended before it was ready (see its log)".into(),
            );
        }
        s.pods.insert(tenant, v);
    }

    /// A pod is gone: remember why, for the next creation.
    fn gone(&self, s: &mut State, tenant: &str) {
        if let Some(v) = s.pods.remove(tenant) {
            tracing::info!(tenant, phase = %v.phase, "the tenant's pod is gone");
            let why = s.replacing.remove(&v.uid).unwrap_or_else(|| v.end_reason());
            s.ended.insert(tenant.to_owned(), why);
            s.deleting.remove(&v.uid);
            s.first_seen.remove(&v.uid);
            s.terminating_since.remove(&v.uid);
            s.created.remove(tenant);
        }
    }

    /// Handles one watch event; returns completed pods to cull.
    fn on_event(&self, ev: Event<Pod>) -> Vec<(String, PodView)> {
        let mut s = lock(&self.state);
        match ev {
            Event::Apply(pod) => self.apply(&mut s, &pod),
            Event::Delete(pod) => {
                if let Some(t) = self.tenant_of(&pod) {
                    self.gone(&mut s, &t);
                }
            }
            Event::Init => s.relist = Some(HashMap::new()),
            Event::InitApply(pod) => {
                if let Some(t) = self.tenant_of(&pod) {
                    let v = PodView::of(&pod);
                    if let Some(r) = s.relist.as_mut() {
                        r.insert(t.clone(), v);
                    }
                    self.apply(&mut s, &pod);
                }
            }
            Event::InitDone => {
                let listed = s.relist.take().unwrap_or_default();
                let missing: Vec<String> = s
                    .pods
                    .keys()
                    .filter(|t| !listed.contains_key(*t))
                    .cloned()
                    .collect();
                for t in missing {
                    self.gone(&mut s, &t);
                }
                self.synced.store(true, Ordering::Release);
                self.listed_once.store(true, Ordering::Release);
                *lock(&self.last_error) = None;
            }
        }
        self.publish(&s);
        s.pods
            .iter()
            .filter(|(_, v)| v.phase == "Succeeded" && !v.deleting && !s.deleting.contains(&v.uid))
            .map(|(t, v)| (t.clone(), v.clone()))
            .collect()
    }

    /// Watches the tenant pods for as long as the returned handle lives: keeps the view, wakes
    /// waiting sessions, deletes completed pods.
    pub fn spawn_watch(self: &Arc<Self>) -> tokio_util::task::AbortOnDropHandle<()> {
        let this = Arc::downgrade(self);
        let api = self.pods.clone();
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            let cfg = watcher::Config::default().labels(TENANT_LABEL);
            let mut events = watcher::watcher(api, cfg)
                .backoff(WatchBackoff::default())
                .boxed();
            let mut sweep = tokio::time::interval(SWEEP);
            sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let ev = tokio::select! {
                    ev = events.next() => match ev {
                        Some(ev) => ev,
                        None => return,
                    },
                    _ = sweep.tick() => {
                        let Some(nodes) = this.upgrade() else { return };
                        for (tenant, v) in nodes.outdated() {
                            tracing::info!(tenant, pod = %nodes.pod_name(&tenant), "the tenant's pod is of an older template and past max_pod_age_secs; replacing it");
                            let n = nodes.clone();
                            tokio::spawn(async move { n.replace(&tenant, &v, "outdated").await });
                        }
                        for (tenant, v, admin) in nodes.upgradable() {
                            let n = nodes.clone();
                            tokio::spawn(async move { n.replace_if_idle(&tenant, &v, admin).await });
                        }
                        continue;
                    }
                };
                let Some(nodes) = this.upgrade() else { return };
                match ev {
                    Ok(ev) => {
                        for (tenant, v) in nodes.on_event(ev) {
                            let n = nodes.clone();
                            tokio::spawn(async move { n.delete_ended(&tenant, &v).await });
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %chain(&e), "tenant pod watch: API error; retrying");
                        nodes.note_error(format!("watch: {}", chain(&e)));
                        if matches!(e, watcher::Error::WatchError(ref s) if s.code == 410) {
                            // Its history is gone: not synced until it has listed again.
                            nodes.synced.store(false, Ordering::Release);
                        }
                    }
                }
            }
        }))
    }

    /// Asks the API server for one tenant pod, for `/readyz`: whether it answers.
    pub async fn probe(&self) {
        let lp = ListParams::default().labels(TENANT_LABEL).limit(1);
        match tokio::time::timeout(PROBE_TIMEOUT, self.pods.list(&lp)).await {
            Ok(Ok(_)) => self.reachable.store(true, Ordering::Release),
            Err(_) => {
                self.reachable.store(false, Ordering::Release);
                self.note_error(format!("probe: no answer within {PROBE_TIMEOUT:?}"));
            }
            Ok(Err(e)) => {
                self.reachable.store(false, Ordering::Release);
                self.note_error(format!("probe: {}", chain(&e)));
            }
        }
    }

    /// `/readyz` detail; ready once the watch has listed the tenant pods, and from then on
    /// whether or not the API server answers
    /// (docs/decisions/0017-settings-travel-with-the-tenant.md: the API server is not the data
    /// path): a tenant whose pod the view shows Ready is served from it, only new starts wait.
    /// `apiReachable` and `watchSynced` say how current the view is.
    pub fn readiness(&self) -> (bool, serde_json::Value) {
        let synced = self.synced.load(Ordering::Acquire);
        let listed_once = self.listed_once.load(Ordering::Acquire);
        let reachable = self.reachable.load(Ordering::Acquire);
        let error = lock(&self.last_error).clone();
        let s = lock(&self.state);
        let pods: serde_json::Map<String, serde_json::Value> = s
            .pods
            .iter()
            .map(|(t, v)| {
                (
                    t.clone(),
                    json!({ "phase": v.phase, "ready": v.ready, "podIP": v.ip.map(|i| i.to_string()) }),
                )
            })
            .collect();
        (
            listed_once,
            json!({
                "backend": "kubernetes",
                "apiServer": self.api_url,
                "namespace": self.namespace,
                "watchSynced": synced,
                "apiReachable": reachable,
                "servingFromCache": listed_once && !(synced && reachable),
                "lastError": error,
                "tenantPods": pods,
            }),
        )
    }
}

/// The note of a `Replaced` Event.
fn replaced_note(why: &str) -> String {
    match why {
        "upgraded" => "made from an older template and its node idle (no session, running turn or loaded thread); deleted, the next session gets a pod of the current template".into(),
        "outdated" => "made from an older template and older than max_pod_age_secs; deleted, the next session gets a pod of the current template".into(),
        _ => format!("the pod ended or cannot start ({why}); deleted, a new one is created for the next session"),
    }
}

/// The watch's back-off on API errors: 200 ms doubling to 5 s, reset by every event. Shorter
/// than kube's default (up to 30 s), so an edge is ready again soon after its API server is.
struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const FIRST: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(5);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (now * 2).min(Self::MAX);
        Some(now)
    }
}

impl ::kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// An error with its causes, outermost first: kube's connection errors say only "client
/// error (Connect)" themselves, and the cause (a certificate the CA does not sign, a refused
/// connection) is what an operator reading `/readyz` needs.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

fn already_exists(e: &::kube::Error) -> bool {
    matches!(e, ::kube::Error::Api(s) if s.code == 409)
}

/// Whether `v`, `tenant`'s pod, is Ready, not being deleted, and made from an older template
/// than the tenant's current one (`hashes`).
fn outdated(
    v: &PodView,
    tenant: &str,
    hashes: &HashMap<String, String>,
    deleting: &HashSet<String>,
) -> bool {
    v.ready
        && !v.deleting
        && !deleting.contains(&v.uid)
        && v.template_hash.is_some()
        && hashes
            .get(tenant)
            .is_some_and(|h| v.template_hash.as_ref() != Some(h))
}

/// A delete of the pod with this uid only: a pod of the same name made since is left alone.
fn only_this_pod(uid: &str) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid.to_owned()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, message: &str) -> ::kube::Error {
        ::kube::Error::Api(Box::new(
            serde_json::from_value::<::kube::core::Status>(json!({
                "status": "Failure", "message": message, "reason": "", "code": code,
            }))
            .expect("a Status"),
        ))
    }

    #[test]
    fn api_errors_are_sorted_into_what_a_retry_can_change_and_what_it_cannot() {
        let quota = "pods \"codex-fleet-node-acme\" is forbidden: exceeded quota: compute";
        assert_eq!(
            classify(&api(403, quota)),
            Failure::Permanent("forbidden", format!("403 {quota}"))
        );
        for code in [400, 404, 422] {
            assert!(
                matches!(classify(&api(code, "x")), Failure::Permanent("invalid", _)),
                "{code}"
            );
        }
        for code in [401, 408, 429, 500, 502, 503, 504] {
            assert_eq!(classify(&api(code, "x")), Failure::Transient, "{code}");
        }
        // A cause is bounded and cannot break a line.
        let long = format!("line\none\r{}", "é".repeat(400));
        let Failure::Permanent(_, c) = classify(&api(422, &long)) else {
            panic!("permanent");
        };
        assert!(!c.contains('\n') && !c.contains('\r'), "{c}");
        assert!(c.len() <= CAUSE_MAX + '…'.len_utf8(), "{}", c.len());
        assert!(c.ends_with('…'));
    }

    #[test]
    fn an_error_is_written_with_its_causes_once_each() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Outer(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("{0}")]
        struct Same(#[source] std::io::Error);
        let cert = || std::io::Error::other("invalid peer certificate: UnknownIssuer");
        assert_eq!(
            chain(&Outer(cert())),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
        // A cause its error already repeats is not written twice.
        assert_eq!(
            chain(&Same(cert())),
            "invalid peer certificate: UnknownIssuer"
        );
    }

    #[test]
    fn the_create_backoff_doubles_to_its_bound_with_jitter() {
        let mut prev = None;
        let mut bases = Vec::new();
        for _ in 0..8 {
            let (base, sleep) = create_backoff(prev);
            assert!(
                sleep >= base && sleep <= base + base / 2,
                "{base:?} {sleep:?}"
            );
            bases.push(base.as_millis());
            prev = Some(base);
        }
        assert_eq!(bases, [250, 500, 1000, 2000, 4000, 5000, 5000, 5000]);
    }
}
