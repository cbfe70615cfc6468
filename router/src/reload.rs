//! Reloading the configuration file (SIGHUP): tenants, tokens and pool sizes change in place;
//! a file that does not validate is refused and the running configuration stays.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus::{IntCounterVec, Opts, Registry};
use worker::metrics::WorkerMetrics;

use crate::config::Config;
use crate::tenants::{Tenant, TenantRegistry, Tenants};

/// Name of the reload counter.
pub const RELOADS_TOTAL: &str = "codex_fleet_config_reloads_total";

/// Called with each newly applied configuration (e.g. admission limits reconfigure from it).
pub type ReloadHook = Box<dyn Fn(&Config) + Send + Sync>;

/// What a successful reload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Tenants now configured.
    pub tenants: usize,
    /// Tenants removed (their pools stop once their sessions end).
    pub removed: Vec<String>,
    /// Removed tenants configured again: they keep the pool still serving their old sessions.
    pub adopted: Vec<String>,
    /// Changes that need a restart and were not applied.
    pub warnings: Vec<String>,
}

/// Re-reads the configuration file and puts it in force.
pub struct Reloader {
    path: Option<PathBuf>,
    /// `codex-fleet node --tenant ID`: every reload serves only this tenant too.
    only_tenant: Option<String>,
    tenants: Arc<TenantRegistry>,
    worker_metrics: WorkerMetrics,
    reloads: IntCounterVec,
    hooks: Mutex<Vec<ReloadHook>>,
    /// The configuration in force (restart-only sections are compared against it).
    current: Mutex<Config>,
    /// Removed tenants whose pools still run for their open sessions.
    retired: Mutex<Vec<Arc<Tenant>>>,
    /// One reload at a time.
    running: tokio::sync::Mutex<()>,
}

// === impl Reloader ===

impl Reloader {
    pub(crate) fn new(
        cfg: Config,
        tenants: Arc<TenantRegistry>,
        worker_metrics: WorkerMetrics,
        registry: &Registry,
    ) -> anyhow::Result<Reloader> {
        let reloads = IntCounterVec::new(
            Opts::new(
                RELOADS_TOTAL,
                "Configuration reloads, by result (ok, invalid).",
            ),
            &["result"],
        )?;
        registry.register(Box::new(reloads.clone()))?;
        for result in ["ok", "invalid"] {
            reloads.with_label_values(&[result]);
        }
        Ok(Reloader {
            path: None,
            only_tenant: None,
            tenants,
            worker_metrics,
            reloads,
            hooks: Mutex::new(Vec::new()),
            current: Mutex::new(cfg),
            retired: Mutex::new(Vec::new()),
            running: tokio::sync::Mutex::new(()),
        })
    }

    pub(crate) fn set_path(&mut self, path: PathBuf) {
        self.path = Some(path);
    }

    pub(crate) fn set_only_tenant(&mut self, tenant: Option<String>) {
        self.only_tenant = tenant;
    }

    /// Adds a hook called with every configuration a reload puts in force.
    pub fn on_reload(&self, hook: ReloadHook) {
        self.hooks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(hook);
    }

    /// Reads, validates and applies the configuration file. On any error nothing changes: the error
    /// is logged and counted (`result="invalid"`) and returned.
    pub async fn reload(&self) -> anyhow::Result<ReloadSummary> {
        let _one = self.running.lock().await;
        match self.apply() {
            Ok(summary) => {
                self.reloads.with_label_values(&["ok"]).inc();
                for w in &summary.warnings {
                    tracing::warn!("reload: {w}");
                }
                tracing::info!(
                    tenants = summary.tenants,
                    removed = ?summary.removed,
                    "configuration reloaded"
                );
                Ok(summary)
            }
            Err(e) => {
                self.reloads.with_label_values(&["invalid"]).inc();
                tracing::error!(error = %format!("{e:#}"), "configuration reload refused; the running configuration stays");
                Err(e)
            }
        }
    }

    fn apply(&self) -> anyhow::Result<ReloadSummary> {
        let path = self
            .path
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no configuration file to reload"))?;
        let cfg = Config::load(path)?;
        let cfg = match &self.only_tenant {
            Some(t) => crate::node::tenant::serve_only(cfg, t)?,
            None => cfg,
        };
        let mut warnings = restart_only_changes(
            &self.current.lock().unwrap_or_else(PoisonError::into_inner),
            &cfg,
        );
        let old = self.tenants.current();
        let retired = self.retired();
        let rebuilt =
            Tenants::rebuild(&cfg.localized(), &self.worker_metrics, Some(&old), &retired)?;
        drop(retired);
        warnings.extend(rebuilt.warnings);
        let removed: Vec<String> = rebuilt.removed.iter().map(|t| t.id.clone()).collect();
        for id in &rebuilt.adopted {
            tracing::info!(tenant = %id, "re-added tenant adopts its running workers");
        }
        let tenants = rebuilt.tenants.iter().count();
        self.tenants.replace(Arc::new(rebuilt.tenants));
        {
            let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
            retired.retain(|t| !rebuilt.adopted.contains(&t.id));
            retired.extend(rebuilt.removed);
        }
        for hook in self
            .hooks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            hook(&cfg);
        }
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = cfg;
        Ok(ReloadSummary {
            tenants,
            removed,
            adopted: rebuilt.adopted,
            warnings,
        })
    }

    /// Stops the pools of removed tenants that no session uses any more. Holds off reloads
    /// meanwhile: a tenant re-added while its old pool stops would get a second pool on the same
    /// sockets.
    pub async fn stop_unused(&self, grace: Duration) {
        let _one = self.running.lock().await;
        let unused: Vec<Arc<Tenant>> = {
            let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
            let (unused, used) = retired.drain(..).partition(|t| Arc::strong_count(t) == 1);
            *retired = used;
            unused
        };
        for t in unused {
            tracing::info!(tenant = %t.id, "removed tenant has no sessions left; stopping its workers");
            t.pool.shutdown(grace).await;
        }
    }

    /// Removed tenants whose pools still run.
    pub(crate) fn retired(&self) -> Vec<Arc<Tenant>> {
        self.retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Sections a reload cannot change (they need a restart), named in a warning.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let differs =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
    if differs(&old.listen, &new.listen) {
        out.push("[listen] changed; it applies after a restart".to_owned());
    }
    if differs(&old.admin, &new.admin) {
        out.push("[admin] changed; it applies after a restart".to_owned());
    }
    if differs(&old.drain, &new.drain) {
        out.push("[drain] changed; it applies after a restart".to_owned());
    }
    out
}
