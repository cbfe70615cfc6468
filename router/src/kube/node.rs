//! A tenant pod's node: `codex-fleet node --tenant ID` serves exactly that one tenant.

use crate::config::{valid_tenant_id, Config, Tenant};

/// The configuration a `--tenant ID` node runs: only that tenant, from the file's `[[tenants]]`
/// entry of that id (assigned to this node) or with default limits. Applied at start and to
/// every reload, so a SIGHUP never drops the tenant.
pub fn serve_only(mut cfg: Config, tenant: &str) -> anyhow::Result<Config> {
    if !valid_tenant_id(tenant) {
        anyhow::bail!("--tenant {tenant:?} is not [a-z0-9_-]{{1,32}}");
    }
    let name = cfg
        .node
        .as_ref()
        .map(|n| n.name.clone())
        .ok_or_else(|| anyhow::anyhow!("--tenant needs a [node] section"))?;
    cfg.tenants.retain(|t| t.id == tenant);
    match cfg.tenants.first_mut() {
        Some(t) => t.node = Some(name),
        None => {
            let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
            // Defaults exactly as a file's `[[tenants]]` entry with only an id would get them.
            let t: Tenant = toml::from_str(&format!("id = {}\nnode = {}\n", q(tenant), q(&name)))?;
            cfg.tenants.push(t);
        }
    }
    Ok(cfg)
}
