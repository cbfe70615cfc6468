//! Typed configuration: parsed from TOML, validated before anything binds, passed down by value.
//!
//! This file is the schema of the file as a whole and its loading; a component's own section is
//! defined beside the component (`[auth]` in [`crate::credentials::config`], `[audit]` in
//! [`crate::audit::config`]), except the roles' `[node]` and `[nodes]` ([`nodes`]): a tenant's
//! entry names its node and its pod's settings, so the edge reads the tenants' schema, and the
//! schema cannot live in the edge without the two importing each other. The defaults are in
//! `defaults.rs`, the rules TOML types cannot express in `validate.rs`.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::admission::AdmissionConfig;
use crate::audit::config::AuditConfig;
use crate::credentials::config::{Auth, TenantCredentials};
use nodes::{NodeRole, Nodes, TenantKubernetes};

mod defaults;
pub mod nodes;
pub mod quantity;
mod validate;

/// `workers.nice` unless set: the same priority as codex-fleet (BENCHMARKS.md, bench 4, "Workers
/// below the router's CPU priority": lower costs streaming throughput when the cores are short).
pub const DEFAULT_WORKER_NICE: u8 = 0;
/// Largest `workers.nice`: the kernel's lowest priority is 19 above the highest (-20 to 19).
pub const MAX_NICE: u8 = 19;
/// Smallest `max_processes` accepted (other than 0): app-server alone runs about 20 threads.
pub const MIN_PROCESSES: u64 = 64;

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The client-facing wss listener.
    pub listen: Listen,
    /// The admin listener (`/healthz`, `/readyz`, `/metrics`).
    #[serde(default)]
    pub admin: Admin,
    /// How workers are started and supervised (not used, and may be left out, on an edge).
    #[serde(default = "defaults::workers")]
    pub workers: Workers,
    /// Limits that protect the service.
    #[serde(default)]
    pub limits: Limits,
    /// How a SIGTERM drains the service.
    #[serde(default)]
    pub drain: Drain,
    /// The tenants; each has its own workers, home and tokens.
    #[serde(default)]
    pub tenants: Vec<Tenant>,
    /// Node role (`codex-fleet node`): this process is the node named here and serves the
    /// tenants assigned to it, to edges only.
    #[serde(default)]
    pub node: Option<NodeRole>,
    /// Edge role (`codex-fleet serve` with this section): tenants live on nodes; this process
    /// terminates TLS, authenticates and relays each session to its tenant's node.
    #[serde(default)]
    pub nodes: Option<Nodes>,
    /// How clients authenticate besides static tokens (`[auth]`).
    #[serde(default)]
    pub auth: Auth,
    /// The audit log (`[audit]`).
    #[serde(default)]
    pub audit: AuditConfig,
}

/// `[listen]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listen {
    /// Address of the wss listener, e.g. `0.0.0.0:8443`.
    pub addr: SocketAddr,
    /// PEM certificate chain.
    pub tls_cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub tls_key: PathBuf,
    /// Deadline for the TLS handshake plus the HTTP upgrade.
    #[serde(default = "defaults::handshake_timeout_secs")]
    pub handshake_timeout_secs: u64,
}

/// `[admin]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// Address of the plain-HTTP admin listener; keep it private.
    #[serde(default = "defaults::admin_addr")]
    pub addr: SocketAddr,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            addr: defaults::admin_addr(),
        }
    }
}

