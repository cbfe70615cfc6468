//! docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md: the kubernetes nodes backend against an
//! in-process fake API server ([`testkit::fake_kube`]) whose pods are real `codex-fleet node --tenant …
//! --exit-when-idle` processes on their own loopback addresses (127.0.0.N), with real workers and
//! the mock model, behind real `codex-fleet serve` edges and a real wss client.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use testkit::fake_kube::FakeKube;
use testkit::kube_cluster::{q, Cluster, Options, SERVER_NAME};
use testkit::{
    agent_text, fleet_bin, http_get, metric_in, reply_text, wait_until, wait_until_async, Client,
    FleetBuilder, FleetProcess,
};
use tokio::time::Instant;

async fn turn(c: &mut Client, thread: &str, prompt: &str) -> anyhow::Result<()> {
    c.start_turn(thread, prompt).await?;
    let msgs = c.until_turn_completed(thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(())
}

fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_in(text, name, labels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_session_creates_the_volume_and_the_pod_and_runs_a_turn() -> anyhow::Result<()> {
    let c = Cluster::start(Options::default()).await?;
    assert!(
        c.synced(0).await,
        "the edge's watch never synced: {:?}",
        c.readyz(0).await
    );
    let m = c.metrics(0).await?;
    for phase in ["Pending", "Running", "Succeeded", "Failed", "Unknown"] {
        assert!(
            m.contains(&format!("codex_fleet_tenant_pods{{phase=\"{phase}\"}} 0")),
            "{m}"
        );
    }
    for reason in ["timeout", "failed", "api"] {
        assert!(
            m.contains(&format!(
                "codex_fleet_node_start_failures_total{{reason=\"{reason}\"}} 0"
            )),
            "{m}"
        );
    }
    for reason in ["idle", "evicted", "failed", "deleted"] {
        assert!(
            m.contains(&format!(
                "codex_fleet_tenant_pod_recreations_total{{reason=\"{reason}\"}} 0"
            )),
            "{m}"
        );
    }
    assert!(m.contains("codex_fleet_tenant_pod_culls_total 0"), "{m}");
    assert!(m.contains("codex_fleet_tenant_pods_unschedulable 0"), "{m}");
    assert!(m.contains("codex_fleet_tenant_pods_starting 0"), "{m}");
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_requests",
            &[("tenant", "acme"), ("resource", "cpu")]
        ),
        0.25
    );
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_requests",
            &[("tenant", "acme"), ("resource", "memory")]
        ),
        536_870_912.0
    );
    assert!(c.fake.pod_names().is_empty(), "a pod before any session");

    let t0 = Instant::now();
    let mut client =
        Client::connect(&c.edges[0].url(), &c.files.ca, Some(&c.files.token("acme"))).await?;
    client.initialize("kubernetes-test").await?;
    let answered = t0.elapsed();
    let thread = client.start_thread().await?;
    turn(&mut client, &thread, "hello from a pod").await?;
    let turned = t0.elapsed();

    assert_eq!(c.fake.pod_creates(), 1);
    assert_eq!(c.fake.pvc_creates(), 1);
    assert!(c.fake.pvc_exists("codex-fleet-home-acme"));
    let pod = c
        .fake
        .pod("codex-fleet-node-acme")
        .context("the tenant's pod")?;
    assert_eq!(pod["metadata"]["labels"]["codex-fleet.io/tenant"], "acme");
    assert_eq!(
        pod["spec"]["containers"][0]["args"],
        json!([
            "node",
            "--config",
            "/etc/codex-fleet/node/config.toml",
            "--tenant",
            "acme",
            "--exit-when-idle"
        ])
    );
    assert_eq!(
        c.phase("codex-fleet-node-acme"),
        Some(("Running".into(), true))
    );
    // `render-tenant-pod` prints what the backend created (one builder for both).
    let out = std::process::Command::new(fleet_bin())
        .args(["render-tenant-pod", "--config"])
        .arg(&c.edge_config)
        .args(["--tenant", "acme"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(list["kind"], "List");
    assert_eq!(list["items"][0]["kind"], "PersistentVolumeClaim");
    assert_eq!(
        list["items"][0]["metadata"]["name"],
        "codex-fleet-home-acme"
    );
    assert_eq!(list["items"][1]["kind"], "Pod");
    assert_eq!(
        list["items"][1]["spec"], pod["spec"],
        "rendered and created pods differ"
    );
    assert_eq!(
        list["items"][1]["metadata"]["labels"],
        pod["metadata"]["labels"]
    );
    let m = c.metrics(0).await?;
    assert_eq!(
        metric(&m, "codex_fleet_tenant_pods", &[("phase", "Running")]),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "codex_fleet_node_start_seconds_count", &[]),
        1.0,
        "{m}"
    );
    let start = metric(&m, "codex_fleet_node_start_seconds_sum", &[]);
    eprintln!(
        "measured: first session to a ready tenant pod {start:.2} s (edge's node_start_seconds); \
         to the answer of initialize {answered:?}; to the first turn completed {turned:?}"
    );
    Ok(())
}

