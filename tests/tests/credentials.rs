//! Credentials and trust (docs/security.md), end to end over real wss with real workers: every
//! credential kind runs a real turn (and the real `codex exec --remote` with a JWT), every bad
//! credential is refused with 401 and counted by reason, a JWT session closes after its `exp`, a
//! reload that removes a token closes its sessions and no other, and `Origin` needs the tenant's
//! allowlist.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use testkit::{agent_text, reply_text, Client, Fleet, FleetBuilder, Upgrade};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::Connector;

const SECRET: &str = "an-hs256-secret-of-more-than-32-bytes-for-tests";
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/jwt");
const STEP: Duration = Duration::from_secs(60);

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}")).expect("fixture")
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

fn hs256(claims: &Value) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .expect("sign")
}

fn signed(alg: Algorithm, kid: &str, pem: &str, claims: &Value) -> String {
    let mut header = Header::new(alg);
    header.kid = Some(kid.into());
    let key = match alg {
        Algorithm::ES256 => EncodingKey::from_ec_pem(&fixture(pem)),
        _ => EncodingKey::from_rsa_pem(&fixture(pem)),
    }
    .expect("key");
    encode(&header, claims, &key).expect("sign")
}

fn jwks(keys: &[&str]) -> String {
    let keys: Vec<String> = keys
        .iter()
        .map(|k| String::from_utf8(fixture(&format!("{k}.jwk.json"))).expect("utf-8"))
        .collect();
    format!("{{\"keys\":[{}]}}", keys.join(","))
}

/// An HS256 token of the `shared` issuer (tenant acme), valid for `secs`.
fn acme_jwt(sub: &str, secs: i64) -> String {
    hs256(
        &json!({"sub": sub, "exp": now() + secs, "iss": "https://issuer.test", "aud": "codex-fleet"}),
    )
}

/// Tenants `acme` (a static token, origin https://app.test allowed) and `beta` (a static token,
/// `close_on_expiry = false`); issuers: `shared` (HS256, tenant acme, iss and aud checked),
/// `idp` (RS256 over a JWKS file, tenant from the `org` claim, subject from `email`) and `ec`
/// (ES256, tenant beta).
async fn fleet() -> anyhow::Result<Fleet> {
    fleet_with("").await
}

/// [`fleet`] with more configuration appended (e.g. another `[[auth.jwt]]`).
async fn fleet_with(extra: &str) -> anyhow::Result<Fleet> {
    let files = FleetBuilder::new()
        .tenant("acme")
        .tenant_toml("allowed_origins = [\"https://app.test\"]")
        .tenant("beta")
        .tenant_toml("close_on_expiry = false")
        .prepare()
        .await?;
    let dir = files.dir.path();
    std::fs::write(dir.join("hs.secret"), format!("{SECRET}\n"))?;
    std::fs::write(dir.join("idp.jwks"), jwks(&["rsa-a"]))?;
    std::fs::write(dir.join("ec.jwks"), jwks(&["ec-a"]))?;
    let mut toml = std::fs::read_to_string(&files.config)?;
    toml.push_str(&format!(
        r#"
[audit]
path = "{audit}"
[auth]
expiry_grace_secs = 0
[[auth.jwt]]
name = "shared"
algorithm = "HS256"
secret_file = "{hs}"
issuer = "https://issuer.test"
audience = "codex-fleet"
leeway_secs = 5
tenant = "acme"
[[auth.jwt]]
name = "idp"
algorithm = "RS256"
jwks_file = "{idp}"
tenant_claim = "org"
subject_claim = "email"
[[auth.jwt]]
name = "ec"
algorithm = "ES256"
jwks_file = "{ec}"
tenant = "beta"
"#,
        hs = dir.join("hs.secret").display(),
        idp = dir.join("idp.jwks").display(),
        ec = dir.join("ec.jwks").display(),
        audit = dir.join("audit.jsonl").display(),
    ));
    toml.push_str(extra);
    router::fsutil::write_private(&files.config, &toml)?;
    files.start().await
}

/// The audit log's events so far.
fn audit_events(fleet: &Fleet) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(fleet.files.dir.path().join("audit.jsonl"))?;
    text.lines()
        .map(|l| serde_json::from_str(l).map_err(Into::into))
        .collect()
}

/// No token, JWT, secret or key in any of `logs` nor in the fleet's audit log.
fn assert_no_secrets(fleet: &Fleet, logs: &[(&str, &str)]) -> anyhow::Result<()> {
    let audit = std::fs::read_to_string(fleet.files.dir.path().join("audit.jsonl"))?;
    let tokens: Vec<String> = fleet
        .files
        .tenants
        .iter()
        .map(|t| t.token.clone())
        .collect();
    for (name, text) in logs.iter().copied().chain([("audit log", audit.as_str())]) {
        // Every JWT starts with the base64 of `{"`: no log line may hold one.
        for needle in ["eyJ", SECRET, "PRIVATE KEY"]
            .into_iter()
            .chain(tokens.iter().map(String::as_str))
        {
            assert!(
                !text.contains(needle),
                "{name} holds a credential ({} chars of it)",
                needle.len()
            );
        }
    }
    Ok(())
}

/// One upgrade with optional token and `Origin`: the client, or the refusal.
async fn upgrade(
    fleet: &Fleet,
    token: Option<&str>,
    origin: Option<&str>,
) -> anyhow::Result<Upgrade> {
    if origin.is_none() {
        return Client::try_connect(&fleet.url(), &fleet.files.ca, token).await;
    }
    let mut req = fleet.url().into_client_request()?;
    if let Some(t) = token {
        req.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse()?);
    }
    if let Some(o) = origin {
        req.headers_mut().insert("origin", o.parse()?);
    }
    let connector = Connector::Rustls(testkit::client_tls(&fleet.files.ca)?);
    match tokio_tungstenite::connect_async_tls_with_config(req, None, true, Some(connector)).await {
        Ok(_) => Ok(Upgrade::Refused {
            status: 101,
            retry_after: None,
            body: String::new(),
        }),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Ok(Upgrade::Refused {
            status: resp.status().as_u16(),
            retry_after: None,
            body: String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned(),
        }),
        Err(e) => Err(e.into()),
    }
}

