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

/// Sections and settings a reload cannot change (they need a restart), each named in a
/// warning: what the running listeners, sessions, audit writer and edge were built with.
/// (Worker settings are compared per tenant by [`Tenants::rebuild`]; `[auth]`, `[limits.*]`
/// rates and caps, the tenants and their tokens are applied.)
fn restart_only_changes(old: &Config, new: &Config) -> Vec<String> {
    let differs =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
    let (o, n) = (&old.limits, &new.limits);
    let checks: [(&str, &dyn std::fmt::Debug, &dyn std::fmt::Debug); 10] = [
        ("[listen]", &old.listen, &new.listen),
        ("[admin]", &old.admin, &new.admin),
        ("[drain]", &old.drain, &new.drain),
        ("[audit]", &old.audit, &new.audit),
        ("[node]", &old.node, &new.node),
        ("[nodes]", &old.nodes, &new.nodes),
        (
            "limits.max_message_bytes",
            &o.max_message_bytes,
            &n.max_message_bytes,
        ),
        ("limits.client_queue", &o.client_queue, &n.client_queue),
        (
            "limits.client_queue_bytes",
            &o.client_queue_bytes,
            &n.client_queue_bytes,
        ),
        (
            "limits.tenant_queue_bytes",
            &o.tenant_queue_bytes,
            &n.tenant_queue_bytes,
        ),
    ];
    checks
        .into_iter()
        .filter(|(_, a, b)| differs(*a, *b))
        .map(|(what, _, _)| format!("{what} changed; it applies after a restart"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::minimal;

    fn parsed(extra: &str) -> Config {
        Config::parse(&minimal(extra)).expect("valid")
    }

    #[test]
    fn a_reload_names_each_setting_it_does_not_apply_and_only_those() {
        let old = parsed("");
        let same = restart_only_changes(&old, &parsed(""));
        assert!(same.is_empty(), "{same:?}");
        // Applied by a reload: no warning here.
        let applied = parsed("[limits]\ntenant_rps = 7\nmax_connections_per_tenant = 3\n");
        let none = restart_only_changes(&old, &applied);
        assert!(none.is_empty(), "{none:?}");
        for (extra, named) in [
            ("[admin]\naddr = \"127.0.0.1:9999\"\n", "[admin]"),
            ("[drain]\ntimeout_secs = 7\n", "[drain]"),
            ("[audit]\npath = \"/tmp/elsewhere.jsonl\"\n", "[audit]"),
            ("[audit]\nmax_file_bytes = 1000\n", "[audit]"),
            (
                "[limits]\nmax_message_bytes = 65536\n",
                "limits.max_message_bytes",
            ),
            ("[limits]\nclient_queue = 77\n", "limits.client_queue"),
            (
                "[limits]\nclient_queue_bytes = 99999999\n",
                "limits.client_queue_bytes",
            ),
            (
                "[limits]\ntenant_queue_bytes = 99999999\n",
                "limits.tenant_queue_bytes",
            ),
        ] {
            let warned = restart_only_changes(&old, &parsed(extra));
            assert_eq!(
                warned,
                vec![format!("{named} changed; it applies after a restart")],
                "{extra}"
            );
        }
    }
}
