//! codex-fleet's router: terminates authenticated wss, binds each connection to a tenant and
//! relays JSON-RPC to the tenant's supervised `codex app-server` workers.

pub mod admin;
pub mod admission;
pub mod auth;
pub mod config;
pub mod dev;
pub mod identity;
pub mod jsonrpc;
pub mod listener;
pub mod metrics;
pub mod mock_model;
pub mod policy;
pub mod route;
pub mod session;
pub mod tenants;
pub mod tls;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::metrics::RouterMetrics;
use crate::tenants::{TenantRegistry, Tenants};

/// How long open sessions get to receive their close frames at shutdown.
const SESSION_CLOSE_GRACE: Duration = Duration::from_secs(5);

/// How often idle per-key admission state (limiter keys, worker slots) is dropped.
const ADMISSION_PRUNE_EVERY: Duration = Duration::from_secs(60);

/// A configured, not yet running codex-fleet.
pub struct Server {
    cfg: Config,
    tenants: Arc<TenantRegistry>,
    metrics: RouterMetrics,
    registry: Registry,
    tls: tokio_rustls::TlsAcceptor,
    warnings: Vec<String>,
    admission: Arc<admission::Admission>,
}

impl Server {
    /// Loads TLS material, resolves the worker program and builds every tenant's pool
    /// (workers listed as `min_workers` start in the background).
    pub fn build(cfg: Config, registry: Registry) -> anyhow::Result<Server> {
        let tls = tls::server_config(&cfg.listen.tls_cert, &cfg.listen.tls_key)?;
        let metrics = RouterMetrics::register(&registry)?;
        let worker_metrics = worker::metrics::WorkerMetrics::register(&registry)?;
        let tenants = Arc::new(TenantRegistry::new(Tenants::build(&cfg, &worker_metrics)?));
        let mut warnings = Vec::new();
        if !nix::unistd::geteuid().is_root() {
            warnings.push(
                "codex-fleet is not running as root: every tenant's workers share its Unix uid"
                    .to_owned(),
            );
        }
        let admission = admission::Admission::new(cfg.limits.admission.clone())?;
        Ok(Server {
            admission,
            cfg,
            tenants,
            metrics,
            registry,
            tls: tokio_rustls::TlsAcceptor::from(tls),
            warnings,
        })
    }

    /// Serves clients on `listener` and the admin endpoints on `admin` until `shutdown`
    /// resolves; then refuses new upgrades, closes sessions with 1001 and stops every worker.
    pub async fn run(
        self,
        listener: TcpListener,
        admin: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let _pruner = self.admission.spawn_pruner(ADMISSION_PRUNE_EVERY);
        let draining = CancellationToken::new();
        let admin_stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let admin_tracker = TaskTracker::new();
        let admin_task = tokio::spawn(
            admin::Admin {
                tcp: admin,
                registry: self.registry.clone(),
                tenants: self.tenants.clone(),
                draining: draining.clone(),
                stop: admin_stop.clone(),
                tracker: admin_tracker.clone(),
                warnings: self.warnings.clone(),
            }
            .run(),
        );
        let accept = tokio::spawn(
            listener::Listener {
                tcp: listener,
                tls: self.tls.clone(),
                tenants: self.tenants.clone(),
                metrics: self.metrics.clone(),
                admission: self.admission.clone(),
                handshake_timeout: self.cfg.handshake_timeout(),
                max_message_bytes: self.cfg.limits.max_message_bytes,
                client_queue: self.cfg.limits.client_queue,
                shutdown: draining.clone(),
                tracker: tracker.clone(),
            }
            .run(),
        );
        shutdown.await;
        tracing::info!("shutting down: closing sessions and stopping workers");
        self.metrics.draining.set(1);
        draining.cancel();
        if let Err(e) = accept.await {
            tracing::warn!(error = %e, "accept loop ended abnormally");
        }
        tracker.close();
        if tokio::time::timeout(SESSION_CLOSE_GRACE, tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("some sessions did not close in time");
        }
        self.tenants
            .current()
            .shutdown(Duration::from_secs(self.cfg.workers.stop_grace_secs))
            .await;
        admin_stop.cancel();
        admin_tracker.close();
        let _admin_done = tokio::time::timeout(Duration::from_secs(1), admin_tracker.wait()).await;
        if let Err(e) = admin_task.await {
            tracing::warn!(error = %e, "admin task ended abnormally");
        }
        tracing::info!("stopped");
        Ok(())
    }

    /// Admission control; a reload applies new `[limits]` with [`admission::Admission::reconfigure`].
    pub fn admission(&self) -> &Arc<admission::Admission> {
        &self.admission
    }

    /// The tenants (tests and tools inspect worker state through it).
    pub fn tenants(&self) -> &Arc<TenantRegistry> {
        &self.tenants
    }
}