fn status(u: &Upgrade) -> u16 {
    match u {
        Upgrade::Open(_) => 101,
        Upgrade::Refused { status, .. } => *status,
    }
}

async fn turn(fleet: &Fleet, token: &str, prompt: &str) -> anyhow::Result<()> {
    let mut c = Client::connect(&fleet.url(), &fleet.files.ca, Some(token)).await?;
    c.initialize("identity-test").await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, prompt).await?;
    let msgs = c.until_turn_completed(&thread).await?;
    anyhow::ensure!(
        agent_text(&msgs) == Some(reply_text(prompt)),
        "{prompt}: {:?}",
        agent_text(&msgs)
    );
    c.close().await;
    Ok(())
}

#[tokio::test]
async fn every_credential_kind_runs_a_real_turn_and_codex_exec_uses_a_jwt() -> anyhow::Result<()> {
    let fleet = fleet().await?;
    turn(&fleet, &fleet.files.token("acme"), "static token").await?;
    turn(&fleet, &acme_jwt("ada", 600), "hs256 jwt").await?;
    let rs = signed(
        Algorithm::RS256,
        "rsa-a",
        "rsa-a.pem",
        &json!({"email": "bob@beta.test", "org": "beta", "exp": now() + 600}),
    );
    turn(&fleet, &rs, "rs256 jwt").await?;
    let es = signed(
        Algorithm::ES256,
        "ec-a",
        "ec-a.pem",
        &json!({"sub": "eve", "exp": now() + 600}),
    );
    turn(&fleet, &es, "es256 jwt").await?;

    // The real codex exec, with the JWT passed through --remote-auth-token-env.
    let out = testkit::codex_exec_remote(
        &fleet.url(),
        &fleet.files.ca,
        &acme_jwt("exec-user", 600),
        "hello jwt",
    )
    .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains(&reply_text("hello jwt")), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The audit log names each subject and credential, never the credential itself.
    let events = audit_events(&fleet)?;
    let subjects: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "authentication.succeeded")
        .filter_map(|e| e["subject"].as_str())
        .collect();
    for who in ["ada", "bob@beta.test", "eve", "exec-user"] {
        assert!(subjects.contains(&who), "{who} in {subjects:?}");
    }
    assert!(events.iter().any(|e| e["event"] == "session.initialized"
        && e["subject"] == "exec-user"
        && e["client_name"].is_string()));
    assert!(events.iter().any(|e| e["event"] == "thread.created"
        && e["tenant"] == "beta"
        && e["thread"].is_string()));
    assert_no_secrets(
        &fleet,
        &[
            ("codex exec stdout", &stdout),
            ("codex exec stderr", &stderr),
        ],
    )?;
    fleet.stop().await
}

