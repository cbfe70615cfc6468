//! TLS for the client listener and the edge↔node link: loads PEM files into rustls
//! configurations, and reloads them when they change ([`CertFiles`] for a certificate and its
//! key, [`CaFile`] for a CA bundle: Kubernetes and cert-manager rotate them in place), without
//! touching the connections already open.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use prometheus::{IntCounterVec, Opts, Registry};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
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
    Ok(server_config_reloading(cert, key)?.0)
}

/// [`server_config`] whose certificate comes from `cert`/`key` as they are now: see
/// [`CertFiles::check`].
pub fn server_config_reloading(
    cert: &Path,
    key: &Path,
) -> Result<(Arc<ServerConfig>, Arc<CertFiles>), TlsError> {
    install_crypto_provider();
    let files = CertFiles::load(cert, key)?;
    let mut cfg = ServerConfig::builder_with_protocol_versions(&[
        &rustls::version::TLS13,
        &rustls::version::TLS12,
    ])
    .with_no_client_auth()
    .with_cert_resolver(files.clone());
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((Arc::new(cfg), files))
}

/// The node's side of the edge→node link: like [`server_config`], and every client must present a
/// certificate chaining to `client_ca` (mutual TLS) whose extended key usage names clientAuth
/// ([`ClientAuthOnly`]); others fail the handshake. Returns the files to watch: the pair and the
/// CA bundle, each put in force for the next handshake when it changes.
pub fn server_config_mutual(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<(Arc<ServerConfig>, Watched), TlsError> {
    install_crypto_provider();
    let ca = CaFile::load(client_ca, client_verifier)?;
    let verifier = Arc::new(ClientAuthOnly { chain: ca.clone() });
    let files = CertFiles::load(cert, key)?;
    let mut cfg = ServerConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(files.clone());
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((Arc::new(cfg), vec![files, ca]))
}

/// The chain check of a link client certificate against a CA bundle.
fn client_verifier(
    roots: rustls::RootCertStore,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))
}

/// The chain check of a node's server certificate against a CA bundle.
fn server_verifier(
    roots: rustls::RootCertStore,
) -> Result<Arc<rustls::client::WebPkiServerVerifier>, TlsError> {
    rustls::client::WebPkiServerVerifier::builder(Arc::new(roots))
        .build()
        .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))
}

/// A client certificate verifier that also requires the clientAuth extended key usage of the
/// end-entity certificate. WebPki accepts a certificate without any extended key usage for
/// every purpose, so a server (or any other) certificate the link CA signed would open a node's
/// port; only certificates issued to edges (clientAuth) do here. The chain is checked against
/// the CA bundle in force when the handshake runs.
#[derive(Debug)]
pub struct ClientAuthOnly {
    /// Checks the chain to the CA, validity and the handshake signatures.
    chain: Arc<CaFile<dyn rustls::server::danger::ClientCertVerifier>>,
}

/// Whether the certificate (DER) names clientAuth in its extended key usage.
pub fn has_client_auth_eku(cert: &[u8]) -> bool {
    x509_parser::parse_x509_certificate(cert).is_ok_and(
        |(_, cert)| matches!(cert.extended_key_usage(), Ok(Some(eku)) if eku.value.client_auth),
    )
}

impl rustls::server::danger::ClientCertVerifier for ClientAuthOnly {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    /// No hints: the CA bundle can change under a running server, and an edge presents its one
    /// certificate whatever the hints say.
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self
            .chain
            .current()
            .verify_client_cert(end_entity, intermediates, now)?;
        if !has_client_auth_eku(end_entity) {
            tracing::warn!(
                "link refused: the client certificate has no clientAuth extended key usage"
            );
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::InvalidPurpose,
            ));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain
            .current()
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain
            .current()
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chain.current().supported_verify_schemes()
    }
}

/// The edge's check of a node's server certificate: the chain to the link CA bundle in force
/// when the handshake runs, and the node's name.
impl rustls::client::danger::ServerCertVerifier for CaFile<rustls::client::WebPkiServerVerifier> {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.current().verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}

/// How often the certificate files are compared with what is serving.
pub const CERT_POLL: Duration = Duration::from_secs(2);

/// `codex_fleet_tls_reloads_total{result}`: certificate reloads, `ok` or `invalid`.
pub const TLS_RELOADS: &str = "codex_fleet_tls_reloads_total";