/// docs/decisions/0017-settings-travel-with-the-tenant.md: a tenant's own `[[tenants]]` settings
/// reach the node the edge starts for it, through the pod the edge creates; the node config every
/// pod mounts has no tenants, and no pod carries a credential or another tenant's entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_own_settings_reach_its_node_and_nothing_of_another() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        max_workers: vec![("acme", 7), ("beta", 2)],
        tenant_toml: vec![("acme", "[tenants.policy]\ncommand_exec = \"deny\"")],
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let _a = c.client(0, "acme").await?;
    let _b = c.client(0, "beta").await?;
    for (tenant, other, want) in [("acme", "beta", 7.0), ("beta", "acme", 2.0)] {
        let pod = format!("codex-fleet-node-{tenant}");
        let admin = c.pod_admin(&pod).context("podIP")?;
        let m = http_get(admin, "/metrics").await?.1;
        assert_eq!(
            metric(
                &m,
                "codex_fleet_tenant_limit",
                &[("tenant", tenant), ("limit", "max_workers")]
            ),
            want,
            "{tenant}'s node does not run with its own max_workers: {m}"
        );
        assert!(
            !m.contains(&format!("tenant=\"{other}\"")),
            "{tenant}'s node knows {other}: {m}"
        );
        // Think as a hostile tenant with a shell in its pod: all it can read of the spec is
        // its own entry; no token digest (its own or another's), no other tenant.
        let spec = c.fake.pod(&pod).context("pod")?.to_string();
        assert!(!spec.contains(other), "{other} in {tenant}'s pod: {spec}");
        for t in ["acme", "beta"] {
            let digest = router::auth::token_digest_hex(&c.files.token(t));
            assert!(!spec.contains(&digest), "{t}'s token digest in {pod}");
        }
    }
    let acme = c.fake.pod("codex-fleet-node-acme").context("pod")?;
    let env = &acme["spec"]["containers"][0]["env"];
    let entry = env
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == "CODEX_FLEET_TENANT_ENTRY"))
        .context("the entry in the pod's env")?;
    let entry: Value = serde_json::from_str(entry["value"].as_str().context("value")?)?;
    assert_eq!(entry["policy"]["command_exec"], "deny", "{entry}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_racing_for_one_tenant_create_one_pod() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        edges: 2,
        ..Options::default()
    })
    .await?;
    assert!(
        c.synced(0).await && c.synced(1).await,
        "watches never synced"
    );
    // Both sessions arrive before either edge has seen a pod: both create, one gets 409. The
    // fake holds the first create until the second arrives, so the race is run every time.
    c.fake.gather_pod_creates(2);
    let (a, b) = tokio::join!(c.client(0, "acme"), c.client(1, "acme"));
    let (mut a, mut b) = (a?, b?);
    let posts = pod_posts(&c);
    assert_eq!(posts, 2, "both racing edges tried to create the pod");
    assert_eq!(c.fake.pod_creates(), 1, "one pod, whoever won");
    assert_eq!(c.fake.pod_names(), vec!["codex-fleet-node-acme".to_owned()]);
    assert_eq!(c.fake.pvc_creates(), 1);
    eprintln!("measured: {posts} pod creations tried by 2 racing edges, 1 created");
    // The loser's 409 AlreadyExists is success, not an API failure.
    for edge in 0..2 {
        let m = c.metrics(edge).await?;
        assert_eq!(start_failures(&m, "api"), 0.0, "{m}");
    }
    // Both are relayed to the same node: a thread started through one edge resumes through
    // the other.
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "through edge zero").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "through edge one").await?;
    Ok(())
}

/// docs/architecture.md ("Faults across the link"): a tenant's node holds its own limits over
/// every edge in front of it. A session that an edge admits and upgrades but the node then
/// refuses (here its tenant's connection cap, reached through the other edge) is told the node's
/// refusal, `-32001` with the node's scope and reason and close 1013, not that its node went
/// away (1012 and `nodeUnavailable`, which send a client to reconnect at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_its_node_refuses_under_its_limits_is_told_the_nodes_refusal(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        edges: 2,
        limits_toml: "max_connections_per_tenant = 2",
        ..Options::default()
    })
    .await?;
    let mut a = c.client(0, "acme").await?;
    let _b = c.client(0, "acme").await?;
    // Edge 1 holds none of acme's connections: it admits a third, which its node refuses.
    let mut third =
        Client::connect(&c.edges[1].url(), &c.files.ca, Some(&c.files.token("acme"))).await?;
    let id = third
        .send_request(
            "initialize",
            json!({"clientInfo": {"name": "third", "version": "1"}}),
        )
        .await?;
    let answer = third.recv_wire(c.first_answer).await?;
    assert_eq!(answer["id"], id, "{answer}");
    assert_eq!(answer["error"]["code"], -32001, "{answer}");
    assert_eq!(answer["error"]["data"]["scope"], "tenant", "{answer}");
    assert_eq!(
        answer["error"]["data"]["reason"], "tooManyConnections",
        "{answer}"
    );
    assert!(
        answer["error"]["data"]["retryAfterMs"]
            .as_u64()
            .is_some_and(|ms| ms > 0),
        "{answer}"
    );
    let close = third.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(
        close,
        Some((1013, router::edge::NODE_REFUSED_REASON.to_owned())),
        "closed as its node's refusal"
    );
    // Not taken for a node gone: no `lost` link, and the first two sessions go on.
    let m = c.metrics(1).await?;
    assert_eq!(
        metric(&m, "codex_fleet_link_errors_total", &[("reason", "lost")]),
        0.0,
        "{m}"
    );
    a.request("thread/list", json!({})).await?;
    Ok(())
}

/// The API requests the fake saw that start with `prefix` (like `POST /api/v1/…/pods`).
fn requests_like(c: &Cluster, prefix: &str) -> usize {
    c.fake
        .requests()
        .iter()
        .filter(|r| r.starts_with(prefix))
        .count()
}

/// `codex_fleet_node_start_failures_total{reason}` in the metrics text `m`.
fn start_failures(m: &str, reason: &str) -> f64 {
    metric(
        m,
        "codex_fleet_node_start_failures_total",
        &[("reason", reason)],
    )
}

/// How often acme's pod was the subject of an Event of `reason`.
fn said(c: &Cluster, reason: &str) -> u64 {
    c.fake.event_occurrences("codex-fleet-node-acme", reason)
}

/// Acme's pod was the subject of exactly one Event of `reason`.
fn said_once(c: &Cluster, reason: &str) {
    assert_eq!(
        said(c, reason),
        1,
        "{reason}: {:?}",
        c.fake.events_about("codex-fleet-node-acme")
    );
}

/// `n` sessions of each of `tenants` upgraded at edge 0, so each is waiting for its tenant's pod,
/// while the fake holds pod creates (a create that arrives stays in flight): none can see a pod
/// made before all of them wait. Returns the clients (not initialized yet) by tenant, with the
/// creates still held.
async fn waiting_sessions(
    c: &Cluster,
    tenants: &[(&str, usize)],
) -> anyhow::Result<Vec<Vec<Client>>> {
    c.fake.hold_pod_creates(true);
    let mut all = Vec::new();
    for &(tenant, n) in tenants {
        let (url, token) = (c.edges[0].url(), c.files.token(tenant));
        let connected = futures_util::future::join_all(
            (0..n).map(|_| Client::connect(&url, &c.files.ca, Some(&token))),
        )
        .await;
        all.push(connected.into_iter().collect::<anyhow::Result<Vec<_>>>()?);
    }
    Ok(all)
}

/// The pod creates that reached the fake so far.
fn pod_posts(c: &Cluster) -> usize {
    requests_like(c, "POST /api/v1/namespaces/codex/pods")
}

/// Waits until `n` pod creates have arrived, then a while longer: more would have arrived by
/// then (the sessions are all waiting already); returns how many did.
async fn pod_posts_settled(c: &Cluster, n: usize) -> usize {
    let arrived = wait_until(Duration::from_secs(15), || pod_posts(c) >= n).await;
    assert!(arrived, "{} pod creates arrived, not {n}", pod_posts(c));
    tokio::time::sleep(Duration::from_millis(500)).await;
    pod_posts(c)
}

