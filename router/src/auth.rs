//! Bearer-token authentication: SHA-256 digests compared in constant time, mapped to a tenant.

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Why an upgrade was refused with 401. The text is safe to send: it says nothing of tenants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("missing bearer token")]
    Missing,
    /// Not `Bearer <token>`.
    #[error("invalid authorization header")]
    Malformed,
    /// No tenant has this token.
    #[error("invalid bearer token")]
    Invalid,
}

/// Token digests and the tenant index each one authenticates.
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
        let token = bearer_token(headers)?;
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for (d, tenant) in &self.entries {
            if bool::from(d.ct_eq(&digest)) {
                found = Some(*tenant);
            }
        }
        found.ok_or(AuthError::Invalid)
    }
}

/// Extracts the token of `Authorization: Bearer <token>` (scheme case-insensitive, trimmed).
fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthError> {
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
            let d = crate::config::parse_digest(&token_digest_hex(tok)).unwrap();
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
