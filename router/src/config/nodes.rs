//! `[node]` and `[nodes]`: the link between edges and nodes, and where an edge finds each
//! tenant's node (a static list, or a pod per tenant on Kubernetes).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[node]`: this process is a node.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRole {
    /// This node's name; it serves the tenants whose `node` is this name.
    pub name: String,
    /// PEM CA bundle that edges' client certificates must chain to (mutual TLS on the link).
    pub edge_ca: PathBuf,
}

/// `[nodes]`: where tenants live, for an edge.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nodes {
    /// How nodes are found: `static` (listed below, tenants assigned by `tenants[].node`).
    pub backend: NodesBackend,
    /// PEM CA bundle nodes' certificates must chain to.
    pub ca: PathBuf,
    /// PEM certificate this edge presents to nodes.
    pub client_cert: PathBuf,
    /// Its private key.
    pub client_key: PathBuf,
    /// Deadline for connecting a session's link (TCP, TLS, upgrade).
    #[serde(default = "defaults::link_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How often each node's reachability is probed (for `/readyz`).
    #[serde(default = "defaults::probe_interval_secs")]
    pub probe_interval_secs: u64,
    /// The nodes (`static` backend).
    #[serde(default, rename = "static")]
    pub static_nodes: Vec<StaticNode>,
    /// `[nodes.kubernetes]` (`kubernetes` backend): a pod and a volume per tenant, started on
    /// demand.
    #[serde(default)]
    pub kubernetes: Option<KubernetesNodes>,
}

/// `[nodes.kubernetes]`: how the edge finds, starts and reaches each tenant's pod.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesNodes {
    /// Namespace of the tenant pods; default: the service account's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The API server; default: the in-cluster configuration.
    #[serde(default)]
    pub api_url: Option<String>,
    /// A complete Pod manifest in JSON; the edge fills in each tenant's parts.
    pub pod_template: PathBuf,
    /// Pods are `<prefix>-node-<tenant>`, volumes `<prefix>-home-<tenant>`, model Secrets
    /// `<prefix>-model-<tenant>`.
    #[serde(default = "defaults::name_prefix")]
    pub name_prefix: String,
    /// The node container's link port.
    #[serde(default = "defaults::link_port")]
    pub link_port: u16,
    /// The name in every tenant node's link certificate (the SNI the edge dials with).
    #[serde(default = "defaults::node_server_name")]
    pub server_name: String,
    /// Creation to ready; past it a waiting session is refused with `nodeStarting`.
    #[serde(default = "defaults::start_timeout_secs")]
    pub start_timeout_secs: u64,
    /// The tenant volume's request.
    #[serde(default = "defaults::storage_size")]
    pub storage_size: String,
    /// The tenant volume's storage class; absent: the cluster's default.
    #[serde(default)]
    pub storage_class: Option<String>,
    /// A Ready tenant pod made from an older template (its `codex-fleet.io/template-hash` is
    /// not the current one) is deleted once this edge has seen it this long, even while busy,
    /// and recreated on the next session; unset: it keeps running until it idles out.
    #[serde(default)]
    pub max_pod_age_secs: Option<u64>,
}

/// `[tenants.kubernetes]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantKubernetes {
    /// Overrides the template's container resources.
    #[serde(default)]
    pub resources: Option<PodResources>,
}

/// `[tenants.kubernetes.resources]`: Kubernetes quantities, e.g. `cpu = "500m"`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PodResources {
    /// `requests`
    #[serde(default)]
    pub requests: BTreeMap<String, String>,
    /// `limits`
    #[serde(default)]
    pub limits: BTreeMap<String, String>,
}

/// `nodes.backend`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodesBackend {
    /// Nodes listed in `[[nodes.static]]`; each tenant names its node.
    Static,
    /// A pod per tenant on Kubernetes (`[nodes.kubernetes]`), created on demand.
    Kubernetes,
}

/// `[[nodes.static]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticNode {
    /// The node's name (what `tenants[].node` refers to).
    pub name: String,
    /// Its link address, `host:port`.
    pub addr: String,
    /// The name its certificate is checked against; defaults to the host of `addr`.
    #[serde(default)]
    pub server_name: Option<String>,
}

mod defaults {
    pub(super) fn link_connect_timeout_ms() -> u64 {
        2000
    }
    pub(super) fn name_prefix() -> String {
        "codex-fleet".into()
    }
    pub(super) fn link_port() -> u16 {
        7443
    }
    pub(super) fn node_server_name() -> String {
        "node.codex-fleet.internal".into()
    }
    pub(super) fn start_timeout_secs() -> u64 {
        120
    }
    pub(super) fn storage_size() -> String {
        "10Gi".into()
    }
    pub(super) fn probe_interval_secs() -> u64 {
        2
    }
}
