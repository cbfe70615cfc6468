//! The credentials' unit tests: every kind of credential, every refusal and its reason, and leases.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use http::HeaderMap;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;

use super::*;
use crate::config::{Config, Tenant};

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

/// The credentials of a whole configuration, as the server builds them.
fn build(cfg: &Config, previous: Option<&Credentials>) -> anyhow::Result<Credentials> {
    Credentials::build(
        cfg.tenants.iter().map(Tenant::credentials),
        cfg.jwt_auth(),
        previous,
    )
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
    let c = build(&s.cfg, None).unwrap();
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
    let c = build(&s.cfg, None).unwrap();
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
    let c = build(&s.cfg, None).unwrap();
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
    let c = build(&s.cfg, None).unwrap();
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
    let c = build(&s.cfg, None).unwrap();
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
    let c = build(&s.cfg, None).unwrap();
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
    let next = build(&s.cfg, Some(&c)).unwrap();
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
    let last = build(&cfg, Some(&next)).unwrap();
    last.commit();
    assert_eq!(ends_soon(token.lease).await, Some(CredentialEnd::Revoked));
    assert_eq!(refusal(&last, "test"), AuthError::Invalid);
}

#[test]
fn a_short_secret_is_refused() {
    let s = setup();
    let path = s.cfg.auth.jwt[0].secret_file.clone().unwrap();
    std::fs::write(&path, "too short").unwrap();
    let e = build(&s.cfg, None).unwrap_err().to_string();
    assert!(e.contains("at least 32 bytes"), "{e}");
    assert!(
        !e.contains("too short"),
        "the secret is never in an error: {e}"
    );
}
