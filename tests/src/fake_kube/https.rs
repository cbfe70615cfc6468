//! The fake API server as a pod sees the real one
//! (docs/decisions/0017-settings-travel-with-the-tenant.md): HTTPS with a certificate of a
//! test CA for `127.0.0.1` (what `KUBERNETES_SERVICE_HOST` names in a cluster is an IP too), and
//! every request authenticated by `Authorization: Bearer <token>` against a set of accepted
//! service-account tokens that a test rotates; anything else is answered `401 Unauthorized`
//! with a `Status`, as a real API server answers it. [`write_service_account`] writes the
//! files a pod's service account mounts (`token`, `ca.crt`, `namespace`), for an edge run where
//! kube-rs looks for them.
//!
//! It serves the same store as the plain listener ([`super::FakeKube::url`]); only this one
//! asks for credentials.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::server::{handle, status};
use super::{Body, FakeKube, Inner};
use crate::pki::TestPki;

/// The directory where a pod's service-account files are mounted (and where kube-rs's
/// in-cluster configuration reads them).
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the HTTPS listener accepts and saw.
#[derive(Default)]
struct Auth {
    /// Tokens answered; every other request gets 401.
    accepted: HashSet<String>,
    /// Each token presented (accepted or not): when first and last.
    seen: HashMap<String, (Instant, Instant)>,
    /// Requests answered 401.
    refused: usize,
}

/// The HTTPS listener of a [`FakeKube`] (stops with it).
pub struct HttpsApi {
    /// `127.0.0.1:PORT`
    pub addr: SocketAddr,
    /// The CA that issued its certificate (PEM): a pod's `ca.crt`.
    pub ca_pem: String,
    auth: Arc<Mutex<Auth>>,
    inner: Arc<Inner>,
}

impl HttpsApi {
    fn auth(&self) -> std::sync::MutexGuard<'_, Auth> {
        self.auth.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// From now on only `tokens` are accepted (a rotation: the old token stops working at
    /// once, as a deleted token Secret's does), and the open watches end, so that every client
    /// must authenticate anew at once rather than when its watch times out.
    pub fn accept_only(&self, tokens: &[&str]) {
        self.auth().accepted = tokens.iter().map(|t| (*t).to_owned()).collect();
        self.inner.end_watches();
    }

    /// When a request first presented `token`.
    pub fn first_use(&self, token: &str) -> Option<Instant> {
        self.auth().seen.get(token).map(|(first, _)| *first)
    }

    /// When a request last presented `token`.
    pub fn last_use(&self, token: &str) -> Option<Instant> {
        self.auth().seen.get(token).map(|(_, last)| *last)
    }

    /// Requests answered 401 so far.
    pub fn refused(&self) -> usize {
        self.auth().refused
    }
}

/// Writes a service account's mounted files into `dir`: `token`, `ca.crt` and `namespace`
/// (each replaced by a rename, as the kubelet swaps them, so a reader never sees half a file).
pub fn write_service_account(
    dir: &Path,
    token: &str,
    ca_pem: &str,
    namespace: &str,
) -> anyhow::Result<()> {
    write_atomically(&dir.join("ca.crt"), ca_pem)?;
    write_atomically(&dir.join("namespace"), namespace)?;
    write_token(dir, token)
}

/// Replaces the `token` file in a service-account directory (a rotation).
pub fn write_token(dir: &Path, token: &str) -> anyhow::Result<()> {
    write_atomically(&dir.join("token"), token)
}

fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The bearer token of a request, if it has one.
fn bearer<B>(req: &Request<B>) -> Option<&str> {
    req.headers()
        .get(hyper::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

impl FakeKube {
    /// Serves the same API over HTTPS on another loopback port, with a certificate for
    /// `127.0.0.1` issued by `pki`, accepting only requests that bear one of `tokens`.
    pub async fn serve_https(&self, pki: &TestPki, tokens: &[&str]) -> anyhow::Result<HttpsApi> {
        let (cert, key) = pki.leaf(
            &["127.0.0.1"],
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth],
            None,
        )?;
        let certs = rustls_pemfile::certs(&mut cert.as_bytes()).collect::<Result<Vec<_>, _>>()?;
        let key = rustls_pemfile::private_key(&mut key.as_bytes())?
            .ok_or_else(|| anyhow::anyhow!("no key"))?;
        let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = tcp.local_addr()?;
        let auth = Arc::new(Mutex::new(Auth {
            accepted: tokens.iter().map(|t| (*t).to_owned()).collect(),
            ..Auth::default()
        }));
        let (inner, stop, auth2) = (self.inner.clone(), self.stop.clone(), auth.clone());
        tokio::spawn(async move {
            loop {
                let (conn, _) = tokio::select! {
                    r = tcp.accept() => match r { Ok(c) => c, Err(_) => continue },
                    () = stop.cancelled() => return,
                };
                let (inner, stop, auth, acceptor) =
                    (inner.clone(), stop.clone(), auth2.clone(), acceptor.clone());
                tokio::spawn(async move {
                    // A client that does not trust the certificate ends here, as it does with
                    // a real API server: the handshake fails on its side.
                    let Ok(Ok(tls)) =
                        tokio::time::timeout(Duration::from_secs(10), acceptor.accept(conn)).await
                    else {
                        return;
                    };
                    let svc = hyper::service::service_fn(move |req| {
                        let (inner, stop, auth) = (inner.clone(), stop.clone(), auth.clone());
                        async move {
                            let allowed = {
                                let mut a = auth.lock().unwrap_or_else(PoisonError::into_inner);
                                let token = bearer(&req).map(str::to_owned);
                                if let Some(t) = &token {
                                    let now = Instant::now();
                                    a.seen
                                        .entry(t.clone())
                                        .and_modify(|(_, last)| *last = now)
                                        .or_insert((now, now));
                                }
                                let ok = token.is_some_and(|t| a.accepted.contains(&t));
                                if !ok {
                                    a.refused += 1;
                                }
                                ok
                            };
                            let r: Response<Body> = if allowed {
                                handle(inner, stop, req).await
                            } else {
                                status(401, "Unauthorized", "Unauthorized")
                            };
                            Ok::<_, Infallible>(r)
                        }
                    });
                    let _served = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        Ok(HttpsApi {
            addr,
            ca_pem: pki.ca.clone(),
            auth,
            inner: self.inner.clone(),
        })
    }
}
