//! Who a client is: the one credential verifier of the embedded listener (`serve`) and the edge.
//!
//! A bearer token is either a static token (its SHA-256 digest is configured:
//! `tenants[].token_sha256`, or a file holding the token, `tenants[].token_files`) or a signed JWT
//! of one of the `[[auth.jwt]]` issuers: HS256 with a shared secret of at least 32 bytes (what
//! the real app-server's `signed-bearer-token` mode accepts), or RS256/ES256 against a JWKS
//! file, so an organization's identity provider issues the tokens. Verification is
//! `jsonwebtoken`'s; this module only picks the key, the tenant and the subject, and names the
//! reason of a refusal (bounded: [`AuthError::ALL`]).
//!
//! Every session holds a [`Lease`] on the credential that admitted it: it ends at the JWT's
//! `exp` (plus `auth.expiry_grace_secs`, unless the tenant has `close_on_expiry = false`), and
//! when a reload removes the token, the key or the tenant ([`Credentials::commit`]).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use http::HeaderMap;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::auth::{bearer_token, AuthError, TokenTable};
use crate::config::{parse_digest, Config, JwtIssuer};

mod jwks;

/// Longest subject admitted, in bytes (OpenID Connect's bound for `sub`, 255 ASCII
/// characters): a longer one is refused (`jwt_claims`), so every log line, audit record and link
/// header holds a subject exactly as the token named it.
pub const MAX_SUBJECT_BYTES: usize = 255;

/// Latest `exp` admitted, Unix seconds (9999-12-31T23:59:59Z): a later one is refused
/// (`jwt_claims`) rather than overflowing the clock arithmetic of the session's lease.
pub const MAX_EXP_SECS: u64 = 253_402_300_799;

/// The smallest HS256 secret accepted, in bytes (as app-server's `signed-bearer-token`).
pub const MIN_SECRET_BYTES: usize = 32;

/// A client that authenticated: its tenant, who it is, and what admitted it.
#[derive(Debug, Clone)]
pub struct Verified {
    /// The tenant.
    pub tenant: String,
    /// Who: the JWT's subject claim, or `token:<first 12 hex digits of the token's SHA-256>`.
    pub subject: String,
    /// `token` or `jwt`.
    pub kind: &'static str,
    /// Which credential: `token:<12 hex>`, `jwt:<issuer name>:<kid>` or `jwt:<issuer name>:secret`.
    pub key_id: String,
    /// The lease that ends the session with its credential.
    pub lease: Lease,
}

/// Why a session's credential ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialEnd {
    /// The JWT's `exp` (plus the grace) passed.
    Expired,
    /// A reload removed the token, the key or the tenant.
    Revoked,
}

/// Ends a session with the credential that admitted it.
#[derive(Debug, Clone)]
pub struct Lease {
    credential: CancellationToken,
    tenant: CancellationToken,
    deadline: Option<tokio::time::Instant>,
}

impl Lease {
    /// A lease that never ends (sessions a node admits: the edge holds their lease).
    pub fn unbounded() -> Lease {
        Lease {
            credential: CancellationToken::new(),
            tenant: CancellationToken::new(),
            deadline: None,
        }
    }

    /// A lease whose credential was revoked already (tests).
    #[cfg(test)]
    pub(crate) fn revoked() -> Lease {
        let lease = Lease::unbounded();
        lease.credential.cancel();
        lease
    }

    /// Whether the credential has ended already, without waiting (the edge checks it before a
    /// session's held messages leave for its node).
    pub fn ended_now(&self) -> Option<CredentialEnd> {
        if self.credential.is_cancelled() || self.tenant.is_cancelled() {
            Some(CredentialEnd::Revoked)
        } else if self
            .deadline
            .is_some_and(|d| tokio::time::Instant::now() >= d)
        {
            Some(CredentialEnd::Expired)
        } else {
            None
        }
    }

    /// Resolves when the credential ends.
    pub async fn ended(&self) -> CredentialEnd {
        let expiry = async {
            match self.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = self.credential.cancelled() => CredentialEnd::Revoked,
            () = self.tenant.cancelled() => CredentialEnd::Revoked,
            () = expiry => CredentialEnd::Expired,
        }
    }
}