#[tokio::test]
async fn every_bad_credential_is_refused_with_401_and_counted_by_reason() -> anyhow::Result<()> {
    let fleet = fleet().await?;
    let ok = json!({"sub": "ada", "exp": now() + 600, "iss": "https://issuer.test", "aud": "codex-fleet"});
    let with = |key: &str, v: Value| {
        let mut c = ok.clone();
        c[key] = v;
        c
    };
    let b64 = |v: &Value| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    let mut no_exp = ok.clone();
    no_exp.as_object_mut().expect("object").remove("exp");
    let beta_claims = json!({"email": "m@beta", "org": "beta", "exp": now() + 600});
    let cases: Vec<(&str, Option<String>, &str)> = vec![
        ("missing", None, "auth_missing"),
        ("unknown token", Some("not-a-token".into()), "auth_invalid"),
        ("malformed jwt", Some("a.b.c".into()), "jwt_malformed"),
        (
            "expired",
            Some(hs256(&with("exp", json!(now() - 60)))),
            "jwt_expired",
        ),
        (
            "not yet valid",
            Some(hs256(&with("nbf", json!(now() + 60)))),
            "jwt_not_yet_valid",
        ),
        (
            "wrong issuer",
            Some(hs256(&with("iss", json!("https://evil.test")))),
            "jwt_issuer",
        ),
        (
            "wrong audience",
            Some(hs256(&with("aud", json!(["other"])))),
            "jwt_audience",
        ),
        ("no exp", Some(hs256(&no_exp)), "jwt_claims"),
        (
            "bad signature",
            Some(
                encode(
                    &Header::new(Algorithm::HS256),
                    &ok,
                    &EncodingKey::from_secret(b"some-other-secret-of-32-bytes-or-more"),
                )
                .expect("sign"),
            ),
            "jwt_signature",
        ),
        (
            "alg none",
            Some(format!(
                "{}.{}.",
                b64(&json!({"alg": "none", "typ": "JWT"})),
                b64(&ok)
            )),
            "jwt_algorithm",
        ),
        (
            "HS512",
            Some(
                encode(
                    &Header::new(Algorithm::HS512),
                    &ok,
                    &EncodingKey::from_secret(SECRET.as_bytes()),
                )
                .expect("sign"),
            ),
            "jwt_algorithm",
        ),
        (
            "RS256 by an unknown key",
            Some(signed(Algorithm::RS256, "rsa-b", "rsa-b.pem", &beta_claims)),
            "jwt_unknown_key",
        ),
        (
            "RS256 forged with the known kid",
            Some(signed(Algorithm::RS256, "rsa-a", "rsa-b.pem", &beta_claims)),
            "jwt_signature",
        ),
        (
            "tenant claim names no tenant",
            Some(signed(
                Algorithm::RS256,
                "rsa-a",
                "rsa-a.pem",
                &json!({"email": "m@x", "org": "nobody", "exp": now() + 600}),
            )),
            "unknown_tenant",
        ),
    ];
    // Key confusion: an HS256 token "signed" with the RSA public key, against a fleet whose
    // only issuer is RS256 (checked below, after a reload leaves only `idp`).
    let confused = {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("rsa-a".into());
        encode(
            &h,
            &beta_claims,
            &EncodingKey::from_secret(&fixture("rsa-a.pub.pem")),
        )
        .expect("sign")
    };
    for (what, token, reason) in &cases {
        let before = fleet
            .metric("codex_fleet_upgrades_refused_total", &[("reason", reason)])
            .await?;
        let u = upgrade(&fleet, token.as_deref(), None).await?;
        assert_eq!(status(&u), 401, "{what}");
        if let Some(t) = token {
            if let Upgrade::Refused { body, .. } = &u {
                assert!(
                    !body.contains(t.as_str()),
                    "{what}: the body echoes the token"
                );
            }
        }
        let after = fleet
            .metric("codex_fleet_upgrades_refused_total", &[("reason", reason)])
            .await?;
        assert_eq!(after, before + 1.0, "{what} is counted as {reason}");
    }

    // Origin: 403 for a tenant without an allowlist, and for an origin not on it; accepted
    // when listed.
    let beta = fleet.files.token("beta");
    let acme = fleet.files.token("acme");
    let u = upgrade(&fleet, Some(&beta), Some("https://app.test")).await?;
    assert_eq!(status(&u), 403);
    let u = upgrade(&fleet, Some(&acme), Some("https://evil.test")).await?;
    assert_eq!(status(&u), 403);
    let u = upgrade(&fleet, Some(&acme), Some("https://app.test")).await?;
    assert_eq!(status(&u), 101);
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_upgrades_refused_total",
                &[("reason", "origin")]
            )
            .await?,
        2.0
    );

    // A reload that removes tenant beta and the HS256 issuer: beta's static token and a JWT
    // naming beta are refused; an HS256 token (the RSA public key as its secret) now meets
    // only the RS256 issuer.
    let rs_beta = signed(Algorithm::RS256, "rsa-a", "rsa-a.pem", &beta_claims);
    assert_eq!(status(&upgrade(&fleet, Some(&rs_beta), None).await?), 101);
    let toml = std::fs::read_to_string(&fleet.files.config)?;
    let toml = remove_tenant(&toml, "beta");
    let toml = remove_issuer(&remove_issuer(&toml, "shared"), "ec");
    router::fsutil::write_private(&fleet.files.config, &toml)?;
    fleet.reloader.reload().await?;
    assert_eq!(status(&upgrade(&fleet, Some(&beta), None).await?), 401);
    assert_eq!(status(&upgrade(&fleet, Some(&rs_beta), None).await?), 401);
    let before = fleet
        .metric(
            "codex_fleet_upgrades_refused_total",
            &[("reason", "jwt_algorithm")],
        )
        .await?;
    assert_eq!(status(&upgrade(&fleet, Some(&confused), None).await?), 401);
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_upgrades_refused_total",
                &[("reason", "jwt_algorithm")]
            )
            .await?,
        before + 1.0
    );
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_upgrades_refused_total",
                &[("reason", "unknown_tenant")]
            )
            .await?,
        2.0
    );
    // The audit writer is a thread of its own: its records are waited for.
    let failed = || {
        audit_events(&fleet).map_or(0, |events| {
            events
                .iter()
                .filter(|e| e["event"] == "authentication.failed")
                .count()
        })
    };
    testkit::wait_until(Duration::from_secs(10), || failed() >= cases.len() + 2).await;
    let failed = failed();
    assert!(
        failed >= cases.len() + 2,
        "{failed} authentication.failed events"
    );
    assert_no_secrets(&fleet, &[])?;
    fleet.stop().await
}

/// An issuer with `tenants` names only those tenants: a token naming another (acme, a
/// tenant of static tokens and of another issuer) is 401 `jwt_tenant`, one naming beta is
/// admitted.
#[tokio::test]
async fn an_issuer_names_only_its_tenants() -> anyhow::Result<()> {
    let files = tempfile::tempdir()?;
    let scoped = files.path().join("scoped.jwks");
    std::fs::write(&scoped, jwks(&["rsa-b"]))?;
    let fleet = fleet_with(&format!(
        "[[auth.jwt]]\nname = \"scoped\"\nalgorithm = \"RS256\"\njwks_file = {scoped:?}\n\
         issuer = \"https://scoped.test\"\ntenant_claim = \"org\"\ntenants = [\"beta\"]\n"
    ))
    .await?;
    let naming = |org: &str| {
        signed(
            Algorithm::RS256,
            "rsa-b",
            "rsa-b.pem",
            &json!({"sub": "m", "org": org, "iss": "https://scoped.test", "exp": now() + 600}),
        )
    };
    // acme is a tenant (of static tokens and of another issuer), but not this issuer's.
    let u = upgrade(&fleet, Some(&naming("acme")), None).await?;
    assert_eq!(status(&u), 401);
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_upgrades_refused_total",
                &[("reason", "jwt_tenant")]
            )
            .await?,
        1.0
    );
    let mut c = Client::connect(&fleet.url(), &fleet.files.ca, Some(&naming("beta"))).await?;
    c.initialize("scoped").await?;
    c.close().await;
    fleet.stop().await
}