/// `[workers]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workers {
    /// The worker command: program and leading arguments, e.g. `["codex", "app-server"]`.
    /// A program that resolves to the npm package's node shim is replaced by the native binary.
    #[serde(default = "defaults::command")]
    pub command: Vec<String>,
    /// Root of all per-tenant state: `tenants/<id>` (CODEX_HOME), `workspaces/<id>`, `sockets/`.
    pub state_dir: PathBuf,
    /// Passed to every worker as `-c thread_unload_delay_secs=N`.
    #[serde(default = "defaults::idle_secs")]
    pub thread_unload_delay_secs: u64,
    /// A worker with no loaded threads and no legs for this long is drained and stopped.
    #[serde(default = "defaults::idle_secs")]
    pub worker_idle_secs: u64,
    /// Active turns per worker above which a tenant's pool starts another worker (caps allowing).
    #[serde(default = "defaults::load_mark")]
    pub load_mark: usize,
    /// Workers across all tenants, at most.
    #[serde(default = "defaults::max_workers_total")]
    pub max_workers: usize,
    /// `-c key=value` overrides given to every worker, before the tenant's own.
    #[serde(default)]
    pub config_overrides: Vec<String>,
    /// Names of codex-fleet's own environment variables passed through to workers.
    #[serde(default)]
    pub pass_env: Vec<String>,
    /// Spawn to `initialize` answered, at most.
    #[serde(default = "defaults::ready_timeout_secs")]
    pub ready_timeout_secs: u64,
    /// Period of the control-leg health ping.
    #[serde(default = "defaults::health_interval_secs")]
    pub health_interval_secs: u64,
    /// Deadline of one health ping; a miss kills the worker as hung.
    #[serde(default = "defaults::health_timeout_secs")]
    pub health_timeout_secs: u64,
    /// Per-tenant uids (when codex-fleet runs as root): tenants without a `uid` get one from
    /// `[start, end)`, remembered in `<state_dir>/tenant-uids`.
    #[serde(default = "defaults::uid_range")]
    pub uid_range: [u32; 2],
    /// Run workers under per-tenant uids when codex-fleet is root (set false to share its uid).
    #[serde(default = "defaults::yes")]
    pub per_tenant_uid: bool,
    /// RLIMIT_NOFILE of each worker.
    #[serde(default = "defaults::rlimit_nofile")]
    pub rlimit_nofile: Option<u64>,
    /// RLIMIT_AS (bytes) of each worker; unset: unlimited.
    #[serde(default)]
    pub rlimit_as_bytes: Option<u64>,
    /// RLIMIT_CPU (seconds) of each worker; unset: unlimited.
    #[serde(default)]
    pub rlimit_cpu_secs: Option<u64>,
    /// RLIMIT_NPROC of each worker, unless its tenant sets its own: processes and threads of the
    /// worker's real uid, at most (a per-tenant wall under per-tenant uids; under a shared uid
    /// it counts everything of codex-fleet's uid). 0: inherited.
    #[serde(default = "defaults::max_processes")]
    pub max_processes: u64,
    /// How many steps below codex-fleet's own CPU priority workers run (`nice`, added to
    /// codex-fleet's own value and capped at 19; 0, the default: the same priority). codex-fleet
    /// serves every tenant, a worker (and every command its model runs) one: set, when the CPU
    /// is short the kernel runs codex-fleet first, so one tenant's busy worker cannot slow every
    /// tenant's traffic; the price is streaming throughput while the cores are short. A worker
    /// cannot raise its priority back (that needs `CAP_SYS_NICE`).
    #[serde(default = "defaults::nice")]
    pub nice: u8,
    /// Resident memory above which a worker takes no new threads and is replaced once idle.
    #[serde(default)]
    pub max_worker_rss_bytes: Option<u64>,
    /// SIGTERM to SIGKILL when stopping a worker.
    #[serde(default = "defaults::stop_grace_secs")]
    pub stop_grace_secs: u64,
    /// First restart delay after a crash; doubles up to `restart_backoff_max_ms`.
    #[serde(default = "defaults::restart_backoff_initial_ms")]
    pub restart_backoff_initial_ms: u64,
    /// Largest restart delay.
    #[serde(default = "defaults::restart_backoff_max_ms")]
    pub restart_backoff_max_ms: u64,
}

/// `[drain]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drain {
    /// After SIGTERM, `/readyz` is 503 at once but new connections are still served this long, so
    /// load balancers notice first; after it they get 503 with `Retry-After`.
    #[serde(default = "defaults::drain_settle_secs")]
    pub settle_secs: u64,
    /// Longest wait for running turns to finish; turns still running then are interrupted.
    #[serde(default = "defaults::drain_timeout_secs")]
    pub timeout_secs: u64,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            settle_secs: defaults::drain_settle_secs(),
            timeout_secs: defaults::drain_timeout_secs(),
        }
    }
}

