//! The edge's upgrade (docs/decisions/0016-every-hop-holds-like-serve.md): after the shared
//! listener has taken the TLS handshake and a valid WebSocket upgrade request, the edge
//! authenticates the client, holds its connection caps, opens the session's link to the
//! tenant's node (so a node that is down or refuses is answered with HTTP, before any 101) and
//! relays the session frame by frame ([`super::relay`]). With a backend that starts nodes (a pod on
//! Kubernetes) the client is upgraded at once and its session waits for the node.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use serde_json::json;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::relay::{Relay, Waited};
use super::{
    Admitted, Edge, Link, LinkError, RelayCtx, EDGE_FULL_CODE, EDGE_FULL_REASON, NODE_LOST_CODE,
    NODE_LOST_REASON, NODE_REFUSED_CODE, NODE_REFUSED_REASON, NODE_STARTING_CODE,
    NODE_STARTING_REASON, NODE_START_FAILED_CODE, NODE_START_FAILED_REASON,
};
use proto::rpc::RequestId;

use crate::admission::{ConnectionGuard, Rejection};
use crate::door::{switching_protocols, Door};

/// How long a client whose tenant's node is unreachable is asked to wait.
const NODE_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a session refused with `nodeStartFailed`, or by its node's limits, before its first
/// request waits for it.
const START_FAILED_LINGER: Duration = Duration::from_secs(2);
/// How long a session refused with `nodeStartFailed` is told to wait (an operator must act).
const NODE_START_FAILED_RETRY: Duration = Duration::from_secs(30);

// === impl Edge ===

impl Edge {
    /// The edge's upgrade: authenticate, open the session's link to the tenant's node (so a
    /// node that is down or refuses is answered here, with HTTP), then answer 101 and relay.
    pub async fn upgrade(
        self: &Arc<Self>,
        door: &Door,
        req: Request<Incoming>,
        key: &str,
        started: tokio::time::Instant,
    ) -> Response<Full<Bytes>> {
        let who = match self.authenticate(req.headers()).await {
            Ok(w) => w,
            Err(e) => return door.auth_refused(&e),
        };
        door.audit_admitted(&who.tenant, &who.subject, who.kind, &who.key_id);
        // The edge holds the connection caps itself, before the 101 and before any link
        // (docs/decisions/0016-every-hop-holds-like-serve.md); the guard lives as long as the
        // relayed session, waiting included.
        let guard: ConnectionGuard = match door.admission.open_connection(&who.tenant) {
            Ok(g) => g,
            Err(r) => {
                tracing::info!(tenant = %who.tenant, scope = r.scope.as_str(), "upgrade refused: connection cap");
                return door.overloaded(&r, "connection_cap");
            }
        };
        if self.starts_nodes() {
            // The tenant's node may have to start first (a pod on Kubernetes): the client is
            // upgraded now and its session waits, longer than a handshake may take.
            return self.spawn_relay(door, req, key, started, (who, guard), None);
        }
        let link = match self.connect(&who, door.addr).await {
            Ok(link) => link,
            Err(LinkError::Refused {
                node,
                status,
                headers,
                body,
                answer: _,
            }) => {
                tracing::info!(tenant = %who.tenant, %node, status, "the node refused the session");
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                // Its body, `Retry-After` and refusal header, with no wait over an hour.
                let body = crate::admission::bounded_refusal_body(&body).unwrap_or(body);
                let mut r = door.plain(status, "node_refused", &body);
                r.headers_mut().extend(super::link::passed_on(&headers));
                return r;
            }
            Err(e) => {
                // An edge out of descriptors is its own limit, not the node's: a full fleet here,
                // for now.
                let (scope, reason) = e.refusal();
                let label = match e {
                    LinkError::Descriptors { .. } => "edge_descriptors",
                    _ => "node_unavailable",
                };
                tracing::warn!(tenant = %who.tenant, error = %e, reason = reason.as_str(), "upgrade refused: no link to the node");
                return door.overloaded(&Rejection::cap(scope, reason, NODE_RETRY), label);
            }
        };
        self.spawn_relay(door, req, key, started, (who, guard), Some(link))
    }

