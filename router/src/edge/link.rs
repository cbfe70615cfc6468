//! The link: the mutual-TLS WebSocket from the edge to a tenant's node, one per session. Where
//! the tenant's node is (the static map, or its pod), the TLS client side with the link's
//! certificate, the upgrade request that names who the session is ([`super::headers`]), the
//! prober that keeps `/readyz` true about each node, and the link metrics.

use std::net::SocketAddr;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Error as WsError;

use super::{headers, Admitted, Backend, Edge, Link, Target};
use crate::admission::{bounded_refusal_header, bounded_retry_after, Reason, Rejection, Scope};

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
        /// Its `Retry-After` and [`crate::admission::REFUSAL_HEADER`] (a codex-fleet node's
        /// refusal), those it gave, the first of each, as they came: a static edge passes them
        /// on bounded (`passed_on`).
        /// (Boxed: a rare answer, and it keeps [`LinkError`] within clippy's
        /// `result_large_err` bound.)
        headers: Box<http::HeaderMap>,
        /// Its body.
        body: String,
        /// What the status, header and body mean to this edge, read once with them
        /// (`LinkError::refused`).
        answer: NodeAnswer,
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
    /// This edge has no descriptor below its reserve for the link ([`crate::descriptors`]): the
    /// edge's own limit, not the node's (no link error is counted, readiness is untouched).
    #[error("no descriptor for a link to node {node}: {reason}")]
    Descriptors {
        /// The node.
        node: String,
        /// The limit and the reserve.
        reason: String,
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

impl LinkError {
    /// A node's HTTP answer to the upgrade (its status, headers and body), with what it means
    /// read once ([`NodeAnswer::read`]).
    fn refused(node: String, status: u16, headers: &http::HeaderMap, body: String) -> LinkError {
        // The first of each (a node sends one), as it came: what the node said, read here and
        // logged; a static edge passes them on bounded (`passed_on`).
        let mut kept = http::HeaderMap::new();
        for name in [
            http::header::RETRY_AFTER,
            http::HeaderName::from_static(crate::admission::REFUSAL_HEADER),
        ] {
            if let Some(v) = headers.get(&name) {
                kept.insert(name, v.clone());
            }
        }
        let answer = NodeAnswer::read(status, refusal_text(&kept).as_deref(), &body);
        LinkError::Refused {
            node,
            status,
            headers: Box::new(kept),
            body,
            answer,
        }
    }

    /// The admission refusal a session gets for this failure: the node's (scope `worker`), or,
    /// when the edge itself has no descriptor for the link, the edge's, as a full fleet.
    pub(super) fn refusal(&self) -> (Scope, Reason) {
        match self {
            LinkError::Starting { .. } => (Scope::Worker, Reason::NodeStarting),
            LinkError::StartFailed { .. } => (Scope::Worker, Reason::NodeStartFailed),
            LinkError::Descriptors { .. } => (Scope::Fleet, Reason::TooManyConnections),
            _ => (Scope::Worker, Reason::NodeUnavailable),
        }
    }

    /// The node refused the session under its own limits (its caps and rates): that refusal
    /// ([`NodeAnswer::Overloaded`]). `None` for any other failure.
    pub(super) fn node_refusal(&self) -> Option<&Rejection> {
        match self {
            LinkError::Refused {
                answer: NodeAnswer::Overloaded(r),
                ..
            } => Some(r),
            _ => None,
        }
    }

    /// What the node's [`crate::admission::REFUSAL_HEADER`] said, as it said it (as text,
    /// lossily), when it refused with one.
    pub(super) fn refusal_header(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            LinkError::Refused { headers, .. } => refusal_text(headers),
            _ => None,
        }
    }

    /// The node answered that it is draining ([`NodeAnswer::Draining`]).
    pub(super) fn draining(&self) -> bool {
        matches!(
            self,
            LinkError::Refused {
                answer: NodeAnswer::Draining,
                ..
            }
        )
    }
}

/// What a node's HTTP answer to the upgrade means to the edge's link, read once where the link
/// reads the answer (`NodeAnswer::read`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeAnswer {
    /// The node refused the session under its own limits (its caps and rates):
    /// [`Rejection::from_http`].
    Overloaded(Rejection),
    /// The node is draining (its process exits: idle, or its pod is being deleted):
    /// [`crate::admission::is_draining_answer`].
    Draining,
    /// Anything else: a tenant it does not hold, an error, a kind of answer this edge has no
    /// name for.
    Other,
}

impl NodeAnswer {
    /// Reads a node's `status`, its [`crate::admission::REFUSAL_HEADER`] when it sent one, and
    /// its `body`.
    pub(super) fn read(status: u16, header: Option<&str>, body: &str) -> NodeAnswer {
        if let Some(r) = Rejection::from_http(status, header, body) {
            NodeAnswer::Overloaded(r)
        } else if crate::admission::is_draining_answer(status, header, body) {
            NodeAnswer::Draining
        } else {
            NodeAnswer::Other
        }
    }
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

