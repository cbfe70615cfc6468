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

mod failure;
pub mod idle;
mod metrics;
pub mod spec;
mod starts;
mod sweep;
mod view;
mod watch;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use ::kube::api::{Api, PostParams};
use ::kube::runtime::events::{Recorder, Reporter};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use prometheus::Registry;
use tokio::time::Instant;

use crate::config::nodes::KubernetesNodes;
use crate::config::Tenant;
pub use failure::StartError;
use failure::{already_exists, cause, chain, create_backoff, CreateError, Failure};
pub use metrics::{KubeMetrics, PHASES, RECREATIONS, START_FAILURES};
use spec::{Names, Template};
use starts::{Answer, Last, Next, Starts};
use view::{PodView, State};

/// Container waiting reasons that no wait will mend: the pod is deleted (and a waiting session
/// told why), so a fixed image in the values reaches the tenant's next pod.
pub(super) const PULL_FAILURES: [&str; 3] =
    ["ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"];
/// How long a waiting session sleeps between looks when the watch says nothing (a missed
/// event, an API error being retried).
const RECHECK: Duration = Duration::from_millis(500);

/// Where a tenant's node is, for the link.
#[derive(Debug, Clone)]
pub struct PodTarget {
    /// The pod's name.
    pub pod: String,
    /// `podIP:link_port`.
    pub addr: SocketAddr,
    /// The pod's uid.
    pub uid: String,
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
    /// Each tenant's start, shared by its waiting sessions (one create in flight).
    starts: Starts,
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
            starts: Starts::default(),
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
        self.starts.retain(|id| current.contains_key(id));
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
        let arrived = Instant::now();
        let deadline = arrived + timeout;
        let mut changes = self.changes.subscribe();
        let mut created_here = false;
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
                Some(v) if v.serving() && !replacing => {
                    if let Some(ip) = v.ip {
                        return Ok(PodTarget {
                            pod: self.pod_name(tenant),
                            addr: SocketAddr::new(ip, self.settings.link_port),
                            uid: v.uid.clone(),
                        });
                    }
                }
                Some(v) if v.ended() && !v.deleting => self.delete_ended(tenant, &v).await,
                Some(v) if v.pull_failure.is_some() && !v.deleting => {
                    let cause = cause(v.pull_failure.as_deref().unwrap_or(""));
                    // Every session waiting on the pod sees its failure at once: the first
                    // counts it, says it and deletes the pod; all are refused with its cause.
                    if self.mark_replacing(&v.uid, "image") {
                        self.metrics
                            .start_failures
                            .with_label_values(&["image"])
                            .inc();
                        tracing::warn!(tenant, %cause, "the tenant's pod cannot pull its image; deleting it");
                        self.note_error(format!("image: {cause}"));
                        self.event(tenant, Some(&v.uid), true, "ImagePullFailed", cause.clone());
                        self.delete_ended(tenant, &v).await;
                    }
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
                None => created_here |= self.start_once(tenant, arrived, deadline).await?,
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
                // One Event per pod that is late, however many sessions it refuses.
                let due = self
                    .starts
                    .of(tenant, self.knows(tenant))
                    .is_none_or(|s| s.timeout_event_due(uid.as_deref(), now, timeout));
                if due {
                    self.event(
                        tenant,
                        uid.as_deref(),
                        true,
                        "StartTimeout",
                        format!("not ready within nodes.kubernetes.start_timeout_secs ({timeout:?}); waiting sessions are refused nodeStarting"),
                    );
                }
                return Err(StartError::Timeout(timeout));
            }
            let wait = (deadline - now).min(RECHECK);
            let _changed = tokio::time::timeout(wait, changes.changed()).await;
        }
    }

    /// A session that found no pod takes its tenant's turn at the create ([`starts`]): posts the
    /// pod unless, by then, the view has it or the last create's answer still stands. `Ok(true)`
    /// when this session created it; `Ok(false)` to wait on the watch (also when `deadline`
    /// passes in the queue: the caller's deadline check answers). The session has waited for the
    /// pod since `arrived`: a refusal that came since is its answer too.
    async fn start_once(
        &self,
        tenant: &str,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<bool, StartError> {
        let Some(start) = self.starts.of(tenant, self.knows(tenant)) else {
            return Ok(false); // not a tenant of this edge's: nothing to create
        };
        let Ok(mut last) = tokio::time::timeout_at(deadline, start.create.lock()).await else {
            return Ok(false);
        };
        // The session ahead in the queue may have made the pod (a `201` puts it in the view).
        if lock(&self.state).pods.contains_key(tenant) {
            return Ok(false);
        }
        let base = match last.as_ref().map(|l| l.next(Instant::now(), arrived)) {
            None => None,
            Some(Next::Post { base }) => base,
            Some(Next::Wait) => return Ok(false),
            Some(Next::Fail(e)) => return Err(e),
        };
        let answer = tokio::time::timeout_at(deadline, self.create(tenant))
            .await
            .unwrap_or(Err(CreateError::Timeout));
        let at = Instant::now();
        let e = match answer {
            Ok(made) => {
                let answer = if made {
                    Answer::Created
                } else {
                    Answer::Exists
                };
                *last = Some(Last { at, answer });
                return Ok(made);
            }
            Err(e) => e,
        };
        match e.failure() {
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
                self.event_of(tenant, None, true, "FailedCreate", action, cause.clone());
                let refused = StartError::Refused { reason, cause };
                *last = Some(Last {
                    at,
                    answer: Answer::Refused(refused.clone()),
                });
                Err(refused)
            }
            Failure::Transient => {
                self.metrics
                    .start_failures
                    .with_label_values(&["api"])
                    .inc();
                let (base, sleep) = create_backoff(base);
                tracing::warn!(tenant, error = %e, retry_in = ?sleep, "cannot create the tenant's pod; retrying");
                self.note_error(format!("create: {}", chain(&e)));
                let retry_at = at + sleep;
                *last = Some(Last {
                    at,
                    answer: Answer::Transient { retry_at, base },
                });
                drop(last);
                tokio::time::sleep_until(retry_at.min(deadline)).await;
                Ok(false)
            }
        }
    }

    /// Whether the tenant's pod `uid`, found ready but not reachable, has gone by the watch's
    /// account within `within`: deleted, deleting, no longer ready, or replaced. A force delete
    /// kills the node at once, and a session can dial it before the watch reports the delete;
    /// such a session looks again (and waits for the next pod) rather than being refused.
    pub async fn went_away(&self, tenant: &str, uid: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut changes = self.changes.subscribe();
        loop {
            let gone = lock(&self.state)
                .pods
                .get(tenant)
                .is_none_or(|v| v.uid != uid || !v.serving());
            if gone {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, changes.changed()).await.is_err() {
                return false;
            }
        }
    }

    /// Creates the tenant's volume claim (once) and pod; `AlreadyExists` is success for both
    /// (another edge, or an earlier session, created them). `true` when this call made the pod.
    async fn create(&self, tenant: &str) -> Result<bool, CreateError> {
        let t = self
            .tenants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(tenant)
            .cloned();
        let Some(t) = t else {
            return Ok(false);
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
                Ok(true)
            }
            Err(e) if already_exists(&e) => {
                tracing::info!(
                    tenant,
                    "the tenant's pod exists already (another edge created it)"
                );
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
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
}
