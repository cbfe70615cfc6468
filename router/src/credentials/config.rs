//! `[auth]`: the credentials' own section of the configuration, and the part of each
//! `[[tenants]]` entry that they read.

use std::path::PathBuf;

use jsonwebtoken::Algorithm;
use serde::Deserialize;

/// `[auth]`: signed JWTs and what ends a session with its credential.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// Seconds a JWT session stays open past its token's `exp` before it is closed.
    #[serde(default)]
    pub expiry_grace_secs: u64,
    /// The issuers whose signed tokens are accepted (`[[auth.jwt]]`).
    #[serde(default)]
    pub jwt: Vec<JwtIssuer>,
}

/// `[[auth.jwt]]`: one issuer of signed bearer tokens.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtIssuer {
    /// Names the issuer in key ids, logs and the audit log.
    pub name: String,
    /// `HS256` (with `secret_file`), `RS256` or `ES256` (with `jwks_file`); tokens of any
    /// other algorithm are refused.
    pub algorithm: String,
    /// HS256: a file holding the shared secret (trimmed, at least 32 bytes).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// RS256/ES256: a JWKS file (`{"keys": [...]}`); each key needs a `kid`.
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    /// RS256/ES256: or a JWKS URL (https), fetched periodically and on an unknown `kid`.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// PEM CA bundle trusted for `jwks_url`.
    #[serde(default = "defaults::jwks_ca_file")]
    pub jwks_ca_file: PathBuf,
    /// Seconds between fetches of `jwks_url`.
    #[serde(default = "defaults::jwks_refresh_secs")]
    pub jwks_refresh_secs: u64,
    /// When set, the token's `iss` must equal it.
    #[serde(default)]
    pub issuer: Option<String>,
    /// When set, the token's `aud` (a string or an array) must contain it.
    #[serde(default)]
    pub audience: Option<String>,
    /// Allowed clock skew for `exp` and `nbf`, seconds.
    #[serde(default = "defaults::jwt_leeway_secs")]
    pub leeway_secs: u64,
    /// Every token of this issuer authenticates as this tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Or: the claim that names the tenant.
    #[serde(default)]
    pub tenant_claim: Option<String>,
    /// With `tenant_claim`: the only tenants its tokens may name (a token naming another is
    /// refused, `jwt_tenant`). Unset: any configured tenant, static-token tenants included.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// The claim that names the person (the subject).
    #[serde(default = "defaults::subject_claim")]
    pub subject_claim: String,
}

impl JwtIssuer {
    /// `algorithm` as the token library names it; `None` for any algorithm not accepted.
    pub fn parsed_algorithm(&self) -> Option<jsonwebtoken::Algorithm> {
        match self.algorithm.as_str() {
            "HS256" => Some(jsonwebtoken::Algorithm::HS256),
            "RS256" => Some(jsonwebtoken::Algorithm::RS256),
            "ES256" => Some(jsonwebtoken::Algorithm::ES256),
            _ => None,
        }
    }
}

/// The name of an accepted algorithm, as tokens and JWKS keys carry it.
pub(crate) fn alg_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::HS256 => "HS256",
        Algorithm::RS256 => "RS256",
        Algorithm::ES256 => "ES256",
        _ => "unsupported",
    }
}

/// A tenant's credentials as configured: its `[[tenants]]` entry's `id`, `token_sha256`,
/// `token_files`, `allowed_origins` and `close_on_expiry`.
#[derive(Debug, Clone, Copy)]
pub struct TenantCredentials<'a> {
    /// The tenant.
    pub id: &'a str,
    /// Hex SHA-256 digests of its static tokens.
    pub token_sha256: &'a [String],
    /// Files each holding one of its static tokens.
    pub token_files: &'a [PathBuf],
    /// `Origin` values accepted from browsers.
    pub allowed_origins: &'a [String],
    /// Close a JWT session when its token expires.
    pub close_on_expiry: bool,
}

mod defaults {
    pub(super) fn jwks_ca_file() -> std::path::PathBuf {
        std::path::PathBuf::from("/etc/ssl/certs/ca-certificates.crt")
    }
    pub(super) fn jwks_refresh_secs() -> u64 {
        300
    }
    pub(super) fn jwt_leeway_secs() -> u64 {
        30
    }
    pub(super) fn subject_claim() -> String {
        "sub".into()
    }
}