/// A hostile (or merely busy) tenant's sessions arriving together on one edge while its pod
/// does not exist make one create, however many they are: they take turns at the create and
/// see its answer, rather than each posting the pod (one `201`, the rest `409`) and the claim.
/// Another tenant's start is its own: its create goes out while the first tenant's is still in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_sessions_arriving_together_make_one_create() -> anyhow::Result<()> {
    const SESSIONS: usize = 8;
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await, "the watch never synced");
    let mut waiting = waiting_sessions(&c, &[("acme", SESSIONS), ("beta", 1)]).await?;
    // Both tenants' creates are in flight at once (held), and no other session of acme's posts.
    let posts = pod_posts_settled(&c, 2).await;
    let claim_gets = requests_like(
        &c,
        "GET /api/v1/namespaces/codex/persistentvolumeclaims/codex-fleet-home-acme",
    );
    eprintln!(
        "measured: {SESSIONS} sessions of one tenant and 1 of another, all waiting: {posts} pod \
         creates, {claim_gets} lookups of the first tenant's claim"
    );
    assert_eq!(posts, 2, "one create for acme's sessions, one for beta's");
    assert_eq!(claim_gets, 1, "acme's claim looked up once");
    c.fake.hold_pod_creates(false);
    let (mut acme, mut beta) = (waiting.remove(0), waiting.remove(0));
    for client in acme.iter_mut().chain(beta.iter_mut()) {
        client
            .initialize_within("kubernetes-test", c.first_answer)
            .await?;
    }
    assert_eq!(pod_posts(&c), 2);
    assert_eq!(c.fake.pod_creates(), 2);
    assert_eq!(c.fake.pvc_creates(), 2);
    // All of acme's are served by its one node.
    let thread = acme[0].start_thread().await?;
    turn(&mut acme[0], &thread, "one pod for all").await?;
    acme[SESSIONS - 1]
        .request("thread/resume", json!({ "threadId": thread }))
        .await?;
    let own = beta[0].start_thread().await?;
    turn(&mut beta[0], &own, "a pod of its own").await?;
    Ok(())
}

/// Each of `clients` (waiting for acme's pod) sends its `initialize` and is refused for `reason`.
async fn each_refused(clients: Vec<Client>, reason: &str) -> anyhow::Result<()> {
    let answers = futures_util::future::join_all(clients.into_iter().map(refused_start_on)).await;
    for answer in answers {
        let (answer, _, _) = answer?;
        assert_eq!(answer["error"]["data"]["reason"], reason, "{answer}");
    }
    Ok(())
}

/// Refusals and start timeouts that a burst of a tenant's sessions share are said once: one
/// create refused (one `FailedCreate` Event, counted once) for the sessions that queued behind
/// it, and one `StartTimeout` Event for a pod that is late however many sessions it refuses,
/// each of which is still counted. A session after a refusal tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_refused_sessions_costs_one_create_and_one_event() -> anyhow::Result<()> {
    const SESSIONS: usize = 6;
    let c = Cluster::start(Options {
        start_timeout_secs: 3,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await, "the watch never synced");
    c.fake.refuse_pod_creates(403, usize::MAX);
    let mut waiting = waiting_sessions(&c, &[("acme", SESSIONS)]).await?;
    let posts = pod_posts_settled(&c, 1).await;
    c.fake.hold_pod_creates(false);
    each_refused(waiting.remove(0), "nodeStartFailed").await?;
    let written = wait_until(Duration::from_secs(10), || said(&c, "FailedCreate") >= 1).await;
    assert!(written, "no FailedCreate Event");
    // Each session's Event (were there several) is written as it is refused: all by now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let events = said(&c, "FailedCreate");
    eprintln!("measured: {SESSIONS} sessions refused together: {posts} pod creates, {events} FailedCreate");
    assert_eq!(
        (posts, pod_posts(&c)),
        (1, 1),
        "the sessions queued behind the refused create share its answer"
    );
    said_once(&c, "FailedCreate");
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "forbidden"), 1.0, "{m}");
    // The namespace mended: the next sessions try again, and their pod is late (all of them
    // wait from before it exists, so none finds it Pending past the timeout and replaces it).
    c.fake.refuse_pod_creates(403, 0);
    c.fake.hold_pods(true);
    let mut waiting = waiting_sessions(&c, &[("acme", SESSIONS)]).await?;
    assert_eq!(pod_posts_settled(&c, 2).await, 2);
    c.fake.hold_pod_creates(false);
    each_refused(waiting.remove(0), "nodeStarting").await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let late = said(&c, "StartTimeout");
    eprintln!("measured: {SESSIONS} sessions refused by a late pod: {late} StartTimeout");
    assert_eq!(pod_posts(&c), 2);
    said_once(&c, "Created");
    said_once(&c, "StartTimeout");
    let m = c.metrics(0).await?;
    assert_eq!(
        start_failures(&m, "timeout"),
        SESSIONS as f64,
        "every refused session is counted: {m}"
    );
    Ok(())
}

