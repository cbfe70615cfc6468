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
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use rustls::pki_types::ServerName;
use serde_json::json;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

pub mod config;
mod relay;
mod upgrade;

use crate::auth::AuthError;
use crate::config::Tenant;
use crate::credentials::config::Auth;
use crate::credentials::{Credentials, Lease};
use crate::jsonrpc::RequestId;
use config::{Nodes, NodesBackend};
use relay::{Relay, Waited};
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
/// How long a session refused with `nodeStartFailed` before its first request waits for it.
const START_FAILED_LINGER: Duration = Duration::from_secs(2);
/// How long a session refused with `nodeStartFailed` is told to wait (an operator must act).
const NODE_START_FAILED_RETRY: Duration = Duration::from_secs(30);

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

/// Why a link could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The node did not answer in time, or refused TCP or TLS.
    #[error("node {node} unreachable: {reason}")]
    Unreachable {
        /// The node.
        node: String,
        /// What failed.
        reason: String,
    },
    /// The node answered the upgrade with an HTTP status (its admission, a tenant it does not
    /// hold).
    #[error("node {node} refused the session: HTTP {status}")]
    Refused {
        /// The node.
        node: String,
        /// The status.
        status: u16,
        /// Its `Retry-After`, when given.
        retry_after: Option<HeaderValue>,
        /// Its body.
        body: String,
    },
    /// The session's identity cannot be carried on the link ([`headers::HeaderError`]): the
    /// session's error, not the node's (no link error is counted, readiness is untouched).
    #[error("node {node}: {source}")]
    Session {
        /// The node.
        node: String,
        /// What cannot be carried.
        source: headers::HeaderError,
    },
    /// The tenant's node is not ready within the backend's start timeout.
    #[error("node {node} still starting")]
    Starting {
        /// The node (pod).
        node: String,
        /// When to try again.
        retry_after: Duration,
    },
    /// The backend cannot start the tenant's node (the API server refused it for good).
    #[error("node {node} cannot start: {cause}")]
    StartFailed {
        /// The node (pod).
        node: String,
        /// Why, for the client (never a secret).
        cause: String,
    },
}

/// Link metrics, by node.
#[derive(Clone)]
pub struct LinkMetrics {
    /// Sessions relayed now, by node.
    pub sessions: IntGaugeVec,
    /// Link failures, by node and reason (`unreachable`, `refused`, `lost`).
    pub errors: IntCounterVec,
    /// Opening a link (TCP, TLS, upgrade), by node.
    pub connect_seconds: HistogramVec,
}

