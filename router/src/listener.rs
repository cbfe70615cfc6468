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
//!
//! The listener is shared by every role: it checks the request, then starts an embedded or a
//! node session here, or hands an edge's upgrade to [`crate::edge::Edge::upgrade`]. The answers
//! at the door (refusals, 101, the upgraded connection's task) are [`crate::door`]'s.

use std::convert::Infallible;
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
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::admission::{Admission, ConnectionGuard, Rejection};
use crate::credentials::Lease;
use crate::door::{switching_protocols, Door};
use crate::metrics::RouterMetrics;
use crate::session::{self, SessionCtx};
use crate::tenants::TenantRegistry;
use crate::untrusted::Untrusted;

/// The role this listener serves ([`crate::config::Role`], with what the role runs on): where
/// its sessions run, and how its clients prove who they are.
#[derive(Clone)]
pub enum Role {
    /// Sessions run here; clients present a tenant's credential (`codex-fleet serve`).
    Embedded,
    /// Sessions run here, for edges (`codex-fleet node`): mutual TLS admitted the edge, and the
    /// link's headers name the tenant ([`crate::edge::TENANT_HEADER`]).
    Node,
    /// Sessions run on the tenants' nodes: this process is an edge and relays each one.
    Edge(Arc<crate::edge::Edge>),
}

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
    /// The role served: where sessions run.
    pub role: Role,
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
    /// What the connection holds until its upgrade is answered, and the answers.
    door: Door,
    tenants: Arc<TenantRegistry>,
    /// Set when the source address was over its handshake rate at accept: every request on
    /// this connection is answered 429.
    throttled: Option<Rejection>,
    refuse: CancellationToken,
    role: Role,
}

/// How long an accept loop waits after a failed accept before the next one.
const ACCEPT_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

/// How often, at most, an accept loop logs its failures.
const ACCEPT_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A connection idle this long is probed by the kernel (TCP keepalive)...
const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
/// ... every this long ...
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
/// ... and this many unanswered probes end it: a peer gone without a word (its machine lost, a
/// NAT or firewall that forgot the flow) is found within about two minutes of idleness (with
/// data unacknowledged, the kernel's retransmission limit ends it instead), and its session
/// ends and frees its connection slot, its legs (and, on a node, lets the pod idle out).
/// Without it such a session, with nothing to send, stayed for the process's life. A live peer
/// answers the probes, however long it is idle or slow to read.
const KEEPALIVE_PROBES: u32 = 6;

/// Nagle off and TCP keepalive on a client's or a link's socket.
pub(crate) fn tune(tcp: &tokio::net::TcpStream) {
    let _nodelay = tcp.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "TCP keepalive not set");
    }
}

/// An accept loop's failures: EMFILE when the process holds every file descriptor it may open
/// (ENFILE, ENOMEM and the like alike), or, for the client port, every one below the reserve
/// ([`crate::descriptors`]). The connection stays in the listen queue and the loop tries again
/// after [`ACCEPT_RETRY`]. Each failure is counted; the log says so at most once per
/// [`ACCEPT_LOG_EVERY`], with how many failed since the last line, so whoever keeps the process
/// at its limit cannot fill the log at 20 lines a second.
pub(crate) struct AcceptFailures {
    listener: &'static str,
    counter: prometheus::IntCounter,
    last_log: Option<tokio::time::Instant>,
    unlogged: u64,
}

impl AcceptFailures {
    pub(crate) fn new(listener: &'static str, counter: &prometheus::IntCounter) -> AcceptFailures {
        AcceptFailures {
            listener,
            counter: counter.clone(),
            last_log: None,
            unlogged: 0,
        }
    }

    /// Counts `e`, logs it if the last line is old enough, and waits before the next accept.
    pub(crate) async fn on_error(&mut self, e: &std::io::Error) {
        self.counter.inc();
        self.unlogged += 1;
        let now = tokio::time::Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= ACCEPT_LOG_EVERY)
        {
            tracing::warn!(
                listener = self.listener,
                error = %e,
                failed = self.unlogged,
                "accept failed; the connection waits in the listen queue"
            );
            self.last_log = Some(now);
            self.unlogged = 0;
        }
        tokio::time::sleep(ACCEPT_RETRY).await;
    }
}