    pub(super) fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
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

/// How many times a session looks again for its tenant's pod after dialling one that went.
const REDIALS: u32 = 3;
/// How long an unreachable pod's session waits for the watch to say the pod went, before it is
/// refused (`nodeUnavailable`, 1012) as a node that is there and does not answer.
const GONE_WITHIN: Duration = Duration::from_secs(3);

/// The host part of `host:port` (brackets of an IPv6 literal removed).
pub(super) fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

// === impl Edge ===

impl Edge {
    /// Where the tenant's node is; on Kubernetes its pod, started if needed (the session
    /// waits, up to the backend's start timeout).
    pub(super) async fn target(&self, who: &Admitted) -> Result<Target, LinkError> {
        match &self.backend {
            Backend::Static(nodes) => nodes
                .get(&who.node)
                .map(|t| Target {
                    addr: t.addr.clone(),
                    server_name: t.server_name.clone(),
                    pod_uid: None,
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
                        pod_uid: Some(pod.uid),
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

    /// Opens a session's link to its tenant's node. On Kubernetes, a pod that cannot be reached
    /// because it has just gone (a force delete kills its node before the watch tells this edge),
    /// or that answers it is draining, is looked for again, so the session waits for the tenant's
    /// next pod instead of being refused; at most `REDIALS` times, and only once the watch says
    /// that pod went.
    pub async fn connect(&self, who: &Admitted, client: SocketAddr) -> Result<Link, LinkError> {
        let mut redials = 0;
        loop {
            // A node that did not or cannot start is counted by the backend
            // (`codex_fleet_node_start_failures_total`), never as an unreachable node.
            let target = self.target(who).await?;
            let result = self.dial(who, &target, client).await;
            // A pod that does not answer, or answers that it is draining (its node exits: idle,
            // or its pod is being deleted), may be going.
            let going = match &result {
                Err(LinkError::Unreachable { .. }) => true,
                Err(e) => e.draining(),
                _ => false,
            };
            if let (true, Backend::Kubernetes(kube), Some(uid)) =
                (going, &self.backend, &target.pod_uid)
            {
                if redials < REDIALS && kube.went_away(&who.tenant, uid, GONE_WITHIN).await {
                    redials += 1;
                    tracing::info!(tenant = %who.tenant, "the tenant's pod went away as the session dialled it; looking again");
                    continue;
                }
            }
            return result;
        }
    }

    /// One attempt at a link to `target`, within the connect timeout, counted.
    async fn dial(
        &self,
        who: &Admitted,
        target: &Target,
        client: SocketAddr,
    ) -> Result<Link, LinkError> {
        let started = tokio::time::Instant::now();
        let result = tokio::time::timeout(self.connect_timeout, self.open(who, target, client))
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
            Err(LinkError::Session { .. } | LinkError::Descriptors { .. }) => {}
            Err(e) => {
                let reason = match e {
                    LinkError::Unreachable { .. }
                    | LinkError::Starting { .. }
                    | LinkError::StartFailed { .. } => "unreachable",
                    LinkError::Refused { .. }
                    | LinkError::Session { .. }
                    | LinkError::Descriptors { .. } => "refused",
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

    pub(super) async fn open(
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
        // A link leaves the descriptors above the reserve's line to what the edge shares.
        let reserved = |e: std::io::Error| LinkError::Descriptors {
            node: node.clone(),
            reason: e.to_string(),
        };
        crate::descriptors::room().map_err(reserved)?;
        let tls = self.tls_to(target).await.map_err(unreachable)?;
        // Another thread took the free descriptor in between: this link is closed.
        crate::descriptors::check(tls.get_ref().0).map_err(reserved)?;
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
                Err(LinkError::refused(
                    node.clone(),
                    resp.status().as_u16(),
                    resp.headers(),
                    body,
                ))
            }
            Err(e) => Err(unreachable(e.to_string())),
        }
    }

    pub(super) async fn tls_to(&self, target: &Target) -> Result<TlsStream<TcpStream>, String> {
        let tcp = TcpStream::connect(&target.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", target.addr))?;
        crate::listener::tune(&tcp);
        self.tls
            .connect(target.server_name.clone(), tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", target.addr))
    }

    pub(super) fn set_reach(&self, node: &str, error: Option<String>) {
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
}

/// What a static edge passes on to its client of a node's refusal headers (those
/// [`LinkError::refused`] kept): no wait longer than an hour, the longest a refusal the edge reads
/// itself gives ([`crate::admission::Rejection::from_http`]), in the fields codex-fleet writes
/// waits in, whatever the node wrote there. Its `Retry-After` as whole seconds, at most an hour,
/// or none when it is not seconds ([`bounded_retry_after`]); its refusal header only when it is
/// visible ASCII, as codex-fleet's always is (readers differ on what other bytes say), with its
/// `retry-after-ms` fields bounded ([`bounded_refusal_header`]).
pub(super) fn passed_on(headers: &http::HeaderMap) -> http::HeaderMap {
    let mut out = http::HeaderMap::new();
    let retry_after = headers.get(http::header::RETRY_AFTER);
    if let Some(secs) = retry_after.and_then(|v| bounded_retry_after(v.as_bytes())) {
        out.insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
    }
    let refusal = headers.get(crate::admission::REFUSAL_HEADER);
    if let Some((v, text)) = refusal.and_then(|v| Some((v, v.to_str().ok()?))) {
        let v = match bounded_refusal_header(text) {
            None => Some(v.clone()),
            // Visible ASCII in, visible ASCII out: always a header again.
            Some(bounded) => http::HeaderValue::from_str(&bounded).ok(),
        };
        if let Some(v) = v {
            out.insert(crate::admission::REFUSAL_HEADER, v);
        }
    }
    out
}

/// A node's [`crate::admission::REFUSAL_HEADER`] as text, lossily: one that is not text is
/// still present (it fails to parse, and the body is not read instead).
fn refusal_text(headers: &http::HeaderMap) -> Option<std::borrow::Cow<'_, str>> {
    headers
        .get(crate::admission::REFUSAL_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()))
}

#[cfg(test)]
mod tests;
