//! Bearer-token authentication: SHA-256 digests compared in constant time, mapped to a tenant.

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Why an upgrade was refused: 401, or 403 for an `Origin` the tenant does not allow. The text
/// is safe to send (app-server's own wording where it has one): it says nothing of tenants, keys
/// or the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("missing bearer token")]
    Missing,
    /// Not `Bearer <token>`.
    #[error("invalid authorization header")]
    Malformed,
    /// No tenant has this static token.
    #[error("invalid bearer token")]
    Invalid,
    /// A JWT whose header or claims cannot be read.
    #[error("invalid websocket jwt")]
    JwtMalformed,
    /// A JWT whose `alg` no issuer is configured with (`none`, HS512, HS256 against an RSA key).
    #[error("invalid websocket jwt")]
    JwtAlgorithm,
    /// A JWT whose `kid` is in no configured JWKS.
    #[error("invalid websocket jwt")]
    JwtUnknownKey,
    /// A JWT whose signature does not verify.
    #[error("invalid websocket jwt")]
    JwtSignature,
    /// A JWT past its `exp` (plus the leeway).
    #[error("expired websocket jwt")]
    JwtExpired,
    /// A JWT before its `nbf` (minus the leeway).
    #[error("websocket jwt is not valid yet")]
    JwtNotYetValid,
    /// A JWT of another issuer.
    #[error("websocket jwt issuer mismatch")]
    JwtIssuer,
    /// A JWT for another audience.
    #[error("websocket jwt audience mismatch")]
    JwtAudience,
    /// A JWT without `exp` or without a subject, or with an `exp`, `nbf` or `iat` beyond any
    /// sane date, or a subject over [`crate::credentials::MAX_SUBJECT_BYTES`].
    #[error("invalid websocket jwt")]
    JwtClaims,
    /// A JWT naming a tenant its issuer's `tenants` does not list.
    #[error("invalid websocket jwt")]
    JwtTenant,
    /// A valid credential whose tenant is not configured (removed, or a tenant claim naming
    /// none).
    #[error("invalid websocket jwt")]
    UnknownTenant,
    /// An `Origin` header the tenant's `allowed_origins` does not list (403).
    #[error("origin not allowed")]
    Origin,
}

impl AuthError {
    /// Every refusal, so each `codex_fleet_upgrades_refused_total` series exists from the start.
    pub const ALL: [AuthError; 15] = [
        AuthError::Missing,
        AuthError::Malformed,
        AuthError::Invalid,
        AuthError::JwtMalformed,
        AuthError::JwtAlgorithm,
        AuthError::JwtUnknownKey,
        AuthError::JwtSignature,
        AuthError::JwtExpired,
        AuthError::JwtNotYetValid,
        AuthError::JwtIssuer,
        AuthError::JwtAudience,
        AuthError::JwtClaims,
        AuthError::JwtTenant,
        AuthError::UnknownTenant,
        AuthError::Origin,
    ];

    /// The `reason` label of `codex_fleet_upgrades_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Missing => "auth_missing",
            AuthError::Malformed => "auth_malformed",
            AuthError::Invalid => "auth_invalid",
            AuthError::JwtMalformed => "jwt_malformed",
            AuthError::JwtAlgorithm => "jwt_algorithm",
            AuthError::JwtUnknownKey => "jwt_unknown_key",
            AuthError::JwtSignature => "jwt_signature",
            AuthError::JwtExpired => "jwt_expired",
            AuthError::JwtNotYetValid => "jwt_not_yet_valid",
            AuthError::JwtIssuer => "jwt_issuer",
            AuthError::JwtAudience => "jwt_audience",
            AuthError::JwtClaims => "jwt_claims",
            AuthError::JwtTenant => "jwt_tenant",
            AuthError::UnknownTenant => "unknown_tenant",
            AuthError::Origin => "origin",
        }
    }

    /// 403 for a refused origin, 401 for everything else.
    pub fn status(&self) -> http::StatusCode {
        match self {
            AuthError::Origin => http::StatusCode::FORBIDDEN,
            _ => http::StatusCode::UNAUTHORIZED,
        }
    }
}

/// Token digests and the index (tenant, or credential) each one authenticates.
#[derive(Debug, Default, Clone)]
pub struct TokenTable {
    entries: Vec<([u8; 32], usize)>,
}

impl TokenTable {
    /// Adds a digest for the tenant at `tenant` (an index into the caller's tenant list).
    pub fn insert(&mut self, digest: [u8; 32], tenant: usize) {
        self.entries.push((digest, tenant));
    }

    /// The tenant index that `headers` authenticate as.
    ///
    /// Every entry is compared, whatever matches, so the time taken does not depend on which
    /// tenant (if any) the token belongs to.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<usize, AuthError> {
        self.lookup(bearer_token(headers)?)
            .ok_or(AuthError::Invalid)
    }

    /// The index `token` names, comparing every entry in constant time.
    pub fn lookup(&self, token: &str) -> Option<usize> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for (d, index) in &self.entries {
            if bool::from(d.ct_eq(&digest)) {
                found = Some(*index);
            }
        }
        found
    }
}

/// Extracts the token of `Authorization: Bearer <token>` (scheme case-insensitive, trimmed).
pub fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthError> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .ok_or(AuthError::Missing)?;
    let value = value.to_str().map_err(|_| AuthError::Malformed)?.trim();
    let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(AuthError::Malformed);
    }
    Ok(token)
}

/// Hex SHA-256 of a token, as written in `token_sha256`.
pub fn token_digest_hex(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = v {
            h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
        }
        h
    }

    fn table() -> TokenTable {
        let mut t = TokenTable::default();
        for (i, tok) in ["alpha", "beta"].iter().enumerate() {
            let d = crate::credentials::parse_digest(&token_digest_hex(tok)).unwrap();
            t.insert(d, i);
        }
        t
    }

    #[test]
    fn tokens_map_to_their_tenant() {
        let t = table();
        assert_eq!(t.authenticate(&headers(Some("Bearer alpha"))), Ok(0));
        assert_eq!(t.authenticate(&headers(Some("bearer  beta "))), Ok(1));
    }

    #[test]
    fn bad_credentials_are_refused() {
        let t = table();
        assert_eq!(t.authenticate(&headers(None)), Err(AuthError::Missing));
        assert_eq!(
            t.authenticate(&headers(Some("Basic alpha"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            t.authenticate(&headers(Some("Bearer"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            t.authenticate(&headers(Some("Bearer gamma"))),
            Err(AuthError::Invalid)
        );
    }
}