// === impl Listener ===

impl Listener {
    /// Accepts until shutdown; each connection runs in its own tracked task.
    pub async fn run(self) {
        let this = Arc::new(self);
        let backstop = accept_backstop(this.admission.config().max_connections);
        let connections = Arc::new(Semaphore::new(backstop));
        let mut failures = AcceptFailures::new(
            "client",
            &this.metrics.accept_errors.with_label_values(&["client"]),
        );
        loop {
            let permit = tokio::select! {
                p = connections.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
                () = this.shutdown.cancelled() => return,
            };
            // Client connections leave the descriptors above the reserve's line to the admin
            // port and the workers: past it, a connection waits in the listen queue.
            if let Err(e) = crate::descriptors::room() {
                failures.on_error(&e).await;
                continue;
            }
            let (tcp, addr) = tokio::select! {
                r = this.tcp.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        failures.on_error(&e).await;
                        continue;
                    }
                },
                () = this.shutdown.cancelled() => return,
            };
            // Another thread took the free descriptor in between (a session's leg or link
            // opens after the look above): the connection waits, accepted but unserved, as it
            // would have in the listen queue, and moves below the line once there is room.
            let tcp = match crate::descriptors::check(&tcp) {
                Ok(()) => tcp,
                Err(e) => {
                    let moved = tokio::select! {
                        m = below_the_line(tcp, e, &mut failures) => m,
                        () = this.shutdown.cancelled() => return,
                    };
                    match moved {
                        Some(tcp) => tcp,
                        None => continue,
                    }
                }
            };
            this.metrics.connections_accepted.inc();
            tune(&tcp);
            // Edges are trusted peers of a node: their addresses carry many clients each.
            let throttled = match this.role {
                Role::Node => None,
                _ => this.admission.check_handshake(addr.ip()).err(),
            };
            let conn = Arc::new(Conn {
                door: Door {
                    admission: this.admission.clone(),
                    metrics: this.metrics.clone(),
                    max_message_bytes: this.max_message_bytes,
                    client_queue: this.client_queue,
                    client_queue_bytes: this.client_queue_bytes,
                    tenant_queue_bytes: this.tenant_queue_bytes,
                    shutdown: this.shutdown.clone(),
                    tracker: this.tracker.clone(),
                    addr,
                    audit: this.audit.clone(),
                },
                tenants: this.tenants.clone(),
                throttled,
                refuse: this.refuse.clone(),
                role: this.role.clone(),
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

/// Moves `tcp`, accepted onto a descriptor in the reserve (`lacking` says so), below the line
/// once there is room there, counting and logging each wait as [`AcceptFailures`] does; `None`
/// when the socket cannot be handed back to the runtime (it is closed). The accept loop takes
/// nothing else meanwhile, so at most one client connection holds a reserve descriptor, and
/// only while it waits: closing it instead would refuse a client without a word.
async fn below_the_line(
    tcp: tokio::net::TcpStream,
    mut lacking: std::io::Error,
    failures: &mut AcceptFailures,
) -> Option<tokio::net::TcpStream> {
    let mut fd = std::os::fd::OwnedFd::from(tcp.into_std().ok()?);
    loop {
        failures.on_error(&lacking).await;
        if let Err(e) = crate::descriptors::room() {
            lacking = e;
            continue;
        }
        match crate::descriptors::move_below(fd) {
            Ok(moved) => {
                let tcp = tokio::net::TcpStream::from_std(std::net::TcpStream::from(moved));
                return tcp.ok();
            }
            Err((unmoved, e)) => (fd, lacking) = (unmoved, e),
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
                self.door.refused("tls");
                return;
            }
            Err(_) => {
                self.door.refused("handshake_timeout");
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
            Err(_) => self.door.refused("handshake_timeout"),
        }
    }

    /// Checks the upgrade request; on success answers 101 and starts the session task.
    async fn upgrade(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        started: tokio::time::Instant,
    ) -> Response<Full<Bytes>> {
        if let Some(r) = &self.throttled {
            return self.door.overloaded(r, "handshake_rate");
        }
        if req.uri().path() != "/" {
            return self.door.plain(
                StatusCode::NOT_FOUND,
                "path",
                "not found: the WebSocket endpoint is /",
            );
        }
        if self.door.shutdown.is_cancelled() || self.refuse.is_cancelled() {
            return self.door.draining();
        }
        let key = match websocket_key(&req) {
            Some(k) => k,
            None => {
                let mut r = self.door.plain(
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
        let mut remote = self.door.addr;
        let (tenant, lease, subject) = match &self.role {
            Role::Edge(edge) => return edge.upgrade(&self.door, req, &key, started).await,
            Role::Node => match crate::node::link::admit(&self.door, &tenants, req.headers()) {
                Ok(linked) => {
                    remote = linked.client;
                    // The edge holds the session's lease and closes it when its credential ends.
                    (Some(linked.tenant), Lease::unbounded(), linked.subject)
                }
                Err(refused) => return *refused,
            },
            Role::Embedded => match tenants.credentials().admit(req.headers()).await {
                Ok(v) => {
                    tracing::info!(tenant = %v.tenant, subject = %Untrusted::text(&v.subject), kind = v.kind, key = %v.key_id, "authenticated");
                    self.door
                        .audit_admitted(&v.tenant, &v.subject, v.kind, &v.key_id);
                    (tenants.get(&v.tenant).cloned(), v.lease, v.subject)
                }
                Err(e) => return self.door.auth_refused(&e),
            },
        };
        let Some(tenant) = tenant else {
            self.door.charge_failed_auth();
            return self.door.plain(
                StatusCode::UNAUTHORIZED,
                "auth_invalid",
                "invalid bearer token",
            );
        };
        let guard: ConnectionGuard = match self.door.admission.open_connection(&tenant.id) {
            Ok(g) => g,
            Err(r) => {
                tracing::info!(tenant = %tenant.id, scope = r.scope.as_str(), "upgrade refused: connection cap");
                return self.door.overloaded(&r, "connection_cap");
            }
        };
        let accept = derive_accept_key(key.as_bytes());
        let on_upgrade = hyper::upgrade::on(&mut req);
        let tenant_id = tenant.id.clone();
        let ctx = SessionCtx {
            tenant,
            metrics: self.door.metrics.clone(),
            max_message_bytes: self.door.max_message_bytes,
            client_queue: self.door.client_queue,
            client_queue_bytes: self.door.client_queue_bytes,
            tenant_queue_bytes: self.door.tenant_queue_bytes,
            admission: self.door.admission.clone(),
            shutdown: self.door.shutdown.clone(),
            lease,
            subject: subject.clone(),
            audit: self.door.audit.clone(),
            client_read: self
                .door
                .admission
                .read_meter(&tenant_id, self.door.tenant_queue_bytes),
        };
        let audit = self.door.audit.clone();
        let span = tracing::info_span!("session", tenant = %ctx.tenant.id, subject = %Untrusted::text(&subject), client.addr = %remote);
        let remote = remote.to_string();
        let meter = ctx.client_read.clone();
        self.door.spawn_upgraded(on_upgrade, started, span, meter, move |ws| async move {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tuned_socket_has_nagle_off_and_keepalive_on() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let plain = socket2::SockRef::from(&accepted);
        assert!(!plain.keepalive().unwrap(), "tokio leaves keepalive off");
        tune(&accepted);
        let tuned = socket2::SockRef::from(&accepted);
        assert!(accepted.nodelay().unwrap());
        assert!(tuned.keepalive().unwrap());
        assert_eq!(tuned.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(tuned.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(tuned.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
        drop(client);
    }
}
