//! Accepts TLS connections, authenticates the WebSocket upgrade and hands each one to a session.
//!
//! Admission at the door (docs/decisions/0007-admission-before-work.md): the per-source-address
//! handshake rate is checked right after `accept`, before any TLS work is started on the
//! connection's behalf, so that a refused address cannot reach token checking at all. Its answer
//! still has to be HTTP (429 with `Retry-After`, so a well-behaved client learns when to come
//! back), and HTTP only exists inside TLS here, so a refused connection completes its TLS handshake
//! (under the handshake timeout and the accept backstop) and gets 429. A failed authentication is
//! charged to the source address's handshake rate once more, so guessing tokens is throttled twice
//! as fast as connecting. The connection caps (per tenant, in total) need the tenant, so they apply
//! after authentication and answer 503 with `Retry-After`. The admitted connection's
//! [`ConnectionGuard`] lives as long as its session.
//!
//! Before the upgrade a connection gets one request and one deadline: every answer other than
//! 101 carries `Connection: close` and the connection is closed after it (no keep-alive, so
//! one connection cannot try token after token), and `handshake_timeout_secs` counts from
//! `accept` over the TLS handshake and the request together.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::admission::{Admission, ConnectionGuard, Rejection};
use crate::auth::AuthError;
use crate::credentials::Lease;
use crate::metrics::RouterMetrics;
use crate::session::{self, SessionCtx};
use crate::tenants::TenantRegistry;
use crate::untrusted::Untrusted;

/// Where a listener's sessions run, and how its clients prove who they are.
#[derive(Clone)]
pub enum Upstream {
    /// Here; clients present a tenant's bearer token (`codex-fleet serve`).
    Local,
    /// Here, for edges (`codex-fleet node`): mutual TLS admitted the edge, and the link's
    /// headers name the tenant ([`crate::edge::TENANT_HEADER`]).
    Link,
    /// On the tenants' nodes: this process is an edge and relays each session.
    Nodes(Arc<crate::edge::Edge>),
}

/// The remote address of a client connection.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

/// Everything the accept loop shares with connection tasks.
pub struct Listener {
    /// The bound TCP listener.
    pub tcp: TcpListener,
    /// TLS server side.
    pub tls: TlsAcceptor,
    /// Tenants and tokens.
    pub tenants: Arc<TenantRegistry>,
    /// Router metrics.
    pub metrics: RouterMetrics,
    /// Rates and caps; also bounds the TCP connections in flight (see [`accept_backstop`]).
    pub admission: Arc<Admission>,
    /// TLS handshake plus upgrade deadline.
    pub handshake_timeout: std::time::Duration,
    /// Largest message in either direction.
    pub max_message_bytes: usize,
    /// Frames queued towards one client.
    pub client_queue: usize,
    /// Bytes queued towards one client.
    pub client_queue_bytes: usize,
    /// Bytes queued towards all of one tenant's clients.
    pub tenant_queue_bytes: usize,
    /// Cancelled when draining refuses new connections (503 + Retry-After); sessions go on.
    pub refuse: CancellationToken,
    /// Cancelled to stop accepting and close sessions with 1001.
    pub shutdown: CancellationToken,
    /// Tracks every connection task.
    pub tracker: TaskTracker,
    /// Where sessions run.
    pub upstream: Upstream,
    /// The audit log.
    pub audit: crate::audit::Audit,
}

/// TCP connections allowed above `limits.max_connections` for handshakes in progress (and for
/// refusals being answered); beyond that, accepts wait.
const HANDSHAKE_HEADROOM: usize = 1024;

/// Open TCP connections at most: every admitted session plus the handshakes in progress.
pub fn accept_backstop(max_connections: usize) -> usize {
    max_connections.saturating_add(HANDSHAKE_HEADROOM)
}