/// `[limits]`: message size, the client queue, and every rate and cap of admission control
/// (docs/decisions/0007-admission-before-work.md; the admission keys are [`AdmissionConfig`]'s,
/// flattened into this table).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawLimits")]
pub struct Limits {
    /// Largest WebSocket message (and frame) accepted from a client or a worker.
    pub max_message_bytes: usize,
    /// Messages queued towards one client before it counts as too slow and is closed (1008);
    /// above half of it, streaming deltas to that client are dropped.
    pub client_queue: usize,
    /// Bytes queued towards one client before it counts as too slow and is closed (1008);
    /// above half of it, streaming deltas to that client are dropped. At least
    /// `max_message_bytes`, so one message of the largest size always fits.
    pub client_queue_bytes: usize,
    /// Bytes queued towards all of one tenant's clients together; a session that would take
    /// the tenant over it is closed like a slow reader (1008), and above half of it streaming
    /// deltas to the tenant's clients are dropped.
    pub tenant_queue_bytes: usize,
    /// Rates and caps: connections, frames, requests, turns, requests in flight per worker.
    pub admission: AdmissionConfig,
}

impl Limits {
    /// Queued messages above which streaming deltas to a client are dropped.
    pub fn client_queue_soft_mark(&self) -> usize {
        soft_mark(self.client_queue)
    }
}

/// Half the queue (at least 1): deltas are expendable (`item/completed` carries the full
/// text), so a slow client loses them long before it loses anything that matters.
pub fn soft_mark(client_queue: usize) -> usize {
    (client_queue / 2).max(1)
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message_bytes: defaults::max_message_bytes(),
            client_queue: defaults::client_queue(),
            client_queue_bytes: defaults::client_queue_bytes(),
            tenant_queue_bytes: defaults::tenant_queue_bytes(),
            admission: AdmissionConfig::default(),
        }
    }
}

/// `[limits]` as written: serde cannot combine `flatten` with `deny_unknown_fields`, so the
/// leftovers are collected and refused by name.
#[derive(Deserialize)]
struct RawLimits {
    #[serde(default = "defaults::max_message_bytes")]
    max_message_bytes: usize,
    #[serde(default = "defaults::client_queue")]
    client_queue: usize,
    #[serde(default = "defaults::client_queue_bytes")]
    client_queue_bytes: usize,
    #[serde(default = "defaults::tenant_queue_bytes")]
    tenant_queue_bytes: usize,
    #[serde(flatten)]
    admission: AdmissionConfig,
    #[serde(flatten)]
    unknown: BTreeMap<String, toml::Value>,
}

impl TryFrom<RawLimits> for Limits {
    type Error = String;

    fn try_from(raw: RawLimits) -> Result<Limits, String> {
        if let Some(key) = raw.unknown.keys().next() {
            return Err(format!("unknown field `{key}` in [limits]"));
        }
        Ok(Limits {
            max_message_bytes: raw.max_message_bytes,
            client_queue: raw.client_queue,
            client_queue_bytes: raw.client_queue_bytes,
            tenant_queue_bytes: raw.tenant_queue_bytes,
            admission: raw.admission,
        })
    }
}

/// `[[tenants]]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Short id: `[a-z0-9_-]{1,32}`; names directories and metric labels.
    pub id: String,
    /// Hex SHA-256 digests of the bearer tokens that authenticate as this tenant.
    #[serde(default)]
    pub token_sha256: Vec<String>,
    /// Files each holding one bearer token of this tenant (trimmed; read at start and reload).
    #[serde(default)]
    pub token_files: Vec<PathBuf>,
    /// `Origin` values accepted from browsers; a request with any other `Origin` gets 403.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Close a JWT session when its token expires (plus `auth.expiry_grace_secs`).
    #[serde(default = "defaults::close_on_expiry")]
    pub close_on_expiry: bool,
    /// Workers kept running even when idle.
    #[serde(default)]
    pub min_workers: usize,
    /// This tenant's worker command instead of `workers.command` (e.g. a pinned codex version).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// Most workers this tenant may run.
    #[serde(default = "defaults::max_workers")]
    pub max_workers: usize,
    /// RLIMIT_NPROC of this tenant's workers; unset: `workers.max_processes`.
    #[serde(default)]
    pub max_processes: Option<u64>,
    /// `-c key=value` overrides for this tenant's workers (after `[workers].config_overrides`).
    #[serde(default)]
    pub config_overrides: Vec<String>,
    /// Unix uid of this tenant's workers (codex-fleet must run as root); allocated from
    /// `workers.uid_range` when unset.
    #[serde(default)]
    pub uid: Option<u32>,
    /// Unix gid of this tenant's workers; defaults to the uid.
    #[serde(default)]
    pub gid: Option<u32>,
    /// Extra directories (besides `<state_dir>/workspaces/<id>`) this tenant's clients may name.
    #[serde(default)]
    pub workspace_roots: Vec<PathBuf>,
    /// Host-access policy for this tenant's clients (`[tenants.policy]`).
    #[serde(default)]
    pub policy: crate::policy::PolicyConfig,
    /// The node this tenant lives on (edge and node roles; its CODEX_HOME is on that node's
    /// disk, so the assignment is explicit).
    #[serde(default)]
    pub node: Option<String>,
    /// This tenant's pod (edge, `kubernetes` backend).
    #[serde(default)]
    pub kubernetes: Option<TenantKubernetes>,
}