impl LinkMetrics {
    /// Every link failure reason.
    pub const REASONS: [&'static str; 3] = ["unreachable", "refused", "lost"];

    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = LinkMetrics {
            sessions: IntGaugeVec::new(
                Opts::new(
                    "codex_fleet_link_sessions",
                    "Sessions this edge relays to each node.",
                ),
                &["node"],
            )?,
            errors: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_link_errors_total",
                    "Edge-to-node link failures, by node and reason.",
                ),
                &["node", "reason"],
            )?,
            connect_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "codex_fleet_link_connect_duration_seconds",
                    "Opening a session's link to its node: TCP, mutual TLS and the upgrade.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                ]),
                &["node"],
            )?,
        };
        registry.register(Box::new(m.sessions.clone()))?;
        registry.register(Box::new(m.errors.clone()))?;
        registry.register(Box::new(m.connect_seconds.clone()))?;
        Ok(m)
    }
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

    /// Where the tenant's node is; on Kubernetes its pod, started if needed (the session
    /// waits, up to the backend's start timeout).
    async fn target(&self, who: &Admitted) -> Result<Target, LinkError> {
        match &self.backend {
            Backend::Static(nodes) => nodes
                .get(&who.node)
                .map(|t| Target {
                    addr: t.addr.clone(),
                    server_name: t.server_name.clone(),
                })
                .ok_or_else(|| LinkError::Unreachable {
                    node: who.node.clone(),
                    reason: "unknown node".into(),
                }),
            Backend::Kubernetes(kube) => {
                let server_name =
                    ServerName::try_from(kube.server_name().to_owned()).map_err(|e| {
                        LinkError::Unreachable {
                            node: who.node.clone(),
                            reason: format!("server name: {e}"),
                        }
                    })?;
                match kube.locate(&who.tenant).await {
                    Ok(pod) => Ok(Target {
                        addr: pod.addr.to_string(),
                        server_name,
                    }),
                    Err(crate::edge::kube::StartError::Timeout(_)) => Err(LinkError::Starting {
                        node: who.node.clone(),
                        retry_after: kube.retry_after(),
                    }),
                    Err(e @ crate::edge::kube::StartError::Refused { .. }) => {
                        Err(LinkError::StartFailed {
                            node: who.node.clone(),
                            cause: e.to_string(),
                        })
                    }
                }
            }
        }
    }

    /// Opens a session's link to its tenant's node.
    pub async fn connect(&self, who: &Admitted, client: SocketAddr) -> Result<Link, LinkError> {
        // A node that did not or cannot start is counted by the backend
        // (`codex_fleet_node_start_failures_total`), never as an unreachable node.
        let target = self.target(who).await?;
        let started = tokio::time::Instant::now();
        let result = tokio::time::timeout(self.connect_timeout, self.open(who, &target, client))
            .await
            .unwrap_or_else(|_| {
                Err(LinkError::Unreachable {
                    node: who.node.clone(),
                    reason: format!("no link within {:?}", self.connect_timeout),
                })
            });
        match &result {
            Ok(_) => self
                .metrics
                .connect_seconds
                .with_label_values(&[&who.node])
                .observe(started.elapsed().as_secs_f64()),
            // Not the node's failure: neither counted against it nor its readiness.
            Err(LinkError::Session { .. }) => {}
            Err(e) => {
                let reason = match e {
                    LinkError::Unreachable { .. }
                    | LinkError::Starting { .. }
                    | LinkError::StartFailed { .. } => "unreachable",
                    LinkError::Refused { .. } | LinkError::Session { .. } => "refused",
                };
                self.metrics
                    .errors
                    .with_label_values(&[&who.node, reason])
                    .inc();
                if matches!(e, LinkError::Unreachable { .. }) {
                    self.set_reach(&who.node, Some(e.to_string()));
                }
            }
        }
        result
    }

    async fn open(
        &self,
        who: &Admitted,
        target: &Target,
        client: SocketAddr,
    ) -> Result<Link, LinkError> {
        let node = &who.node;
        let unreachable = |reason: String| LinkError::Unreachable {
            node: node.clone(),
            reason,
        };
        // Before any connection: a session whose identity cannot travel is its own error.
        let identity = headers::build(&who.tenant, &who.subject, client).map_err(|source| {
            LinkError::Session {
                node: node.clone(),
                source,
            }
        })?;
        let tls = self.tls_to(target).await.map_err(unreachable)?;
        let mut request = format!("wss://{}/", target.addr)
            .into_client_request()
            .map_err(|e| unreachable(e.to_string()))?;
        let h = request.headers_mut();
        for (name, value) in identity {
            h.insert(name, value);
        }
        let config = proto::ws::client_config(self.max_message_bytes);
        match tokio_tungstenite::client_async_with_config(request, tls, Some(config)).await {
            Ok((ws, _)) => {
                self.set_reach(node, None);
                Ok(ws)
            }
            Err(WsError::Http(resp)) => {
                let body = resp
                    .body()
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).trim().to_owned())
                    .unwrap_or_default();
                Err(LinkError::Refused {
                    node: node.clone(),
                    status: resp.status().as_u16(),
                    retry_after: resp.headers().get(http::header::RETRY_AFTER).cloned(),
                    body,
                })
            }
            Err(e) => Err(unreachable(e.to_string())),
        }
    }

    async fn tls_to(&self, target: &Target) -> Result<TlsStream<TcpStream>, String> {
        let tcp = TcpStream::connect(&target.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", target.addr))?;
        let _nodelay = tcp.set_nodelay(true);
        self.tls
            .connect(target.server_name.clone(), tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", target.addr))
    }

    fn set_reach(&self, node: &str, error: Option<String>) {
        self.reach
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(node.to_owned(), error);
    }

    /// Probes every node (TCP and mutual TLS) every `every`, for `/readyz`; stops when dropped.
    pub fn spawn_prober(
        self: &Arc<Self>,
        every: Duration,
    ) -> tokio_util::task::AbortOnDropHandle<()> {
        let edge = Arc::downgrade(self);
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            loop {
                let Some(e) = edge.upgrade() else { return };
                let nodes = match &e.backend {
                    Backend::Static(nodes) => nodes,
                    Backend::Kubernetes(kube) => {
                        let kube = kube.clone();
                        drop(e);
                        kube.probe().await;
                        drop(kube);
                        tokio::time::sleep(every).await;
                        continue;
                    }
                };
                for (name, target) in nodes {
                    let outcome = tokio::time::timeout(e.connect_timeout, e.tls_to(target)).await;
                    let error = match outcome {
                        Ok(Ok(_tls)) => None,
                        Ok(Err(reason)) => Some(reason),
                        Err(_) => Some(format!("no TLS within {:?}", e.connect_timeout)),
                    };
                    e.set_reach(name, error);
                }
                drop(e);
                tokio::time::sleep(every).await;
            }
        }))
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

    /// The session of an upgraded client whose node may still be starting: its messages are
    /// held while the backend starts the node (up to its start timeout; bounded in messages
    /// and bytes, and ended with the credential), then sent on, in order. A node that does not
    /// start in time answers every held request with `-32001` (scope `worker`, reason
    /// `nodeStarting`, `retryAfterMs`) and closes with [`NODE_STARTING_CODE`]; a node that
    /// cannot be reached, with reason `nodeUnavailable`.
    pub async fn wait_and_relay<C>(
        &self,
        client: WebSocketStream<C>,
        who: &Admitted,
        addr: SocketAddr,
        ctx: RelayCtx,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let mut relay = Relay::new(client, ctx);
        let (link, pending) = match relay.wait(self.connect(who, addr), &who.lease).await {
            Waited::Linked(link, pending) => (link, pending),
            Waited::Ended(ending) => return relay.end(ending).await,
            Waited::Failed(e, pending) => {
                let (reason, retry_after, code, text) = match &e {
                    LinkError::Starting { retry_after, .. } => (
                        crate::admission::Reason::NodeStarting,
                        *retry_after,
                        NODE_STARTING_CODE,
                        NODE_STARTING_REASON,
                    ),
                    LinkError::StartFailed { .. } => (
                        crate::admission::Reason::NodeStartFailed,
                        NODE_START_FAILED_RETRY,
                        NODE_START_FAILED_CODE,
                        NODE_START_FAILED_REASON,
                    ),
                    _ => (
                        crate::admission::Reason::NodeUnavailable,
                        Duration::from_secs(2),
                        NODE_LOST_CODE,
                        NODE_LOST_REASON,
                    ),
                };
                tracing::warn!(tenant = %who.tenant, error = %e, "session refused: no node");
                let r = crate::admission::Rejection::cap(
                    crate::admission::Scope::Worker,
                    reason,
                    retry_after,
                );
                // A start that cannot succeed is answered with its cause; a refusal can come
                // before the client's first request has arrived, so that request is waited for
                // (briefly) rather than the session closed bare.
                let (cause, linger) = match &e {
                    LinkError::StartFailed { cause, .. } => {
                        (Some(cause.clone()), Some(START_FAILED_LINGER))
                    }
                    _ => (None, None),
                };
                let answer = |id: &RequestId| match &cause {
                    Some(cause) => {
                        let mut data = r.to_error_data();
                        data["cause"] = json!(cause);
                        proto::error::overloaded_response(id, data)
                    }
                    None => r.to_error_response(id),
                };
                return relay.refuse(pending, answer, linger, code, text).await;
            }
        };
        self.relay_pending(relay, link, who, pending).await;
    }

    /// Relays one session between its client and its link until either ends (see the module
    /// documentation for what each end means for the other; `edge/relay.rs` for its bounds).
    pub async fn relay<C>(
        &self,
        client: WebSocketStream<C>,
        link: Link,
        who: &Admitted,
        ctx: RelayCtx,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        self.relay_pending(Relay::new(client, ctx), link, who, Vec::new())
            .await;
    }

    async fn relay_pending<C>(
        &self,
        relay: Relay<C>,
        link: Link,
        who: &Admitted,
        pending: Vec<Message>,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let node = who.node.as_str();
        let sessions = self.metrics.sessions.with_label_values(&[node]);
        sessions.inc();
        let relayed = |lost: bool| {
            sessions.dec();
            if lost {
                self.metrics.errors.with_label_values(&[node, "lost"]).inc();
                tracing::warn!(node, "link lost: the node went away mid-session");
            }
        };
        relay.run(link, pending, &who.lease, relayed).await;
    }
}

/// The host part of `host:port` (brackets of an IPv6 literal removed).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}