/// An `exp` past any sane date (2^63, u64::MAX) is 401 `jwt_claims`, not a panic of
/// the connection, and the server goes on serving.
#[tokio::test]
async fn an_absurd_exp_is_refused_and_the_server_goes_on() -> anyhow::Result<()> {
    let fleet = fleet().await?;
    for exp in [json!(1u64 << 63), json!(u64::MAX)] {
        let claims =
            json!({"sub": "ada", "exp": exp, "iss": "https://issuer.test", "aud": "codex-fleet"});
        let u = upgrade(&fleet, Some(&hs256(&claims)), None).await?;
        assert_eq!(status(&u), 401, "exp {exp}");
    }
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_upgrades_refused_total",
                &[("reason", "jwt_claims")]
            )
            .await?,
        2.0
    );
    // And the next client is served.
    let mut c = Client::connect(&fleet.url(), &fleet.files.ca, Some(&acme_jwt("ada", 600))).await?;
    c.initialize("after").await?;
    c.close().await;
    fleet.stop().await
}

/// The config text without the `[[tenants]]` table of `id`.
fn remove_tenant(toml: &str, id: &str) -> String {
    remove_table(toml, "[[tenants]]", &format!("id = \"{id}\""))
}

/// The config text without the `[[auth.jwt]]` table named `name`.
fn remove_issuer(toml: &str, name: &str) -> String {
    remove_table(toml, "[[auth.jwt]]", &format!("name = \"{name}\""))
}

fn remove_table(toml: &str, header: &str, first_line: &str) -> String {
    let mut out = Vec::new();
    let mut lines = toml.lines().peekable();
    while let Some(l) = lines.next() {
        if l == header && lines.peek() == Some(&first_line) {
            while lines.peek().is_some_and(|n| !n.starts_with('[')) {
                lines.next();
            }
            continue;
        }
        out.push(l);
    }
    out.join("\n") + "\n"
}

async fn open(fleet: &Fleet, token: &str) -> anyhow::Result<Client> {
    let mut c = Client::connect(&fleet.url(), &fleet.files.ca, Some(token)).await?;
    c.initialize("identity-test").await?;
    Ok(c)
}

async fn still_serves(c: &mut Client) -> anyhow::Result<()> {
    c.request("thread/loaded/list", json!({})).await.map(|_| ())
}

#[tokio::test]
async fn sessions_end_with_their_credential_and_no_other() -> anyhow::Result<()> {
    let fleet = fleet().await?;
    let exp_in = 4;
    // Before the tokens are minted: their exp (whole seconds) is then at least exp_in - 1 away.
    let started = tokio::time::Instant::now();
    // Tenant beta has close_on_expiry = false: its short JWT session stays. Its token expires a
    // second before `short`'s, so when `short` is closed, `kept` has been expired for a second.
    let kept_exp = now() + exp_in;
    let es = signed(
        Algorithm::ES256,
        "ec-a",
        "ec-a.pem",
        &json!({"sub": "kept", "exp": kept_exp}),
    );
    let mut kept = open(&fleet, &es).await?;
    let short_jwt = hs256(&json!({"sub": "short", "exp": kept_exp + 1,
        "iss": "https://issuer.test", "aud": "codex-fleet"}));
    let mut short = open(&fleet, &short_jwt).await?;
    let mut long = open(&fleet, &acme_jwt("long", 600)).await?;
    let mut token = open(&fleet, &fleet.files.token("acme")).await?;
    let frame = short.recv_close_frame(STEP).await?;
    assert_eq!(
        frame,
        Some((1008, router::end::EXPIRED_REASON.to_owned())),
        "the expired session is closed with 1008"
    );
    // Closed after exp (the clock has whole seconds), and not long after it.
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(exp_in as u64 - 1), "{took:?}");
    assert!(took < Duration::from_secs(40), "{took:?}");
    for c in [&mut kept, &mut long, &mut token] {
        still_serves(c).await?;
    }
    // The session's end is counted as it finishes (after its close frame went out).
    let expired = [("reason", "credential_expired")];
    testkit::wait_until_async(Duration::from_secs(10), || async {
        fleet
            .metric("codex_fleet_sessions_closed_total", &expired)
            .await
            .is_ok_and(|n| n >= 1.0)
    })
    .await;
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_sessions_closed_total",
                &[("reason", "credential_expired")]
            )
            .await?,
        1.0
    );

    // A second static token for acme, then a reload that removes the first: only the first
    // token's session closes.
    let second = router::cli::dev::random_token();
    let first = fleet.files.token("acme");
    let toml = std::fs::read_to_string(&fleet.files.config)?;
    let toml = toml.replacen(
        &format!(
            "token_sha256 = [\"{}\"]",
            router::auth::token_digest_hex(&first)
        ),
        &format!(
            "token_sha256 = [\"{}\", \"{}\"]",
            router::auth::token_digest_hex(&first),
            router::auth::token_digest_hex(&second)
        ),
        1,
    );
    router::fsutil::write_private(&fleet.files.config, &toml)?;
    fleet.reloader.reload().await?;
    let mut by_second = open(&fleet, &second).await?;
    let toml = toml.replacen(
        &format!("\"{}\", ", router::auth::token_digest_hex(&first)),
        "",
        1,
    );
    router::fsutil::write_private(&fleet.files.config, &toml)?;
    fleet.reloader.reload().await?;
    let frame = token.recv_close_frame(STEP).await?;
    assert_eq!(frame, Some((1008, router::end::REVOKED_REASON.to_owned())));
    for c in [&mut kept, &mut long, &mut by_second] {
        still_serves(c)
            .await
            .context("a session of another credential")?;
    }
    assert_eq!(status(&upgrade(&fleet, Some(&first), None).await?), 401);
    assert_no_secrets(&fleet, &[])?;
    fleet.stop().await
}

