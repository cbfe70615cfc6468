//! Typed configuration: parsed from TOML, validated before anything binds, passed down by value.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::admission::AdmissionConfig;

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

/// `[audit]`: where the audit log goes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// A file (appended, rotated to `<path>.1` past `max_file_bytes`) or `-` for stdout; unset:
    /// no audit log.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Events queued towards the sink; beyond it events are dropped and counted.
    #[serde(default = "defaults::audit_queue")]
    pub queue: usize,
    /// Size at which the file is rotated.
    #[serde(default = "defaults::audit_max_file_bytes")]
    pub max_file_bytes: u64,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            path: None,
            queue: defaults::audit_queue(),
            max_file_bytes: defaults::audit_max_file_bytes(),
        }
    }
}

/// `[auth]`: signed JWTs and what ends a session with its credential.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// Seconds a JWT session stays open past its token's `exp` before it is closed.
    #[serde(default)]
    pub expiry_grace_secs: u64,
    /// The issuers whose signed tokens are accepted (`[[auth.jwt]]`).
    #[serde(default)]
    pub jwt: Vec<JwtIssuer>,
}

/// `[[auth.jwt]]`: one issuer of signed bearer tokens.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtIssuer {
    /// Names the issuer in key ids, logs and the audit log.
    pub name: String,
    /// `HS256` (with `secret_file`), `RS256` or `ES256` (with `jwks_file`); tokens of any
    /// other algorithm are refused.
    pub algorithm: String,
    /// HS256: a file holding the shared secret (trimmed, at least 32 bytes).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// RS256/ES256: a JWKS file (`{"keys": [...]}`); each key needs a `kid`.
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    /// RS256/ES256: or a JWKS URL (https), fetched periodically and on an unknown `kid`.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// PEM CA bundle trusted for `jwks_url`.
    #[serde(default = "defaults::jwks_ca_file")]
    pub jwks_ca_file: PathBuf,
    /// Seconds between fetches of `jwks_url`.
    #[serde(default = "defaults::jwks_refresh_secs")]
    pub jwks_refresh_secs: u64,
    /// When set, the token's `iss` must equal it.
    #[serde(default)]
    pub issuer: Option<String>,
    /// When set, the token's `aud` (a string or an array) must contain it.
    #[serde(default)]
    pub audience: Option<String>,
    /// Allowed clock skew for `exp` and `nbf`, seconds.
    #[serde(default = "defaults::jwt_leeway_secs")]
    pub leeway_secs: u64,
    /// Every token of this issuer authenticates as this tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Or: the claim that names the tenant.
    #[serde(default)]
    pub tenant_claim: Option<String>,
    /// With `tenant_claim`: the only tenants its tokens may name (a token naming another is
    /// refused, `jwt_tenant`). Unset: any configured tenant, static-token tenants included.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// The claim that names the person (the subject).
    #[serde(default = "defaults::subject_claim")]
    pub subject_claim: String,
}

impl JwtIssuer {
    /// `algorithm` as the token library names it; `None` for any algorithm not accepted.
    pub fn parsed_algorithm(&self) -> Option<jsonwebtoken::Algorithm> {
        match self.algorithm.as_str() {
            "HS256" => Some(jsonwebtoken::Algorithm::HS256),
            "RS256" => Some(jsonwebtoken::Algorithm::RS256),
            "ES256" => Some(jsonwebtoken::Algorithm::ES256),
            _ => None,
        }
    }
}

/// `[node]`: this process is a node.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRole {
    /// This node's name; it serves the tenants whose `node` is this name.
    pub name: String,
    /// PEM CA bundle that edges' client certificates must chain to (mutual TLS on the link).
    pub edge_ca: PathBuf,
}

/// `[nodes]`: where tenants live, for an edge.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nodes {
    /// How nodes are found: `static` (listed below, tenants assigned by `tenants[].node`).
    pub backend: NodesBackend,
    /// PEM CA bundle nodes' certificates must chain to.
    pub ca: PathBuf,
    /// PEM certificate this edge presents to nodes.
    pub client_cert: PathBuf,
    /// Its private key.
    pub client_key: PathBuf,
    /// Deadline for connecting a session's link (TCP, TLS, upgrade).
    #[serde(default = "defaults::link_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How often each node's reachability is probed (for `/readyz`).
    #[serde(default = "defaults::probe_interval_secs")]
    pub probe_interval_secs: u64,
    /// The nodes (`static` backend).
    #[serde(default, rename = "static")]
    pub static_nodes: Vec<StaticNode>,
    /// `[nodes.kubernetes]` (`kubernetes` backend): a pod and a volume per tenant, started on
    /// demand.
    #[serde(default)]
    pub kubernetes: Option<KubernetesNodes>,
}