/// One cancellation token per live credential and per tenant, shared by every configuration
/// built after the first, so a reload can end exactly the sessions whose credential it removed.
#[derive(Debug, Default)]
struct Leases {
    tokens: Mutex<HashMap<String, CancellationToken>>,
}

impl Leases {
    fn token(&self, key: &str) -> CancellationToken {
        self.tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    /// Cancels and forgets every token whose key is not in `keep`; returns how many.
    fn retain(&self, keep: &HashSet<String>) -> usize {
        let mut tokens = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        let before = tokens.len();
        tokens.retain(|k, t| {
            let live = keep.contains(k);
            if !live {
                t.cancel();
            }
            live
        });
        before - tokens.len()
    }
}

/// What a tenant asks of its clients besides a credential.
#[derive(Debug, Clone)]
struct TenantRules {
    origins: Vec<String>,
    close_on_expiry: bool,
}

/// A static token: its tenant and key id.
#[derive(Debug)]
struct StaticToken {
    tenant: String,
    key_id: String,
}

/// A verification key of an issuer.
#[derive(Clone)]
pub(crate) struct Key {
    /// `secret` or the JWKS `kid`.
    pub(crate) id: String,
    pub(crate) key: DecodingKey,
}

/// What a lease deadline beyond the clock's range becomes (a hundred years).
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Who a credential names, before the tenant's rules apply.
struct Named {
    tenant: String,
    subject: String,
    kind: &'static str,
    key_id: String,
    /// The lease token's key: the credential a reload can remove.
    lease_key: String,
    exp: Option<SystemTime>,
}

/// One `[[auth.jwt]]` issuer, ready to verify.
struct Issuer {
    name: String,
    algorithm: Algorithm,
    /// The keys of a secret or a JWKS file.
    keys: Arc<Vec<Key>>,
    /// Or a JWKS fetched over HTTPS.
    url: Option<Arc<jwks::JwksUrl>>,
    validation: Validation,
    tenant: Option<String>,
    tenant_claim: Option<String>,
    /// The tenants `tenant_claim` may name; `None`: any.
    tenants: Option<HashSet<String>>,
    subject_claim: String,
}

/// Every credential of one configuration.
pub struct Credentials {
    tokens: TokenTable,
    statics: Vec<StaticToken>,
    issuers: Vec<Issuer>,
    tenants: HashMap<String, TenantRules>,
    grace: Duration,
    leases: Arc<Leases>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys or digests.
        f.debug_struct("Credentials")
            .field("static_tokens", &self.statics.len())
            .field("issuers", &self.issuers.len())
            .finish()
    }
}

impl Credentials {
    /// Reads every credential of `cfg` (token files, secrets, JWKS files). `previous` is the
    /// configuration in force, whose leases carry over; nothing is revoked until
    /// [`Credentials::commit`].
    pub fn build(cfg: &Config, previous: Option<&Credentials>) -> anyhow::Result<Credentials> {
        let mut tokens = TokenTable::default();
        let mut statics = Vec::new();
        let mut tenants = HashMap::new();
        for t in &cfg.tenants {
            let mut digests: Vec<[u8; 32]> = t
                .token_sha256
                .iter()
                .filter_map(|d| parse_digest(d))
                .collect();
            for path in &t.token_files {
                let token = read_trimmed(path)
                    .map_err(|e| anyhow::anyhow!("tenant {:?}: token file: {e}", t.id))?;
                digests.push(Sha256::digest(token.as_bytes()).into());
            }
            for digest in digests {
                tokens.insert(digest, statics.len());
                statics.push(StaticToken {
                    tenant: t.id.clone(),
                    key_id: format!("token:{}", &hex::encode(digest)[..12]),
                });
            }
            tenants.insert(
                t.id.clone(),
                TenantRules {
                    origins: t.allowed_origins.clone(),
                    close_on_expiry: t.close_on_expiry,
                },
            );
        }
        // A node trusts its edges, which verify JWTs: it needs none of their keys.
        let issuers = if cfg.node.is_some() {
            Vec::new()
        } else {
            cfg.auth
                .jwt
                .iter()
                .map(Issuer::build)
                .collect::<anyhow::Result<_>>()?
        };
        Ok(Credentials {
            tokens,
            statics,
            issuers,
            tenants,
            grace: Duration::from_secs(cfg.auth.expiry_grace_secs),
            leases: previous.map(|p| p.leases.clone()).unwrap_or_default(),
        })
    }