/// The leaf certificate a new TLS handshake with `fleet` is served (trusting `cas`).
async fn served_cert(fleet: &Fleet, cas: &[&str]) -> anyhow::Result<Vec<u8>> {
    let mut roots = rustls::RootCertStore::empty();
    for pem in cas {
        for cert in rustls_pemfile::certs(&mut pem.as_bytes()) {
            roots.add(cert?)?;
        }
    }
    let cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(fleet.addr).await?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
        .await?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no certificate")?
        .to_vec();
    Ok(leaf)
}

fn leaf_der(pem: &str) -> Vec<u8> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .expect("a certificate")
        .expect("PEM")
        .to_vec()
}

/// Replaces a file as Kubernetes does: a new file renamed over the old one.
fn replace(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("new");
    router::fsutil::write_private(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Whether `codex_fleet_tls_reloads_total{result="invalid"}` reaches `n` within 30 s.
async fn refused_certificates(fleet: &Fleet, n: f64) -> bool {
    testkit::wait_until_async(Duration::from_secs(30), || async {
        fleet
            .metric("codex_fleet_tls_reloads_total", &[("result", "invalid")])
            .await
            .unwrap_or(0.0)
            == n
    })
    .await
}

#[tokio::test]
async fn the_certificate_rotates_in_place_and_a_broken_one_is_refused() -> anyhow::Result<()> {
    let fleet = fleet().await?;
    let old_ca = std::fs::read_to_string(&fleet.files.ca)?;
    let cert_path = fleet.files.dir.path().join("tls.crt");
    let key_path = fleet.files.dir.path().join("tls.key");
    let old_leaf = leaf_der(&std::fs::read_to_string(&cert_path)?);
    assert_eq!(served_cert(&fleet, &[&old_ca]).await?, old_leaf);
    let mut before = open(&fleet, &fleet.files.token("acme")).await?;

    let next = router::cli::dev::generate_pki(&["localhost", "127.0.0.1"])?;
    replace(&key_path, &next.key_pem)?;
    replace(&cert_path, &next.cert_pem)?;
    let new_leaf = leaf_der(&next.cert_pem);
    let cas = [old_ca.as_str(), next.ca_pem.as_str()];
    // Clients trust both CAs from now on.
    std::fs::write(&fleet.files.ca, cas.concat())?;
    let mut served = Vec::new();
    for _ in 0..150 {
        served = served_cert(&fleet, &cas).await?;
        if served == new_leaf {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(served, new_leaf, "a new handshake sees the new certificate");
    still_serves(&mut before)
        .await
        .context("the session opened before the rotation")?;
    assert_eq!(
        fleet
            .metric("codex_fleet_tls_reloads_total", &[("result", "ok")])
            .await?,
        1.0
    );

    // A corrupt replacement, then a certificate whose key is not the one beside it: both are
    // refused, counted, and the rotated pair keeps serving.
    replace(
        &cert_path,
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
    )?;
    assert!(
        refused_certificates(&fleet, 1.0).await,
        "the corrupt certificate is refused and counted"
    );
    assert_eq!(served_cert(&fleet, &cas).await?, new_leaf);
    let other = router::cli::dev::generate_pki(&["localhost"])?;
    replace(&cert_path, &other.cert_pem)?;
    assert!(
        refused_certificates(&fleet, 2.0).await,
        "a certificate without its key is refused"
    );
    assert_eq!(served_cert(&fleet, &cas).await?, new_leaf);
    let mut after = open(&fleet, &fleet.files.token("acme")).await?;
    still_serves(&mut after).await?;
    still_serves(&mut before).await?;
    fleet.stop().await
}

/// A new thread's turn asks to run a command, and `c` accepts: the thread and the turn's frames.
async fn run_an_approved_command(c: &mut Client) -> anyhow::Result<(String, Vec<Value>)> {
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "please RUNSHELL").await?;
    let ask = c
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    c.send(&json!({ "id": ask["id"], "result": { "decision": "accept" } }))
        .await?;
    let msgs = c.until_turn_completed(&thread).await?;
    Ok((thread, msgs))
}

#[tokio::test]
async fn the_audit_log_holds_an_approval_its_command_decision_and_who_answered(
) -> anyhow::Result<()> {
    let fleet = fleet().await?;
    let mut c = open(&fleet, &acme_jwt("approver@acme", 600)).await?;
    let (thread, msgs) = run_an_approved_command(&mut c).await?;
    assert!(msgs
        .iter()
        .any(|m| m["method"] == "item/completed"
            && m["params"]["item"]["type"] == "commandExecution"));
    // A host-access denial is audited too.
    let denied = c
        .call(
            "config/value/write",
            json!({ "keyPath": "model", "value": "x", "mergeStrategy": "replace" }),
        )
        .await?;
    assert_eq!(denied["error"]["code"], -32003, "{denied}");
    c.close().await;
    assert!(
        testkit::wait_until_async(Duration::from_secs(30), || async {
            audit_events(&fleet)
                .unwrap_or_default()
                .iter()
                .any(|e| e["event"] == "session.ended" && e["subject"] == "approver@acme")
        })
        .await
    );
    let events = audit_events(&fleet)?;
    let asked = events
        .iter()
        .find(|e| e["event"] == "approval.requested")
        .context("approval.requested")?;
    assert_eq!(asked["thread"], thread.as_str());
    assert!(asked["turn"].is_string(), "{asked}");
    assert!(
        asked["command"]
            .as_str()
            .is_some_and(|c| c.contains("echo mock-approved")),
        "{asked}"
    );
    let answered = events
        .iter()
        .position(|e| e["event"] == "approval.answered")
        .context("approval.answered")?;
    let a = &events[answered];
    assert_eq!(a["decision"], "accept", "{a}");
    assert_eq!(a["subject"], "approver@acme", "{a}");
    assert_eq!(a["tenant"], "acme", "{a}");
    assert_eq!(a["thread"], thread.as_str(), "{a}");
    assert_eq!(a["command"], asked["command"], "{a}");
    assert!(events.iter().any(|e| e["event"] == "access.denied"
        && e["method"] == "config/value/write"
        && e["policy"] == "config_write"
        && e["subject"] == "approver@acme"));
    assert!(
        events.iter().any(|e| e["event"] == "worker.ready"
            && e["tenant"] == "acme"
            && e["worker"].is_string()),
        "the worker's start is audited"
    );
    // In order: authenticated, thread created, asked, answered, session ended.
    let at = |name: &str| events.iter().position(|e| e["event"] == name);
    let order = [
        at("authentication.succeeded"),
        at("thread.created"),
        at("approval.requested"),
        Some(answered),
        at("session.ended"),
    ];
    assert!(order.iter().all(Option::is_some), "{order:?}");
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
    assert_no_secrets(&fleet, &[])?;
    fleet.stop().await
}

/// The audit log is every tenant's: one tenant flooding it with host-access denials (here 9000,
/// as fast as its admission lets it) while another tenant's approval is asked and decided gets a
/// bounded number of records of its own, drops none of the other's, and leaves every one of its
/// denials accounted for exactly once (a record, or a count in a later record of the same
/// session, or in the one it writes when it ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_flood_of_denials_leaves_another_tenants_audit_whole() -> anyhow::Result<()> {
    const CONNECTIONS: usize = 3;
    const PER_CONNECTION: usize = 3000;
    const CHUNK: usize = 100;
    let files = FleetBuilder::new()
        .tenant("acme")
        .tenant("beta")
        .limits_toml(
            "tenant_rps = 1000000\ntenant_burst = 1000000\nconn_fps = 1000000\nconn_burst = 1000000",
        )
        .prepare()
        .await?;
    let mut toml = std::fs::read_to_string(&files.config)?;
    toml.push_str(&format!(
        "\n[audit]\npath = \"{}\"\n",
        files.dir.path().join("audit.jsonl").display()
    ));
    router::fsutil::write_private(&files.config, &toml)?;
    let fleet = files.start().await?;
    let deny = r#"{"id":ID,"method":"config/value/write","params":{"keyPath":"model","value":"x","mergeStrategy":"replace"}}"#;
    let flood = |mut c: Client| async move {
        for chunk in 0..PER_CONNECTION / CHUNK {
            for i in 0..CHUNK {
                c.send_text(&deny.replace("ID", &(chunk * CHUNK + i + 100).to_string()))
                    .await?;
            }
            for _ in 0..CHUNK {
                let v = c.wait_for(|v| v.get("error").is_some()).await?;
                anyhow::ensure!(v["error"]["code"] == -32003, "{v}");
            }
        }
        c.close().await;
        anyhow::Ok(())
    };
    let mut hogs = Vec::new();
    for _ in 0..CONNECTIONS {
        hogs.push(open(&fleet, &fleet.files.token("beta")).await?);
    }
    let mut c = open(&fleet, &fleet.files.token("acme")).await?;
    let started = std::time::Instant::now();
    let decided = async {
        run_an_approved_command(&mut c)
            .await
            .map(|(thread, _)| thread)
    };
    let (floods, thread) = tokio::join!(
        futures_util::future::join_all(hogs.into_iter().map(flood)),
        decided
    );
    let elapsed = started.elapsed();
    let thread = thread?;
    for f in floods {
        f?;
    }
    c.close().await;
    let denials = CONNECTIONS * PER_CONNECTION;
    // Every session has ended (and written what it still counted).
    let ended = testkit::wait_until_async(Duration::from_secs(30), || async {
        audit_events(&fleet)
            .unwrap_or_default()
            .iter()
            .filter(|e| e["event"] == "session.ended")
            .count()
            == CONNECTIONS + 1
    })
    .await;
    assert!(ended, "sessions not ended");
    let events = audit_events(&fleet)?;
    let of = |tenant: &str, event: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["tenant"] == tenant && e["event"] == event)
            .collect()
    };
    let records = of("beta", "access.denied");
    let counted: u64 = records
        .iter()
        .map(|e| e["suppressed"].as_u64().unwrap_or(0))
        .sum::<u64>()
        + of("beta", "access.denied.suppressed")
            .iter()
            .map(|e| e["count"].as_u64().unwrap_or(0))
            .sum::<u64>();
    eprintln!(
        "measured: {denials} denials in {elapsed:?}: {} records, {counted} counted in them; \
         the other tenant's approval asked and answered meanwhile",
        records.len()
    );
    let allowed = 100 + 10 * elapsed.as_secs() as usize + 10;
    assert!(
        records.len() <= allowed,
        "{} records for {denials} denials in {elapsed:?}",
        records.len()
    );
    assert_eq!(
        records.len() as u64 + counted,
        denials as u64,
        "each denial is a record or counted once"
    );
    let asked = of("acme", "approval.requested");
    let answered = of("acme", "approval.answered");
    assert_eq!((asked.len(), answered.len()), (1, 1), "{events:?}");
    assert_eq!(answered[0]["thread"], thread.as_str());
    assert_eq!(answered[0]["decision"], "accept");
    assert_eq!(
        fleet.metric("codex_fleet_audit_dropped_total", &[]).await?,
        0.0
    );
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_client_errors_total",
                &[("reason", "host_access_denied")]
            )
            .await?,
        denials as f64
    );
    fleet.stop().await
}

