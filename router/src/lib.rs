//! codex-fleet's router: terminates authenticated wss, binds each connection to a tenant and
//! relays JSON-RPC to the tenant's supervised `codex app-server` workers.

pub mod admin;
pub mod admission;
pub mod audit;
pub mod auth;
pub mod cli;
pub mod config;
pub mod credentials;
pub use worker::descriptors;
pub mod door;
pub mod edge;
pub mod end;
pub mod fsutil;
mod gate;
pub mod listener;
pub mod metrics;
pub mod node;
pub mod offload;
pub mod policy;
#[cfg(test)]
mod raw_ws;
pub mod reload;
pub mod session;
pub mod tenants;
pub mod tls;
pub mod untrusted;
pub mod usage;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::metrics::RouterMetrics;
use crate::reload::{ReloadHook, Reloader};
use crate::tenants::{TenantRegistry, Tenants};

/// How long open sessions get to receive their close frames at shutdown.
const SESSION_CLOSE_GRACE: Duration = Duration::from_secs(5);
/// How often the drain looks at the running turns, and removed tenants' pools are checked.
const DRAIN_POLL: Duration = Duration::from_millis(100);
/// How long a turn a session saw start counts as running before the workers' counts must agree.
const FRESH_TURN: Duration = Duration::from_secs(3);
/// After the last turn ends, a moment for its `turn/completed` to reach the client before 1001.
const LAST_FRAMES: Duration = Duration::from_millis(250);
/// At the drain deadline, how long interrupted turns get to report `turn/completed`.
const INTERRUPT_WAIT: Duration = Duration::from_secs(5);
/// How often removed tenants are checked for remaining sessions.
const RETIRE_POLL: Duration = Duration::from_secs(1);

/// How often idle per-key admission state (limiter keys, worker slots) is dropped.
const ADMISSION_PRUNE_EVERY: Duration = Duration::from_secs(60);

/// A configured, not yet running codex-fleet.
pub struct Server {
    cfg: Config,
    tenants: Arc<TenantRegistry>,
    metrics: RouterMetrics,
    registry: Registry,
    tls: tokio_rustls::TlsAcceptor,
    /// The listener's TLS files (its pair; a node's edge CA too), watched for rotation while
    /// running.
    tls_files: tls::Watched,
    /// The audit log.
    audit: audit::Audit,
    warnings: Vec<String>,
    reloader: Arc<Reloader>,
    events: ServerEvents,
    admission: Arc<admission::Admission>,
    /// Where sessions run (here, or on nodes when this process is an edge).
    role: listener::Role,
}

/// Moments of a shutdown, for tests and tools (each token is cancelled when it happens).
#[derive(Clone, Default)]
pub struct ServerEvents {
    /// The drain began: `/readyz` is 503.
    pub draining: CancellationToken,
    /// New connections are refused (after the settle period).
    pub refusing: CancellationToken,
    /// Sessions are being closed with 1001.
    pub closing: CancellationToken,
}