    /// Answers 101 and relays the session: over `link`, or, with none, once the tenant's node
    /// has started ([`Edge::wait_and_relay`], the kubernetes backend).
    fn spawn_relay(
        self: &Arc<Self>,
        door: &Door,
        mut req: Request<Incoming>,
        key: &str,
        started: tokio::time::Instant,
        (who, guard): (Admitted, ConnectionGuard),
        link: Option<Link>,
    ) -> Response<Full<Bytes>> {
        let accept = derive_accept_key(key.as_bytes());
        let on_upgrade = hyper::upgrade::on(&mut req);
        let ctx = RelayCtx {
            guard,
            metrics: door.metrics.clone(),
            admission: door.admission.clone(),
            client_queue: door.client_queue,
            client_queue_bytes: door.client_queue_bytes,
            tenant_queue_bytes: door.tenant_queue_bytes,
            shutdown: door.shutdown.clone(),
            client_read: door
                .admission
                .read_meter(&who.tenant, door.tenant_queue_bytes),
        };
        let span = tracing::info_span!("relay", tenant = %who.tenant, node = %who.node, subject = %crate::untrusted::Untrusted::text(&who.subject));
        let audit = door.audit.clone();
        let client = door.addr;
        let edge = self.clone();
        let meter = ctx.client_read.clone();
        door.spawn_upgraded(on_upgrade, started, span, meter, move |ws| async move {
            match link {
                Some(link) => {
                    tracing::info!("relaying the session to its node");
                    edge.relay(ws, link, &who, ctx).await;
                }
                None => edge.wait_and_relay(ws, &who, client, ctx).await,
            }
            tracing::info!("relay ended");
            audit.record(
                "session.ended",
                serde_json::json!({ "tenant": who.tenant, "subject": who.subject, "node": who.node, "remote": client.to_string() }),
            );
        });
        switching_protocols(&accept)
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
        // Boxed: waiting (the node's connect and TLS handshake inside it) takes kilobytes more
        // than relaying, and the task would otherwise keep them for as long as it relays;
        // the linked path shares the task's code, so every edge session would.
        let waited = Box::pin(relay.wait(self.connect(who, addr), &who.lease)).await;
        let (link, pending) = match waited {
            Waited::Linked(link, pending) => (link, pending),
            Waited::Ended(ending) => return relay.end(ending).await,
            Waited::Failed(e, pending) => {
                // The node refused the session under its own limits (its caps and rates hold
                // over every edge in front of it): the client learns the node's refusal, as
                // `serve`'s client would, not that the node went away.
                if let Some(r) = e.node_refusal() {
                    // What the node said, as it said it: a newer node's reason this edge reads
                    // as `nodeOverloaded` is named here.
                    let said = e.refusal_header().unwrap_or_default();
                    tracing::info!(tenant = %who.tenant, scope = r.scope.as_str(), reason = r.reason.as_str(), node_said = %crate::untrusted::Untrusted::text(&said), "session refused by its node's limits");
                    let answer = |id: &RequestId| r.to_error_response(id);
                    return relay
                        .refuse(
                            pending,
                            r,
                            answer,
                            Some(START_FAILED_LINGER),
                            NODE_REFUSED_CODE,
                            NODE_REFUSED_REASON,
                        )
                        .await;
                }
                let (scope, reason) = e.refusal();
                let (retry_after, code, text) = match &e {
                    LinkError::Starting { retry_after, .. } => {
                        (*retry_after, NODE_STARTING_CODE, NODE_STARTING_REASON)
                    }
                    LinkError::StartFailed { .. } => (
                        NODE_START_FAILED_RETRY,
                        NODE_START_FAILED_CODE,
                        NODE_START_FAILED_REASON,
                    ),
                    LinkError::Descriptors { .. } => (NODE_RETRY, EDGE_FULL_CODE, EDGE_FULL_REASON),
                    _ => (NODE_RETRY, NODE_LOST_CODE, NODE_LOST_REASON),
                };
                tracing::warn!(tenant = %who.tenant, error = %e, "session refused: no node");
                let r = crate::admission::Rejection::cap(scope, reason, retry_after);
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
                return relay.refuse(pending, &r, answer, linger, code, text).await;
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
