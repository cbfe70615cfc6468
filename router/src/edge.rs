//! The edge role (docs/decisions/0014-two-roles-one-binary.md): TLS, authentication and admission
//! at the door, then each session relayed frame by frame over its own link to the node that holds
//! its tenant.
//!
//! The link is wss with mutual TLS (TLS 1.3): the edge trusts only `nodes.ca` for nodes and
//! presents `nodes.client_cert`; a node accepts only edges whose certificate chains to its
//! `node.edge_ca`. The upgrade request names the tenant, the authenticated subject and the
//! client's address in headers ([`TENANT_HEADER`], [`SUBJECT_HEADER`], [`CLIENT_ADDR_HEADER`]).
//! One session is one link connection; the same WebSocket limits apply on both hops, close
//! frames pass through unchanged, and a node that goes away mid-session closes its clients with
//! [`NODE_LOST_CODE`].
//!
//! The edge holds no tenant state: its tokens come from the configuration, and where a tenant's
//! node runs is its nodes backend's answer (`Backend`): a static tenant→node map, or on
//! Kubernetes the tenant's own pod, started on demand ([`crate::edge::kube`]). Any number of edges
//! can run behind one load balancer.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use http::HeaderMap;
use prometheus::Registry;
use rustls::pki_types::ServerName;
use serde_json::json;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::WebSocketStream;

mod link;
mod relay;
mod upgrade;

use crate::auth::AuthError;
use crate::config::nodes::{Nodes, NodesBackend};
use crate::config::Tenant;
use crate::credentials::config::Auth;
use crate::credentials::{Credentials, Lease};
use link::host_of;
pub use link::{LinkError, LinkMetrics, NodeAnswer};
pub use relay::{RelayCtx, PENDING_CLOSE_REASON};

pub mod headers;
pub mod kube;

/// Link upgrade header: the tenant the client authenticated as.
pub const TENANT_HEADER: &str = "x-codex-fleet-tenant";
/// Link upgrade header: who the client is (the credential that authenticated it),
/// percent-encoded ([`headers`]).
pub const SUBJECT_HEADER: &str = "x-codex-fleet-subject";
/// Link upgrade header: the client's address as the edge saw it.
pub const CLIENT_ADDR_HEADER: &str = "x-codex-fleet-client-addr";
/// Close code for a client whose tenant's node went away mid-session (1012, service restart):
/// reconnect, and `thread/resume` loads the thread from disk once the node is back.
pub const NODE_LOST_CODE: u16 = 1012;
/// Its reason.
pub const NODE_LOST_REASON: &str = "codex-fleet: the tenant's node went away; reconnect and resume";
/// Close code for a session whose tenant's node did not start in time (1013, try again later).
pub const NODE_STARTING_CODE: u16 = 1013;
/// Its reason.
pub const NODE_STARTING_REASON: &str =
    "codex-fleet: the tenant's node is still starting; retry after retryAfterMs";
/// Close code for a session whose tenant's node the backend cannot start (1011), and its
/// reason; the `-32001` answers carry the cause.
pub const NODE_START_FAILED_CODE: u16 = 1011;
/// Its reason.
pub const NODE_START_FAILED_REASON: &str =
    "codex-fleet: the tenant's node cannot start; the error's data.cause says why";

/// Close code for a session the tenant's node refused under its own limits after the client
/// was upgraded (on Kubernetes; its caps and rates hold over every edge in front of it): 1013,
/// try again later. The `-32001` answers carry the node's scope and reason.
pub const NODE_REFUSED_CODE: u16 = 1013;
/// Its reason.
pub const NODE_REFUSED_REASON: &str =
    "codex-fleet: the tenant's node refused the session under its limits; retry after retryAfterMs";

/// Close code for a session this edge has no descriptor for (its link would take one from the
/// reserve, [`crate::descriptors`]): 1013, try again later, at this edge or another.
pub const EDGE_FULL_CODE: u16 = 1013;
/// Its reason.
pub const EDGE_FULL_REASON: &str =
    "codex-fleet: this edge is at its open-files limit; retry after retryAfterMs";

/// The link to one node.
pub(crate) type Link = WebSocketStream<TlsStream<TcpStream>>;