struct Conn {
    tenants: Arc<TenantRegistry>,
    admission: Arc<Admission>,
    /// Set when the source address was over its handshake rate at accept: every request on
    /// this connection is answered 429.
    throttled: Option<Rejection>,
    metrics: RouterMetrics,
    max_message_bytes: usize,
    client_queue: usize,
    client_queue_bytes: usize,
    tenant_queue_bytes: usize,
    refuse: CancellationToken,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    addr: ClientAddr,
    upstream: Upstream,
    audit: crate::audit::Audit,
}

// === impl Listener ===

impl Listener {
    /// Accepts until shutdown; each connection runs in its own tracked task.
    pub async fn run(self) {
        let this = Arc::new(self);
        let backstop = accept_backstop(this.admission.config().max_connections);
        let connections = Arc::new(Semaphore::new(backstop));
        loop {
            let permit = tokio::select! {
                p = connections.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
                () = this.shutdown.cancelled() => return,
            };
            let (tcp, addr) = tokio::select! {
                r = this.tcp.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = this.shutdown.cancelled() => return,
            };
            this.metrics.connections_accepted.inc();
            let _nodelay = tcp.set_nodelay(true);
            // Edges are trusted peers of a node: their addresses carry many clients each.
            let throttled = match this.upstream {
                Upstream::Link => None,
                _ => this.admission.check_handshake(addr.ip()).err(),
            };
            let conn = Arc::new(Conn {
                tenants: this.tenants.clone(),
                admission: this.admission.clone(),
                throttled,
                metrics: this.metrics.clone(),
                max_message_bytes: this.max_message_bytes,
                client_queue: this.client_queue,
                client_queue_bytes: this.client_queue_bytes,
                tenant_queue_bytes: this.tenant_queue_bytes,
                refuse: this.refuse.clone(),
                shutdown: this.shutdown.clone(),
                tracker: this.tracker.clone(),
                addr: ClientAddr(addr),
                upstream: this.upstream.clone(),
                audit: this.audit.clone(),
            });
            let tls = this.tls.clone();
            let timeout = this.handshake_timeout;
            let span = tracing::info_span!("conn", client.addr = %addr);
            this.tracker.spawn(
                async move {
                    let _permit = permit;
                    conn.serve(tls, tcp, timeout).await;
                }
                .instrument(span),
            );
        }
    }
}

// === impl Conn ===