/// The listener's certificate and key files, and the pair serving now. New handshakes get the
/// pair in force when they start; open connections keep theirs.
pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    serving: RwLock<Arc<CertifiedKey>>,
    /// The file contents last tried (served, or refused): a broken pair is reported once.
    seen: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for CertFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertFiles")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.serving
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }
}

/// The edge's side of the link presents the pair in force too: a certificate renewed in place
/// (cert-manager renews before expiry) is what the next link's handshake presents.
impl rustls::client::ResolvesClientCert for CertFiles {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(
            self.serving
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl CertFiles {
    /// Loads the pair; fails when it is unreadable or the key is not the certificate's.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<CertFiles>, TlsError> {
        let seen = (read(cert)?, read(key)?);
        let pair = certified_key(cert, key, &seen)?;
        Ok(Arc::new(CertFiles {
            cert: cert.to_owned(),
            key: key.to_owned(),
            serving: RwLock::new(Arc::new(pair)),
            seen: Mutex::new(seen),
        }))
    }

    /// Reads the files; when they differ from what was last tried, serves them if they make a
    /// valid pair. `Ok(true)`: a new pair serves; `Ok(false)`: unchanged; `Err`: the new files
    /// are refused and the previous pair keeps serving.
    pub fn check(&self) -> Result<bool, TlsError> {
        let now = (read(&self.cert)?, read(&self.key)?);
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *seen == now {
                return Ok(false);
            }
            seen.clone_from(&now);
        }
        let pair = certified_key(&self.cert, &self.key, &now)?;
        *self.serving.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(pair);
        Ok(true)
    }
}

impl Reload for CertFiles {
    fn check(&self) -> Result<bool, TlsError> {
        CertFiles::check(self)
    }

    fn path(&self) -> &Path {
        &self.cert
    }
}

/// The TLS files of one configuration, to watch ([`spawn_watch`]).
pub type Watched = Vec<Arc<dyn Reload>>;

/// TLS files watched for rotation: [`Reload::check`] puts what they hold now in force for the
/// next handshake.
pub trait Reload: Send + Sync {
    /// `Ok(true)`: new contents are in force; `Ok(false)`: unchanged; `Err`: the new contents
    /// are refused and the previous ones stay in force.
    fn check(&self) -> Result<bool, TlsError>;

    /// The file named in logs.
    fn path(&self) -> &Path;
}

/// Checks `files` every `every` until dropped; each reload is logged and counted in `reloads`
/// ([`reload_counter`]).
pub fn spawn_watch(
    files: Watched,
    every: Duration,
    reloads: IntCounterVec,
) -> tokio_util::task::AbortOnDropHandle<()> {
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            for file in &files {
                match file.check() {
                    Ok(false) => {}
                    Ok(true) => {
                        reloads.with_label_values(&["ok"]).inc();
                        tracing::info!(file = %file.path().display(), "TLS file reloaded; new handshakes use it");
                    }
                    Err(e) => {
                        reloads.with_label_values(&["invalid"]).inc();
                        tracing::error!(file = %file.path().display(), error = %e, "TLS file changed but is not valid; what it held before stays in use");
                    }
                }
            }
        }
    }))
}

/// A CA bundle file and the verifier built from what it holds now. New handshakes are checked
/// against the bundle in force when they start; open connections are not touched. A bundle that
/// holds no certificate, or one rustls refuses, is refused and the previous one stays.
pub struct CaFile<V: ?Sized> {
    path: PathBuf,
    build: fn(rustls::RootCertStore) -> Result<Arc<V>, TlsError>,
    current: RwLock<Arc<V>>,
    /// The file contents last tried (in force, or refused): a broken bundle is reported once.
    seen: Mutex<Vec<u8>>,
}

impl<V: ?Sized> std::fmt::Debug for CaFile<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl<V: ?Sized> CaFile<V> {
    /// Loads the bundle; fails when it is unreadable or holds no valid certificate.
    pub fn load(
        path: &Path,
        build: fn(rustls::RootCertStore) -> Result<Arc<V>, TlsError>,
    ) -> Result<Arc<CaFile<V>>, TlsError> {
        let seen = read(path)?;
        let current = build(roots_of(path, &seen)?)?;
        Ok(Arc::new(CaFile {
            path: path.to_owned(),
            build,
            current: RwLock::new(current),
            seen: Mutex::new(seen),
        }))
    }