impl Tenant {
    /// This tenant's part of the credentials: its tokens and what it asks of its clients.
    pub fn credentials(&self) -> TenantCredentials<'_> {
        TenantCredentials {
            id: &self.id,
            token_sha256: &self.token_sha256,
            token_files: &self.token_files,
            allowed_origins: &self.allowed_origins,
            close_on_expiry: self.close_on_expiry,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// TOML syntax, a wrong type or an unknown key.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said (names the key and line).
        message: String,
    },
    /// Parsed, but a value is not acceptable.
    #[error("{0}")]
    Invalid(String),
}

/// What a process does, decided by its configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Clients and workers in one process (`codex-fleet serve` without `[nodes]`).
    Embedded,
    /// Clients only: sessions are relayed to the tenants' nodes (`[nodes]`).
    Edge,
    /// Workers only, for edges (`[node]`, `codex-fleet node`).
    Node,
}

/// The longest socket path a client can connect through (sun_path is 108 bytes with its NUL).
pub use proto::names::MAX_SOCKET_PATH;

impl Config {
    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg = Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_owned(),
                message,
            },
            other => other,
        })?;
        Ok(cfg)
    }

    /// The role the file describes.
    pub fn role(&self) -> Role {
        match (&self.node, &self.nodes) {
            (Some(_), _) => Role::Node,
            (None, Some(_)) => Role::Edge,
            (None, None) => Role::Embedded,
        }
    }

    /// The tenants this process runs workers for: all of them, or on a node those assigned to
    /// it; none on an edge.
    pub fn local_tenants(&self) -> impl Iterator<Item = &Tenant> {
        let role = self.role();
        let name = self.node.as_ref().map(|n| n.name.as_str());
        self.tenants.iter().filter(move |t| match role {
            Role::Embedded => true,
            Role::Node => t.node.as_deref() == name,
            Role::Edge => false,
        })
    }

    /// This configuration as the process runs it: on a node, only its own tenants; on an
    /// edge, no tenant runs here (their tokens and nodes are kept by the edge).
    pub fn localized(&self) -> Config {
        let mut cfg = self.clone();
        let keep: HashSet<String> = self.local_tenants().map(|t| t.id.clone()).collect();
        cfg.tenants.retain(|t| keep.contains(&t.id));
        cfg
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<config>"),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// `[auth]` where this process verifies JWTs itself; `None` on a node (its edges verify
    /// them and it trusts its edges).
    pub fn jwt_auth(&self) -> Option<&Auth> {
        self.node.is_none().then_some(&self.auth)
    }

    /// `<state_dir>/sockets`
    pub fn socket_dir(&self) -> PathBuf {
        self.workers.state_dir.join("sockets")
    }

    /// `<state_dir>/tenants/<id>`: the tenant's CODEX_HOME.
    pub fn tenant_home(&self, id: &str) -> PathBuf {
        self.workers.state_dir.join("tenants").join(id)
    }

    /// `<state_dir>/workspaces/<id>`: the workers' working directory.
    pub fn tenant_workspace(&self, id: &str) -> PathBuf {
        self.workers.state_dir.join("workspaces").join(id)
    }

    /// The worker command of tenant `t`: its own, or `workers.command`.
    pub fn worker_command<'a>(&'a self, t: &'a Tenant) -> &'a [String] {
        t.command.as_deref().unwrap_or(&self.workers.command)
    }

    /// Handshake deadline.
    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_secs(self.listen.handshake_timeout_secs)
    }
}

/// Whether `id` is a valid tenant id: `[a-z0-9_-]{1,32}`.
pub fn valid_tenant_id(id: &str) -> bool {
    proto::names::valid_config_tenant_id(id)
}

#[cfg(test)]
pub(crate) mod tests;