/// `[nodes.kubernetes]`: how the edge finds, starts and reaches each tenant's pod.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesNodes {
    /// Namespace of the tenant pods; default: the service account's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The API server; default: the in-cluster configuration.
    #[serde(default)]
    pub api_url: Option<String>,
    /// A complete Pod manifest in JSON; the edge fills in each tenant's parts.
    pub pod_template: PathBuf,
    /// Pods are `<prefix>-node-<tenant>`, volumes `<prefix>-home-<tenant>`, model Secrets
    /// `<prefix>-model-<tenant>`.
    #[serde(default = "defaults::name_prefix")]
    pub name_prefix: String,
    /// The node container's link port.
    #[serde(default = "defaults::link_port")]
    pub link_port: u16,
    /// The name in every tenant node's link certificate (the SNI the edge dials with).
    #[serde(default = "defaults::node_server_name")]
    pub server_name: String,
    /// Creation to ready; past it a waiting session is refused with `nodeStarting`.
    #[serde(default = "defaults::start_timeout_secs")]
    pub start_timeout_secs: u64,
    /// The tenant volume's request.
    #[serde(default = "defaults::storage_size")]
    pub storage_size: String,
    /// The tenant volume's storage class; absent: the cluster's default.
    #[serde(default)]
    pub storage_class: Option<String>,
    /// A Ready tenant pod made from an older template (its `codex-fleet.io/template-hash` is
    /// not the current one) is deleted once this edge has seen it this long, even while busy,
    /// and recreated on the next session; unset: it keeps running until it idles out.
    #[serde(default)]
    pub max_pod_age_secs: Option<u64>,
}

/// `[tenants.kubernetes]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantKubernetes {
    /// Overrides the template's container resources.
    #[serde(default)]
    pub resources: Option<PodResources>,
}

/// `[tenants.kubernetes.resources]`: Kubernetes quantities, e.g. `cpu = "500m"`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PodResources {
    /// `requests`
    #[serde(default)]
    pub requests: BTreeMap<String, String>,
    /// `limits`
    #[serde(default)]
    pub limits: BTreeMap<String, String>,
}

/// `nodes.backend`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodesBackend {
    /// Nodes listed in `[[nodes.static]]`; each tenant names its node.
    Static,
    /// A pod per tenant on Kubernetes (`[nodes.kubernetes]`), created on demand.
    Kubernetes,
}

/// `[[nodes.static]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticNode {
    /// The node's name (what `tenants[].node` refers to).
    pub name: String,
    /// Its link address, `host:port`.
    pub addr: String,
    /// The name its certificate is checked against; defaults to the host of `addr`.
    #[serde(default)]
    pub server_name: Option<String>,
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

mod defaults {
    use std::net::SocketAddr;

    pub fn audit_queue() -> usize {
        4096
    }
    pub fn audit_max_file_bytes() -> u64 {
        104_857_600
    }
    pub fn jwks_ca_file() -> std::path::PathBuf {
        std::path::PathBuf::from("/etc/ssl/certs/ca-certificates.crt")
    }
    pub fn jwks_refresh_secs() -> u64 {
        300
    }
    pub fn jwt_leeway_secs() -> u64 {
        30
    }
    pub fn subject_claim() -> String {
        "sub".into()
    }
    pub fn close_on_expiry() -> bool {
        true
    }