    /// The verifier in force.
    pub fn current(&self) -> Arc<V> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<V: ?Sized + Send + Sync> Reload for CaFile<V> {
    fn check(&self) -> Result<bool, TlsError> {
        let now = read(&self.path)?;
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *seen == now {
                return Ok(false);
            }
            seen.clone_from(&now);
        }
        let verifier = (self.build)(roots_of(&self.path, &now)?)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = verifier;
        Ok(true)
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// [`TLS_RELOADS`], registered on `registry`, both results at zero: every watched file (the
/// listener's pair, a node's edge CA, an edge's link pair and node CA) counts into it.
pub fn reload_counter(registry: &Registry) -> Result<IntCounterVec, prometheus::Error> {
    let reloads = IntCounterVec::new(
        Opts::new(
            TLS_RELOADS,
            "TLS file reloads after the files changed (certificate pairs and CA bundles of the listener and the link), by result (ok, invalid).",
        ),
        &["result"],
    )?;
    registry.register(Box::new(reloads.clone()))?;
    for result in ["ok", "invalid"] {
        reloads.with_label_values(&[result]);
    }
    Ok(reloads)
}

/// The pair of PEM texts as rustls serves it; the key must be the certificate's.
fn certified_key(
    cert: &Path,
    key: &Path,
    pem: &(Vec<u8>, Vec<u8>),
) -> Result<CertifiedKey, TlsError> {
    let certs = parse_certs(cert, &pem.0)?;
    let key = parse_key(key, &pem.1)?;
    let provider = rustls::crypto::ring::default_provider();
    Ok(CertifiedKey::from_der(certs, key, &provider)?)
}

/// The edge's side of the link: trusts only `ca` for nodes and presents `cert`, as the files
/// hold them now (see [`Reload::check`]; the caller watches the returned files: the pair and the
/// CA bundle).
pub fn client_config_mutual(
    ca: &Path,
    cert: &Path,
    key: &Path,
) -> Result<(Arc<rustls::ClientConfig>, Watched), TlsError> {
    install_crypto_provider();
    let files = CertFiles::load(cert, key)?;
    let ca = CaFile::load(ca, server_verifier)?;
    let cfg = rustls::ClientConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
        .dangerous()
        .with_custom_certificate_verifier(ca.clone())
        .with_client_cert_resolver(files.clone());
    Ok((Arc::new(cfg), vec![files, ca]))
}

/// Every certificate of a PEM bundle, as trust anchors; a bundle without one is refused.
fn roots_of(path: &Path, pem: &[u8]) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in parse_certs(path, pem)? {
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
    parse_certs(path, &read(path)?)
}

fn parse_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut BufReader::new(pem))
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

fn parse_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut BufReader::new(pem))
        .map_err(|source| TlsError::Read {
            path: path.display().to_string(),
            source,
        })?
        .ok_or_else(|| TlsError::NoKey(path.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, ExtendedKeyUsagePurpose as Eku, KeyPair};

    fn der(eku: Vec<Eku>) -> Vec<u8> {
        let mut params = CertificateParams::new(vec!["edge".to_owned()]).unwrap();
        params.extended_key_usages = eku;
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn only_a_client_auth_certificate_has_the_client_auth_eku() {
        assert!(has_client_auth_eku(&der(vec![Eku::ClientAuth])));
        assert!(has_client_auth_eku(&der(vec![
            Eku::ServerAuth,
            Eku::ClientAuth
        ])));
        assert!(!has_client_auth_eku(&der(vec![])));
        assert!(!has_client_auth_eku(&der(vec![Eku::ServerAuth])));
        assert!(!has_client_auth_eku(&der(vec![Eku::Any])));
        assert!(!has_client_auth_eku(b"not a certificate"));
    }

    fn ca_pem() -> String {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().pem()
    }

    /// A CA bundle renewed in place is in force after the next check; one that is not a bundle is
    /// refused once and what was in force stays.
    #[test]
    fn a_ca_bundle_reloads_and_a_broken_one_is_refused_once() {
        install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, ca_pem()).unwrap();
        let ca = CaFile::load(&path, server_verifier).unwrap();
        let first = ca.current();
        assert!(!ca.check().unwrap(), "unchanged");
        std::fs::write(&path, ca_pem()).unwrap();
        assert!(ca.check().unwrap(), "renewed");
        let second = ca.current();
        assert!(!Arc::ptr_eq(&first, &second));
        std::fs::write(&path, "not a bundle").unwrap();
        assert!(ca.check().is_err(), "refused");
        assert!(!ca.check().unwrap(), "reported once");
        assert!(
            Arc::ptr_eq(&second, &ca.current()),
            "the renewed bundle stays"
        );
        assert!(CaFile::load(&path, client_verifier).is_err());
    }
}
