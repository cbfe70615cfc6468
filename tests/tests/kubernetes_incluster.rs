//! docs/decisions/0017-settings-travel-with-the-tenant.md: an edge that reaches the API server the
//! way an edge pod does. No `api_url`, no KUBECONFIG: `KUBERNETES_SERVICE_HOST`/`_PORT` in its
//! environment and the service account's `token`, `ca.crt` and `namespace` at
//! /var/run/secrets/kubernetes.io/serviceaccount, put there by a bind mount in a mount namespace of
//! its own (so they are where kube-rs reads them, and nowhere else on the machine). The fake API
//! server ([`testkit::fake_kube`]) speaks HTTPS with a test CA's certificate and answers 401 to any
//! request without an accepted bearer token. Root only (the mount namespace).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use testkit::fake_kube::{write_service_account, write_token, HttpsApi, SERVICE_ACCOUNT_DIR};
use testkit::kube_cluster::{Cluster, Options};
use testkit::pki::TestPki;
use testkit::FleetProcess;
use testkit::{agent_text, fleet_bin, reply_text, root_or_explicit_skip, wait_until_async, Client};
use tokio::time::Instant;

async fn turn(c: &mut Client, thread: &str, prompt: &str) -> anyhow::Result<()> {
    c.start_turn(thread, prompt).await?;
    let msgs = c.until_turn_completed(thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(())
}

/// The cluster's edge config without `api_url` and `namespace`: both come from the pod's
/// environment and service account.
fn in_cluster_config(c: &Cluster) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(&c.edge_config)?;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("api_url = ") && !l.starts_with("namespace = \"codex\""))
        .collect();
    assert_eq!(kept.len() + 2, text.lines().count(), "{text}");
    let path = c.files.dir.path().join("edge-in-cluster.toml");
    std::fs::write(&path, kept.join("\n") + "\n")?;
    Ok(path)
}

/// A script that runs codex-fleet with `service_account` mounted at [`SERVICE_ACCOUNT_DIR`] in
/// a private mount namespace: a tmpfs over /var/run (this machine has no
/// /var/run/secrets to mount onto), the directory made in it, the test's directory bound there.
fn in_pod_wrapper(dir: &Path) -> anyhow::Result<PathBuf> {
    let script = dir.join("in-pod.sh");
    let sa_parent = Path::new(SERVICE_ACCOUNT_DIR)
        .strip_prefix("/var/run")
        .context("under /var/run")?;
    let text = format!(
        "#!/bin/sh\nset -e\nexec unshare --mount --propagation private sh -c '\
         set -e; run=$(readlink -f /var/run); mount -t tmpfs -o size=1m,mode=755 tmpfs \"$run\"; \
         mkdir -p \"$run/{sa}\"; mount --bind -o ro \"$SA_DIR\" \"$run/{sa}\"; exec \"$0\" \"$@\"' {fleet} \"$@\"\n",
        sa = sa_parent.display(),
        fleet = fleet_bin().display(),
    );
    std::fs::write(&script, text)?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(script)
}