/// The edge: who is who, where each tenant lives, and how to reach it.
pub struct Edge {
    table: RwLock<Table>,
    backend: Backend,
    tls: TlsConnector,
    /// The link's client pair and node CA bundle, as their files hold them now (renewed in
    /// place).
    link_files: crate::tls::Watched,
    connect_timeout: Duration,
    max_message_bytes: usize,
    reach: RwLock<HashMap<String, Option<String>>>,
    metrics: LinkMetrics,
}

/// Credentials and the tenant→node map (replaced by a reload).
struct Table {
    credentials: Arc<Credentials>,
    /// Tenant id → node name.
    tenants: HashMap<String, String>,
}

struct Target {
    addr: String,
    server_name: ServerName<'static>,
    /// On Kubernetes, the uid of the pod dialled: if it cannot be reached, whether that pod has
    /// gone meanwhile ([`kube::KubeNodes::went_away`]).
    pod_uid: Option<String>,
}

/// Where tenants' nodes are: "where is this tenant's node (start it if needed)".
enum Backend {
    /// Nodes named in the configuration, each tenant assigned to one (`tenants[].node`).
    Static(HashMap<String, Target>),
    /// A pod per tenant, created on demand (`[nodes.kubernetes]`).
    Kubernetes(Arc<crate::edge::kube::KubeNodes>),
}

/// A client the edge admitted: its tenant, its node and who it is.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The tenant.
    pub tenant: String,
    /// The node that holds it.
    pub node: String,
    /// Who the client is: its JWT's subject, or for a static token `token:` and the first 12
    /// hex digits of its digest (enough to tell tokens apart in logs, useless to an attacker).
    pub subject: String,
    /// `token` or `jwt`.
    pub kind: &'static str,
    /// Which credential (see [`crate::credentials::Verified::key_id`]).
    pub key_id: String,
    /// Ends the relay when the credential ends.
    pub lease: Lease,
}

// === impl Edge ===

impl Edge {
    /// Builds the edge from its `[nodes]`, the largest message relayed, and the tenants and
    /// `[auth]` whose clients it authenticates.
    pub fn build(
        nodes_cfg: &Nodes,
        max_message_bytes: usize,
        tenants: &[Tenant],
        auth: &Auth,
        registry: &Registry,
    ) -> anyhow::Result<Arc<Edge>> {
        let (tls, link_files) = crate::tls::client_config_mutual(
            &nodes_cfg.ca,
            &nodes_cfg.client_cert,
            &nodes_cfg.client_key,
        )?;
        let metrics = LinkMetrics::register(registry)?;
        let backend = if nodes_cfg.backend == NodesBackend::Kubernetes {
            let k = nodes_cfg.kubernetes.as_ref().ok_or_else(|| {
                anyhow::anyhow!("the kubernetes backend needs [nodes.kubernetes]")
            })?;
            Backend::Kubernetes(crate::edge::kube::KubeNodes::build(k, tenants, registry)?)
        } else {
            let mut nodes = HashMap::new();
            for n in &nodes_cfg.static_nodes {
                let host = n
                    .server_name
                    .clone()
                    .unwrap_or_else(|| host_of(&n.addr).to_owned());
                let server_name = ServerName::try_from(host.clone())
                    .map_err(|e| anyhow::anyhow!("node {}: server name {host:?}: {e}", n.name))?;
                nodes.insert(
                    n.name.clone(),
                    Target {
                        addr: n.addr.clone(),
                        server_name,
                        pod_uid: None,
                    },
                );
            }
            for name in nodes.keys() {
                metrics.sessions.with_label_values(&[name]);
                metrics.connect_seconds.with_label_values(&[name]);
                for reason in LinkMetrics::REASONS {
                    metrics.errors.with_label_values(&[name, reason]);
                }
            }
            Backend::Static(nodes)
        };
        let edge = Edge {
            table: RwLock::new(Table {
                credentials: Arc::new(Credentials::build(
                    tenants.iter().map(Tenant::credentials),
                    Some(auth),
                    None,
                )?),
                tenants: HashMap::new(),
            }),
            backend,
            tls: TlsConnector::from(tls),
            link_files,
            connect_timeout: Duration::from_millis(nodes_cfg.connect_timeout_ms),
            max_message_bytes,
            reach: RwLock::new(HashMap::new()),
            metrics,
        };
        edge.reload(tenants, auth)?;
        Ok(Arc::new(edge))
    }

