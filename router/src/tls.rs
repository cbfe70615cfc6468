//! TLS for the client listener: loads PEM files into a rustls server configuration.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The certificate file holds no certificate.
    #[error("{0}: no PEM certificate found")]
    NoCertificate(String),
    /// The key file holds no private key.
    #[error("{0}: no PEM private key found")]
    NoKey(String),
    /// rustls refused the pair.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The process-wide crypto provider (ring); installing twice is harmless.
pub fn install_crypto_provider() {
    // Err only means another provider was installed first, which is fine for us.
    let _installed = rustls::crypto::ring::default_provider().install_default();
}

/// Builds the server configuration: TLS 1.2 and 1.3, HTTP/1.1 only (WebSocket upgrades).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    install_crypto_provider();
    let certs = load_certs(cert)?;
    let key = load_key(key)?;
    let mut cfg = ServerConfig::builder_with_protocol_versions(&[
        &rustls::version::TLS13,
        &rustls::version::TLS12,
    ])
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The node's side of the edge→node link: like [`server_config`], and every client must present a
/// certificate chaining to `client_ca` (mutual TLS); others fail the handshake.
pub fn server_config_mutual(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<Arc<ServerConfig>, TlsError> {
    install_crypto_provider();
    let roots = Arc::new(root_store(client_ca)?);
    let verifier = rustls::server::WebPkiClientVerifier::builder(roots)
        .build()
        .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))?;
    let mut cfg = ServerConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(cert)?, load_key(key)?)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The edge's side of the link: trusts only `ca` for nodes and presents `cert`.
pub fn client_config_mutual(
    ca: &Path,
    cert: &Path,
    key: &Path,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    install_crypto_provider();
    let cfg = rustls::ClientConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
        .with_root_certificates(root_store(ca)?)
        .with_client_auth_cert(load_certs(cert)?, load_key(key)?)?;
    Ok(Arc::new(cfg))
}

/// Every certificate of a PEM bundle, as trust anchors.
fn root_store(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert)?;
    }
    Ok(roots)
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// Loads every certificate of a PEM chain.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut BufReader::new(&pem[..]))
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Read {
            path: path.display().to_string(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.display().to_string()));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    rustls_pemfile::private_key(&mut BufReader::new(&pem[..]))
        .map_err(|source| TlsError::Read {
            path: path.display().to_string(),
            source,
        })?
        .ok_or_else(|| TlsError::NoKey(path.display().to_string()))
}
