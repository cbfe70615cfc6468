//! The admin port: `/healthz` (alive), `/readyz` (accepting work, with detail), `/metrics`.

use std::convert::Infallible;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prometheus::{Encoder, Registry, TextEncoder};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::tenants::TenantRegistry;

/// State the admin endpoints read.
pub struct Admin {
    /// The bound admin listener.
    pub tcp: TcpListener,
    /// Every metric.
    pub registry: Registry,
    /// Tenants, for readiness detail.
    pub tenants: Arc<TenantRegistry>,
    /// Cancelled when draining starts: `/readyz` turns 503 at once.
    pub draining: CancellationToken,
    /// Cancelled when the admin port must close.
    pub stop: CancellationToken,
    /// Tracks connection tasks.
    pub tracker: TaskTracker,
    /// Warnings an operator should see in `/readyz` detail.
    pub warnings: Vec<String>,
    /// The edge, when this process is one: `/readyz` says which nodes and tenants it reaches.
    pub edge: Option<std::sync::Arc<crate::edge::Edge>>,
    /// Counts this port's failed accepts.
    pub accept_errors: prometheus::IntCounter,
}

impl Admin {
    /// Serves until `stop`.
    pub async fn run(self) {
        let this = Arc::new(self);
        let mut failures = crate::listener::AcceptFailures::new("admin", &this.accept_errors);
        loop {
            let (tcp, _) = tokio::select! {
                r = this.tcp.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        failures.on_error(&e).await;
                        continue;
                    }
                },
                () = this.stop.cancelled() => return,
            };
            let this2 = this.clone();
            let stop = this.stop.clone();
            this.tracker.spawn(async move {
                let svc = service_fn(move |req| {
                    let this = this2.clone();
                    async move { Ok::<_, Infallible>(this.handle(&req)) }
                });
                let conn = http1::Builder::new()
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(tcp), svc);
                tokio::select! {
                    r = conn => if let Err(e) = r { tracing::debug!(error = %e, "admin connection error") },
                    () = stop.cancelled() => {}
                }
            });
        }
    }

    fn handle(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed\n".into(),
                "text/plain",
            );
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
            "/readyz" => self.readyz(),
            "/metrics" => self.metrics(),
            _ => text(StatusCode::NOT_FOUND, "not found\n".into(), "text/plain"),
        }
    }

    /// 200 while accepting work; 503 while draining, when no tenant can get a worker (every
    /// tenant's pool is quarantined or misconfigured), or while connections hold every file
    /// descriptor below the reserve (new ones wait in the listen queue: [`crate::descriptors`]).
    /// The JSON detail says why.
    fn readyz(&self) -> Response<Full<Bytes>> {
        let draining = self.draining.is_cancelled();
        let current = self.tenants.current();
        let mut reasons = Vec::new();
        if draining {
            reasons.push("draining: codex-fleet is shutting down".to_owned());
        }
        let mut any_capacity = false;
        let mut count = 0;
        let tenants: Vec<_> = current
            .iter()
            .map(|t| {
                count += 1;
                let unavailable = t.pool.unavailable();
                any_capacity |= unavailable.is_none();
                let workers: Vec<_> = t
                    .pool
                    .workers()
                    .into_iter()
                    .map(|w| {
                        json!({
                            "id": w.id.to_string(),
                            "slot": w.slot,
                            "pid": w.pid,
                            "state": w.state.as_str(),
                            "restarts": w.restarts,
                            "lastError": w.last_error,
                            "handles": w.handles,
                            "activeTurns": w.active_turns,
                            "loadedThreads": w.loaded_threads,
                            "rssBytes": w.rss_bytes,
                        })
                    })
                    .collect();
                json!({ "id": t.id, "unavailable": unavailable, "workers": workers })
            })
            .collect();
        let no_capacity = count > 0 && !any_capacity;
        if no_capacity {
            reasons.push(
                "no capacity: no tenant can get a worker (see tenants[].unavailable)".to_owned(),
            );
        }
        let descriptors = crate::descriptors::room();
        if let Err(e) = &descriptors {
            reasons.push(format!("no descriptors for new connections: {e}"));
        }
        let mut ready = !draining && !no_capacity && descriptors.is_ok();
        let mut body = json!({
            "ready": ready,
            "draining": draining,
            "reasons": reasons,
            "warnings": self.warnings,
            "tenants": tenants,
        });
        if let Some(edge) = &self.edge {
            let (reachable, detail) = edge.readiness();
            if !reachable {
                ready = false;
                reasons.push("no node reachable, or (kubernetes backend) the API server not answering or the pod watch not synced (see edge)".to_owned());
            }
            body["ready"] = json!(ready);
            body["reasons"] = json!(reasons);
            body["edge"] = detail;
        }
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        text(status, format!("{body:#}\n"), "application/json")
    }

    fn metrics(&self) -> Response<Full<Bytes>> {
        let encoder = TextEncoder::new();
        let mut buf = Vec::new();
        if let Err(e) = encoder.encode(&self.registry.gather(), &mut buf) {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot encode metrics: {e}\n"),
                "text/plain",
            );
        }
        let mut r = Response::new(Full::new(Bytes::from(buf)));
        if let Ok(v) = HeaderValue::from_str(encoder.format_type()) {
            r.headers_mut().insert(header::CONTENT_TYPE, v);
        }
        r
    }
}

fn text(status: StatusCode, body: String, ctype: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    r
}