/// A tenant removed by a reload while its sessions wait for its pod: each of them is closed at
/// once as revoked (1008), not left to its start timeout; no create follows, no `StartTimeout`
/// is written nor counted for them, and another tenant's session on the same edge is served
/// throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_removed_while_its_sessions_wait_for_its_pod_is_told_at_once() -> anyhow::Result<()>
{
    const SESSIONS: usize = 4;
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        start_timeout_secs: 30,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await, "the watch never synced");
    let mut beta = c.client(0, "beta").await?;
    let thread = beta.start_thread().await?;
    // Acme's pod is created and stays Pending: its sessions wait.
    c.fake.hold_pods(true);
    let mut waiting = waiting_sessions(&c, &[("acme", SESSIONS)]).await?;
    assert_eq!(pod_posts_settled(&c, 2).await, 2, "beta's pod and acme's");
    c.fake.hold_pod_creates(false);
    let created = wait_until(Duration::from_secs(10), || {
        c.fake.pod("codex-fleet-node-acme").is_some()
    })
    .await;
    assert!(created, "acme's pod was never created");
    let text = std::fs::read_to_string(&c.edge_config)?;
    let from = text
        .find("[[tenants]]\nid = \"acme\"")
        .context("acme's entry")?;
    let to = from + 1 + text[from + 1..].find("\n[").context("the entry's end")?;
    std::fs::write(
        &c.edge_config,
        format!("{}{}", &text[..from], &text[to + 1..]),
    )?;
    let removed = Instant::now();
    c.edges[0].signal(nix::sys::signal::Signal::SIGHUP)?;
    let closes = futures_util::future::join_all(
        waiting[0]
            .iter_mut()
            .map(|a| a.recv_close_frame(Duration::from_secs(20))),
    )
    .await;
    let told = removed.elapsed();
    for close in closes {
        assert_eq!(
            close?,
            Some((1008, router::end::REVOKED_REASON.to_owned())),
            "a waiting session of a removed tenant is closed as revoked"
        );
    }
    eprintln!("measured: {SESSIONS} waiting sessions of a removed tenant all closed {told:?} after the reload signal (start timeout 30 s)");
    assert!(told < Duration::from_secs(15), "closed only after {told:?}");
    turn(&mut beta, &thread, "served while acme went").await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(pod_posts(&c), 2, "no create for a removed tenant");
    assert_eq!(said(&c, "StartTimeout"), 0);
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "timeout"), 0.0, "{m}");
    // A new session with acme's token is refused at the door.
    let refused = c.client(0, "acme").await;
    assert!(
        refused.is_err(),
        "a removed tenant's token still opens a session"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_exits_its_pod_is_culled_and_the_next_session_resumes_from_the_volume(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        worker_idle_secs: 2,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "remember me").await?;
    let first_uid = c.fake.pod("codex-fleet-node-acme").context("pod")?["metadata"]["uid"].clone();
    a.close().await;
    // No session, no turn, no loaded thread for worker_idle_secs: the node exits 0, its pod
    // completes and the edge deletes it; the volume stays.
    let culled = wait_until_async(Duration::from_secs(40), || async {
        c.metrics(0)
            .await
            .is_ok_and(|m| metric(&m, "codex_fleet_tenant_pod_culls_total", &[]) == 1.0)
    })
    .await;
    assert!(
        culled,
        "no cull: pod {:?}\nnode log:\n{}",
        c.fake.pod("codex-fleet-node-acme"),
        c.pod_log("codex-fleet-node-acme")
    );
    assert!(
        wait_until(Duration::from_secs(10), || c.fake.pod_names().is_empty()).await,
        "the completed pod was not deleted"
    );
    assert!(
        c.fake.pvc_exists("codex-fleet-home-acme"),
        "the volume went with the pod"
    );
    let evs = events_with(&c, "codex-fleet-node-acme", &["Created", "Culled"]).await;
    assert!(
        evs.iter().any(|(ty, r, _)| ty == "Normal" && r == "Culled"),
        "{evs:?}"
    );
    assert!(c
        .fake
        .requests()
        .iter()
        .any(|r| r.starts_with("DELETE /api/v1/namespaces/codex/pods/codex-fleet-node-acme")));
    // The gauge follows the edge's watch, which sees the delete after the API server answered it.
    let gone = wait_until_async(Duration::from_secs(10), || async {
        c.metrics(0)
            .await
            .is_ok_and(|m| metric(&m, "codex_fleet_tenant_pods", &[("phase", "Succeeded")]) == 0.0)
    })
    .await;
    assert!(gone, "{}", c.metrics(0).await?);

    // The next session creates a new pod on the same volume and resumes the thread.
    let mut b = c.client(0, "acme").await?;
    let second = c.fake.pod("codex-fleet-node-acme").context("a new pod")?;
    assert_ne!(second["metadata"]["uid"], first_uid);
    assert_eq!(c.fake.pod_creates(), 2);
    assert_eq!(c.fake.pvc_creates(), 1, "the volume is created once");
    let resumed = b
        .request("thread/resume", json!({ "threadId": thread }))
        .await?;
    assert_eq!(resumed["thread"]["id"], json!(thread));
    turn(&mut b, &thread, "still there").await?;
    let m = c.metrics(0).await?;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "idle")]
        ),
        1.0,
        "{m}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_or_evicted_mid_session_closes_its_clients_and_is_recreated(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options::default()).await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "before the eviction").await?;

    // `kubectl delete` is graceful: the node drains and closes its session 1001, passed
    // through (kubernetes_lifecycle.rs has the drain in detail); a kubelet's eviction kills.
    assert!(c.fake.delete_pod("codex-fleet-node-acme"));
    let close = a.recv_close_frame(Duration::from_secs(10)).await?;
    let (code, reason) = close.context("a close frame")?;
    assert_eq!(code, 1001, "{reason}");

    let mut b = c.client(0, "acme").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "after the deletion").await?;
    assert_eq!(c.fake.pod_creates(), 2);

    // An eviction leaves a Failed pod: it is deleted and replaced at the next session.
    c.fake.evict("codex-fleet-node-acme");
    let close = b.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(
        close.context("a close frame")?.0,
        router::edge::NODE_LOST_CODE
    );
    let mut d = c.client(0, "acme").await?;
    d.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut d, &thread, "after the eviction").await?;
    assert_eq!(c.fake.pod_creates(), 3);
    assert_eq!(c.fake.pod_names().len(), 1);
    let m = c.metrics(0).await?;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "deleted")]
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "evicted")]
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "codex_fleet_tenant_pod_culls_total", &[]),
        0.0,
        "a failed pod is no cull: {m}"
    );
    Ok(())
}

/// With the namespace's storage quota used up, creating a claim that exists is
/// 403 Forbidden (quota admission before the exists check); a tenant whose volume exists still
/// starts: the edge looks the claim up first and takes a 403 on an existing one as existing.
/// Also the closing note's number for a replaced pod: its start to ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_storage_quota_does_not_stop_a_tenant_whose_volume_exists() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        start_timeout_secs: 15,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "before the quota fills").await?;
    let first = metric(
        &c.metrics(0).await?,
        "codex_fleet_node_start_seconds_sum",
        &[],
    );
    c.fake.storage_quota_full(true);
    assert!(c.fake.delete_pod("codex-fleet-node-acme"));
    // A graceful delete: the node drains and closes its session 1001 (passed through).
    let close = a.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(close.context("a close frame")?.0, 1001);
    let t0 = Instant::now();
    let mut b = c.client(0, "acme").await?;
    let answered = t0.elapsed();
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "after the quota filled").await?;
    assert_eq!(c.fake.pod_creates(), 2);
    assert_eq!(c.fake.pvc_creates(), 1);
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "api"), 0.0, "{m}");
    let replaced = metric(&m, "codex_fleet_node_start_seconds_sum", &[]) - first;
    eprintln!(
        "measured: a replaced pod (same volume) to ready {replaced:.2} s (edge's node_start_seconds); \
         session to the answer of initialize {answered:?}"
    );
    Ok(())
}