/// Starts an edge as a pod would run it: in-cluster environment, no KUBECONFIG, the service
/// account `sa_dir` mounted where kube-rs reads it.
async fn in_pod_edge(c: &Cluster, api: &HttpsApi, sa_dir: &Path) -> anyhow::Result<FleetProcess> {
    let config = in_cluster_config(c)?;
    let wrapper = in_pod_wrapper(c.files.dir.path())?;
    let port = api.addr.port().to_string();
    FleetProcess::spawn_role(&wrapper, "serve", &config, |cmd| {
        cmd.env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            .env("KUBERNETES_SERVICE_PORT", &port)
            .env("SA_DIR", sa_dir)
            .env_remove("KUBECONFIG")
            .env("HOME", "/nonexistent");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_in_a_pod_uses_its_service_account_over_https_and_outlives_a_token_rotation(
) -> anyhow::Result<()> {
    if !root_or_explicit_skip("an edge with a service account mounted in a mount namespace") {
        return Ok(());
    }
    let mut c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        edges: 0,
        ..Options::default()
    })
    .await?;
    let pki = TestPki::new()?;
    let api = c.fake.serve_https(&pki, &["token-one"]).await?;
    let sa = tempfile::tempdir()?;
    write_service_account(sa.path(), "token-one", &api.ca_pem, "codex")?;
    let edge = in_pod_edge(&c, &api, sa.path()).await?;
    c.edges.push(edge);
    assert!(
        c.synced(0).await,
        "the in-cluster edge never synced: {:?}\n{}",
        c.readyz(0).await,
        c.edges[0].stderr()
    );
    let (_, r) = c.readyz(0).await?;
    assert_eq!(
        r["edge"]["apiServer"],
        format!("https://{}/", api.addr),
        "{r}"
    );
    assert_eq!(
        r["edge"]["namespace"], "codex",
        "the service account's namespace: {r}"
    );
    assert!(
        api.first_use("token-one").is_some(),
        "no request bore the token"
    );
    assert_eq!(api.refused(), 0, "the edge was refused with its own token");

    let mut acme = c.client(0, "acme").await?;
    let thread = acme.start_thread().await?;
    turn(&mut acme, &thread, "through an in-cluster edge").await?;
    assert!(c.fake.pod("codex-fleet-node-acme").is_some());

    // The token rotates: a new file, and the old token is refused from now on (its open watch
    // ends and must authenticate again).
    write_token(sa.path(), "token-two")?;
    api.accept_only(&["token-two"]);
    let rotated = Instant::now();
    // Until kube-rs reads the file again, the edge's requests are refused; it stays Ready and
    // its tenant with a Ready pod is served
    // (docs/decisions/0017-settings-travel-with-the-tenant.md), a new turn included.
    assert!(
        wait_until_async(Duration::from_secs(10), || async { api.refused() > 0 }).await,
        "the edge made no request with the old token after the rotation"
    );
    let (status, r) = c.readyz(0).await?;
    assert_eq!(status, 200, "unready while its token is refused: {r}");
    turn(&mut acme, &thread, "while the old token is refused").await?;
    let picked_up = wait_until_async(Duration::from_secs(70), || async {
        api.first_use("token-two").is_some()
    })
    .await;
    assert!(
        picked_up,
        "the edge never read the rotated token: {:?}",
        c.readyz(0).await
    );
    let pickup = api.first_use("token-two").context("used")? - rotated;
    assert!(
        wait_until_async(Duration::from_secs(15), || async {
            c.readyz(0).await.is_ok_and(|(s, r)| {
                s == 200 && r["edge"]["watchSynced"] == true && r["edge"]["apiReachable"] == true
            })
        })
        .await,
        "not synced with the new token: {:?}",
        c.readyz(0).await
    );
    let refused = api.refused();
    // A new start needs the API server: it works with the new token.
    let t0 = Instant::now();
    let mut beta = c.client(0, "beta").await?;
    let thread = beta.start_thread().await?;
    turn(&mut beta, &thread, "a new tenant after the rotation").await?;
    assert!(c.fake.pod("codex-fleet-node-beta").is_some());
    let last_old = api.last_use("token-one").context("old token used")?;
    assert!(
        api.last_use("token-two").context("new")? > last_old,
        "the edge still presents the old token"
    );
    eprintln!(
        "measured: the in-cluster edge presented the rotated token {pickup:?} after the file \
         changed ({refused} requests refused 401 meanwhile); a new tenant's start and turn \
         after it took {:?}",
        t0.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_that_does_not_trust_the_api_servers_certificate_is_unready_and_says_why(
) -> anyhow::Result<()> {
    if !root_or_explicit_skip("an edge with a service account mounted in a mount namespace") {
        return Ok(());
    }
    let mut c = Cluster::start(Options {
        edges: 0,
        ..Options::default()
    })
    .await?;
    let pki = TestPki::new()?;
    let api = c.fake.serve_https(&pki, &["token-one"]).await?;
    // The pod's ca.crt is another CA's (a mis-set bundle, or a server that is not the cluster's).
    let other = TestPki::new()?;
    let sa = tempfile::tempdir()?;
    write_service_account(sa.path(), "token-one", &other.ca, "codex")?;
    let edge = in_pod_edge(&c, &api, sa.path()).await?;
    c.edges.push(edge);
    let said = wait_until_async(Duration::from_secs(20), || async {
        c.readyz(0).await.is_ok_and(|(_, r)| {
            r["edge"]["lastError"]
                .as_str()
                .is_some_and(|e| e.contains("certificate"))
        })
    })
    .await;
    let (status, r) = c.readyz(0).await?;
    assert!(said, "/readyz does not say why: {r}");
    assert_eq!(status, 503, "ready without its API server: {r}");
    assert_eq!(r["edge"]["watchSynced"], false, "{r}");
    let error = r["edge"]["lastError"].as_str().unwrap_or("");
    // The CA's name is the server's issuer's (both are "test link CA"): its signature fails.
    assert!(error.contains("invalid peer certificate"), "{error}");
    // Log lines reach stderr from a thread of their own, a moment after `/readyz` says it.
    let logged = wait_until_async(Duration::from_secs(10), || async {
        c.edges[0].stderr().contains("certificate")
    })
    .await;
    assert!(logged, "the log does not say why: {}", c.edges[0].stderr());
    // Its token never went to a server it does not trust.
    assert!(api.first_use("token-one").is_none());
    assert!(c.fake.requests().is_empty(), "{:?}", c.fake.requests());
    eprintln!("measured: an untrusted API server certificate, /readyz says: {error}");
    Ok(())
}