impl Conn {
    async fn serve(
        self: Arc<Self>,
        tls: TlsAcceptor,
        tcp: tokio::net::TcpStream,
        timeout: std::time::Duration,
    ) {
        let started = tokio::time::Instant::now();
        // One deadline from accept to upgrade, whatever the client spends it on.
        let deadline = started + timeout;
        let stream = match tokio::time::timeout_at(deadline, tls.accept(tcp)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                self.refused("tls");
                return;
            }
            Err(_) => {
                self.refused("handshake_timeout");
                return;
            }
        };
        let this = self.clone();
        let service = service_fn(move |req| {
            let this = this.clone();
            async move { Ok::<_, Infallible>(this.upgrade(req, started).await) }
        });
        let conn = http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(deadline.saturating_duration_since(tokio::time::Instant::now()))
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        // The connection future ends when the request is answered and, for 101, handed over
        // to the session task; past the deadline the connection is dropped (closed).
        match tokio::time::timeout_at(deadline, conn).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "HTTP connection ended with an error"),
            Err(_) => self.refused("handshake_timeout"),
        }
    }

    /// A failed authentication costs the source address one more handshake: over its rate,
    /// its next connections are answered 429.
    fn charge_failed_auth(&self) {
        // Refused or not, the attempt is counted; the refusal shows on the next connection.
        let _charged = self.admission.check_handshake(self.addr.0.ip());
    }

    fn refused(&self, reason: &str) {
        self.metrics
            .upgrades_refused
            .with_label_values(&[reason])
            .inc();
    }

    fn plain(&self, status: StatusCode, reason: &str, body: &str) -> Response<Full<Bytes>> {
        self.refused(reason);
        let mut resp = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        // Every answer but 101 is the connection's last.
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        resp
    }

    /// A credential that does not authenticate: 401, charged to the source address; or an
    /// `Origin` the tenant does not allow: 403.
    fn auth_refused(&self, e: &AuthError) -> Response<Full<Bytes>> {
        let reason = e.reason();
        tracing::info!(reason, "upgrade refused: {e}");
        self.audit.record(
            "authentication.failed",
            serde_json::json!({ "reason": reason, "remote": self.addr.0.to_string() }),
        );
        if *e != AuthError::Origin {
            self.charge_failed_auth();
        }
        self.plain(e.status(), reason, &e.to_string())
    }

    fn audit_admitted(&self, tenant: &str, subject: &str, kind: &str, key_id: &str) {
        self.audit.record(
            "authentication.succeeded",
            serde_json::json!({
                "tenant": tenant, "subject": subject, "credential": kind, "key_id": key_id,
                "remote": self.addr.0.to_string(),
            }),
        );
    }

    /// The edge's upgrade: authenticate, open the session's link to the tenant's node (so a
    /// node that is down or refuses is answered here, with HTTP), then answer 101 and relay.
    async fn relay(
        self: &Arc<Self>,
        edge: Arc<crate::edge::Edge>,
        req: Request<Incoming>,
        key: &str,
        started: tokio::time::Instant,
    ) -> Response<Full<Bytes>> {
        let who = match edge.authenticate(req.headers()).await {
            Ok(w) => w,
            Err(e) => return self.auth_refused(&e),
        };
        self.audit_admitted(&who.tenant, &who.subject, who.kind, &who.key_id);
        // The edge holds the connection caps itself, before the 101 and before any link
        // (docs/decisions/0016-every-hop-holds-like-serve.md); the guard lives as long as the
        // relayed session, waiting included.
        let guard: ConnectionGuard = match self.admission.open_connection(&who.tenant) {
            Ok(g) => g,
            Err(r) => {
                tracing::info!(tenant = %who.tenant, scope = r.scope.as_str(), "upgrade refused: connection cap");
                return self.overloaded(&r, "connection_cap");
            }
        };
        if edge.starts_nodes() {
            // The tenant's node may have to start first (a pod on Kubernetes): the client is
            // upgraded now and its session waits, longer than a handshake may take.
            return self.spawn_relay(edge, req, key, started, (who, guard), None);
        }
        let link = match edge.connect(&who, self.addr.0).await {
            Ok(link) => link,
            Err(crate::edge::LinkError::Refused {
                node,
                status,
                retry_after,
                body,
            }) => {
                tracing::info!(tenant = %who.tenant, %node, status, "the node refused the session");
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                let mut r = self.plain(status, "node_refused", &body);
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
                return self.overloaded(&r, "node_unavailable");
            }
        };
        self.spawn_relay(edge, req, key, started, (who, guard), Some(link))
    }

    /// Answers 101 and relays the session: over `link`, or, with none, once the tenant's node
    /// has started ([`crate::edge::Edge::wait_and_relay`], the kubernetes backend).
    fn spawn_relay(
        self: &Arc<Self>,
        edge: Arc<crate::edge::Edge>,
        mut req: Request<Incoming>,
        key: &str,
        started: tokio::time::Instant,
        (who, guard): (crate::edge::Admitted, ConnectionGuard),
        link: Option<crate::edge::Link>,
    ) -> Response<Full<Bytes>> {
        let accept = derive_accept_key(key.as_bytes());
        let on_upgrade = hyper::upgrade::on(&mut req);
        let ctx = crate::edge::RelayCtx {
            guard,
            metrics: self.metrics.clone(),
            admission: self.admission.clone(),
            client_queue: self.client_queue,
            client_queue_bytes: self.client_queue_bytes,
            tenant_queue_bytes: self.tenant_queue_bytes,
            shutdown: self.shutdown.clone(),
        };
        let span = tracing::info_span!("relay", tenant = %who.tenant, node = %who.node, subject = %crate::untrusted::Untrusted::text(&who.subject));
        let audit = self.audit.clone();
        let client = self.addr.0;
        self.spawn_upgraded(on_upgrade, started, span, move |ws| async move {
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

    /// An admission refusal: 429 (rates) or 503 (caps) with `Retry-After`, and the connection
    /// is closed after the answer.
    fn overloaded(&self, r: &Rejection, reason: &str) -> Response<Full<Bytes>> {
        self.metrics.rejected(r);
        let status =
            StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut resp = self.plain(
            status,
            reason,
            &format!(
                "{} (scope {}, reason {}); retry after {} ms",
                crate::admission::OVERLOADED_MESSAGE,
                r.scope.as_str(),
                r.reason.as_str(),
                r.retry_after_ms_jittered()
            ),
        );
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(r.retry_after_secs()));
        resp
    }

    /// Checks the upgrade request; on success answers 101 and starts the session task.
    async fn upgrade(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        started: tokio::time::Instant,
    ) -> Response<Full<Bytes>> {
        if let Some(r) = &self.throttled {
            return self.overloaded(r, "handshake_rate");
        }
        if req.uri().path() != "/" {
            return self.plain(
                StatusCode::NOT_FOUND,
                "path",
                "not found: the WebSocket endpoint is /",
            );
        }
        if self.shutdown.is_cancelled() || self.refuse.is_cancelled() {
            let mut r = self.plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "draining",
                "codex-fleet is shutting down",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            return r;
        }
        let key = match websocket_key(&req) {
            Some(k) => k,
            None => {
                let mut r = self.plain(
                    StatusCode::UPGRADE_REQUIRED,
                    "not_websocket",
                    "this endpoint only serves WebSocket upgrades",
                );
                r.headers_mut()
                    .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
                return r;
            }
        };
        let tenants = self.tenants.current();
        // The client's address: on a node, the one its edge saw (the link names it).
        let mut remote = self.addr.0;
        let (tenant, lease, subject) = match &self.upstream {
            Upstream::Nodes(edge) => return self.relay(edge.clone(), req, &key, started).await,
            Upstream::Link => {
                let who = match crate::edge::headers::read(req.headers(), self.addr.0) {
                    Ok(who) => who,
                    Err(e) => {
                        tracing::warn!(error = %e, "link refused: a malformed identity header");
                        return self.plain(StatusCode::BAD_REQUEST, "link_header", &e.to_string());
                    }
                };
                remote = who.client;
                match who.tenant.as_deref().and_then(|id| tenants.get(id)) {
                    // The edge holds the session's lease and closes it when its credential ends.
                    Some(t) => {
                        self.audit.record(
                            "link.admitted",
                            serde_json::json!({
                                "tenant": t.id, "subject": who.subject,
                                "remote": remote.to_string(), "edge": self.addr.0.to_string(),
                            }),
                        );
                        (Some(t.clone()), Lease::unbounded(), who.subject)
                    }
                    None => {
                        let named = who.tenant.as_deref().map(Untrusted::text);
                        tracing::warn!(tenant = ?named, "link refused: the tenant is not on this node");
                        return self.plain(
                            StatusCode::NOT_FOUND,
                            "tenant_not_here",
                            "the tenant is not on this node",
                        );
                    }
                }
            }
            Upstream::Local => match tenants.credentials().admit(req.headers()).await {
                Ok(v) => {
                    tracing::info!(tenant = %v.tenant, subject = %Untrusted::text(&v.subject), kind = v.kind, key = %v.key_id, "authenticated");
                    self.audit_admitted(&v.tenant, &v.subject, v.kind, &v.key_id);
                    (tenants.get(&v.tenant).cloned(), v.lease, v.subject)
                }
                Err(e) => return self.auth_refused(&e),
            },
        };
        let Some(tenant) = tenant else {
            self.charge_failed_auth();
            return self.plain(
                StatusCode::UNAUTHORIZED,
                "auth_invalid",
                "invalid bearer token",
            );
        };
        let guard: ConnectionGuard = match self.admission.open_connection(&tenant.id) {
            Ok(g) => g,
            Err(r) => {
                tracing::info!(tenant = %tenant.id, scope = r.scope.as_str(), "upgrade refused: connection cap");
                return self.overloaded(&r, "connection_cap");
            }
        };
        let accept = derive_accept_key(key.as_bytes());
        let on_upgrade = hyper::upgrade::on(&mut req);
        let ctx = SessionCtx {
            tenant,
            metrics: self.metrics.clone(),
            max_message_bytes: self.max_message_bytes,
            client_queue: self.client_queue,
            client_queue_bytes: self.client_queue_bytes,
            tenant_queue_bytes: self.tenant_queue_bytes,
            admission: self.admission.clone(),
            shutdown: self.shutdown.clone(),
            lease,
            subject: subject.clone(),
            audit: self.audit.clone(),
        };
        let audit = self.audit.clone();
        let span = tracing::info_span!("session", tenant = %ctx.tenant.id, subject = %Untrusted::text(&subject), client.addr = %remote);
        let remote = remote.to_string();
        self.spawn_upgraded(on_upgrade, started, span, move |ws| async move {
            let (sink, stream) = futures_util::StreamExt::split(ws);
            tracing::info!("session started");
            let tenant = ctx.tenant.id.clone();
            let who = ctx.subject.clone();
            let end = session::serve(sink, stream, ctx, guard).await;
            tracing::info!(?end, "session ended");
            audit.record(
                "session.ended",
                serde_json::json!({ "tenant": tenant, "subject": who, "reason": end.label(), "remote": remote }),
            );
        });
        switching_protocols(&accept)
    }

    /// After the 101: waits for the upgraded connection, records the handshake time and runs
    /// `serve` on its WebSocket in a tracked task.
    fn spawn_upgraded<F, Fut>(
        &self,
        on_upgrade: hyper::upgrade::OnUpgrade,
        started: tokio::time::Instant,
        span: tracing::Span,
        serve: F,
    ) where
        F: FnOnce(WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let max = self.max_message_bytes;
        let handshake = self.metrics.handshake_seconds.clone();
        self.tracker.spawn(
            async move {
                let upgraded = match on_upgrade.await {
                    Ok(u) => u,
                    Err(e) => {
                        tracing::debug!(error = %e, "upgrade failed");
                        return;
                    }
                };
                handshake.observe(started.elapsed().as_secs_f64());
                let ws = WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    Role::Server,
                    Some(proto::ws::client_config(max)),
                )
                .await;
                serve(ws).await;
            }
            .instrument(span),
        );
    }
}

/// How long a client whose tenant's node is unreachable is asked to wait.
const NODE_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// The 101 answer. Deliberately no x-codex-app-server-compression echo: clients then send plain
/// text frames.
fn switching_protocols(accept: &str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(v) = HeaderValue::from_str(accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    resp
}

/// `Sec-WebSocket-Key` of a valid upgrade request.
fn websocket_key<B>(req: &Request<B>) -> Option<String> {
    let h = req.headers();
    let has_token = |name: header::HeaderName, token: &str| {
        h.get_all(name).iter().any(|v| {
            v.to_str()
                .map(|s| s.split(',').any(|p| p.trim().eq_ignore_ascii_case(token)))
                .unwrap_or(false)
        })
    };
    if req.method() != http::Method::GET
        || !has_token(header::CONNECTION, "upgrade")
        || !has_token(header::UPGRADE, "websocket")
        || h.get(header::SEC_WEBSOCKET_VERSION).map(|v| v.as_bytes()) != Some(b"13")
    {
        return None;
    }
    h.get(header::SEC_WEBSOCKET_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}
