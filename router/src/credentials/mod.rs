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
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::auth::{bearer_token, AuthError, TokenTable};
use config::alg_name;
use config::{Auth, TenantCredentials};
use jwt::{Issuer, Peek};
pub use jwt::{MAX_EXP_SECS, MAX_SUBJECT_BYTES, MIN_SECRET_BYTES};
use lease::Leases;
pub use lease::{CredentialEnd, Lease};

pub mod config;
mod jwks;
mod jwt;
mod lease;

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
    /// Reads every credential of `tenants` and of `auth` (token files, secrets, JWKS files);
    /// `auth` is `None` where JWTs are not verified (a node: its edges verify them). `previous`
    /// is the configuration in force, whose leases carry over; nothing is revoked until
    /// [`Credentials::commit`].
    pub fn build<'a>(
        tenants: impl IntoIterator<Item = TenantCredentials<'a>>,
        auth: Option<&Auth>,
        previous: Option<&Credentials>,
    ) -> anyhow::Result<Credentials> {
        let mut tokens = TokenTable::default();
        let mut statics = Vec::new();
        let mut rules = HashMap::new();
        for t in tenants {
            let mut digests: Vec<[u8; 32]> = t
                .token_sha256
                .iter()
                .filter_map(|d| parse_digest(d))
                .collect();
            for path in t.token_files {
                let token = read_trimmed(path)
                    .map_err(|e| anyhow::anyhow!("tenant {:?}: token file: {e}", t.id))?;
                digests.push(Sha256::digest(token.as_bytes()).into());
            }
            for digest in digests {
                tokens.insert(digest, statics.len());
                statics.push(StaticToken {
                    tenant: t.id.to_owned(),
                    key_id: format!("token:{}", &hex::encode(digest)[..12]),
                });
            }
            rules.insert(
                t.id.to_owned(),
                TenantRules {
                    origins: t.allowed_origins.to_vec(),
                    close_on_expiry: t.close_on_expiry,
                },
            );
        }
        let issuers = match auth {
            Some(auth) => auth
                .jwt
                .iter()
                .map(Issuer::build)
                .collect::<anyhow::Result<_>>()?,
            None => Vec::new(),
        };
        Ok(Credentials {
            tokens,
            statics,
            issuers,
            tenants: rules,
            grace: Duration::from_secs(auth.map_or(0, |a| a.expiry_grace_secs)),
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
            None if looks_like_jwt(token) => jwt::verify(&self.issuers, token)?,
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
}

/// Three dot-separated parts: a JWT, not a static token.
fn looks_like_jwt(token: &str) -> bool {
    token.split('.').count() == 3
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

/// Parses 64 hex digits into a digest.
pub fn parse_digest(hex_digest: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_digest.trim(), &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests;