/// An HTTPS server on loopback that answers every request with the JWKS it holds now.
struct JwksServer {
    url: String,
    ca: std::path::PathBuf,
    jwks: std::sync::Arc<std::sync::Mutex<String>>,
    fetches: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// When the last fetch's request arrived (after the fetch started at codex-fleet).
    last_fetch: std::sync::Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    _dir: tempfile::TempDir,
    _task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    /// Waits until codex-fleet may fetch again for an unknown `kid`: a second after its last
    /// fetch started (which was before that fetch arrived here).
    async fn until_refetch_allowed(&self) {
        let last = *self.last_fetch.lock().expect("last fetch");
        if let Some(at) = last {
            tokio::time::sleep_until(at + Duration::from_secs(1)).await;
        }
    }

    async fn start(jwks: String) -> anyhow::Result<JwksServer> {
        use std::sync::atomic::Ordering;
        use tokio::io::AsyncWriteExt;
        let dir = tempfile::tempdir()?;
        let pki = router::cli::dev::generate_pki(&["localhost", "127.0.0.1"])?;
        let (ca, cert, key) = (
            dir.path().join("ca.pem"),
            dir.path().join("cert.pem"),
            dir.path().join("key.pem"),
        );
        std::fs::write(&ca, &pki.ca_pem)?;
        std::fs::write(&cert, &pki.cert_pem)?;
        router::fsutil::write_private(&key, &pki.key_pem)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(router::tls::server_config(&cert, &key)?);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!(
            "https://localhost:{}/.well-known/jwks.json",
            listener.local_addr()?.port()
        );
        let body = std::sync::Arc::new(std::sync::Mutex::new(jwks));
        let fetches = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let last_fetch = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (b, f, at) = (body.clone(), fetches.clone(), last_fetch.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, b, f, at) = (acceptor.clone(), b.clone(), f.clone(), at.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    if testkit::read_request_head(&mut tls).await.is_none() {
                        return;
                    }
                    *at.lock().expect("last fetch") = Some(tokio::time::Instant::now());
                    f.fetch_add(1, Ordering::SeqCst);
                    let jwks = b.lock().expect("jwks").clone();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{jwks}",
                        jwks.len()
                    );
                    let _written = tls.write_all(resp.as_bytes()).await;
                    let _closed = tls.shutdown().await;
                });
            }
        });
        Ok(JwksServer {
            url,
            ca,
            jwks: body,
            fetches,
            last_fetch,
            _dir: dir,
            _task: task,
        })
    }
}