/// Waits for Events about `pod` with these reasons (in any order, at least once each).
async fn events_with(c: &Cluster, pod: &str, reasons: &[&str]) -> Vec<(String, String, String)> {
    let all = || {
        let evs = c.fake.events_about(pod);
        reasons
            .iter()
            .all(|r| evs.iter().any(|(_, reason, _)| reason == r))
    };
    let _seen = wait_until(Duration::from_secs(10), all).await;
    c.fake.events_about(pod)
}

/// The first request of a session whose tenant's node cannot start, and the close that follows.
async fn refused_start(c: &Cluster, tenant: &str) -> anyhow::Result<(Value, Duration, u16)> {
    refused_start_after(c, tenant, Duration::ZERO).await
}

/// [`refused_start`] with the first request sent `delay` after the upgrade (the refusal may
/// come before it).
async fn refused_start_after(
    c: &Cluster,
    tenant: &str,
    delay: Duration,
) -> anyhow::Result<(Value, Duration, u16)> {
    let a = Client::connect(&c.edges[0].url(), &c.files.ca, Some(&c.files.token(tenant))).await?;
    tokio::time::sleep(delay).await;
    refused_start_on(a).await
}

/// The cause of a start refused `nodeStartFailed` (the answer must be one).
fn start_failed_cause(answer: &Value) -> anyhow::Result<&str> {
    assert_eq!(
        answer["error"]["data"]["reason"], "nodeStartFailed",
        "{answer}"
    );
    answer["error"]["data"]["cause"]
        .as_str()
        .with_context(|| format!("a cause in {answer}"))
}

/// [`refused_start`] of a session already connected.
async fn refused_start_on(mut a: Client) -> anyhow::Result<(Value, Duration, u16)> {
    let started = Instant::now();
    a.send(&json!({ "id": 1, "method": "initialize", "params": { "clientInfo": { "name": "t", "title": null, "version": "0" } } }))
        .await?;
    let answer = a.wait_for(|v| v["id"] == 1).await?;
    let took = started.elapsed();
    let close = a.recv_close_frame(Duration::from_secs(5)).await?;
    Ok((answer, took, close.context("a close frame")?.0))
}

/// An API error no retry can mend (403 from PodSecurity admission or a full
/// quota, 422 invalid) ends the session's wait at once with `-32001` scope `worker`, reason
/// `nodeStartFailed` and the cause, counted by reason; a transient one (429) is retried and the
/// session is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_cannot_succeed_ends_at_once_with_its_cause() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        start_timeout_secs: 30,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let digests: Vec<String> = ["acme", "beta"]
        .iter()
        .map(|t| router::auth::token_digest_hex(&c.files.token(t)))
        .collect();
    // The 422's first request is sent after the refusal: it still gets the answer with the
    // cause, not a bare close.
    for (refused, (code, reason, needle, delay)) in [
        (403, "forbidden", "PodSecurity", 0),
        (422, "invalid", "Invalid value", 300),
    ]
    .into_iter()
    .enumerate()
    {
        c.fake.refuse_pod_creates(code, usize::MAX);
        let (answer, took, close) =
            refused_start_after(&c, "acme", Duration::from_millis(delay)).await?;
        assert_eq!(answer["error"]["code"], -32001, "{answer}");
        assert_eq!(answer["error"]["data"]["scope"], "worker", "{answer}");
        let cause = start_failed_cause(&answer)?;
        assert!(
            cause.contains(needle) && cause.contains(&code.to_string()),
            "{answer}"
        );
        for d in &digests {
            assert!(
                !answer.to_string().contains(d.as_str()),
                "a digest in {answer}"
            );
        }
        assert_eq!(close, router::edge::NODE_START_FAILED_CODE);
        // `kubectl get events` says why too.
        let said = |e: &(String, String, String)| {
            e.0 == "Warning" && e.1 == "FailedCreate" && e.2.contains(needle)
        };
        let seen = wait_until(Duration::from_secs(10), || {
            c.fake
                .events_about("codex-fleet-node-acme")
                .iter()
                .any(said)
        })
        .await;
        assert!(seen, "{:?}", c.fake.events_about("codex-fleet-node-acme"));
        // Not the 30 s start timeout: at once (generous bound, not a timing claim).
        assert!(
            took < Duration::from_secs(15),
            "{code} answered after {took:?}"
        );
        eprintln!("measured: a {code} create answered nodeStartFailed after {took:?}");
        let m = c.metrics(0).await?;
        assert_eq!(start_failures(&m, reason), 1.0, "{m}");
        assert_eq!(start_failures(&m, "timeout"), 0.0, "{m}");
        // Every refused request is counted with the admission refusals, the held one (403)
        // and the one that came after the refusal (422) alike.
        assert_eq!(
            metric(
                &m,
                "codex_fleet_admission_rejections_total",
                &[("scope", "worker"), ("reason", "nodeStartFailed")]
            ),
            (refused + 1) as f64,
            "{m}"
        );
    }
    // A full storage quota refuses a tenant that has no volume yet: that too is said at once.
    c.fake.refuse_pod_creates(403, 0);
    c.fake.storage_quota_full(true);
    let (answer, took, _) = refused_start(&c, "beta").await?;
    assert!(
        start_failed_cause(&answer)?.contains("exceeded quota"),
        "{answer}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
    c.fake.storage_quota_full(false);
    // Transient: 429 three times, then the pod is created and the session served (the backend
    // retries with back-off and jitter; kube's own retry is off, so the deadline holds).
    let posts = pod_posts;
    let before = posts(&c);
    c.fake.refuse_pod_creates(429, 3);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "after the 429s").await?;
    assert_eq!(
        posts(&c) - before,
        4,
        "three refused creates and one that succeeded"
    );
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "api"), 3.0, "{m}");
    assert_eq!(start_failures(&m, "forbidden"), 2.0, "{m}");
    assert_eq!(c.fake.pod_creates(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_fails_before_ready_is_replaced_while_the_session_waits() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        crashing_pods: 1,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "second pod lucky").await?;
    assert_eq!(c.fake.pod_creates(), 2, "the failed pod was replaced once");
    // Events on the pod: created, then failed before ready and replaced, then created. The
    // waiting session (StartFailed) and the pod watch (Replaced) see the failure on their own,
    // so those two may come in either order; both lie between the two creations.
    let evs = events_with(
        &c,
        "codex-fleet-node-acme",
        &["Created", "StartFailed", "Replaced"],
    )
    .await;
    let reasons: Vec<&str> = evs.iter().map(|(_, r, _)| r.as_str()).collect();
    assert_eq!(reasons.len(), 4, "{evs:?}");
    assert_eq!((reasons[0], reasons[3]), ("Created", "Created"), "{evs:?}");
    let mut middle = [reasons[1], reasons[2]];
    middle.sort_unstable();
    assert_eq!(middle, ["Replaced", "StartFailed"], "{evs:?}");
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "failed"), 1.0, "{m}");
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "failed")]
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "codex_fleet_tenant_pods", &[("phase", "Failed")]),
        0.0,
        "{m}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_and_an_expired_watch_are_survived() -> anyhow::Result<()> {
    let c = Cluster::start(Options::default()).await?;
    assert!(c.synced(0).await);
    // The API server fails the next requests: the volume and pod creation are retried while
    // the session waits.
    c.fake.fail_next(3);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "through the errors").await?;
    let m = c.metrics(0).await?;
    assert!(start_failures(&m, "api") >= 1.0, "{m}");
    assert_eq!(c.fake.pod_creates(), 1);

    // The watch expires (410 Gone on resume) and the relist fails a few times: /readyz says
    // so, then the edge lists again and sees what happened meanwhile.
    let lists_before = list_requests(&c.fake);
    c.fake.fail_next(12);
    c.fake.expire_watches();
    assert!(c.fake.delete_pod("codex-fleet-node-acme"));
    let close = a.recv_close_frame(Duration::from_secs(10)).await?;
    assert_eq!(close.context("a close frame")?.0, 1001, "the node drains");
    // The edge stays Ready (it has listed once;
    // docs/decisions/0017-settings-travel-with-the-tenant.md) and says the API server is failing.
    let reported = wait_until_async(Duration::from_secs(20), || async {
        c.readyz(0)
            .await
            .is_ok_and(|(s, r)| s == 200 && r["edge"]["apiReachable"] == false)
    })
    .await;
    assert!(
        reported,
        "/readyz did not report the failing API server: {:?}",
        c.readyz(0).await
    );
    assert!(
        c.synced(0).await,
        "the edge did not recover: {:?}",
        c.readyz(0).await
    );
    let seen = wait_until_async(Duration::from_secs(20), || async {
        c.readyz(0)
            .await
            .is_ok_and(|(_, r)| r["edge"]["tenantPods"] == json!({}))
    })
    .await;
    assert!(
        seen,
        "the edge did not see the deletion: {:?}",
        c.readyz(0).await
    );
    assert!(
        list_requests(&c.fake) > lists_before,
        "no relist after 410 Gone"
    );
    let mut b = c.client(0, "acme").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "after the relist").await?;
    assert_eq!(c.fake.pod_creates(), 2);
    Ok(())
}

