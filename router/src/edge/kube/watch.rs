//! The watch over the tenant pods: list, then follow from the list's `resourceVersion`
//! (relisted on `410 Gone`, backed off on errors); each event updates the view, its gauges and
//! the sessions waiting on it. Also the readiness the edge reports for the backend.

use std::sync::Arc;
use std::time::Duration;

use ::kube::api::ListParams;
use ::kube::runtime::watcher::{self, Event};
use ::kube::runtime::WatchStreamExt;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

use super::failure::chain;
use super::metrics::PHASES;
use super::sweep::SWEEP;
use super::view::{PodView, State};
use super::{lock, spec::TENANT_LABEL, KubeNodes};

/// How long the readiness probe waits for the API server.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The watch's back-off on API errors: 200 ms doubling to 5 s, reset by every event. Shorter
/// than kube's default (up to 30 s), so an edge is ready again soon after its API server is.
pub(super) struct WatchBackoff {
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

// === impl KubeNodes ===

impl KubeNodes {
    /// Recomputes the gauges from the view and wakes waiting sessions.
    pub(super) fn publish(&self, s: &State) {
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
    pub(super) fn tenant_of(&self, pod: &Pod) -> Option<String> {
        let tenant = pod.metadata.labels.as_ref()?.get(TENANT_LABEL)?;
        (pod.metadata.name.as_deref() == Some(self.pod_name(tenant).as_str()))
            .then(|| tenant.clone())
    }

    /// One pod's new state, from the watch.
    pub(super) fn apply(&self, s: &mut State, pod: &Pod) {
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
    pub(super) fn gone(&self, s: &mut State, tenant: &str) {
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
    pub(super) fn on_event(&self, ev: Event<Pod>) -> Vec<(String, PodView)> {
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