    /// Puts this configuration in force for sessions: ends those whose token, key or tenant it
    /// no longer has. Returns how many credentials and tenants were removed.
    pub fn commit(&self) -> usize {
        let mut keep: HashSet<String> = self.statics.iter().map(|s| s.key_id.clone()).collect();
        for i in &self.issuers {
            match &i.url {
                Some(_) => {
                    keep.insert(format!("jwt:{}:url", i.name));
                }
                None => keep.extend(i.keys.iter().map(|k| format!("jwt:{}:{}", i.name, k.id))),
            }
        }
        keep.extend(self.tenants.keys().map(|t| format!("tenant:{t}")));
        let removed = self.leases.retain(&keep);
        if removed > 0 {
            tracing::info!(
                removed,
                "reload removed credentials or tenants: their sessions are closed"
            );
        }
        removed
    }

    /// Authenticates an upgrade: its bearer token, then its `Origin` against the tenant's
    /// allowlist. A JWT whose `kid` no JWKS URL holds yet has that JWKS fetched again first
    /// (at most once a second per URL), so a rotated key works without a reload.
    pub async fn admit(&self, headers: &HeaderMap) -> Result<Verified, AuthError> {
        let refused = match self.admit_now(headers) {
            Err(e) => e,
            admitted => return admitted,
        };
        // A JWT with a kid that a JWKS URL of its algorithm does not hold (yet).
        let Some(peek) = bearer_token(headers).ok().and_then(Peek::of) else {
            return Err(refused);
        };
        let Some(kid) = peek.kid.as_deref() else {
            return Err(refused);
        };
        let mut refreshed = false;
        for url in self
            .issuers
            .iter()
            .filter(|i| alg_name(i.algorithm) == peek.alg)
            .filter_map(|i| i.url.as_ref())
            .filter(|u| !u.keys().iter().any(|k| k.id == kid))
        {
            // A fetch already under way (or just done) may have brought the key too.
            refreshed |= url.refresh(jwks::UNKNOWN_KID_REFETCH).await
                || url.keys().iter().any(|k| k.id == kid);
        }
        if refreshed {
            self.admit_now(headers)
        } else {
            Err(refused)
        }
    }

    fn admit_now(&self, headers: &HeaderMap) -> Result<Verified, AuthError> {
        let token = bearer_token(headers)?;
        let Named {
            tenant,
            subject,
            kind,
            key_id,
            lease_key,
            exp,
        } = match self.tokens.lookup(token) {
            Some(i) => {
                let s = &self.statics[i];
                Named {
                    tenant: s.tenant.clone(),
                    subject: s.key_id.clone(),
                    kind: "token",
                    key_id: s.key_id.clone(),
                    lease_key: s.key_id.clone(),
                    exp: None,
                }
            }
            None if looks_like_jwt(token) => self.verify_jwt(token)?,
            None => return Err(AuthError::Invalid),
        };
        let rules = self.tenants.get(&tenant).ok_or(AuthError::UnknownTenant)?;
        if let Some(origin) = headers.get(http::header::ORIGIN) {
            let allowed = origin
                .to_str()
                .is_ok_and(|o| rules.origins.iter().any(|a| a == o));
            if !allowed {
                return Err(AuthError::Origin);
            }
        }
        let deadline = exp.filter(|_| rules.close_on_expiry).map(|exp| {
            let left = exp
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            let now = tokio::time::Instant::now();
            // `exp` is at most MAX_EXP_SECS, but the grace is configured: never overflow.
            now.checked_add(left.saturating_add(self.grace))
                .unwrap_or_else(|| now + FAR_FUTURE)
        });
        let lease = Lease {
            credential: self.leases.token(&lease_key),
            tenant: self.leases.token(&format!("tenant:{tenant}")),
            deadline,
        };
        Ok(Verified {
            tenant,
            subject,
            kind,
            key_id,
            lease,
        })
    }

