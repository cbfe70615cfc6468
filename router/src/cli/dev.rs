//! `codex-fleet dev`: the embedded default — a local state dir, a private CA and server
//! certificate, one tenant with a fresh token, and the offline mock model when no credentials exist.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use rand::RngCore;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::auth::token_digest_hex;
use crate::fsutil::{private_dir, write_private};

/// PEM material of a private CA and a server certificate it signed.
pub struct Pki {
    /// The CA certificate, for clients' `SSL_CERT_FILE`.
    pub ca_pem: String,
    /// The server certificate.
    pub cert_pem: String,
    /// The server's private key.
    pub key_pem: String,
}

/// Generates a private CA and a server certificate for `names` (DNS names or IP addresses).
pub fn generate_pki(names: &[&str]) -> anyhow::Result<Pki> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "codex-fleet dev CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let mut leaf = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
    leaf.distinguished_name.push(
        DnType::CommonName,
        names.first().copied().unwrap_or("localhost"),
    );
    leaf.use_authority_key_identifier_extension = true;
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
    Ok(Pki {
        ca_pem: ca_cert.pem(),
        cert_pem: leaf_cert.pem(),
        key_pem: leaf_key.serialize_pem(),
    })
}

/// PEM material for the edge→node link: a private CA, a node (server) certificate and an edge
/// (client) certificate it signed.
pub struct LinkPki {
    /// The link CA: nodes' `node.edge_ca` and edges' `nodes.ca`.
    pub ca_pem: String,
    /// A node's certificate (for `names`) and key.
    pub node_cert_pem: String,
    /// Its key.
    pub node_key_pem: String,
    /// An edge's client certificate.
    pub edge_cert_pem: String,
    /// Its key.
    pub edge_key_pem: String,
}

/// Generates the link's CA, a node certificate for `names` and an edge client certificate.
pub fn generate_link_pki(names: &[&str]) -> anyhow::Result<LinkPki> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "codex-fleet link CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |names: Vec<String>,
                cn: &str,
                usage: ExtendedKeyUsagePurpose|
     -> anyhow::Result<(String, String)> {
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, cn);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let (node_cert_pem, node_key_pem) = leaf(
        names,
        "codex-fleet node",
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    let (edge_cert_pem, edge_key_pem) = leaf(
        vec!["codex-fleet-edge".into()],
        "codex-fleet edge",
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    Ok(LinkPki {
        ca_pem: ca_cert.pem(),
        node_cert_pem,
        node_key_pem,
        edge_cert_pem,
        edge_key_pem,
    })
}

/// A fresh random bearer token (256 bits, hex).
pub fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// What `dev` prepared on disk.
pub struct DevSetup {
    /// The generated config file.
    pub config_path: PathBuf,
    /// The CA file clients trust.
    pub ca_path: PathBuf,
    /// The token file (0600).
    pub token_path: PathBuf,
    /// The token itself, printed once.
    pub token: String,
}

/// Options of `codex-fleet dev`.
pub struct DevOptions {
    /// Where everything lives.
    pub state_dir: PathBuf,
    /// Client listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
    /// Worker command.
    pub command: Vec<String>,
    /// `-c` overrides for the dev tenant (the mock model's, when it runs).
    pub overrides: Vec<String>,
}

/// Writes the CA, certificate, token and config for a dev run.
pub fn prepare(opts: &DevOptions) -> anyhow::Result<DevSetup> {
    let dir = &opts.state_dir;
    private_dir(dir).with_context(|| format!("creating {}", dir.display()))?;
    let pki = generate_pki(&["localhost", "127.0.0.1", "::1"])?;
    let ca_path = dir.join("ca.pem");
    let cert_path = dir.join("tls.crt");
    let key_path = dir.join("tls.key");
    fs::write(&ca_path, &pki.ca_pem)?;
    fs::write(&cert_path, &pki.cert_pem)?;
    write_private(&key_path, &pki.key_pem)?;
    let token = random_token();
    let token_path = dir.join("token");
    write_private(&token_path, &format!("{token}\n"))?;
    let config = render_config(opts, &cert_path, &key_path, &token_digest_hex(&token))?;
    let config_path = dir.join("config.toml");
    write_private(&config_path, &config)?;
    Ok(DevSetup {
        config_path,
        ca_path,
        token_path,
        token,
    })
}

fn render_config(
    opts: &DevOptions,
    cert: &Path,
    key: &Path,
    digest: &str,
) -> anyhow::Result<String> {
    let q = |s: &str| toml_string(s);
    let list = |v: &[String]| v.iter().map(|s| q(s)).collect::<Vec<_>>().join(", ");
    let state = opts.state_dir.join("state");
    Ok(format!(
        r#"# Written by `codex-fleet dev`; regenerated on every run.
[listen]
addr = "{listen}"
tls_cert = {cert}
tls_key = {key}

[admin]
addr = "{admin}"

[limits]
# One local developer: far fewer connections than a shared fleet's default, so any open-files
# limit fits the caps.
max_connections = 256

[workers]
command = [{command}]
state_dir = {state}
thread_unload_delay_secs = 1800
# One local developer: the dev tenant shares codex-fleet's uid even when run as root.
per_tenant_uid = false

[[tenants]]
id = "dev"
token_sha256 = ["{digest}"]
min_workers = 1
max_workers = 2
config_overrides = [{overrides}]
"#,
        listen = opts.listen,
        admin = opts.admin,
        cert = q(&cert.display().to_string()),
        key = q(&key.display().to_string()),
        command = list(&opts.command),
        state = q(&state.display().to_string()),
        overrides = list(&opts.overrides),
    ))
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

/// True when the dev tenant has credentials of its own (then the mock model is not used).
pub fn has_model_credentials(state_dir: &Path) -> bool {
    state_dir.join("state/tenants/dev/auth.json").is_file()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn dev_config_is_valid_and_private() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = DevOptions {
            state_dir: tmp.path().join("dev"),
            listen: "127.0.0.1:0".parse().unwrap(),
            admin: "127.0.0.1:0".parse().unwrap(),
            command: vec!["/opt/codex \"x\"".into(), "app-server".into()],
            overrides: vec!["model=\"mock-model\"".into()],
        };
        let setup = prepare(&opts).unwrap();
        let cfg = Config::load(&setup.config_path).unwrap();
        assert_eq!(cfg.tenants[0].id, "dev");
        assert_eq!(cfg.workers.command[0], "/opt/codex \"x\"");
        assert_eq!(cfg.tenants[0].config_overrides, ["model=\"mock-model\""]);
        // A dev fleet's caps fit any open-files limit: no sizing warning at start.
        assert_eq!(cfg.limits.admission.max_connections, 256);
        assert_eq!(
            crate::descriptors::sizing_warning(
                cfg.limits.admission.max_connections,
                2,
                cfg.workers.max_workers
            ),
            None
        );
        use std::os::unix::fs::PermissionsExt;
        for p in [&setup.token_path, &setup.config_path, &cfg.listen.tls_key] {
            let mode = fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", p.display());
        }
        assert_eq!(
            crate::auth::token_digest_hex(&setup.token),
            cfg.tenants[0].token_sha256[0]
        );
        crate::tls::server_config(&cfg.listen.tls_cert, &cfg.listen.tls_key).unwrap();
    }
}
