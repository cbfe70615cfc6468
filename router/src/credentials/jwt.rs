//! Signed JWTs: each `[[auth.jwt]]` issuer ready to verify (its secret or JWKS keys), and the
//! verification of a token against the issuers of its algorithm, down to its tenant, subject
//! and expiry.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use sha2::{Digest, Sha256};

use super::config::{alg_name, JwtIssuer};
use super::jwks::{jwks_keys, Key};
use super::{jwks, read_trimmed, Named};
use crate::auth::AuthError;

/// Longest subject admitted, in bytes (OpenID Connect's bound for `sub`, 255 ASCII
/// characters): a longer one is refused (`jwt_claims`), so every log line, audit record and link
/// header holds a subject exactly as the token named it.
pub const MAX_SUBJECT_BYTES: usize = 255;

/// Latest `exp` admitted, Unix seconds (9999-12-31T23:59:59Z): a later one is refused
/// (`jwt_claims`) rather than overflowing the clock arithmetic of the session's lease.
pub const MAX_EXP_SECS: u64 = 253_402_300_799;

/// The smallest HS256 secret accepted, in bytes (as app-server's `signed-bearer-token`).
pub const MIN_SECRET_BYTES: usize = 32;

/// One `[[auth.jwt]]` issuer, ready to verify.
pub(super) struct Issuer {
    pub(super) name: String,
    pub(super) algorithm: Algorithm,
    /// The keys of a secret or a JWKS file.
    pub(super) keys: Arc<Vec<Key>>,
    /// Or a JWKS fetched over HTTPS.
    pub(super) url: Option<Arc<jwks::JwksUrl>>,
    validation: Validation,
    tenant: Option<String>,
    tenant_claim: Option<String>,
    /// The tenants `tenant_claim` may name; `None`: any.
    tenants: Option<HashSet<String>>,
    subject_claim: String,
}

/// Verifies a JWT with the issuers configured for its algorithm.
pub(super) fn verify(issuers: &[Issuer], token: &str) -> Result<Named, AuthError> {
    let peek = Peek::of(token).ok_or(AuthError::JwtMalformed)?;
    let mut candidates: Vec<&Issuer> = issuers
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

/// The unverified header and issuer of a JWT: only to choose the issuer and key.
pub(super) struct Peek {
    pub(super) alg: String,
    pub(super) kid: Option<String>,
    pub(super) iss: Option<String>,
}

impl Peek {
    pub(super) fn of(token: &str) -> Option<Peek> {
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

impl Issuer {
    pub(super) fn build(c: &JwtIssuer) -> anyhow::Result<Issuer> {
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