fn list_requests(fake: &FakeKube) -> usize {
    fake.requests()
        .iter()
        .filter(|r| {
            r.starts_with("GET /api/v1/namespaces/codex/pods?") && !r.contains("watch=true")
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_not_ready_in_time_answers_minus_32001_node_starting() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        start_timeout_secs: 3,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    c.fake.hold_pods(true);
    let mut a =
        Client::connect(&c.edges[0].url(), &c.files.ca, Some(&c.files.token("acme"))).await?;
    a.send(&json!({ "id": 1, "method": "initialize", "params": { "clientInfo": { "name": "t", "title": null, "version": "0" } } }))
        .await?;
    let started = Instant::now();
    let answer = a.wait_for(|v| v["id"] == 1).await?;
    assert_eq!(answer["error"]["code"], -32001, "{answer}");
    assert_eq!(answer["error"]["data"]["scope"], "worker", "{answer}");
    assert_eq!(
        answer["error"]["data"]["reason"], "nodeStarting",
        "{answer}"
    );
    assert!(
        answer["error"]["data"]["retryAfterMs"]
            .as_u64()
            .is_some_and(|ms| ms >= 1),
        "{answer}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "refused before the start timeout"
    );
    let close = a.recv_close_frame(Duration::from_secs(5)).await?;
    assert_eq!(
        close.context("a close frame")?.0,
        router::edge::NODE_STARTING_CODE
    );
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "timeout"), 1.0, "{m}");
    assert_eq!(
        metric(&m, "codex_fleet_tenant_pods_starting", &[]),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "codex_fleet_tenant_pods_unschedulable", &[]),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "codex_fleet_tenant_pods", &[("phase", "Pending")]),
        1.0,
        "{m}"
    );
    assert_eq!(
        c.fake.pod_creates(),
        1,
        "a waiting tenant's pod is created once"
    );
    // A start timeout is a start failure, never an unreachable node (CodexFleetNodeUnreachable
    // is critical and means a node that runs cannot be reached).
    let unreachable: f64 = m
        .lines()
        .filter(|l| l.starts_with("codex_fleet_link_errors_total{") && l.contains("unreachable"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        unreachable, 0.0,
        "a start timeout counted as unreachable: {m}"
    );
    let evs = events_with(&c, "codex-fleet-node-acme", &["Created", "StartTimeout"]).await;
    assert!(
        evs.iter()
            .any(|(ty, r, _)| ty == "Warning" && r == "StartTimeout"),
        "{evs:?}"
    );
    Ok(())
}

/// A pod Pending past the start timeout (here unschedulable until the cluster
/// has room) is deleted and recreated at the tenant's next session, counted as `stuck`; pods
/// carry the template hash label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_stuck_pending_past_the_start_timeout_is_replaced() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        start_timeout_secs: 3,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    c.fake.hold_pods(true);
    let (answer, _, _) = refused_start(&c, "acme").await?;
    assert_eq!(
        answer["error"]["data"]["reason"], "nodeStarting",
        "{answer}"
    );
    // The cluster has room again, but the held pod stays Pending (as a pod bound to nothing
    // does until the scheduler retries it, or forever with a fixed template): replaced.
    c.fake.hold_pods(false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "on the replacement").await?;
    assert_eq!(c.fake.pod_creates(), 2);
    let m = c.metrics(0).await?;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "stuck")]
        ),
        1.0,
        "{m}"
    );
    let pod = c.fake.pod("codex-fleet-node-acme").context("pod")?;
    let hash = pod["metadata"]["labels"]["codex-fleet.io/template-hash"]
        .as_str()
        .context("a template hash label")?;
    assert_eq!(hash.len(), 10, "{hash}");
    Ok(())
}