    /// The link's TLS files, for the server to watch: a client pair renewed in place is presented
    /// by the next link, a CA bundle renewed in place checks the next node's certificate.
    pub fn link_files(&self) -> crate::tls::Watched {
        self.link_files.clone()
    }

    /// Puts a configuration's tokens and tenant→node map in force (the nodes themselves are
    /// fixed for the process's life).
    pub fn reload(&self, tenants: &[Tenant], auth: &Auth) -> anyhow::Result<()> {
        let mut homes = HashMap::new();
        match &self.backend {
            Backend::Static(nodes) => {
                for t in tenants {
                    let node = t.node.clone().unwrap_or_default();
                    if !nodes.contains_key(&node) {
                        anyhow::bail!(
                            "tenant {:?}: node {node:?} is not one this edge started with",
                            t.id
                        );
                    }
                    homes.insert(t.id.clone(), node);
                }
            }
            Backend::Kubernetes(kube) => {
                // Each tenant's node is its own pod.
                for t in tenants {
                    homes.insert(t.id.clone(), kube.pod_name(&t.id));
                }
            }
        }
        let credentials = {
            let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
            Arc::new(Credentials::build(
                tenants.iter().map(Tenant::credentials),
                Some(auth),
                Some(&table.credentials),
            )?)
        };
        if let Backend::Kubernetes(kube) = &self.backend {
            kube.reload(tenants)?;
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        *table = Table {
            credentials,
            tenants: homes,
        };
        table.credentials.commit();
        Ok(())
    }

    /// Authenticates an upgrade (its credential, then its `Origin`).
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Admitted, AuthError> {
        let credentials = self
            .table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .credentials
            .clone();
        let v = credentials.admit(headers).await?;
        let node = self
            .table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .tenants
            .get(&v.tenant)
            .cloned()
            .ok_or(AuthError::UnknownTenant)?;
        tracing::info!(tenant = %v.tenant, subject = %crate::untrusted::Untrusted::text(&v.subject), kind = v.kind, key = %v.key_id, "authenticated");
        Ok(Admitted {
            tenant: v.tenant,
            node,
            subject: v.subject,
            kind: v.kind,
            key_id: v.key_id,
            lease: v.lease,
        })
    }

    /// `/readyz` detail: each node and whether it was reachable at the last look, and the
    /// tenants whose node is not. Ready while any node is reachable (or none was probed yet).
    pub fn readiness(&self) -> (bool, serde_json::Value) {
        let nodes = match &self.backend {
            Backend::Static(nodes) => nodes,
            Backend::Kubernetes(kube) => return kube.readiness(),
        };
        let reach = self.reach.read().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<&String> = nodes.keys().collect();
        names.sort();
        let nodes: Vec<_> = names
            .iter()
            .map(|n| {
                let error = reach.get(*n).cloned().flatten();
                json!({
                    "name": n,
                    "addr": nodes[*n].addr,
                    "reachable": error.is_none(),
                    "lastError": error,
                })
            })
            .collect();
        let down: HashSet<&str> = reach
            .iter()
            .filter(|(_, e)| e.is_some())
            .map(|(n, _)| n.as_str())
            .collect();
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        let unreachable: Vec<&str> = table
            .tenants
            .iter()
            .filter(|(_, node)| down.contains(node.as_str()))
            .map(|(t, _)| t.as_str())
            .collect();
        let ready = nodes.is_empty() || down.len() < nodes.len();
        (
            ready,
            json!({ "nodes": nodes, "unreachableTenants": unreachable }),
        )
    }

    /// Watches the tenant pods (kubernetes backend) while the returned handle lives.
    pub fn spawn_watch(&self) -> Option<tokio_util::task::AbortOnDropHandle<()>> {
        match &self.backend {
            Backend::Static(_) => None,
            Backend::Kubernetes(kube) => Some(kube.spawn_watch()),
        }
    }

    /// Whether sessions wait for their tenant's node after the upgrade (the kubernetes
    /// backend starts nodes on demand; a static node is there or not).
    pub fn starts_nodes(&self) -> bool {
        matches!(self.backend, Backend::Kubernetes(_))
    }
}
