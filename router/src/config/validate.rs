//! The rules a configuration must keep that TOML types cannot express: checked by
//! [`Config::parse`] before anything binds, each refusal naming the key.

use std::collections::HashSet;

use super::{
    valid_tenant_id, Config, ConfigError, Tenant, MAX_NICE, MAX_SOCKET_PATH, MIN_PROCESSES,
};
use crate::config::nodes::{Nodes, NodesBackend};
use crate::credentials::parse_digest;

impl Config {
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
        if self.workers.nice > MAX_NICE {
            return bad(format!(
                "workers.nice must be 0 to {MAX_NICE} (steps below codex-fleet's own CPU priority), got {}",
                self.workers.nice
            ));
        }
        let keep = self.audit.keep_files;
        if !(1..=crate::audit::config::MAX_KEEP_FILES).contains(&keep) {
            return bad(format!(
                "audit.keep_files must be 1 to {}, got {keep}",
                crate::audit::config::MAX_KEEP_FILES
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
        if lo < FIRST_TENANT_ID || (lo..hi).contains(&NOBODY) {
            return bad(format!(
                "workers.uid_range [{lo}, {hi}) reaches the host's ids ({HOST_RESERVED_IDS}): \
                 tenants get uids no account or daemon of the host uses"
            ));
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
            for (key, id) in [("uid", t.uid), ("gid", t.gid)] {
                if let Some(id) = id.filter(|&id| host_reserved_id(id)) {
                    return bad(format!(
                        "tenant {:?}: {key} {id} is the host's ({}): a tenant's workers run \
                         with it, and when its last worker ends every process of the tenant's uid \
                         is stopped; give the tenant an id no account, group or daemon of the host \
                         uses, or leave it out to have one allocated from workers.uid_range",
                        t.id, HOST_RESERVED_IDS,
                    ));
                }
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
        if super::quantity::bytes(&k.storage_size).is_none() {
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
                        "cpu" => super::quantity::cores(q).is_some(),
                        "memory" | "ephemeral-storage" => super::quantity::bytes(q).is_some(),
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
}

/// The lowest uid or gid a tenant may have: below it are the host's system accounts and groups
/// (`SYS_UID_MAX` is 999 in the `login.defs` of Debian and most distributions). A tenant's gid
/// there would give its workers the group's files (`adm`'s logs, `docker`'s socket), and its uid
/// a daemon's processes, which the sweep after its last worker stops.
const FIRST_TENANT_ID: u32 = 1000;

/// `nobody` and `nogroup`, shared by the daemons that run unprivileged.
const NOBODY: u32 = 65534;

/// What [`host_reserved_id`] refuses, for messages.
const HOST_RESERVED_IDS: &str = "below 1000: the system's; 65534: nobody's; 4294967295: -1";

/// An id the host itself uses on every system, so no tenant may have it. (`u32::MAX` is
/// `(uid_t) -1`, "no change" to the kernel.)
fn host_reserved_id(id: u32) -> bool {
    id < FIRST_TENANT_ID || id == NOBODY || id == u32::MAX
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

/// A DNS label (RFC 1123): 1 to 63 of `a-z`, `0-9`, `-`, not starting or ending with `-`.
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}