/// A pod whose image cannot be pulled (ImagePullBackOff) ends the waiting
/// session at once with `nodeStartFailed` and the kubelet's reason, and is deleted, so the next
/// session (after a fix) gets a new pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_cannot_pull_its_image_is_refused_with_the_cause_and_replaced(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        start_timeout_secs: 30,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    c.fake.fail_image_pulls(true);
    // Several sessions wait on the pod; each is refused with the cause, which is counted and
    // said (an Event) once.
    let mut waiting = waiting_sessions(&c, &[("acme", 4)]).await?;
    assert_eq!(pod_posts_settled(&c, 1).await, 1);
    c.fake.hold_pod_creates(false);
    let refused =
        futures_util::future::join_all(waiting.remove(0).into_iter().map(refused_start_on)).await;
    for r in refused {
        let (answer, took, close) = r?;
        let cause = start_failed_cause(&answer)?;
        assert!(cause.contains("ImagePullBackOff"), "{answer}");
        assert_eq!(close, router::edge::NODE_START_FAILED_CODE);
        assert!(took < Duration::from_secs(15), "answered after {took:?}");
        eprintln!("measured: ImagePullBackOff answered nodeStartFailed after {took:?}");
    }
    let gone = wait_until(Duration::from_secs(10), || c.fake.pod_names().is_empty()).await;
    assert!(gone, "the pod that cannot pull was not deleted");
    assert_eq!(c.fake.pod_creates(), 1, "the sessions shared one pod");
    tokio::time::sleep(Duration::from_secs(1)).await;
    said_once(&c, "ImagePullFailed");
    let m = c.metrics(0).await?;
    assert_eq!(start_failures(&m, "image"), 1.0, "{m}");
    // The image is fixed: the next session gets a new pod and is served.
    c.fake.fail_image_pulls(false);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "after the fix").await?;
    assert_eq!(c.fake.pod_creates(), 2);
    let m = c.metrics(0).await?;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "image")]
        ),
        1.0,
        "{m}"
    );
    Ok(())
}

/// docs/decisions/0017-settings-travel-with-the-tenant.md: with the API server down, an edge stays
/// Ready and serves every tenant whose pod its watch cache shows Ready; `/readyz` reports the API
/// server separately; only a new start waits (and is refused `nodeStarting`), until it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_outage_delays_new_starts_never_running_tenants() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        start_timeout_secs: 4,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "before the outage").await?;
    a.close().await;
    c.fake.outage(true);
    let reported = wait_until_async(Duration::from_secs(20), || async {
        c.readyz(0).await.is_ok_and(|(s, r)| {
            s == 200 && r["edge"]["apiReachable"] == false && r["edge"]["servingFromCache"] == true
        })
    })
    .await;
    assert!(reported, "during the outage: {:?}", c.readyz(0).await);
    // acme's pod is Ready in the cache: a new session is served, a turn runs.
    let mut b = c.client(0, "acme").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "during the outage").await?;
    // beta has no pod: its start waits for the API server, and is refused when it does not come.
    let (answer, _, _) = refused_start(&c, "beta").await?;
    assert_eq!(
        answer["error"]["data"]["reason"], "nodeStarting",
        "{answer}"
    );
    let (status, _) = c.readyz(0).await?;
    assert_eq!(status, 200, "the edge left the Service during the outage");
    // Back: the edge relists and beta starts.
    c.fake.outage(false);
    let back = wait_until_async(Duration::from_secs(30), || async {
        c.readyz(0).await.is_ok_and(|(s, r)| {
            s == 200 && r["edge"]["apiReachable"] == true && r["edge"]["servingFromCache"] == false
        })
    })
    .await;
    assert!(back, "after the outage: {:?}", c.readyz(0).await);
    let mut d = c.client(0, "beta").await?;
    let t = d.start_thread().await?;
    turn(&mut d, &t, "after the outage").await?;
    Ok(())
}

/// docs/decisions/0017-settings-travel-with-the-tenant.md: a tenant's edited entry reaches its
/// node. The edge reloads, the running pod is now of an older template (its hash label differs),
/// and with `max_pod_age_secs` it is replaced although busy: it is deleted (gracefully: its node
/// drains and its session closes 1001), the next session gets a new pod that serves the new
/// settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_of_an_older_template_is_replaced_past_max_pod_age() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        max_pod_age_secs: Some(3),
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "on the old template").await?;
    let pod = "codex-fleet-node-acme";
    let first = c.fake.pod(pod).context("pod")?;
    // Past max_pod_age_secs, but of the current template: kept.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        c.fake.pod(pod).context("pod")?["metadata"]["uid"],
        first["metadata"]["uid"]
    );
    // The tenant's entry changes (max_workers 1 → 2) and the edge reloads.
    let text = std::fs::read_to_string(&c.edge_config)?;
    assert_eq!(text.matches("max_workers = 1\n").count(), 1, "{text}");
    std::fs::write(
        &c.edge_config,
        text.replace("max_workers = 1\n", "max_workers = 2\n"),
    )?;
    c.edges[0].signal(nix::sys::signal::Signal::SIGHUP)?;
    let close = a.recv_close_frame(Duration::from_secs(20)).await?;
    assert_eq!(close.context("a close frame")?.0, 1001);
    let mut b = c.client(0, "acme").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "on the new template").await?;
    let second = c.fake.pod(pod).context("pod")?;
    assert_ne!(second["metadata"]["uid"], first["metadata"]["uid"]);
    let label = |p: &Value| p["metadata"]["labels"]["codex-fleet.io/template-hash"].clone();
    assert_ne!(label(&second), label(&first));
    let m = http_get(c.pod_admin(pod).context("podIP")?, "/metrics")
        .await?
        .1;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_limit",
            &[("tenant", "acme"), ("limit", "max_workers")]
        ),
        2.0,
        "{m}"
    );
    let m = c.metrics(0).await?;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "outdated")]
        ),
        1.0,
        "{m}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_session_never_reaches_another_tenants_pod() -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        start_timeout_secs: 4,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut b = c.client(0, "beta").await?;
    let b_thread = b.start_thread().await?;
    turn(&mut b, &b_thread, "beta's secret").await?;
    let beta_ip: Ipv4Addr = c.fake.pod("codex-fleet-node-beta").context("beta's pod")?["status"]
        ["podIP"]
        .as_str()
        .context("podIP")?
        .parse()?;
    // A confused (or hostile) cluster reports beta's address for acme's pod: the edge does not
    // dial it for acme; acme's session waits and is refused when the start timeout passes.
    c.fake.override_ip("codex-fleet-node-acme", beta_ip);
    let mut a =
        Client::connect(&c.edges[0].url(), &c.files.ca, Some(&c.files.token("acme"))).await?;
    a.send(&json!({ "id": "i", "method": "initialize", "params": { "clientInfo": { "name": "t", "title": null, "version": "0" } } }))
        .await?;
    a.send(&json!({ "id": 1, "method": "thread/read", "params": { "threadId": b_thread } }))
        .await?;
    for id in [json!("i"), json!(1)] {
        let answer = a.wait_for(|v| v["id"] == id).await?;
        assert_eq!(answer["error"]["code"], -32001, "{answer}");
        assert_eq!(
            answer["error"]["data"]["reason"], "nodeStarting",
            "{answer}"
        );
        assert!(!answer.to_string().contains("secret"), "{answer}");
    }
    let m = c.metrics(0).await?;
    assert!(
        !m.contains("node=\"codex-fleet-node-acme\""),
        "a link was opened for acme: {m}"
    );
    // And beta's node itself refuses a link for a tenant it does not serve, even from an edge
    // with the right certificate.
    let link = c.files.dir.path().join("link");
    let refused = link_to(SocketAddr::from((beta_ip, c.link_port)), &link, "acme").await?;
    assert_eq!(refused, Some(404), "beta's node took a link for acme");
    assert_eq!(
        link_to(SocketAddr::from((beta_ip, c.link_port)), &link, "beta").await?,
        None
    );
    // beta is untouched.
    turn(&mut b, &b_thread, "beta carries on").await?;
    Ok(())
}

