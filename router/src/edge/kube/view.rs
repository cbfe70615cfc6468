//! What an edge knows of the tenant pods, from its watch: one [`PodView`] per pod, and the
//! bookkeeping ([`State`]) of what this edge created, deletes and asked.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use tokio::time::Instant;

use super::{spec, PULL_FAILURES};

/// What this edge knows of one tenant pod, from the watch.
#[derive(Debug, Clone)]
pub(super) struct PodView {
    pub(super) uid: String,
    pub(super) phase: String,
    pub(super) ready: bool,
    pub(super) ip: Option<IpAddr>,
    pub(super) deleting: bool,
    pub(super) unschedulable: bool,
    pub(super) evicted: bool,
    /// Its image cannot be pulled: the kubelet's reason and message.
    pub(super) pull_failure: Option<String>,
    /// Its `codex-fleet.io/template-hash` label.
    pub(super) template_hash: Option<String>,
    /// Its `deletionGracePeriodSeconds`, while it is Terminating.
    pub(super) deletion_grace: Option<u64>,
}

impl PodView {
    pub(super) fn of(pod: &Pod) -> PodView {
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

    /// Ready, Running and not going away: a pod a session may be relayed to.
    pub(super) fn serving(&self) -> bool {
        self.ready && self.phase == "Running" && !self.deleting
    }

    pub(super) fn ended(&self) -> bool {
        self.phase == "Succeeded" || self.phase == "Failed"
    }

    /// Why a pod in this state went away, for the recreation counter.
    pub(super) fn end_reason(&self) -> &'static str {
        match self.phase.as_str() {
            "Succeeded" => "idle",
            "Failed" if self.evicted => "evicted",
            "Failed" => "failed",
            _ => "deleted",
        }
    }
}

#[derive(Default)]
pub(super) struct State {
    /// Tenant → its pod, as the watch last said.
    pub(super) pods: HashMap<String, PodView>,
    /// Pods listed since the watch (re)started, replacing `pods` when the list is complete.
    pub(super) relist: Option<HashMap<String, PodView>>,
    /// Tenants whose pod this edge created and has not seen ready: since when.
    pub(super) created: HashMap<String, Instant>,
    /// Why each tenant's last pod went away (taken by the next creation).
    pub(super) ended: HashMap<String, &'static str>,
    /// Pods (uid) this edge is deleting.
    pub(super) deleting: HashSet<String>,
    /// Pods (uid) this edge deletes to replace them, and why (for the recreation counter).
    pub(super) replacing: HashMap<String, &'static str>,
    /// When this edge first saw each pod (uid): a pod Pending longer than the start timeout is
    /// stuck.
    pub(super) first_seen: HashMap<String, Instant>,
    /// When this edge first saw each pod (uid) Terminating (its own clock: no skew with the API
    /// server's `deletionTimestamp`).
    pub(super) terminating_since: HashMap<String, Instant>,
    /// Pods (uid) of an older template: when this edge last asked their node whether it is
    /// idle (an entry without a time: asking now).
    pub(super) upgrade_asked: HashMap<String, Option<Instant>>,
}