#[tokio::test]
async fn a_jwks_over_https_rotates_its_key_without_a_restart() -> anyhow::Result<()> {
    let idp = JwksServer::start(jwks(&["rsa-a"])).await?;
    let fleet = fleet_with(&format!(
        r#"
[[auth.jwt]]
name = "remote"
algorithm = "RS256"
jwks_url = "{}"
jwks_ca_file = "{}"
issuer = "https://idp.remote.test"
tenant = "beta"
"#,
        idp.url,
        idp.ca.display()
    ))
    .await?;
    let claims = json!({"sub": "rita", "iss": "https://idp.remote.test", "exp": now() + 600});
    let a = signed(Algorithm::RS256, "rsa-a", "rsa-a.pem", &claims);
    turn(&fleet, &a, "remote jwks").await?;
    let before = idp.fetches.load(std::sync::atomic::Ordering::SeqCst);
    assert!(before >= 1);

    // The identity provider rotates: rsa-b replaces rsa-a. A token of the new key is accepted
    // at once (its unknown kid fetches the JWKS again), with no reload or restart.
    *idp.jwks.lock().expect("jwks") = jwks(&["rsa-b"]);
    // Fetches for unknown kids are at most once a second per URL: from the last one on.
    idp.until_refetch_allowed().await;
    let b = signed(Algorithm::RS256, "rsa-b", "rsa-b.pem", &claims);
    let mut c = open(&fleet, &b).await?;
    still_serves(&mut c).await?;
    assert!(idp.fetches.load(std::sync::atomic::Ordering::SeqCst) > before);
    let events = audit_events(&fleet)?;
    assert!(events
        .iter()
        .any(|e| e["event"] == "authentication.succeeded"
            && e["subject"] == "rita"
            && e["key_id"] == "jwt:remote:rsa-b"));
    // A key the provider no longer publishes is unknown once the JWKS was fetched again: its
    // kid is unknown, fetches once more, and is still refused.
    idp.until_refetch_allowed().await;
    let before = idp.fetches.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(status(&upgrade(&fleet, Some(&a), None).await?), 401);
    assert!(
        idp.fetches.load(std::sync::atomic::Ordering::SeqCst) > before,
        "the unknown kid fetched the JWKS again"
    );
    assert_no_secrets(&fleet, &[])?;
    fleet.stop().await
}

/// Stops `p` (SIGKILL, reaped, so its port is free), points its config's audit log at
/// `audit_to` instead of `audit_from`, and starts it again (`role`) with `CODEX_FLEET_LOG=debug`.
async fn restart_with_own_audit(
    mut p: testkit::FleetProcess,
    role: &str,
    config: &std::path::Path,
    audit_from: &std::path::Path,
    audit_to: &std::path::Path,
) -> anyhow::Result<testkit::FleetProcess> {
    p.signal(nix::sys::signal::Signal::SIGKILL)?;
    p.wait(Duration::from_secs(10)).await?;
    let text = std::fs::read_to_string(config)?;
    let from = format!("path = {audit_from:?}");
    anyhow::ensure!(text.contains(&from), "{} has no {from}", config.display());
    std::fs::write(config, text.replace(&from, &format!("path = {audit_to:?}")))?;
    testkit::FleetProcess::spawn_role(&testkit::fleet_bin(), role, config, |c| {
        c.env("CODEX_FLEET_LOG", "debug");
    })
    .await
}