    /// Verifies a JWT with the issuers configured for its algorithm.
    fn verify_jwt(&self, token: &str) -> Result<Named, AuthError> {
        let peek = Peek::of(token).ok_or(AuthError::JwtMalformed)?;
        let mut candidates: Vec<&Issuer> = self
            .issuers
            .iter()
            .filter(|i| alg_name(i.algorithm) == peek.alg)
            .collect();
        if candidates.is_empty() {
            return Err(AuthError::JwtAlgorithm);
        }
        // The issuer the token names (unverified) is tried first, so its refusal is the one
        // reported.
        candidates.sort_by_key(|i| {
            !i.validation
                .iss
                .as_ref()
                .is_some_and(|iss| peek.iss.as_ref().is_some_and(|p| iss.contains(p)))
        });
        let mut first_error = None;
        for issuer in candidates {
            match issuer.verify(token, peek.kid.as_deref()) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or(AuthError::JwtSignature))
    }
}

/// The unverified header and issuer of a JWT: only to choose the issuer and key.
struct Peek {
    alg: String,
    kid: Option<String>,
    iss: Option<String>,
}

impl Peek {
    fn of(token: &str) -> Option<Peek> {
        let mut parts = token.split('.');
        let (header, claims) = (parts.next()?, parts.next()?);
        let decode = |s: &str| -> Option<serde_json::Value> {
            let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(s.trim_end_matches('='))
                .ok()?;
            serde_json::from_slice(&bytes).ok()
        };
        let header = decode(header)?;
        let claims = decode(claims)?;
        Some(Peek {
            alg: header.get("alg")?.as_str()?.to_owned(),
            kid: header
                .get("kid")
                .and_then(|k| k.as_str())
                .map(str::to_owned),
            iss: claims
                .get("iss")
                .and_then(|k| k.as_str())
                .map(str::to_owned),
        })
    }
}

/// Three dot-separated parts: a JWT, not a static token.
fn looks_like_jwt(token: &str) -> bool {
    token.split('.').count() == 3
}

fn alg_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::HS256 => "HS256",
        Algorithm::RS256 => "RS256",
        Algorithm::ES256 => "ES256",
        _ => "unsupported",
    }
}

fn read_trimmed(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let text = text.trim().to_owned();
    if text.is_empty() {
        anyhow::bail!("{} is empty", path.display());
    }
    Ok(text)
}

