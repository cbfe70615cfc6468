//! JWKS: the keys of a JWKS document, and a JWKS fetched over HTTPS as identity providers
//! publish them: fetched every `jwks_refresh_secs`, and again when a token names a `kid` it does
//! not hold.

use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey};
use rustls::pki_types::ServerName;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use super::config::{alg_name, JwtIssuer};

/// A verification key of an issuer.
#[derive(Clone)]
pub(crate) struct Key {
    /// `secret` or the JWKS `kid`.
    pub(crate) id: String,
    pub(crate) key: DecodingKey,
}

/// The keys of a JWKS usable with `algorithm`, each by its `kid`.
pub(crate) fn jwks_keys(text: &str, algorithm: Algorithm) -> anyhow::Result<Vec<Key>> {
    let set: JwkSet = serde_json::from_str(text)?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let family_fits = matches!(
            (&jwk.algorithm, algorithm),
            (AlgorithmParameters::RSA(_), Algorithm::RS256)
                | (AlgorithmParameters::EllipticCurve(_), Algorithm::ES256)
        );
        let alg_fits = jwk
            .common
            .key_algorithm
            .is_none_or(|a| format!("{a:?}") == alg_name(algorithm));
        if !family_fits || !alg_fits {
            continue;
        }
        let id = jwk
            .common
            .key_id
            .clone()
            .ok_or_else(|| anyhow::anyhow!("a key has no kid"))?;
        keys.push(Key {
            id,
            key: DecodingKey::from_jwk(jwk)?,
        });
    }
    if keys.is_empty() {
        anyhow::bail!("no {} key", alg_name(algorithm));
    }
    Ok(keys)
}

/// Fetches for an unknown `kid` are at most this frequent per URL.
pub(super) const UNKNOWN_KID_REFETCH: Duration = Duration::from_secs(1);
/// Deadline of one fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest JWKS accepted.
const MAX_JWKS_BYTES: usize = 1 << 20;

/// One issuer's JWKS URL and the keys last fetched from it.
pub(crate) struct JwksUrl {
    name: String,
    uri: http::Uri,
    host: String,
    port: u16,
    tls: TlsConnector,
    algorithm: Algorithm,
    every: Duration,
    keys: RwLock<Arc<Vec<Key>>>,
    /// When the last fetch started; one fetch at a time.
    last: tokio::sync::Mutex<Option<Instant>>,
}

impl JwksUrl {
    pub(super) fn new(c: &JwtIssuer, algorithm: Algorithm) -> anyhow::Result<Arc<JwksUrl>> {
        let url = c.jwks_url.as_deref().unwrap_or_default();
        let uri: http::Uri = url.parse()?;
        if uri.scheme_str() != Some("https") {
            anyhow::bail!("jwks_url must be https://");
        }
        let host = uri
            .host()
            .ok_or_else(|| anyhow::anyhow!("jwks_url has no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(443);
        crate::tls::install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        for cert in crate::tls::load_certs(&c.jwks_ca_file)? {
            roots.add(cert)?;
        }
        let tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Arc::new(JwksUrl {
            name: c.name.clone(),
            uri,
            host,
            port,
            tls: TlsConnector::from(Arc::new(tls)),
            algorithm,
            every: Duration::from_secs(c.jwks_refresh_secs.max(1)),
            keys: RwLock::new(Arc::new(Vec::new())),
            last: tokio::sync::Mutex::new(None),
        }))
    }

    /// The keys last fetched.
    pub(super) fn keys(&self) -> Arc<Vec<Key>> {
        self.keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Fetches the JWKS unless the last fetch started less than `not_within` ago; whether
    /// new keys were put in force. A failed fetch keeps the keys there are (logged).
    pub(super) async fn refresh(&self, not_within: Duration) -> bool {
        let mut last = self.last.lock().await;
        if last.is_some_and(|t| t.elapsed() < not_within) {
            return false;
        }
        *last = Some(Instant::now());
        let fetched = tokio::time::timeout(FETCH_TIMEOUT, self.fetch())
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {FETCH_TIMEOUT:?}")));
        match fetched.and_then(|text| jwks_keys(&text, self.algorithm)) {
            Ok(keys) => {
                tracing::info!(issuer = %self.name, keys = keys.len(), "JWKS fetched");
                *self.keys.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(keys);
                true
            }
            Err(e) => {
                tracing::warn!(issuer = %self.name, error = %format!("{e:#}"), "JWKS fetch failed; the keys fetched before stay");
                false
            }
        }
    }

    async fn fetch(&self) -> anyhow::Result<String> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
        let tls = self
            .tls
            .connect(ServerName::try_from(self.host.clone())?, tcp)
            .await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        let conn = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(conn));
        let path = self.uri.path_and_query().map_or("/", |p| p.as_str());
        let authority = self.uri.authority().map_or("", |a| a.as_str());
        let req = http::Request::get(path)
            .header(http::header::HOST, authority)
            .header(http::header::ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())?;
        let resp = sender.send_request(req).await?;
        if !resp.status().is_success() {
            anyhow::bail!("HTTP {}", resp.status());
        }
        let body = Limited::new(resp.into_body(), MAX_JWKS_BYTES)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the JWKS: {e}"))?
            .to_bytes();
        drop(conn);
        Ok(String::from_utf8(body.to_vec())?)
    }

    /// Fetches now and then every `jwks_refresh_secs` while the issuer is in force (the task
    /// ends once its configuration is replaced and dropped). Without a runtime (e.g.
    /// `check-config`), nothing is started: the first token with a `kid` fetches.
    pub(super) fn spawn_refresh(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak: Weak<JwksUrl> = Arc::downgrade(self);
        let every = self.every;
        rt.spawn(async move {
            loop {
                match weak.upgrade() {
                    Some(url) => {
                        url.refresh(Duration::ZERO).await;
                    }
                    None => return,
                }
                tokio::time::sleep(every).await;
            }
        });
    }
}