/// The audit events in `path`.
fn events_in(path: &std::path::Path) -> anyhow::Result<Vec<Value>> {
    std::fs::read_to_string(path)
        .with_context(|| format!("{}", path.display()))?
        .lines()
        .map(|l| serde_json::from_str(l).map_err(Into::into))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_an_edge_a_jwt_names_the_subject_on_the_node_and_its_session_ends_at_exp(
) -> anyhow::Result<()> {
    let keys = tempfile::tempdir()?;
    let secret = keys.path().join("hs.secret");
    std::fs::write(&secret, SECRET)?;
    let shared_audit = keys.path().join("audit.jsonl");
    // Split writes these tables into the edge's and the nodes' files alike (nodes skip the
    // issuers: they trust their edges).
    let extra = format!(
        "max_connections = 10000\n[audit]\npath = {shared_audit:?}\n[auth]\n[[auth.jwt]]\nname = \"shared\"\n\
         algorithm = \"HS256\"\nsecret_file = {secret:?}\ntenant = \"acme\"\n",
    );
    let mut s = testkit::Split::start(&[("acme", "n1"), ("beta", "n2")], 1, &extra).await?;
    // Each process its own audit log (so what the node records is the node's), and every
    // process logging at debug (so no credential hides below the default level).
    let audit_of = |name: &str| keys.path().join(format!("audit-{name}.jsonl"));
    for i in 0..s.nodes.len() {
        let old = s.nodes[i].process.take().context("node")?;
        let (name, config) = (s.nodes[i].name.clone(), s.nodes[i].config.clone());
        s.nodes[i].process = Some(
            restart_with_own_audit(old, "node", &config, &shared_audit, &audit_of(&name)).await?,
        );
    }
    let edge_config = s.files.dir.path().join("edge0.toml");
    let old = s.edges.remove(0);
    s.edges.push(
        restart_with_own_audit(old, "serve", &edge_config, &shared_audit, &audit_of("edge"))
            .await?,
    );
    let started = tokio::time::Instant::now();
    let jwt = hs256(&json!({"sub": "edge-user", "exp": now() + 8}));
    let mut c = s.edges[0].client(&s.files, &jwt).await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "through the edge").await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("through the edge")));
    let frame = c.recv_close_frame(STEP).await?;
    assert_eq!(
        frame,
        Some((1008, router::end::EXPIRED_REASON.to_owned())),
        "the edge closes the relay at exp"
    );
    assert!(started.elapsed() >= Duration::from_secs(6));
    // The edge authenticated the JWT; the node learnt the subject from the edge: its own
    // audit events name the person, on the thread it created.
    let edge_events = events_in(&audit_of("edge"))?;
    assert!(
        edge_events
            .iter()
            .any(|e| e["event"] == "authentication.succeeded"
                && e["subject"] == "edge-user"
                && e["credential"] == "jwt"),
        "{edge_events:#?}"
    );
    let node_events = events_in(&audit_of("n1"))?;
    let named = |event: &str| {
        node_events
            .iter()
            .any(|e| e["event"] == event && e["subject"] == "edge-user")
    };
    assert!(
        named("session.initialized"),
        "the node's session names the subject: {node_events:#?}"
    );
    assert!(
        node_events.iter().any(|e| e["event"] == "thread.created"
            && e["subject"] == "edge-user"
            && e["thread"] == thread.as_str()),
        "the node's thread.created names the subject: {node_events:#?}"
    );
    // The edge holds no thread: that event is the node's alone.
    assert!(!edge_events.iter().any(|e| e["event"] == "thread.created"));
    // No credential in any audit log or in what the edge and the nodes wrote to stderr.
    let mut logs = Vec::new();
    for name in ["edge", "n1", "n2"] {
        logs.push((
            format!("{name} audit log"),
            std::fs::read_to_string(audit_of(name)).unwrap_or_default(),
        ));
    }
    logs.push(("edge stderr".to_owned(), s.edges[0].stderr()));
    for n in &s.nodes {
        if let Some(p) = &n.process {
            logs.push((format!("{} stderr", n.name), p.stderr()));
        }
    }
    let debug_lines = logs
        .iter()
        .filter(|(name, _)| name.ends_with("stderr"))
        .map(|(_, text)| text.lines().filter(|l| l.contains("DEBUG")).count())
        .sum::<usize>();
    eprintln!("measured: {debug_lines} DEBUG lines of stderr checked for credentials");
    assert!(debug_lines > 0, "the processes did not log at debug");
    for (name, text) in &logs {
        for needle in ["eyJ", SECRET, &s.token("acme"), &s.token("beta")] {
            assert!(!text.contains(needle), "{name} holds a credential");
        }
    }
    Ok(())
}

#[tokio::test]
async fn check_config_refuses_a_short_secret_without_printing_it() -> anyhow::Result<()> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let secret = files.dir.path().join("short.secret");
    let short = "too-short-secret-1234";
    std::fs::write(&secret, short)?;
    let text = std::fs::read_to_string(&files.config)?
        + &format!(
            "\n[auth]\n[[auth.jwt]]\nname = \"shared\"\nalgorithm = \"HS256\"\nsecret_file = {:?}\ntenant = \"acme\"\n",
            secret
        );
    router::fsutil::write_private(&files.config, &text)?;
    let check = || {
        tokio::process::Command::new(testkit::fleet_bin())
            .arg("check-config")
            .arg(&files.config)
            .output()
    };
    let out = check().await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("at least 32 bytes"), "{stderr}");
    assert!(!stderr.contains(short), "the secret is printed: {stderr}");
    std::fs::write(&secret, SECRET)?;
    let out = check().await?;
    assert!(out.status.success(), "{out:?}");
    Ok(())
}