impl Issuer {
    fn build(c: &JwtIssuer) -> anyhow::Result<Issuer> {
        let algorithm = c.parsed_algorithm().ok_or_else(|| {
            anyhow::anyhow!(
                "auth.jwt {:?}: unsupported algorithm {:?}",
                c.name,
                c.algorithm
            )
        })?;
        let mut url = None;
        let keys = match (algorithm, &c.secret_file, &c.jwks_file) {
            (Algorithm::HS256, Some(path), None) => {
                let secret = read_trimmed(path)
                    .map_err(|e| anyhow::anyhow!("auth.jwt {:?}: secret: {e}", c.name))?;
                if secret.len() < MIN_SECRET_BYTES {
                    anyhow::bail!(
                        "auth.jwt {:?}: the secret in {} must be at least {MIN_SECRET_BYTES} bytes",
                        c.name,
                        path.display()
                    );
                }
                // Its id changes with the secret, so replacing the secret revokes its sessions.
                let id = format!(
                    "secret-{}",
                    &hex::encode(Sha256::digest(secret.as_bytes()))[..8]
                );
                vec![Key {
                    id,
                    key: DecodingKey::from_secret(secret.as_bytes()),
                }]
            }
            (Algorithm::RS256 | Algorithm::ES256, None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    anyhow::anyhow!("auth.jwt {:?}: cannot read {}: {e}", c.name, path.display())
                })?;
                jwks_keys(&text, algorithm).map_err(|e| {
                    anyhow::anyhow!("auth.jwt {:?}: {}: {e}", c.name, path.display())
                })?
            }
            (Algorithm::RS256 | Algorithm::ES256, None, None) if c.jwks_url.is_some() => {
                let fetched = jwks::JwksUrl::new(c, algorithm)
                    .map_err(|e| anyhow::anyhow!("auth.jwt {:?}: {e}", c.name))?;
                fetched.spawn_refresh();
                url = Some(fetched);
                Vec::new()
            }
            _ => anyhow::bail!(
                "auth.jwt {:?}: HS256 takes secret_file, RS256 and ES256 take jwks_file or jwks_url",
                c.name
            ),
        };
        let mut validation = Validation::new(algorithm);
        validation.leeway = c.leeway_secs;
        validation.validate_nbf = true;
        let mut required = vec!["exp"];
        if let Some(iss) = &c.issuer {
            validation.set_issuer(&[iss]);
            required.push("iss");
        }
        match &c.audience {
            Some(aud) => {
                validation.set_audience(&[aud]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        Ok(Issuer {
            name: c.name.clone(),
            algorithm,
            keys: Arc::new(keys),
            url,
            validation,
            tenant: c.tenant.clone(),
            tenant_claim: c.tenant_claim.clone(),
            tenants: c.tenants.as_ref().map(|t| t.iter().cloned().collect()),
            subject_claim: c.subject_claim.clone(),
        })
    }

    fn verify(&self, token: &str, kid: Option<&str>) -> Result<Named, AuthError> {
        let keys = match &self.url {
            Some(url) => url.keys(),
            None => self.keys.clone(),
        };
        let key = match (self.algorithm, kid) {
            (Algorithm::HS256, _) => keys.first(),
            (_, Some(kid)) => keys.iter().find(|k| k.id == kid),
            // No kid: only unambiguous with a single key.
            (_, None) if keys.len() == 1 => keys.first(),
            (_, None) => None,
        }
        .ok_or(AuthError::JwtUnknownKey)?;
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token,
            &key.key,
            &self.validation,
        )
        .map_err(|e| jwt_error(&e))?;
        let claims = data.claims;
        let text = |name: &str| claims.get(name).and_then(|v| v.as_str()).map(str::to_owned);
        let tenant = match (&self.tenant, &self.tenant_claim) {
            (Some(t), _) => t.clone(),
            (None, Some(claim)) => text(claim).ok_or(AuthError::UnknownTenant)?,
            (None, None) => return Err(AuthError::UnknownTenant),
        };
        if self.tenants.as_ref().is_some_and(|t| !t.contains(&tenant)) {
            return Err(AuthError::JwtTenant);
        }
        let subject = text(&self.subject_claim)
            .filter(|s| !s.is_empty() && s.len() <= MAX_SUBJECT_BYTES)
            .ok_or(AuthError::JwtClaims)?;
        // `exp` is required and a u64 (jsonwebtoken checked both); `nbf` and `iat` are only
        // compared, never added to a clock.
        let exp = match claims.get("exp").and_then(serde_json::Value::as_u64) {
            Some(s) if s <= MAX_EXP_SECS => Some(UNIX_EPOCH + Duration::from_secs(s)),
            _ => return Err(AuthError::JwtClaims),
        };
        let key_id = format!("jwt:{}:{}", self.name, key.id);
        let lease_key = match self.url {
            // Keys come and go with the identity provider's rotation; the issuer is what a
            // reload removes.
            Some(_) => format!("jwt:{}:url", self.name),
            None => key_id.clone(),
        };
        Ok(Named {
            tenant,
            subject,
            kind: "jwt",
            key_id,
            lease_key,
            exp,
        })
    }
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

/// The refusal a `jsonwebtoken` error stands for.
fn jwt_error(e: &jsonwebtoken::errors::Error) -> AuthError {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::ExpiredSignature => AuthError::JwtExpired,
        K::ImmatureSignature => AuthError::JwtNotYetValid,
        K::InvalidIssuer => AuthError::JwtIssuer,
        K::InvalidAudience => AuthError::JwtAudience,
        K::MissingRequiredClaim(c) if c == "iss" => AuthError::JwtIssuer,
        K::MissingRequiredClaim(c) if c == "aud" => AuthError::JwtAudience,
        K::MissingRequiredClaim(_) => AuthError::JwtClaims,
        K::InvalidSignature => AuthError::JwtSignature,
        K::InvalidAlgorithm | K::InvalidAlgorithmName | K::MissingAlgorithm => {
            AuthError::JwtAlgorithm
        }
        _ => AuthError::JwtMalformed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    const SECRET: &str = "0123456789abcdef0123456789abcdef-secret";
    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/jwt");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    struct Setup {
        _dir: tempfile::TempDir,
        cfg: Config,
        jwks: std::path::PathBuf,
    }

    /// Tenants `acme` (static token "test", origin https://ok.example) and `beta`; an HS256
    /// issuer fixed to `acme` with iss/aud, and an RS256 issuer (key rsa-a) naming the tenant
    /// in the `org` claim.
    fn setup() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        let jwks = dir.path().join("jwks.json");
        let rsa_a = String::from_utf8(fixture("rsa-a.jwk.json")).unwrap();
        std::fs::write(&jwks, format!("{{\"keys\":[{rsa_a}]}}")).unwrap();
        let auth = format!(
            r#"
[auth]
expiry_grace_secs = 0
[[auth.jwt]]
name = "shared"
algorithm = "HS256"
secret_file = "{}"
issuer = "https://issuer.example"
audience = "codex-fleet"
leeway_secs = 5
tenant = "acme"
[[auth.jwt]]
name = "idp"
algorithm = "RS256"
jwks_file = "{}"
tenant_claim = "org"
subject_claim = "email"
"#,
            secret.display(),
            jwks.display(),
        );
        let text = crate::config::tests::minimal(&auth)
            + "allowed_origins = [\"https://ok.example\"]\n[[tenants]]\nid = \"beta\"\n";
        Setup {
            _dir: dir,
            cfg: Config::parse(&text).unwrap(),
            jwks,
        }
    }

    fn now() -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    fn hs(claims: serde_json::Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap()
    }

    fn good_hs() -> serde_json::Value {
        json!({"sub": "ada", "exp": now() + 600, "iss": "https://issuer.example", "aud": ["x", "codex-fleet"]})
    }

    fn rs(kid: &str, pem: &str, claims: serde_json::Value) -> String {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.into());
        encode(
            &header,
            &claims,
            &EncodingKey::from_rsa_pem(&fixture(pem)).unwrap(),
        )
        .unwrap()
    }

    fn refusal(c: &Credentials, token: &str) -> AuthError {
        c.admit_now(&bearer(token)).unwrap_err()
    }

    #[test]
    fn each_credential_kind_names_its_tenant_and_subject() {
        let s = setup();
        let c = Credentials::build(&s.cfg, None).unwrap();
        let v = c.admit_now(&bearer("test")).unwrap();
        assert_eq!((v.tenant.as_str(), v.kind), ("acme", "token"));
        assert!(v.subject.starts_with("token:"));
        let v = c.admit_now(&bearer(&hs(good_hs()))).unwrap();
        assert_eq!((v.tenant.as_str(), v.subject.as_str()), ("acme", "ada"));
        assert!(v.key_id.starts_with("jwt:shared:secret-"));
        let v = c
            .admit_now(&bearer(&rs(
                "rsa-a",
                "rsa-a.pem",
                json!({"email": "bob@beta", "org": "beta", "exp": now() + 60}),
            )))
            .unwrap();
        assert_eq!(
            (v.tenant.as_str(), v.subject.as_str()),
            ("beta", "bob@beta")
        );
        assert_eq!(v.key_id, "jwt:idp:rsa-a");
    }

    #[test]
    fn every_bad_credential_is_refused_with_its_reason() {
        let s = setup();
        let c = Credentials::build(&s.cfg, None).unwrap();
        assert_eq!(
            c.admit_now(&HeaderMap::new()).unwrap_err(),
            AuthError::Missing
        );
        assert_eq!(refusal(&c, "gamma"), AuthError::Invalid);
        assert_eq!(refusal(&c, "a.b.c"), AuthError::JwtMalformed);
        let mut claims = good_hs();
        claims["exp"] = json!(now() - 60);
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtExpired);
        let mut claims = good_hs();
        claims["exp"] = json!(now() - 2); // within the 5 s leeway
        assert!(c.admit_now(&bearer(&hs(claims))).is_ok());
        let mut claims = good_hs();
        claims["nbf"] = json!(now() + 60);
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtNotYetValid);
        let mut claims = good_hs();
        claims["iss"] = json!("https://evil.example");
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtIssuer);
        let mut claims = good_hs();
        claims.as_object_mut().unwrap().remove("iss");
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtIssuer);
        let mut claims = good_hs();
        claims["aud"] = json!("someone-else");
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtAudience);
        let mut claims = good_hs();
        claims.as_object_mut().unwrap().remove("exp");
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtClaims);
        // Bad signature: signed with another secret.
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &good_hs(),
            &EncodingKey::from_secret(b"another secret of at least 32 bytes!!"),
        )
        .unwrap();
        assert_eq!(refusal(&c, &forged), AuthError::JwtSignature);
        // alg none: the unsigned token of good claims.
        let b64 = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let none = format!("{}.{}.", b64(json!({"alg": "none"})), b64(good_hs()));
        assert_eq!(refusal(&c, &none), AuthError::JwtAlgorithm);
        // HS512 with the right secret, when HS256 is configured.
        let hs512 = encode(
            &Header::new(Algorithm::HS512),
            &good_hs(),
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap();
        assert_eq!(refusal(&c, &hs512), AuthError::JwtAlgorithm);
        // Key confusion: HS256 "signed" with the RSA public key, naming its kid.
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("rsa-a".into());
        let confused = encode(
            &header,
            &json!({"email": "m@beta", "org": "beta", "exp": now() + 60}),
            &EncodingKey::from_secret(&fixture("rsa-a.pub.pem")),
        )
        .unwrap();
        assert_eq!(refusal(&c, &confused), AuthError::JwtSignature);
        // An RS256 token signed by a key the JWKS does not hold.
        let claims = json!({"email": "m@beta", "org": "beta", "exp": now() + 60});
        assert_eq!(
            refusal(&c, &rs("rsa-b", "rsa-b.pem", claims.clone())),
            AuthError::JwtUnknownKey
        );
        // ... or claiming the known kid.
        assert_eq!(
            refusal(&c, &rs("rsa-a", "rsa-b.pem", claims)),
            AuthError::JwtSignature
        );
        // A tenant claim naming no tenant.
        let claims = json!({"email": "m@x", "org": "nobody", "exp": now() + 60});
        assert_eq!(
            refusal(&c, &rs("rsa-a", "rsa-a.pem", claims)),
            AuthError::UnknownTenant
        );
    }

    #[test]
    fn absurd_claims_are_refused_and_an_issuer_names_only_its_tenants() {
        let mut s = setup();
        let c = Credentials::build(&s.cfg, None).unwrap();
        // An `exp` past the clock's range is a refusal, not a panic.
        for exp in [json!(1u64 << 63), json!(u64::MAX), json!(MAX_EXP_SECS + 1)] {
            let mut claims = good_hs();
            claims["exp"] = exp;
            assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtClaims);
        }
        let mut claims = good_hs();
        claims["exp"] = json!(MAX_EXP_SECS);
        assert!(c.admit_now(&bearer(&hs(claims))).is_ok());
        // A subject over the bound; one at it is admitted as it is.
        let mut claims = good_hs();
        claims["sub"] = json!("é".repeat(128));
        assert_eq!(refusal(&c, &hs(claims)), AuthError::JwtClaims);
        let mut claims = good_hs();
        claims["sub"] = json!(format!("a\nb{}", "é".repeat(126)));
        let v = c.admit_now(&bearer(&hs(claims.clone()))).unwrap();
        assert_eq!(v.subject, claims["sub"].as_str().unwrap());
        // `tenants`: the `org` claim may name beta only.
        s.cfg.auth.jwt[1].tenants = Some(vec!["beta".into()]);
        let c = Credentials::build(&s.cfg, None).unwrap();
        let named = |org: &str| {
            rs(
                "rsa-a",
                "rsa-a.pem",
                json!({"email": "m@x", "org": org, "exp": now() + 60}),
            )
        };
        assert_eq!(refusal(&c, &named("acme")), AuthError::JwtTenant);
        assert_eq!(c.admit_now(&bearer(&named("beta"))).unwrap().tenant, "beta");
    }

    #[test]
    fn origins_need_the_tenants_allowlist() {
        let s = setup();
        let c = Credentials::build(&s.cfg, None).unwrap();
        let mut h = bearer("test");
        h.insert(http::header::ORIGIN, "https://ok.example".parse().unwrap());
        assert!(c.admit_now(&h).is_ok());
        h.insert(
            http::header::ORIGIN,
            "https://evil.example".parse().unwrap(),
        );
        assert_eq!(c.admit_now(&h).unwrap_err(), AuthError::Origin);
        let mut h = bearer(&rs(
            "rsa-a",
            "rsa-a.pem",
            json!({"email": "b", "org": "beta", "exp": now() + 60}),
        ));
        h.insert(http::header::ORIGIN, "https://ok.example".parse().unwrap());
        assert_eq!(c.admit_now(&h).unwrap_err(), AuthError::Origin);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_ends_at_exp_and_when_a_reload_removes_its_key_or_tenant() {
        let s = setup();
        let c = Credentials::build(&s.cfg, None).unwrap();
        let jwt = c
            .admit_now(&bearer(&hs(json!({"sub": "ada", "exp": now() + 30, "iss": "https://issuer.example", "aud": "codex-fleet"}))))
            .unwrap();
        let started = tokio::time::Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(120), jwt.lease.ended()).await;
        assert_eq!(ended.ok(), Some(CredentialEnd::Expired));
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(28) && waited <= Duration::from_secs(31),
            "{waited:?}"
        );

        let token = c.admit_now(&bearer("test")).unwrap();
        let idp = |org: &str| {
            c.admit_now(&bearer(&rs(
                "rsa-a",
                "rsa-a.pem",
                json!({"email": "b", "org": org, "exp": now() + 3600}),
            )))
            .unwrap()
        };
        let beta = idp("beta");
        let acme = idp("acme");
        // A reload that swaps the RSA key: the sessions it admitted end, the static token's not.
        let rsa_b = String::from_utf8(fixture("rsa-b.jwk.json")).unwrap();
        std::fs::write(&s.jwks, format!("{{\"keys\":[{rsa_b}]}}")).unwrap();
        let next = Credentials::build(&s.cfg, Some(&c)).unwrap();
        let ends_soon = |l: Lease| async move {
            tokio::time::timeout(Duration::from_secs(1), l.ended())
                .await
                .ok()
        };
        assert_eq!(
            ends_soon(beta.lease.clone()).await,
            None,
            "nothing ends before commit"
        );
        assert_eq!(next.commit(), 1);
        assert_eq!(ends_soon(beta.lease).await, Some(CredentialEnd::Revoked));
        assert_eq!(ends_soon(acme.lease).await, Some(CredentialEnd::Revoked));
        assert_eq!(ends_soon(token.lease.clone()).await, None);
        // A reload that removes the tenant acme ends its token's session.
        let mut cfg = s.cfg.clone();
        cfg.tenants.retain(|t| t.id != "acme");
        cfg.auth.jwt.retain(|j| j.name != "shared");
        let last = Credentials::build(&cfg, Some(&next)).unwrap();
        last.commit();
        assert_eq!(ends_soon(token.lease).await, Some(CredentialEnd::Revoked));
        assert_eq!(refusal(&last, "test"), AuthError::Invalid);
    }

    #[test]
    fn a_short_secret_is_refused() {
        let s = setup();
        let path = s.cfg.auth.jwt[0].secret_file.clone().unwrap();
        std::fs::write(&path, "too short").unwrap();
        let e = Credentials::build(&s.cfg, None).unwrap_err().to_string();
        assert!(e.contains("at least 32 bytes"), "{e}");
        assert!(
            !e.contains("too short"),
            "the secret is never in an error: {e}"
        );
    }
}