impl Server {
    /// Loads TLS material, resolves the worker program and builds every tenant's pool
    /// (workers listed as `min_workers` start in the background).
    pub fn build(cfg: Config, registry: Registry) -> anyhow::Result<Server> {
        let (tls, tls_files) = match &cfg.node {
            Some(node) => {
                tls::server_config_mutual(&cfg.listen.tls_cert, &cfg.listen.tls_key, &node.edge_ca)?
            }
            None => {
                let (tls, pair) =
                    tls::server_config_reloading(&cfg.listen.tls_cert, &cfg.listen.tls_key)?;
                let pair: Arc<dyn tls::Reload> = pair;
                (tls, vec![pair])
            }
        };
        let metrics = RouterMetrics::register(&registry)?;
        // The process's own CPU, memory, threads and open files against its limit
        // (`process_open_fds` / `process_max_fds`): near that limit connections wait in the
        // listen queue and legs cannot open, so the alert rules watch it.
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        descriptors::prepare()?;
        session::metrics::init_series(&metrics);
        let audit = audit::Audit::start(&cfg.audit, &registry)?;
        let worker_metrics = worker::metrics::WorkerMetrics::register(&registry)?;
        // A node runs only its own tenants, an edge none (it relays them).
        let tenants = Arc::new(TenantRegistry::new(Tenants::build(
            &cfg.localized(),
            &worker_metrics,
        )?));
        let role = match cfg.role() {
            config::Role::Embedded => listener::Role::Embedded,
            config::Role::Node => listener::Role::Node,
            config::Role::Edge => listener::Role::Edge(edge::Edge::build(
                cfg.nodes
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("an edge needs [nodes]"))?,
                cfg.limits.max_message_bytes,
                &cfg.tenants,
                &cfg.auth,
                &registry,
            )?),
        };
        let reloader = Reloader::new(cfg.clone(), tenants.clone(), worker_metrics, &registry)?;
        let mut warnings = Vec::new();
        if let Some(w) = tenants::shared_uid_warning(&cfg) {
            tracing::warn!("{w}");
            warnings.push(w);
        }
        // A session holds its client's socket and a leg (on an edge, a link); workers run
        // only where sessions do.
        let workers = match cfg.role() {
            config::Role::Edge => 0,
            _ => cfg.workers.max_workers,
        };
        let max_connections = cfg.limits.admission.max_connections;
        if let Some(w) = descriptors::sizing_warning(max_connections, 2, workers) {
            tracing::warn!("{w}");
            warnings.push(w);
        }
        // Per-tenant series exist at zero for every configured tenant, now and after reloads.
        metrics.init_config(&cfg);
        let init_metrics = metrics.clone();
        reloader.on_reload(Box::new(move |new: &Config| init_metrics.init_config(new)));
        if let listener::Role::Edge(edge) = &role {
            // A reload puts new tokens and tenant→node assignments in force at the edge.
            let edge = edge.clone();
            reloader.on_reload(Box::new(move |new: &Config| {
                if let Err(e) = edge.reload(&new.tenants, &new.auth) {
                    tracing::error!(error = %e, "reload: the edge keeps its old tenants");
                }
            }));
        }
        // The audit log records every tenant's worker lifecycle, new tenants' after a reload.
        audit.watch_workers(tenants.current().iter().map(|t| (t.id.as_str(), &t.pool)));
        let (watcher, watched) = (audit.clone(), tenants.clone());
        reloader.on_reload(Box::new(move |_: &Config| {
            watcher.watch_workers(watched.current().iter().map(|t| (t.id.as_str(), &t.pool)));
        }));
        let admission = admission::Admission::new(cfg.limits.admission.clone())?;
        // A reload applies new [limits] rates and caps to the running admission control.
        let reconfigure = admission.clone();
        reloader.on_reload(Box::new(move |new: &Config| {
            if let Err(e) = reconfigure.reconfigure(new.limits.admission.clone()) {
                tracing::error!(error = %e, "reload: new [limits] refused; the old limits stay");
            }
        }));
        Ok(Server {
            admission,
            cfg,
            tenants,
            metrics,
            registry,
            tls: tokio_rustls::TlsAcceptor::from(tls),
            tls_files,
            audit,
            warnings,
            reloader: Arc::new(reloader),
            events: ServerEvents::default(),
            role,
        })
    }

    /// The file [`Reloader::reload`] re-reads (SIGHUP). Call before [`Server::reloader`].
    pub fn with_config_path(mut self, path: PathBuf) -> Server {
        if let Some(r) = Arc::get_mut(&mut self.reloader) {
            r.set_path(path);
        }
        self
    }

    /// `codex-fleet node --tenant ID`: reloads keep serving only that tenant. Call before
    /// [`Server::reloader`].
    pub fn with_only_tenant(mut self, tenant: Option<String>) -> Server {
        if let Some(r) = Arc::get_mut(&mut self.reloader) {
            r.set_only_tenant(tenant);
        }
        self
    }

    /// Reloads the configuration file on demand (main wires SIGHUP to it).
    pub fn reloader(&self) -> Arc<Reloader> {
        self.reloader.clone()
    }

    /// Adds a hook called with every configuration a reload puts in force, after the tenants
    /// changed (e.g. admission reconfigures its limits from `cfg.limits`).
    pub fn on_reload(&self, hook: impl Fn(&Config) + Send + Sync + 'static) {
        let hook: ReloadHook = Box::new(hook);
        self.reloader.on_reload(hook);
    }

    /// The moments of the shutdown, to watch.
    pub fn events(&self) -> ServerEvents {
        self.events.clone()
    }

    /// Serves clients on `listener` and the admin endpoints on `admin` until `shutdown`
    /// resolves; then drains: `/readyz` 503 at once, new connections refused after
    /// `drain.settle_secs`, running turns awaited up to `drain.timeout_secs` (then interrupted),
    /// sessions closed with 1001, workers stopped gracefully.
    pub async fn run(
        self,
        listener: TcpListener,
        admin: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let ServerEvents {
            draining,
            refusing,
            closing,
        } = self.events.clone();
        let _pruner = self.admission.spawn_pruner(ADMISSION_PRUNE_EVERY);
        // Certificates and CA bundles renewed in place are used by the next handshake: the
        // listener's pair, a node's edge CA, an edge's link client pair and node CA
        // (cert-manager renews them before they expire).
        let reloads = tls::reload_counter(&self.registry)?;
        let mut watched = self.tls_files.clone();
        if let Some(edge) = self.edge() {
            watched.extend(edge.link_files());
        }
        let _tls_watch = tls::spawn_watch(watched, tls::CERT_POLL, reloads);
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
                edge: self.edge().cloned(),
                accept_errors: self.metrics.accept_errors.with_label_values(&["admin"]),
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
                client_queue_bytes: self.cfg.limits.client_queue_bytes,
                tenant_queue_bytes: self.cfg.limits.tenant_queue_bytes,
                refuse: refusing.clone(),
                shutdown: closing.clone(),
                tracker: tracker.clone(),
                role: self.role.clone(),
                audit: self.audit.clone(),
            }
            .run(),
        );
        let _prober = self.edge().map(|edge| {
            let every = self.cfg.nodes.as_ref().map_or(2, |n| n.probe_interval_secs);
            edge.spawn_prober(Duration::from_secs(every))
        });
        let _pod_watch = self.edge().and_then(|edge| edge.spawn_watch());
        let grace = Duration::from_secs(self.cfg.workers.stop_grace_secs);
        let retire = {
            let reloader = self.reloader.clone();
            tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(RETIRE_POLL).await;
                    reloader.stop_unused(grace).await;
                }
            }))
        };
        shutdown.await;
        let began = Instant::now();
        tracing::info!(
            settle_secs = self.cfg.drain.settle_secs,
            timeout_secs = self.cfg.drain.timeout_secs,
            "draining: /readyz is 503; waiting for running turns"
        );
        self.metrics.draining.set(1);
        draining.cancel();
        let settle = began + Duration::from_secs(self.cfg.drain.settle_secs);
        let refuse_at = {
            let refusing = refusing.clone();
            tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                tokio::time::sleep_until(settle).await;
                tracing::info!("settle period over: refusing new connections");
                refusing.cancel();
            }))
        };
        self.wait_for_turns(began + Duration::from_secs(self.cfg.drain.timeout_secs))
            .await;
        tokio::time::sleep_until(settle).await;
        refusing.cancel();
        drop(refuse_at);
        tracing::info!(elapsed = ?began.elapsed(), "no turn running: closing sessions and stopping workers");
        closing.cancel();
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
        drop(retire);
        let retired = self.reloader.retired();
        let current = self.tenants.current();
        futures_util::future::join(
            current.shutdown(grace),
            futures_util::future::join_all(retired.iter().map(|t| t.pool.shutdown(grace))),
        )
        .await;
        admin_stop.cancel();
        admin_tracker.close();
        let _admin_done = tokio::time::timeout(Duration::from_secs(1), admin_tracker.wait()).await;
        if let Err(e) = admin_task.await {
            tracing::warn!(error = %e, "admin task ended abnormally");
        }
        tracing::info!(elapsed = ?began.elapsed(), "stopped");
        Ok(())
    }

    /// Running turns over every pool, including removed tenants' pools still serving sessions.
    /// Turns a session saw start in the last few seconds count too: a worker's control leg may
    /// report a turn a moment after the client saw it begin.
    fn active_turns(&self) -> usize {
        let fresh = self.admission.turns_started_within(FRESH_TURN);
        fresh.max(self.tenants.current().active_turns())
            + self
                .reloader
                .retired()
                .iter()
                .map(|t| t.pool.active_turns())
                .sum::<usize>()
    }

    /// Waits until no turn runs anywhere, up to `deadline`; then interrupts the turns still running
    /// (clients see `turn/completed` "interrupted") and waits briefly for them to end.
    async fn wait_for_turns(&self, deadline: Instant) {
        let mut seen_active = false;
        loop {
            let active = self.active_turns();
            if active == 0 {
                if seen_active {
                    tokio::time::sleep(LAST_FRAMES).await;
                }
                return;
            }
            seen_active = true;
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(DRAIN_POLL.min(deadline.saturating_duration_since(Instant::now())))
                .await;
        }
        let until = Instant::now() + INTERRUPT_WAIT;
        let mut pools: Vec<_> = self
            .tenants
            .current()
            .iter()
            .map(|t| t.pool.clone())
            .collect();
        pools.extend(self.reloader.retired().iter().map(|t| t.pool.clone()));
        let interrupted: usize =
            futures_util::future::join_all(pools.iter().map(|p| p.interrupt_active_turns(until)))
                .await
                .into_iter()
                .sum();
        tracing::warn!(
            interrupted,
            "drain timeout: interrupted the turns still running"
        );
        while self.active_turns() > 0 && Instant::now() < until {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        tokio::time::sleep(LAST_FRAMES).await;
    }

    /// The edge, when this process is one.
    pub fn edge(&self) -> Option<&Arc<edge::Edge>> {
        match &self.role {
            listener::Role::Edge(edge) => Some(edge),
            _ => None,
        }
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
