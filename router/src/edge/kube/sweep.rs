//! Pods an edge deletes: completed ones (the node's idle exit), pods stuck Pending or unable to
//! pull their image, pods left Terminating on a lost machine (force-deleted), and pods of an
//! older template (at an idle moment of their node, or past `max_pod_age_secs`). Also the
//! Kubernetes Events written about tenant pods.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::PoisonError;
use std::time::Duration;

use ::kube::api::{DeleteParams, Preconditions};
use ::kube::runtime::events::{Event as KubeEvent, EventType};
use k8s_openapi::api::core::v1::ObjectReference;
use tokio::time::Instant;

use super::failure::chain;
use super::view::PodView;
use super::{idle, lock, KubeNodes};

/// How often pods of an older template are looked for (`max_pod_age_secs`).
pub(super) const SWEEP: Duration = Duration::from_secs(1);

/// How long past its grace period a pod may stay Terminating before an edge force-deletes it:
/// a kubelet removes a pod within seconds of killing it; one that does not is out of reach
/// (its machine lost) and would keep the tenant's pod name taken for good.
pub(super) const FORCE_DELETE_AFTER: Duration = Duration::from_secs(10);

/// How often, at most, an edge asks the node of a pod of an older template whether it is idle,
/// and how long it waits for the answer.
pub(super) const UPGRADE_LOOK: Duration = Duration::from_secs(2);

pub(super) const UPGRADE_ASK: Duration = Duration::from_secs(2);

/// The note of a `Replaced` Event.
pub(super) fn replaced_note(why: &str) -> String {
    match why {
        "upgraded" => "made from an older template and its node idle (no session, running turn or loaded thread); deleted, the next session gets a pod of the current template".into(),
        "outdated" => "made from an older template and older than max_pod_age_secs; deleted, the next session gets a pod of the current template".into(),
        _ => format!("the pod ended or cannot start ({why}); deleted, a new one is created for the next session"),
    }
}

/// Whether `v`, `tenant`'s pod, is Ready, not being deleted, and made from an older template
/// than the tenant's current one (`hashes`).
pub(super) fn outdated(
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
pub(super) fn only_this_pod(uid: &str) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid.to_owned()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}

// === impl KubeNodes ===

impl KubeNodes {
    /// Whether a pod has been Pending (unscheduled, or its volume or image not there) for
    /// longer than the start timeout, as this edge has seen it.
    pub(super) fn stuck(&self, v: &PodView) -> bool {
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
    pub(super) fn stranded(&self, v: &PodView) -> bool {
        let grace = Duration::from_secs(v.deletion_grace.unwrap_or(30));
        v.deleting
            && lock(&self.state)
                .terminating_since
                .get(&v.uid)
                .is_some_and(|at| at.elapsed() > grace + FORCE_DELETE_AFTER)
    }

    /// Force-deletes (grace period 0) a pod stranded Terminating, so the tenant's next pod can
    /// take its name (only that pod: uid precondition); counted as recreation `lost`.
    pub(super) async fn force_delete(&self, tenant: &str, v: &PodView) {
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
    pub(super) fn outdated(&self) -> Vec<(String, PodView)> {
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
    pub(super) fn upgradable(&self) -> Vec<(String, PodView, std::net::SocketAddr)> {
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
    pub(super) async fn replace_if_idle(&self, tenant: &str, v: &PodView, admin: SocketAddr) {
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

    /// Marks pod `uid` as being replaced for `why`, unless a replacement of it is already under
    /// way (which keeps its own reason): whether this call marked it, and so acts on it.
    pub(super) fn mark_replacing(&self, uid: &str, why: &'static str) -> bool {
        let mut s = lock(&self.state);
        if s.replacing.contains_key(uid) {
            return false;
        }
        s.replacing.insert(uid.to_owned(), why);
        true
    }

    /// Deletes a pod that cannot become ready so the next creation replaces it (on the same
    /// volume); `why` is counted when the new pod is created.
    pub(super) async fn replace(&self, tenant: &str, v: &PodView, why: &'static str) {
        lock(&self.state).replacing.insert(v.uid.clone(), why);
        self.delete_ended(tenant, v).await;
    }

    /// Deletes a completed or failed pod so a new one can be created (only that pod: a uid
    /// precondition keeps a newer pod of the same name safe).
    pub(super) async fn delete_ended(&self, tenant: &str, v: &PodView) {
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
    pub(super) fn event(
        &self,
        tenant: &str,
        uid: Option<&str>,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        self.event_of(tenant, uid, warning, reason, reason, note);
    }

    pub(super) fn event_of(
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

    pub(super) fn note_error(&self, e: String) {
        *lock(&self.last_error) = Some(e);
    }
}