    pub fn handshake_timeout_secs() -> u64 {
        10
    }
    /// An absent `[workers]` table: every default, and no `state_dir` (only an edge may omit it).
    pub fn workers() -> super::Workers {
        toml::from_str("state_dir = \"\"").expect("every other [workers] key has a default")
    }
    pub fn link_connect_timeout_ms() -> u64 {
        2000
    }
    pub fn name_prefix() -> String {
        "codex-fleet".into()
    }
    pub fn link_port() -> u16 {
        7443
    }
    pub fn node_server_name() -> String {
        "node.codex-fleet.internal".into()
    }
    pub fn start_timeout_secs() -> u64 {
        120
    }
    pub fn storage_size() -> String {
        "10Gi".into()
    }
    pub fn probe_interval_secs() -> u64 {
        2
    }
    pub fn admin_addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9464))
    }
    pub fn command() -> Vec<String> {
        vec!["codex".into(), "app-server".into()]
    }
    pub fn idle_secs() -> u64 {
        1800
    }
    pub fn ready_timeout_secs() -> u64 {
        20
    }
    pub fn health_interval_secs() -> u64 {
        10
    }
    pub fn health_timeout_secs() -> u64 {
        5
    }
    pub fn stop_grace_secs() -> u64 {
        10
    }
    pub fn restart_backoff_initial_ms() -> u64 {
        250
    }
    pub fn restart_backoff_max_ms() -> u64 {
        30_000
    }
    pub fn max_message_bytes() -> usize {
        32 << 20
    }
    pub fn client_queue() -> usize {
        8192
    }
    pub fn client_queue_bytes() -> usize {
        64 << 20
    }
    pub fn tenant_queue_bytes() -> usize {
        256 << 20
    }
    pub fn max_workers() -> usize {
        4
    }
    pub fn uid_range() -> [u32; 2] {
        [200_000, 300_000]
    }
    pub fn yes() -> bool {
        true
    }
    pub fn rlimit_nofile() -> Option<u64> {
        Some(65_536)
    }
    pub fn max_processes() -> u64 {
        4096
    }
    pub fn load_mark() -> usize {
        4
    }
    pub fn max_workers_total() -> usize {
        64
    }
    pub fn drain_settle_secs() -> u64 {
        5
    }
    pub fn drain_timeout_secs() -> u64 {
        300
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

    /// Checks every rule that TOML types cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.workers.command.is_empty() {
            return bad("workers.command must name a program".into());
        }
        if self.workers.state_dir.as_os_str().is_empty() && self.nodes.is_none() {
            return bad("workers.state_dir is required (a [workers] table); only an edge ([nodes]) runs without one".into());
        }
        if self.nodes.is_none() && !self.workers.state_dir.is_absolute() {
            return bad(format!(
                "workers.state_dir must be an absolute path, got {}",
                self.workers.state_dir.display()
            ));
        }
        // sockets/<tenant>-<slot>.sock must stay connectable.
        let longest = self.socket_dir().as_os_str().len() + 1 + 32 + 1 + 4 + 5;
        if longest > MAX_SOCKET_PATH {
            return bad(format!(
                "workers.state_dir is too long for Unix socket paths ({} > {MAX_SOCKET_PATH} bytes with the longest tenant id); use a shorter state_dir",
                longest
            ));
        }
        if self.workers.thread_unload_delay_secs > 365 * 24 * 3600 {
            return bad("workers.thread_unload_delay_secs is larger than a year".into());
        }
        for (key, v) in [
            (
                "workers.ready_timeout_secs",
                self.workers.ready_timeout_secs,
            ),
            (
                "workers.health_interval_secs",
                self.workers.health_interval_secs,
            ),
            (
                "workers.health_timeout_secs",
                self.workers.health_timeout_secs,
            ),
            (
                "listen.handshake_timeout_secs",
                self.listen.handshake_timeout_secs,
            ),
        ] {
            if v == 0 {
                return bad(format!("{key} must be at least 1"));
            }
        }
        if self.workers.restart_backoff_initial_ms > self.workers.restart_backoff_max_ms {
            return bad(
                "workers.restart_backoff_initial_ms is above restart_backoff_max_ms".into(),
            );
        }
        for o in self
            .workers
            .config_overrides
            .iter()
            .chain(self.tenants.iter().flat_map(|t| &t.config_overrides))
        {
            if !o.contains('=') {
                return bad(format!(
                    "config override {o:?} is not of the form key=value"
                ));
            }
        }
        let [lo, hi] = self.workers.uid_range;
        if lo == 0 || lo >= hi {
            return bad("workers.uid_range must be [start, end) with 0 < start < end".into());
        }
        if self.workers.max_workers == 0 || self.workers.load_mark == 0 {
            return bad("workers.max_workers and workers.load_mark must be at least 1".into());
        }
        if self.limits.max_message_bytes < 1024 {
            return bad("limits.max_message_bytes must be at least 1024".into());
        }
        if self.limits.client_queue == 0 {
            return bad("limits.client_queue must be at least 1".into());
        }
        if self.limits.client_queue_bytes < self.limits.max_message_bytes {
            return bad(
                "limits.client_queue_bytes must be at least limits.max_message_bytes".into(),
            );
        }
        if self.limits.tenant_queue_bytes < self.limits.client_queue_bytes {
            return bad(
                "limits.tenant_queue_bytes must be at least limits.client_queue_bytes".into(),
            );
        }
        if let Err(e) = self.limits.admission.validate() {
            return bad(e.to_string());
        }
        let mut ids = HashSet::new();
        let mut digests = HashSet::new();
        check_tenant_boundaries(&self.tenants)?;
        for t in &self.tenants {
            if !valid_tenant_id(&t.id) {
                return bad(format!(
                    "tenant id {:?} must be 1 to 32 characters of a-z, 0-9, '-' or '_'",
                    t.id
                ));
            }
            if !ids.insert(t.id.as_str()) {
                return bad(format!("tenant id {:?} appears twice", t.id));
            }
            if t.token_sha256.is_empty() && t.token_files.is_empty() && self.auth.jwt.is_empty() {
                return bad(format!(
                    "tenant {:?} has no token_sha256 or token_files, and no [[auth.jwt]] is configured",
                    t.id
                ));
            }
            for d in &t.token_sha256 {
                let digest = parse_digest(d).ok_or_else(|| {
                    ConfigError::Invalid(format!(
                        "tenant {:?}: token_sha256 {d:?} is not 64 hex digits",
                        t.id
                    ))
                })?;
                if !digests.insert(digest) {
                    return bad(format!(
                        "tenant {:?}: a token digest is used twice; each token must name one tenant",
                        t.id
                    ));
                }
            }
            if t.uid == Some(0) || t.gid == Some(0) {
                return bad(format!(
                    "tenant {:?}: workers never run as uid or gid 0",
                    t.id
                ));
            }
            if let Some(root) = t.workspace_roots.iter().find(|r| !r.is_absolute()) {
                return bad(format!(
                    "tenant {:?}: workspace root {} is not absolute",
                    t.id,
                    root.display()
                ));
            }
            if let Err(e) = t.policy.resolve(false) {
                return bad(format!("tenant {:?}: {e}", t.id));
            }
            if t.command.as_ref().is_some_and(Vec::is_empty) {
                return bad(format!("tenant {:?}: command must name a program", t.id));
            }
            if t.max_workers == 0 {
                return bad(format!("tenant {:?}: max_workers must be at least 1", t.id));
            }
            let processes = t.max_processes.unwrap_or(self.workers.max_processes);
            if processes != 0 && processes < MIN_PROCESSES {
                return bad(format!(
                    "tenant {:?}: max_processes must be 0 (inherited) or at least {MIN_PROCESSES} \
                     (app-server alone runs about 20 threads)",
                    t.id
                ));
            }
            if t.min_workers > t.max_workers {
                return bad(format!(
                    "tenant {:?}: min_workers is above max_workers",
                    t.id
                ));
            }
        }
        self.validate_auth()?;
        self.validate_roles()
    }

    fn validate_auth(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let mut names = HashSet::new();
        for j in &self.auth.jwt {
            if j.name.is_empty() || !names.insert(j.name.as_str()) {
                return bad(format!(
                    "auth.jwt name {:?} is empty or appears twice",
                    j.name
                ));
            }
            let Some(alg) = j.parsed_algorithm() else {
                return bad(format!(
                    "auth.jwt {:?}: algorithm {:?} is not HS256, RS256 or ES256",
                    j.name, j.algorithm
                ));
            };
            let hs = alg == jsonwebtoken::Algorithm::HS256;
            let jwks = usize::from(j.jwks_file.is_some()) + usize::from(j.jwks_url.is_some());
            if hs != j.secret_file.is_some() || (hs && jwks > 0) || (!hs && jwks != 1) {
                return bad(format!(
                    "auth.jwt {:?}: HS256 takes secret_file, RS256 and ES256 take jwks_file or jwks_url",
                    j.name
                ));
            }
            if j.jwks_url
                .as_ref()
                .is_some_and(|u| !u.starts_with("https://"))
            {
                return bad(format!("auth.jwt {:?}: jwks_url must be https://", j.name));
            }
            if j.tenant.is_some() == j.tenant_claim.is_some() {
                return bad(format!(
                    "auth.jwt {:?}: set exactly one of tenant and tenant_claim",
                    j.name
                ));
            }
            match &j.tenants {
                Some(_) if j.tenant_claim.is_none() => {
                    return bad(format!(
                        "auth.jwt {:?}: tenants lists what tenant_claim may name; with a fixed tenant leave it out",
                        j.name
                    ));
                }
                Some(list) if list.is_empty() => {
                    return bad(format!(
                        "auth.jwt {:?}: tenants = [] admits no token; list tenants or leave it out",
                        j.name
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn validate_roles(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.node.is_some() && self.nodes.is_some() {
            return bad("[node] and [nodes] describe different roles; a file has one".into());
        }
        let kube_backend = self
            .nodes
            .as_ref()
            .is_some_and(|n| n.backend == NodesBackend::Kubernetes);
        if !kube_backend {
            if let Some(t) = self.tenants.iter().find(|t| t.kubernetes.is_some()) {
                return bad(format!(
                    "tenant {:?}: [tenants.kubernetes] needs nodes.backend = \"kubernetes\"",
                    t.id
                ));
            }
        }
        if let Some(nodes) = self.nodes.as_ref().filter(|_| kube_backend) {
            return self.validate_kubernetes(nodes);
        }
        if let Some(nodes) = &self.nodes {
            if nodes.kubernetes.is_some() {
                return bad(
                    "[nodes.kubernetes] is for nodes.backend = \"kubernetes\" (backend is \"static\")"
                        .into(),
                );
            }
            let mut names = HashSet::new();
            for n in &nodes.static_nodes {
                if !valid_tenant_id(&n.name) {
                    return bad(format!(
                        "nodes.static: node name {:?} is not [a-z0-9_-]{{1,32}}",
                        n.name
                    ));
                }
                if !names.insert(n.name.as_str()) {
                    return bad(format!("nodes.static: node {:?} is listed twice", n.name));
                }
                if n.addr
                    .rsplit_once(':')
                    .is_none_or(|(_, p)| p.parse::<u16>().is_err())
                {
                    return bad(format!(
                        "nodes.static: node {:?}: addr {:?} is not host:port",
                        n.name, n.addr
                    ));
                }
            }
            for t in &self.tenants {
                match &t.node {
                    Some(n) if names.contains(n.as_str()) => {}
                    Some(n) => {
                        return bad(format!(
                            "tenant {:?}: node {n:?} is not in [[nodes.static]]",
                            t.id
                        ))
                    }
                    None => {
                        return bad(format!(
                            "tenant {:?}: an edge needs each tenant's node (tenants[].node)",
                            t.id
                        ))
                    }
                }
            }
            if nodes.connect_timeout_ms == 0 || nodes.probe_interval_secs == 0 {
                return bad(
                    "nodes.connect_timeout_ms and nodes.probe_interval_secs must be positive"
                        .into(),
                );
            }
        }
        if let Some(node) = &self.node {
            if !valid_tenant_id(&node.name) {
                return bad(format!(
                    "node.name {:?} is not [a-z0-9_-]{{1,32}}",
                    node.name
                ));
            }
        }
        Ok(())
    }

    /// `[nodes]` with `backend = "kubernetes"`: no static nodes, no `tenants[].node`, names that
    /// make valid pod and volume names, quantities Kubernetes accepts.
    fn validate_kubernetes(&self, nodes: &Nodes) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let Some(k) = &nodes.kubernetes else {
            return bad("nodes.backend = \"kubernetes\" needs a [nodes.kubernetes] table".into());
        };
        if !nodes.static_nodes.is_empty() {
            return bad("[[nodes.static]] is for nodes.backend = \"static\"; the kubernetes backend starts a pod per tenant".into());
        }
        if nodes.connect_timeout_ms == 0 || nodes.probe_interval_secs == 0 {
            return bad(
                "nodes.connect_timeout_ms and nodes.probe_interval_secs must be positive".into(),
            );
        }
        if !dns_label(&k.name_prefix) {
            return bad(format!(
                "nodes.kubernetes.name_prefix {:?} must be lowercase letters, digits and '-' (a DNS label)",
                k.name_prefix
            ));
        }
        if let Some(ns) = &k.namespace {
            if !dns_label(ns) {
                return bad(format!(
                    "nodes.kubernetes.namespace {ns:?} is not a valid namespace name"
                ));
            }
        }
        if k.max_pod_age_secs == Some(0) {
            return bad("nodes.kubernetes.max_pod_age_secs must be positive (or unset)".into());
        }
        if k.link_port == 0 || k.start_timeout_secs == 0 {
            return bad(
                "nodes.kubernetes.link_port and nodes.kubernetes.start_timeout_secs must be positive"
                    .into(),
            );
        }
        if rustls::pki_types::ServerName::try_from(k.server_name.as_str()).is_err() {
            return bad(format!(
                "nodes.kubernetes.server_name {:?} is not a DNS name",
                k.server_name
            ));
        }
        if let Some(url) = &k.api_url {
            if url
                .parse::<http::Uri>()
                .map_or(true, |u| u.host().is_none())
            {
                return bad(format!(
                    "nodes.kubernetes.api_url {url:?} is not a URL like https://host:6443"
                ));
            }
        }
        if crate::edge::kube::quantity::bytes(&k.storage_size).is_none() {
            return bad(format!(
                "nodes.kubernetes.storage_size {:?} is not a quantity like 10Gi",
                k.storage_size
            ));
        }
        for t in &self.tenants {
            if t.node.is_some() {
                return bad(format!(
                    "tenant {:?}: tenants[].node is for the static backend; the kubernetes backend gives each tenant its own pod",
                    t.id
                ));
            }
            // `<prefix>-node-<tenant>` is a pod name: a DNS label of at most 63 characters.
            let pod = format!("{}-node-{}", k.name_prefix, t.id);
            if !dns_label(&pod) {
                return bad(format!(
                    "tenant {:?}: its pod name {pod:?} is not a DNS label (lowercase letters, digits, '-', at most 63 characters); the kubernetes backend needs tenant ids without '_' and a shorter name_prefix",
                    t.id
                ));
            }
            let Some(r) = t.kubernetes.as_ref().and_then(|k| k.resources.as_ref()) else {
                continue;
            };
            for (what, map) in [("requests", &r.requests), ("limits", &r.limits)] {
                for (resource, q) in map {
                    let ok = match resource.as_str() {
                        "cpu" => crate::edge::kube::quantity::cores(q).is_some(),
                        "memory" | "ephemeral-storage" => crate::edge::kube::quantity::bytes(q).is_some(),
                        _ => {
                            return bad(format!(
                                "tenant {:?}: kubernetes.resources.{what}: unknown resource {resource:?} (cpu, memory, ephemeral-storage)",
                                t.id
                            ))
                        }
                    };
                    if !ok {
                        return bad(format!(
                            "tenant {:?}: kubernetes.resources.{what}.{resource} = {q:?} is not a Kubernetes quantity",
                            t.id
                        ));
                    }
                }
            }
        }
        Ok(())
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

/// Two tenants must never share a Unix uid or reach each other's workspace roots: a shared uid
/// reads the other's files, and with `/srv` for A and `/srv/b` for B, `confine` lets A into B's
/// files. Roots are compared by path components as written (a link between them is the
/// operator's to avoid).
fn check_tenant_boundaries(tenants: &[Tenant]) -> Result<(), ConfigError> {
    for (i, a) in tenants.iter().enumerate() {
        for b in &tenants[..i] {
            if let (Some(ua), Some(ub)) = (a.uid, b.uid) {
                if ua == ub {
                    return Err(ConfigError::Invalid(format!(
                        "tenants {:?} and {:?} both have uid {ua}; each tenant needs its own uid",
                        b.id, a.id
                    )));
                }
            }
            for ra in &a.workspace_roots {
                if let Some(rb) = b
                    .workspace_roots
                    .iter()
                    .find(|rb| ra.starts_with(rb) || rb.starts_with(ra))
                {
                    return Err(ConfigError::Invalid(format!(
                        "tenant {:?}: workspace root {} overlaps tenant {:?}'s {}; \
                         tenants' workspace_roots must not contain one another",
                        a.id,
                        ra.display(),
                        b.id,
                        rb.display()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Whether `id` is a valid tenant id: `[a-z0-9_-]{1,32}`.
pub fn valid_tenant_id(id: &str) -> bool {
    proto::names::valid_config_tenant_id(id)
}

/// A DNS label (RFC 1123): 1 to 63 of `a-z`, `0-9`, `-`, not starting or ending with `-`.
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Parses 64 hex digits into a digest.
pub fn parse_digest(hex_digest: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_digest.trim(), &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// SHA-256 of the token `test`, the token of [`minimal`]'s tenant `acme`.
    pub(crate) const DIGEST: &str =
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    /// The smallest valid configuration, `extra` after `[workers]`, then tenant `acme` (its
    /// table is the last: lines appended to the result belong to it).
    pub(crate) fn minimal(extra: &str) -> String {
        format!(
            r#"
[listen]
addr = "127.0.0.1:8443"
tls_cert = "/etc/c.crt"
tls_key = "/etc/c.key"

[workers]
state_dir = "/var/lib/codex-fleet"
{extra}
[[tenants]]
id = "acme"
token_sha256 = ["{DIGEST}"]
"#
        )
    }

    /// Two tenants on two nodes, with `tail` appended (a `[node]` or `[nodes]` section).
    fn two_nodes(tail: &str) -> String {
        let other = DIGEST.replace('a', "b");
        format!(
            r#"
[listen]
addr = "127.0.0.1:8443"
tls_cert = "/etc/c.crt"
tls_key = "/etc/c.key"

[workers]
state_dir = "/var/lib/codex-fleet"

[[tenants]]
id = "acme"
token_sha256 = ["{DIGEST}"]
node = "n1"

[[tenants]]
id = "beta"
token_sha256 = ["{other}"]
node = "n2"
{tail}"#
        )
    }

    const NODES: &str = "[nodes]\nbackend = \"static\"\nca = \"/l/ca.pem\"\nclient_cert = \"/l/e.crt\"\nclient_key = \"/l/e.key\"\n\
                         [[nodes.static]]\nname = \"n1\"\naddr = \"10.0.0.1:7443\"\n\
                         [[nodes.static]]\nname = \"n2\"\naddr = \"10.0.0.2:7443\"\n";

    #[test]
    fn the_role_comes_from_the_file_and_a_node_runs_only_its_tenants() {
        let embedded = Config::parse(&minimal("")).expect("valid");
        assert_eq!(embedded.role(), Role::Embedded);
        assert_eq!(embedded.localized().tenants.len(), 1);
        let node = Config::parse(&two_nodes(
            "[node]\nname = \"n2\"\nedge_ca = \"/l/ca.pem\"\n",
        ))
        .expect("valid");
        assert_eq!(node.role(), Role::Node);
        let ids: Vec<_> = node.localized().tenants.into_iter().map(|t| t.id).collect();
        assert_eq!(ids, ["beta"]);
        let edge = Config::parse(&two_nodes(NODES)).expect("valid");
        assert_eq!(edge.role(), Role::Edge);
        let no_workers =
            two_nodes(NODES).replace("[workers]\nstate_dir = \"/var/lib/codex-fleet\"\n", "");
        assert!(
            Config::parse(&no_workers).is_ok(),
            "an edge needs no [workers]"
        );
        let e = Config::parse(
            &minimal("").replace("[workers]\nstate_dir = \"/var/lib/codex-fleet\"\n", ""),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("workers.state_dir is required"), "{e}");
        assert!(
            edge.localized().tenants.is_empty(),
            "an edge runs no worker"
        );
        assert_eq!(
            edge.nodes.as_ref().map(|n| n.connect_timeout_ms),
            Some(2000)
        );
    }

    #[test]
    fn an_edge_needs_every_tenant_on_a_listed_node() {
        let unknown = two_nodes(NODES).replace("node = \"n2\"", "node = \"n9\"");
        let e = Config::parse(&unknown).unwrap_err().to_string();
        assert!(e.contains("\"n9\" is not in [[nodes.static]]"), "{e}");
        let missing = two_nodes(NODES).replace("node = \"n2\"\n", "");
        let e = Config::parse(&missing).unwrap_err().to_string();
        assert!(e.contains("tenants[].node"), "{e}");
        let twice = two_nodes(NODES).replace("name = \"n2\"", "name = \"n1\"");
        assert!(Config::parse(&twice)
            .unwrap_err()
            .to_string()
            .contains("listed twice"));
        let bad_addr = two_nodes(NODES).replace("10.0.0.2:7443", "10.0.0.2");
        assert!(Config::parse(&bad_addr)
            .unwrap_err()
            .to_string()
            .contains("host:port"));
        let both = two_nodes(&format!(
            "{NODES}[node]\nname = \"n1\"\nedge_ca = \"/l/ca.pem\"\n"
        ));
        assert!(Config::parse(&both)
            .unwrap_err()
            .to_string()
            .contains("one"));
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let cfg = Config::parse(&minimal("")).expect("valid");
        assert_eq!(cfg.workers.thread_unload_delay_secs, 1800);
        assert_eq!(cfg.workers.command, ["codex", "app-server"]);
        assert_eq!(cfg.limits.max_message_bytes, 32 << 20);
        assert_eq!(cfg.tenants[0].max_workers, 4);
        assert_eq!(cfg.admin.addr.port(), 9464);
    }

    #[test]
    fn max_processes_is_inherited_or_large_enough_for_app_server() {
        let tenant = |line: &str| format!("{}{line}\n", minimal(""));
        let cfg = Config::parse(&tenant("max_processes = 200")).expect("valid");
        assert_eq!(cfg.tenants[0].max_processes, Some(200));
        assert_eq!(cfg.workers.max_processes, 4096);
        let err = Config::parse(&tenant("max_processes = 10")).unwrap_err();
        assert!(err.to_string().contains("max_processes"), "{err}");
        let err = Config::parse(&minimal("max_processes = 63\n")).unwrap_err();
        assert!(err.to_string().contains("at least 64"), "{err}");
        assert!(Config::parse(&minimal("max_processes = 0\n")).is_ok());
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = Config::parse(&minimal("bogus_key = 1\n")).unwrap_err();
        assert!(err.to_string().contains("bogus_key"), "{err}");
    }

    #[test]
    fn bad_values_are_refused() {
        for (extra, needle) in [
            ("ready_timeout_secs = 0\n", "ready_timeout_secs"),
            ("config_overrides = [\"novalue\"]\n", "key=value"),
            (
                "restart_backoff_initial_ms = 5\nrestart_backoff_max_ms = 1\n",
                "restart_backoff",
            ),
        ] {
            let err = Config::parse(&minimal(extra)).unwrap_err();
            assert!(err.to_string().contains(needle), "{extra}: {err}");
        }
        let bad_digest = minimal("").replace(DIGEST, "abc");
        assert!(Config::parse(&bad_digest)
            .unwrap_err()
            .to_string()
            .contains("64 hex"));
        let bad_id = minimal("").replace("\"acme\"", "\"Acme/..\"");
        assert!(Config::parse(&bad_id)
            .unwrap_err()
            .to_string()
            .contains("tenant id"));
        let long_dir = minimal("").replace("/var/lib/codex-fleet", &format!("/{}", "x".repeat(90)));
        assert!(Config::parse(&long_dir)
            .unwrap_err()
            .to_string()
            .contains("too long"));
    }

    #[test]
    fn limits_take_admission_keys_by_name_and_refuse_unknown_ones() {
        let text = minimal("").replace(
            "[[tenants]]",
            "[limits]\nmax_connections = 7\ntenant_rps = 3\nclient_queue = 64\n\n[[tenants]]",
        );
        let cfg = Config::parse(&text).expect("valid");
        assert_eq!(cfg.limits.admission.max_connections, 7);
        assert_eq!(cfg.limits.admission.tenant_rps, 3);
        assert_eq!(cfg.limits.client_queue, 64);
        assert_eq!(cfg.limits.client_queue_soft_mark(), 32);
        assert_eq!(
            cfg.limits.admission.conn_fps,
            AdmissionConfig::default().conn_fps
        );
        assert_eq!(
            Config::parse(&minimal("")).expect("valid").limits,
            Limits::default()
        );
        let typo = text.replace("tenant_rps", "tenant_rsp");
        let err = Config::parse(&typo).unwrap_err().to_string();
        assert!(err.contains("tenant_rsp"), "{err}");
        let zero = text.replace("tenant_rps = 3", "tenant_rps = 0");
        let err = Config::parse(&zero).unwrap_err().to_string();
        assert!(err.contains("tenant_rps"), "{err}");
    }

    #[test]
    fn queue_byte_bounds_hold_a_largest_message() {
        let with = |lines: &str| {
            minimal("").replace("[[tenants]]", &format!("[limits]\n{lines}\n\n[[tenants]]"))
        };
        let cfg = Config::parse(&with(
            "client_queue_bytes = 2048\ntenant_queue_bytes = 4096\nmax_message_bytes = 1024",
        ))
        .expect("valid");
        assert_eq!(cfg.limits.client_queue_bytes, 2048);
        assert_eq!(cfg.limits.tenant_queue_bytes, 4096);
        let small = with("client_queue_bytes = 1024\nmax_message_bytes = 2048");
        let err = Config::parse(&small).unwrap_err().to_string();
        assert!(err.contains("client_queue_bytes"), "{err}");
        let tenant = with("client_queue_bytes = 67108864\ntenant_queue_bytes = 1048576");
        let err = Config::parse(&tenant).unwrap_err().to_string();
        assert!(err.contains("tenant_queue_bytes"), "{err}");
    }

    #[test]
    fn a_token_names_one_tenant() {
        let two = format!(
            "{}\n[[tenants]]\nid = \"other\"\ntoken_sha256 = [\"{DIGEST}\"]\n",
            minimal("")
        );
        assert!(Config::parse(&two)
            .unwrap_err()
            .to_string()
            .contains("used twice"));
    }

    /// The defaults the docs' key tables document (docs/configuration.md, and the edge and node
    /// keys in docs/architecture.md), for every key with a literal default: a minimal file gets
    /// exactly those (not whatever `Default` says), and no documented literal default goes
    /// unchecked.
    #[test]
    fn a_minimal_config_gets_the_documented_defaults() {
        let cfg = Config::parse(&minimal("")).expect("valid");
        let (w, a, t) = (&cfg.workers, &cfg.limits.admission, &cfg.tenants[0]);
        let opt = |v: Option<u64>| v.map_or("unset".to_owned(), |v| v.to_string());
        let actual: Vec<(&str, String)> = vec![
            (
                "listen.handshake_timeout_secs",
                cfg.listen.handshake_timeout_secs.to_string(),
            ),
            ("admin.addr", format!("`{}`", cfg.admin.addr)),
            ("workers.command", format!("`{:?}`", w.command)),
            (
                "workers.thread_unload_delay_secs",
                w.thread_unload_delay_secs.to_string(),
            ),
            ("workers.worker_idle_secs", w.worker_idle_secs.to_string()),
            ("workers.load_mark", w.load_mark.to_string()),
            ("workers.max_workers", w.max_workers.to_string()),
            (
                "workers.config_overrides",
                format!("`{:?}`", w.config_overrides),
            ),
            ("workers.pass_env", format!("`{:?}`", w.pass_env)),
            (
                "workers.ready_timeout_secs",
                w.ready_timeout_secs.to_string(),
            ),
            (
                "workers.health_interval_secs",
                w.health_interval_secs.to_string(),
            ),
            (
                "workers.health_timeout_secs",
                w.health_timeout_secs.to_string(),
            ),
            ("workers.stop_grace_secs", w.stop_grace_secs.to_string()),
            ("workers.per_tenant_uid", w.per_tenant_uid.to_string()),
            (
                "workers.uid_range",
                format!("`[{}, {}]`", w.uid_range[0], w.uid_range[1]),
            ),
            ("workers.rlimit_nofile", opt(w.rlimit_nofile)),
            ("workers.rlimit_as_bytes", opt(w.rlimit_as_bytes)),
            ("workers.rlimit_cpu_secs", opt(w.rlimit_cpu_secs)),
            ("workers.max_processes", w.max_processes.to_string()),
            ("tenants[].max_processes", opt(t.max_processes)),
            ("workers.max_worker_rss_bytes", opt(w.max_worker_rss_bytes)),
            (
                "workers.restart_backoff_initial_ms",
                w.restart_backoff_initial_ms.to_string(),
            ),
            (
                "workers.restart_backoff_max_ms",
                w.restart_backoff_max_ms.to_string(),
            ),
            ("drain.settle_secs", cfg.drain.settle_secs.to_string()),
            ("drain.timeout_secs", cfg.drain.timeout_secs.to_string()),
            (
                "limits.max_message_bytes",
                cfg.limits.max_message_bytes.to_string(),
            ),
            ("limits.client_queue", cfg.limits.client_queue.to_string()),
            (
                "limits.client_queue_bytes",
                cfg.limits.client_queue_bytes.to_string(),
            ),
            (
                "limits.tenant_queue_bytes",
                cfg.limits.tenant_queue_bytes.to_string(),
            ),
            ("limits.max_connections", a.max_connections.to_string()),
            (
                "limits.max_connections_per_tenant",
                a.max_connections_per_tenant.to_string(),
            ),
            (
                "limits.handshakes_per_sec_per_ip",
                a.handshakes_per_sec_per_ip.to_string(),
            ),
            ("limits.handshake_burst", a.handshake_burst.to_string()),
            ("limits.conn_fps", a.conn_fps.to_string()),
            (
                "tenants[].node",
                t.node.clone().unwrap_or_else(|| "unset".to_owned()),
            ),
            (
                "tenants[].kubernetes.resources",
                if t.kubernetes.is_none() {
                    "unset".to_owned()
                } else {
                    "set".to_owned()
                },
            ),
            ("limits.conn_burst", a.conn_burst.to_string()),
            ("limits.tenant_rps", a.tenant_rps.to_string()),
            ("limits.tenant_burst", a.tenant_burst.to_string()),
            (
                "limits.turn_start_per_min",
                a.turn_start_per_min.to_string(),
            ),
            ("limits.turn_start_burst", a.turn_start_burst.to_string()),
            (
                "limits.max_active_turns_per_tenant",
                a.max_active_turns_per_tenant.to_string(),
            ),
            (
                "limits.max_in_flight_per_worker",
                a.max_in_flight_per_worker.to_string(),
            ),
            (
                "limits.max_in_flight_per_connection",
                a.max_in_flight_per_connection.to_string(),
            ),
            ("limits.in_flight_wait_ms", a.in_flight_wait_ms.to_string()),
            (
                "limits.cap_retry_after_ms",
                a.cap_retry_after_ms.to_string(),
            ),
            (
                "limits.active_turn_ttl_secs",
                a.active_turn_ttl_secs.to_string(),
            ),
            ("tenants[].min_workers", t.min_workers.to_string()),
            ("tenants[].max_workers", t.max_workers.to_string()),
            (
                "tenants[].config_overrides",
                format!("`{:?}`", t.config_overrides),
            ),
            (
                "tenants[].workspace_roots",
                format!("`{:?}`", t.workspace_roots),
            ),
            ("tenants[].token_files", format!("`{:?}`", t.token_files)),
            (
                "tenants[].allowed_origins",
                format!("`{:?}`", t.allowed_origins),
            ),
            ("tenants[].close_on_expiry", t.close_on_expiry.to_string()),
            (
                "auth.expiry_grace_secs",
                cfg.auth.expiry_grace_secs.to_string(),
            ),
            ("auth.jwt", format!("`{:?}`", cfg.auth.jwt)),
            ("audit.path", "unset".to_owned()),
            ("audit.queue", cfg.audit.queue.to_string()),
            ("audit.max_file_bytes", cfg.audit.max_file_bytes.to_string()),
        ];
        let docs = [
            include_str!("../../docs/configuration.md"),
            include_str!("../../docs/architecture.md"),
        ];
        let documented: Vec<(String, String)> = docs
            .iter()
            .flat_map(|d| d.lines())
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let key = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
                let known = [
                    "listen.",
                    "admin.",
                    "workers.",
                    "drain.",
                    "limits.",
                    "tenants[].",
                    "auth.",
                    "audit.",
                ];
                known.iter().any(|p| key.starts_with(p)).then(|| {
                    (
                        key.to_owned(),
                        cells.get(2).copied().unwrap_or("").to_owned(),
                    )
                })
            })
            .collect();
        for (key, value) in &actual {
            let doc = documented
                .iter()
                .find(|(k, _)| k == key)
                .unwrap_or_else(|| panic!("the docs document no default for {key}"));
            assert_eq!(&doc.1, value, "the docs' default for {key}");
        }
        // Every other documented default is not a literal (required, allocated, another key's).
        for (key, doc) in &documented {
            if !actual.iter().any(|(k, _)| k == key) {
                assert!(
                    ["required", "allocated", "see Security", "`workers.command`"]
                        .contains(&doc.as_str()),
                    "{key}: documented default {doc} is not checked here"
                );
            }
        }
    }
}