/// Opens a link as an edge would (its client certificate, SNI the node name, the tenant
/// header); `None` when upgraded, else the HTTP status of the refusal.
async fn link_to(addr: SocketAddr, link: &Path, tenant: &str) -> anyhow::Result<Option<u16>> {
    router::tls::install_crypto_provider();
    let (config, _files) = router::tls::client_config_mutual(
        &link.join("ca.pem"),
        &link.join("edge.crt"),
        &link.join("edge.key"),
    )?;
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        format!("wss://{SERVER_NAME}:{}/", addr.port()),
    )?;
    req.headers_mut()
        .insert(router::edge::TENANT_HEADER, tenant.parse()?);
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    match tokio_tungstenite::client_async_tls_with_config(
        req,
        tcp,
        None,
        Some(tokio_tungstenite::Connector::Rustls(config)),
    )
    .await
    {
        Ok(_) => Ok(None),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Ok(Some(resp.status().as_u16())),
        Err(e) => Err(e.into()),
    }
}

/// The closing note's number: an edge's resident memory with 1,000 tenants known in its
/// configuration (and its watch synced against the fake API server), against one with one
/// tenant. `cargo test -p codex-fleet-testkit --test kubernetes -- --ignored --nocapture edge_memory`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check: run it by name"]
async fn edge_memory_with_1000_tenants_known() -> anyhow::Result<()> {
    let mut rss = Vec::new();
    for n in [1usize, 1000] {
        let tenants: Vec<&'static str> = (0..n)
            .map(|i| &*Box::leak(format!("t{i}").into_boxed_str()))
            .collect();
        let c = Cluster::start(Options {
            tenants,
            ..Options::default()
        })
        .await?;
        assert!(c.synced(0).await);
        // One session, so the edge has done its work once (TLS, a pod, a link).
        let _client = c.client(0, "t0").await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pid = c.edges[0].pid().context("edge pid")?;
        let kib = testkit::rss_kib(pid).context("rss")?;
        let series = c
            .metrics(0)
            .await?
            .lines()
            .filter(|l| !l.starts_with('#'))
            .count();
        eprintln!("measured: edge RSS with {n} tenants known: {kib} KiB ({series} metric series)");
        rss.push(kib);
    }
    assert!(rss[1] > 0 && rss[0] > 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_tenant_serves_exactly_that_tenant_with_its_entry_or_defaults() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("acme", 0, 3)
        .tenant_pool("beta", 0, 1)
        .prepare()
        .await?;
    let dir = files.dir.path();
    let pki = router::cli::dev::generate_link_pki(&[SERVER_NAME])?;
    router::fsutil::write_private(&dir.join("ca.pem.link"), &pki.ca_pem)?;
    let node = std::fs::read_to_string(&files.config)?
        + &format!(
            "\n[node]\nname = \"tenant-node\"\nedge_ca = {}\n",
            q(&dir.join("ca.pem.link"))
        );
    let config = dir.join("node.toml");
    std::fs::write(&config, node)?;
    let readyz_tenants = |p: &FleetProcess| {
        let admin = p.admin;
        async move {
            let (_, body) = http_get(admin, "/readyz").await?;
            let v: Value = serde_json::from_str(&body)?;
            let ids: Vec<String> = v["tenants"]
                .as_array()
                .context("tenants")?
                .iter()
                .filter_map(|t| t["id"].as_str().map(str::to_owned))
                .collect();
            anyhow::Ok(ids)
        }
    };
    // An entry of that id: only it, with its limits.
    let p = FleetProcess::spawn_role(&fleet_bin(), "node", &config, |c| {
        c.args(["--tenant", "acme"]);
    })
    .await?;
    assert_eq!(readyz_tenants(&p).await?, vec!["acme".to_owned()]);
    let m = http_get(p.admin, "/metrics").await?.1;
    assert_eq!(
        metric(
            &m,
            "codex_fleet_tenant_limit",
            &[("tenant", "acme"), ("limit", "max_workers")]
        ),
        3.0,
        "{m}"
    );
    // A reload (SIGHUP) keeps serving exactly that tenant.
    p.signal(nix::sys::signal::Signal::SIGHUP)?;
    let reloaded = wait_until_async(Duration::from_secs(10), || async {
        http_get(p.admin, "/metrics").await.is_ok_and(|(_, m)| {
            metric(&m, "codex_fleet_config_reloads_total", &[("result", "ok")]) == 1.0
        })
    })
    .await;
    assert!(reloaded, "no reload: {}", p.stderr());
    assert_eq!(readyz_tenants(&p).await?, vec!["acme".to_owned()]);
    drop(p);
    // No entry: that tenant, default limits.
    let p = FleetProcess::spawn_role(&fleet_bin(), "node", &config, |c| {
        c.args(["--tenant", "gamma"]);
    })
    .await?;
    assert_eq!(readyz_tenants(&p).await?, vec!["gamma".to_owned()]);
    drop(p);
    // Not a tenant id: refused as a configuration error.
    let out = std::process::Command::new(fleet_bin())
        .args(["node", "--config"])
        .arg(&config)
        .args(["--tenant", "../etc"])
        .output()?;
    assert_eq!(
        out.status.code(),
        Some(78),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
