//! A tenant pod's node: `codex-fleet node --tenant ID` serves exactly that one tenant.

use crate::config::{valid_tenant_id, Config, Tenant};

use crate::edge::kube::spec::TENANT_ENTRY_ENV;

/// The configuration a `--tenant ID` node runs: only that tenant, with its settings from the
/// entry the edge put in the pod ([`TENANT_ENTRY_ENV`], see [`crate::edge::kube::spec::node_entry`]), else
/// from the file's `[[tenants]]` entry of that id, else with default limits. Applied at start
/// and to every reload, so a SIGHUP never drops the tenant or its settings.
pub fn serve_only(cfg: Config, tenant: &str) -> anyhow::Result<Config> {
    let entry = std::env::var_os(TENANT_ENTRY_ENV)
        .map(|v| {
            v.into_string()
                .map_err(|_| anyhow::anyhow!("{TENANT_ENTRY_ENV} is not UTF-8"))
        })
        .transpose()?;
    serve_only_with(cfg, tenant, entry.as_deref())
}

/// [`serve_only`] with the edge's entry (`entry`, JSON) given rather than read from the
/// environment.
pub fn serve_only_with(
    mut cfg: Config,
    tenant: &str,
    entry: Option<&str>,
) -> anyhow::Result<Config> {
    if !valid_tenant_id(tenant) {
        anyhow::bail!("--tenant {tenant:?} is not [a-z0-9_-]{{1,32}}");
    }
    let name = cfg
        .node
        .as_ref()
        .map(|n| n.name.clone())
        .ok_or_else(|| anyhow::anyhow!("--tenant needs a [node] section"))?;
    let from_edge = match entry {
        Some(text) => {
            let t: Tenant = serde_json::from_str(text)
                .map_err(|e| anyhow::anyhow!("{TENANT_ENTRY_ENV}: not a tenant entry: {e}"))?;
            if t.id != tenant {
                anyhow::bail!(
                    "{TENANT_ENTRY_ENV} is the entry of tenant {:?}, not of --tenant {tenant:?}",
                    t.id
                );
            }
            Some(t)
        }
        None => None,
    };
    cfg.tenants.retain(|t| t.id == tenant);
    if let Some(t) = from_edge {
        cfg.tenants = vec![t];
    }
    match cfg.tenants.first_mut() {
        Some(t) => t.node = Some(name),
        None => {
            let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
            // Defaults exactly as a file's `[[tenants]]` entry with only an id would get them.
            let t: Tenant = toml::from_str(&format!("id = {}\nnode = {}\n", q(tenant), q(&name)))?;
            cfg.tenants.push(t);
        }
    }
    // The edge checked the entry against its own file; the node checks it against its own,
    // every rule but the one for credentials (a node authenticates no client: the entry
    // carries none), which a stand-in digest satisfies on a copy.
    let mut check = cfg.clone();
    for t in &mut check.tenants {
        t.token_sha256 = vec!["0".repeat(64)];
    }
    check
        .validate()
        .map_err(|e| anyhow::anyhow!("--tenant {tenant:?} with its entry: {e}"))?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::kube::spec::node_entry;

    const NODE: &str = r#"
[listen]
addr = "127.0.0.1:7443"
tls_cert = "/l/node.crt"
tls_key = "/l/node.key"

[node]
name = "tenant-node"
edge_ca = "/l/ca.pem"

[workers]
state_dir = "/var/lib/codex-fleet"
"#;

    const EDGE_TENANTS: &str = r#"
[[tenants]]
id = "acme"
token_sha256 = ["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]
max_workers = 7
min_workers = 1
config_overrides = ["model=\"o3\""]
workspace_roots = ["/var/lib/codex-fleet/projects"]
command = ["/opt/codex/bin/codex", "app-server"]

[tenants.policy]
command_exec = "deny"

[[tenants]]
id = "beta"
token_sha256 = ["bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"]
"#;

    fn edge_tenants() -> Vec<Tenant> {
        #[derive(serde::Deserialize)]
        struct T {
            tenants: Vec<Tenant>,
        }
        toml::from_str::<T>(EDGE_TENANTS).expect("tenants").tenants
    }

    #[test]
    fn the_edges_entry_reaches_the_node_without_credentials() {
        let acme = &edge_tenants()[0];
        let entry = node_entry(acme).expect("entry");
        assert!(
            !entry.contains("aaaa"),
            "a token digest in the pod: {entry}"
        );
        assert!(!entry.contains("token"), "{entry}");
        let cfg = Config::parse(NODE).expect("node config");
        let cfg = serve_only_with(cfg, "acme", Some(&entry)).expect("served");
        assert_eq!(cfg.tenants.len(), 1);
        let t = &cfg.tenants[0];
        assert_eq!(t.id, "acme");
        assert_eq!(t.node.as_deref(), Some("tenant-node"));
        assert_eq!(t.max_workers, 7);
        assert_eq!(t.min_workers, 1);
        assert_eq!(t.config_overrides, vec!["model=\"o3\"".to_owned()]);
        assert_eq!(
            t.workspace_roots,
            vec![std::path::PathBuf::from("/var/lib/codex-fleet/projects")]
        );
        assert_eq!(
            t.command.as_deref(),
            Some(&["/opt/codex/bin/codex".to_owned(), "app-server".to_owned()][..])
        );
        assert_eq!(
            t.policy.command_exec,
            Some(crate::policy::Mode::Deny),
            "{entry}"
        );
        assert!(t.token_sha256.is_empty());
        // Without an entry: defaults, as before.
        let cfg = serve_only_with(Config::parse(NODE).expect("node"), "acme", None).expect("ok");
        assert_eq!(cfg.tenants[0].max_workers, 4);
        assert_eq!(cfg.tenants[0].policy.command_exec, None);
    }

    #[test]
    fn an_entry_of_another_tenant_or_not_an_entry_is_refused() {
        let beta = node_entry(&edge_tenants()[1]).expect("entry");
        let cfg = || Config::parse(NODE).expect("node config");
        let e = serve_only_with(cfg(), "acme", Some(&beta))
            .expect_err("beta's entry for acme")
            .to_string();
        assert!(e.contains("not of --tenant"), "{e}");
        for bad in [
            "",
            "{",
            r#"{"id":"acme","max_workers":"many"}"#,
            r#"{"id":"acme","unknown":1}"#,
        ] {
            let e = serve_only_with(cfg(), "acme", Some(bad)).expect_err(bad);
            assert!(e.to_string().contains(TENANT_ENTRY_ENV), "{bad}: {e}");
        }
        // Checked as a file's entry is: an entry the node's own rules refuse is refused.
        let e = serve_only_with(cfg(), "acme", Some(r#"{"id":"acme","max_workers":0}"#))
            .expect_err("max_workers 0");
        assert!(e.to_string().contains("acme"), "{e}");
    }
}
