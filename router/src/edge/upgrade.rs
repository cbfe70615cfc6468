//! The edge's upgrade (docs/decisions/0016-every-hop-holds-like-serve.md): after the shared
//! listener has taken the TLS handshake and a valid WebSocket upgrade request, the edge
//! authenticates the client, holds its connection caps, opens the session's link to the
//! tenant's node (so a node that is down or refuses is answered with HTTP, before any 101) and
//! relays the session frame by frame ([`super::relay`]). With a backend that starts nodes (a pod on
//! Kubernetes) the client is upgraded at once and its session waits for the node.

use std::sync::Arc;

use http::{header, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use super::{Admitted, Edge, Link, LinkError, RelayCtx};
use crate::admission::{ConnectionGuard, Rejection};
use crate::door::{switching_protocols, Door};

/// How long a client whose tenant's node is unreachable is asked to wait.
const NODE_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

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
                retry_after,
                body,
            }) => {
                tracing::info!(tenant = %who.tenant, %node, status, "the node refused the session");
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                let mut r = door.plain(status, "node_refused", &body);
                if let Some(v) = retry_after {
                    r.headers_mut().insert(header::RETRY_AFTER, v);
                }
                return r;
            }
            Err(e) => {
                tracing::warn!(tenant = %who.tenant, error = %e, "upgrade refused: node unavailable");
                let r = Rejection::cap(
                    crate::admission::Scope::Worker,
                    crate::admission::Reason::NodeUnavailable,
                    NODE_RETRY,
                );
                return door.overloaded(&r, "node_unavailable");
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
        };
        let span = tracing::info_span!("relay", tenant = %who.tenant, node = %who.node, subject = %crate::untrusted::Untrusted::text(&who.subject));
        let audit = door.audit.clone();
        let client = door.addr;
        let edge = self.clone();
        door.spawn_upgraded(on_upgrade, started, span, move |ws| async move {
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
}
