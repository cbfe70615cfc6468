//! docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md: the kubernetes backend against a fake
//! API server that deletes and loses pods as a cluster does ([`testkit::fake_kube`]): a delete is
//! graceful (`deletionTimestamp`, the pod's grace period, SIGTERM to the node, SIGKILL when the
//! grace period is over, the pod gone when its process is), a force delete is at once, a
//! Terminating pod keeps its name, and a lost machine's pod stays Terminating until force-deleted.
//! Each test checks what docs/kubernetes.md promises for it, through real
//! edges, real nodes and a real wss client.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use testkit::kube_cluster::{Cluster, Options};
use testkit::{agent_text, reply_text, wait_until, wait_until_async, Client};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const POD: &str = "codex-fleet-node-acme";

async fn turn(c: &mut Client, thread: &str, prompt: &str) -> anyhow::Result<()> {
    c.start_turn(thread, prompt).await?;
    let msgs = c.until_turn_completed(thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(())
}

/// POSTs `body` to the fake API server; returns the status and the answer.
async fn post(addr: SocketAddr, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    let body = body.to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("a status line")?;
    let answer = text
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b.trim()).ok())
        .unwrap_or(Value::Null);
    Ok((code, answer))
}

fn uid(c: &Cluster) -> Option<Value> {
    c.fake.pod(POD).map(|p| p["metadata"]["uid"].clone())
}

/// A cluster (its pods' grace period `grace`, unset: the API server's), a session of acme's with
/// a thread that has run a turn, and acme's pod's uid.
async fn acme_with_a_thread(
    grace: Option<u64>,
) -> anyhow::Result<(Cluster, Client, String, Value)> {
    let c = Cluster::start(Options {
        termination_grace_secs: grace,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "before the delete").await?;
    let first = uid(&c).context("the pod")?;
    Ok((c, a, thread, first))
}

/// docs/kubernetes.md ("Culling"): `kubectl delete pod` (and an API eviction, a drain) is
/// graceful: the pod is Terminating (its name still taken: a create gets 409), its node gets
/// SIGTERM and drains — the running turn finishes, then the session closes 1001 "codex-fleet is
/// shutting down", passed through by the edge — and the pod goes once the node has exited. A
/// session that comes meanwhile waits and is served by the next pod, on the same volume. A
/// force delete (`--grace-period=0 --force`) kills the node at once: 1012.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_finishes_its_turn_closes_1001_and_its_next_session_waits_for_it_to_go(
) -> anyhow::Result<()> {
    let (c, mut a, thread, first) = acme_with_a_thread(Some(20)).await?;

    let prompt = "SLOW3 a turn across the delete";
    a.start_turn(&thread, prompt).await?;
    a.notification("turn/started").await?;
    assert!(c.fake.delete_pod(POD));
    let pod = c
        .fake
        .pod(POD)
        .context("a Terminating pod is still there")?;
    assert!(
        pod["metadata"]["deletionTimestamp"].is_string(),
        "{:#}",
        pod["metadata"]
    );
    assert_eq!(pod["metadata"]["deletionGracePeriodSeconds"], 20);
    assert!(c.fake.terminated(POD), "no SIGTERM reached the node");
    // Its name is taken while it terminates.
    let template = c.fake.pod(POD).context("pod")?;
    let mut again = json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": POD,
        "labels": template["metadata"]["labels"] }, "spec": template["spec"] });
    again["metadata"]["namespace"] = json!("codex");
    let (code, answer) = post(c.fake.addr, "/api/v1/namespaces/codex/pods", &again).await?;
    assert_eq!(
        (code, answer["reason"].clone()),
        (409, json!("AlreadyExists"))
    );

    // The edge has seen the delete once it sees the draining node not ready (the watch
    // reports the two in that order); a session that comes now waits for the next pod.
    let seen = wait_until_async(Duration::from_secs(10), || async {
        c.readyz(0)
            .await
            .is_ok_and(|(_, r)| r["edge"]["tenantPods"]["acme"]["ready"] == false)
    })
    .await;
    assert!(seen, "{:?}", c.readyz(0).await);
    let (done, next) = tokio::join!(
        async {
            let msgs = a.until_turn_completed(&thread).await?;
            let close = a.recv_close_frame(Duration::from_secs(20)).await?;
            anyhow::Ok((msgs, close))
        },
        c.client(0, "acme")
    );
    let (msgs, close) = done?;
    assert_eq!(
        agent_text(&msgs),
        Some(reply_text(prompt)),
        "the running turn did not finish: {msgs:#?}"
    );
    let (code, reason) = close.context("a close frame")?;
    assert_eq!(
        (code, reason.as_str()),
        (1001, "codex-fleet is shutting down")
    );
    let mut b = next?;
    let second = uid(&c).context("the next pod")?;
    assert_ne!(second, first);
    assert_eq!(c.fake.pod_creates(), 2);
    assert_eq!(c.fake.pvc_creates(), 1);
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "after the delete").await?;

    // A force delete: gone at once, the node killed, the session closed 1012.
    assert!(c.fake.delete_pod_with_grace(POD, 0));
    assert!(c.fake.pod(POD).is_none());
    let (code, _) = b
        .recv_close_frame(Duration::from_secs(10))
        .await?
        .context("a close frame")?;
    assert_eq!(code, router::edge::NODE_LOST_CODE);
    let mut d = c.client(0, "acme").await?;
    d.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut d, &thread, "after the force delete").await?;
    assert_eq!(c.fake.pod_creates(), 3);
    Ok(())
}

/// docs/kubernetes.md ("When a pod goes"): a force delete kills the node at once, and the
/// watch that tells the edge can come after a new session has dialled the dead pod (here the
/// watch is down across the delete). That session is not refused 1012: once the watch says the
/// pod went, the edge looks again and the session is served by the tenant's next pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_dials_a_pod_just_force_deleted_waits_for_the_next_pod() -> anyhow::Result<()>
{
    let (c, mut a, thread, first) = acme_with_a_thread(None).await?;

    watch_down(&c).await;
    assert!(c.fake.delete_pod_with_grace(POD, 0));
    let (code, _) = a
        .recv_close_frame(Duration::from_secs(10))
        .await?
        .context("a close frame")?;
    assert_eq!(code, router::edge::NODE_LOST_CODE);
    // The edge still sees the pod ready: the next session dials it and finds nobody.
    next_session_outlives_the_going_pod(&c, &thread, &first, "unreachable").await
}

/// Holds the fake's watches and ends the open ones: the edge hears of no change until they are
/// released.
async fn watch_down(c: &Cluster) {
    c.fake.hold_watches(true);
    c.fake.end_watches();
    assert!(wait_until(Duration::from_secs(10), || c.fake.open_watches() == 0).await);
}

/// With the watch down and acme's pod (`first`) going, a new session dials it while the edge
/// still sees it ready; the watch comes back a second later. The session is served by the next
/// pod (it resumes `thread` and runs a turn there), having dialled the going one once (counted
/// as `link_errors_total{reason}`).
async fn next_session_outlives_the_going_pod(
    c: &Cluster,
    thread: &str,
    first: &Value,
    reason: &str,
) -> anyhow::Result<()> {
    let (next, ()) = tokio::join!(c.client(0, "acme"), async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        c.fake.hold_watches(false);
    });
    let mut b = next?;
    assert_ne!(&uid(c).context("the next pod")?, first);
    assert_eq!(c.fake.pod_creates(), 2);
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, thread, "on the next pod").await?;
    let m = c.metrics(0).await?;
    assert_eq!(
        testkit::metric_in(&m, "codex_fleet_link_errors_total", &[("reason", reason)]),
        1.0,
        "the going pod was dialled once: {m}"
    );
    Ok(())
}

/// docs/kubernetes.md ("When a pod goes"): a node draining (its pod deleted, its turn still
/// running) answers new links 503 "shutting down", and the watch that tells the edge can come
/// after a new session has dialled it (here the watch is down across the delete). That session
/// is not refused 1012: once the watch says the pod is going, the edge looks again and the
/// session is served by the tenant's next pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_dials_a_draining_pod_waits_for_the_next_pod() -> anyhow::Result<()> {
    let (c, mut a, thread, first) = acme_with_a_thread(Some(20)).await?;

    watch_down(&c).await;
    // The node drains while its turn runs (SLOW4: four seconds more).
    a.start_turn(&thread, "SLOW4 a turn across the delete")
        .await?;
    a.notification("turn/started").await?;
    assert!(c.fake.delete_pod(POD));
    assert!(c.fake.terminated(POD), "no SIGTERM reached the node");
    // The edge still sees the pod ready: the next session dials it and is told it drains.
    next_session_outlives_the_going_pod(&c, &thread, &first, "refused").await
}

/// docs/kubernetes.md ("Culling"): a node that has not drained when its grace period is over
/// is SIGKILLed by the kubelet: its sessions close 1012, and the pod goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_still_draining_at_the_end_of_its_grace_period_is_killed_and_closes_1012(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        termination_grace_secs: Some(2),
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "SLOW60 longer than the grace period")
        .await?;
    a.notification("turn/started").await?;
    assert!(c.fake.delete_pod(POD));
    assert!(c.fake.pod(POD).is_some(), "gone before its grace period");
    let (code, reason) = a
        .recv_close_frame(Duration::from_secs(20))
        .await?
        .context("a close frame")?;
    assert_eq!(code, router::edge::NODE_LOST_CODE, "{reason}");
    assert!(
        wait_until(Duration::from_secs(10), || c.fake.pod(POD).is_none()).await,
        "the killed pod was not removed"
    );
    let readyz_clear = wait_until_async(Duration::from_secs(10), || async {
        c.readyz(0)
            .await
            .is_ok_and(|(_, r)| r["edge"]["tenantPods"] == json!({}))
    })
    .await;
    assert!(readyz_clear, "{:?}", c.readyz(0).await);
    Ok(())
}

/// docs/kubernetes.md ("When a pod goes"): a machine lost (here its node frozen, SIGSTOP: its
/// links open and silent, as to a machine that is gone) closes the tenant's sessions 1012 — the
/// edge hears nothing from the link and gives up on it — and once Kubernetes deletes the pod
/// (the taint manager) it stays Terminating for good, since no kubelet confirms it: the edge
/// force-deletes it past its grace period and the tenant's next session gets a new pod on the
/// same volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_machines_sessions_close_1012_and_its_pod_stuck_terminating_is_replaced(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        termination_grace_secs: Some(1),
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "before the machine is lost").await?;
    let first = uid(&c).context("the pod")?;

    let lost = tokio::time::Instant::now();
    assert!(c.fake.lose_machine(POD));
    let unready = wait_until_async(Duration::from_secs(10), || async {
        c.readyz(0)
            .await
            .is_ok_and(|(_, r)| r["edge"]["tenantPods"]["acme"]["ready"] == false)
    })
    .await;
    assert!(unready, "{:?}", c.readyz(0).await);
    // The taint manager deletes the pod; no kubelet ever confirms it. The open session and a
    // new one, together.
    assert!(c.fake.delete_pod(POD));
    let pod = c.fake.pod(POD).context("Terminating")?;
    assert!(pod["metadata"]["deletionTimestamp"].is_string());
    let deleted = tokio::time::Instant::now();
    let (closed, next) = tokio::join!(
        async {
            let closed = a.recv_close_frame(Duration::from_secs(40)).await;
            (closed, lost.elapsed())
        },
        async { (c.client(0, "acme").await, deleted.elapsed()) }
    );
    let ((closed, told), (next, served)) = (closed, next);
    eprintln!(
        "measured: machine lost to its session closed 1012 {told:?}; lost pod deleted (grace 1 s) \
         to a new session initialized on a new pod {served:?}"
    );
    let (code, reason) = closed?.context("a close frame")?;
    assert_eq!(code, router::edge::NODE_LOST_CODE, "{reason}");
    let mut b = next?;
    let second = uid(&c).context("a new pod")?;
    assert_ne!(second, first);
    assert_eq!(c.fake.force_deletes(), 1, "{:?}", c.fake.requests());
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "on a new machine").await?;
    let m = c.metrics(0).await?;
    assert_eq!(
        testkit::metric_in(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "lost")]
        ),
        1.0,
        "{m}"
    );
    Ok(())
}

fn count(c: &Cluster, watch: bool) -> usize {
    c.fake
        .requests()
        .iter()
        .filter(|r| {
            // The readiness probe's list (`limit=1`) is no relist.
            r.starts_with("GET /api/v1/namespaces/codex/pods?")
                && r.contains("watch=true") == watch
                && !r.contains("limit=1")
        })
        .count()
}

/// A real API server ends every watch (the client's `timeoutSeconds`, 290 s from kube, and its
/// own request timeout) with a BOOKMARK of where it had got to. The edge resumes each time from
/// the last resourceVersion it was told (so a compacted history behind it does not cost it a
/// relist), and a change made while no watch is open reaches it with the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_resumes_its_watch_from_bookmarks_without_relisting_and_misses_nothing_between(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options::default()).await?;
    assert!(c.synced(0).await);
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "before the watches end").await?;
    let lists = count(&c, false);
    let watch_requests = c.fake.requests();
    let first_watch = watch_requests
        .iter()
        .find(|r| r.contains("watch=true"))
        .context("a watch")?;
    assert!(
        first_watch.contains("allowWatchBookmarks=true") && first_watch.contains("timeoutSeconds="),
        "{first_watch}"
    );
    c.fake.cap_watches(Duration::from_secs(1));
    for round in 0..3 {
        // Other pods in the namespace move the resourceVersion past the edge's last pod
        // event; only a bookmark tells the edge, and then the history behind it goes. (Their
        // claim does not exist: they stay Pending, nothing more happens to them.)
        let other = json!({ "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": format!("unrelated-{round}"), "labels": { "app": "other" } },
            "spec": { "containers": [{ "name": "node", "image": "x" }],
                "volumes": [{ "name": "home", "persistentVolumeClaim": { "claimName": "none" } }] } });
        let (code, _) = post(c.fake.addr, "/api/v1/namespaces/codex/pods", &other).await?;
        assert_eq!(code, 201);
        let rv = c.fake.resource_version();
        assert!(
            wait_until(Duration::from_secs(10), || c.fake.last_bookmark() >= rv).await,
            "no bookmark past {rv}"
        );
        c.fake.compact();
    }
    // Two more watch ends after the last compaction, so the edge has resumed across it.
    let watches = count(&c, true);
    assert!(wait_until(Duration::from_secs(10), || count(&c, true) >= watches + 2).await);
    // A change while no watch is open.
    c.fake.hold_watches(true);
    assert!(wait_until(Duration::from_secs(10), || c.fake.open_watches() == 0).await);
    assert!(c.fake.delete_pod_with_grace(POD, 0));
    c.fake.hold_watches(false);
    let seen = wait_until_async(Duration::from_secs(10), || async {
        c.readyz(0)
            .await
            .is_ok_and(|(_, r)| r["edge"]["tenantPods"] == json!({}))
    })
    .await;
    assert!(seen, "the edge missed the delete: {:?}", c.readyz(0).await);
    assert_eq!(
        count(&c, false),
        lists,
        "the edge listed again: {:#?}",
        c.fake.requests()
    );
    assert!(count(&c, true) >= watches + 3);
    let mut b = c.client(0, "acme").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "after the watches ended").await?;
    Ok(())
}

/// The API server keeps namespaces apart, and so must the edge: a pod in another namespace with
/// the tenant pod's very name and labels (a hostile or mistaken one, Running and Ready, a real
/// node of that tenant) is never routed to; the edge creates and serves the tenant's own pod in
/// its namespace, and never calls the API server outside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_of_the_same_name_in_another_namespace_is_never_routed_to() -> anyhow::Result<()> {
    let c = Cluster::start(Options::default()).await?;
    assert!(c.synced(0).await);
    let out = std::process::Command::new(testkit::fleet_bin())
        .args(["render-tenant-pod", "--config"])
        .arg(&c.edge_config)
        .args(["--tenant", "acme"])
        .output()?;
    assert!(out.status.success());
    let list: Value = serde_json::from_slice(&out.stdout)?;
    let mut hostile = list["items"][1].clone();
    assert_eq!(hostile["metadata"]["name"], POD);
    hostile["metadata"]["namespace"] = json!("evil");
    for v in hostile["spec"]["volumes"]
        .as_array_mut()
        .context("volumes")?
    {
        if v["name"] == "home" {
            v["persistentVolumeClaim"]["claimName"] = json!("evil-home");
        }
    }
    let claim = json!({ "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": { "name": "evil-home" }, "spec": {} });
    let (code, _) = post(
        c.fake.addr,
        "/api/v1/namespaces/evil/persistentvolumeclaims",
        &claim,
    )
    .await?;
    assert_eq!(code, 201);
    let (code, _) = post(c.fake.addr, "/api/v1/namespaces/evil/pods", &hostile).await?;
    assert_eq!(code, 201);
    let ready = wait_until(Duration::from_secs(20), || {
        c.fake.pod_in("evil", POD).is_some_and(|p| {
            p["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
    })
    .await;
    assert!(ready, "the hostile pod never got ready");
    let hostile_ip = c.fake.pod_in("evil", POD).context("pod")?["status"]["podIP"]
        .as_str()
        .context("podIP")?
        .parse::<std::net::Ipv4Addr>()?;

    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "in my own namespace").await?;
    let own = c
        .fake
        .pod(POD)
        .context("the edge created no pod of its own")?;
    assert_eq!(own["metadata"]["namespace"], "codex");
    assert_ne!(own["status"]["podIP"], json!(hostile_ip.to_string()));
    assert_eq!(
        c.fake.pod_creates(),
        2,
        "the hostile pod and the tenant's own"
    );
    let accepted = |m: &str| testkit::metric_in(m, "codex_fleet_connections_accepted_total", &[]);
    let hostile_m = testkit::http_get(SocketAddr::from((hostile_ip, c.admin_port)), "/metrics")
        .await?
        .1;
    assert_eq!(
        accepted(&hostile_m),
        0.0,
        "the edge linked to the hostile pod"
    );
    let own_m = testkit::http_get(c.pod_admin(POD).context("podIP")?, "/metrics")
        .await?
        .1;
    assert!(accepted(&own_m) >= 1.0, "{own_m}");
    let outside: Vec<String> = c
        .fake
        .requests()
        .into_iter()
        .filter(|r| {
            !r.contains("/namespaces/codex/") && !r.starts_with("POST /api/v1/namespaces/evil/")
        })
        .collect();
    assert!(
        outside.is_empty(),
        "the edge called outside its namespace: {outside:?}"
    );
    Ok(())
}

fn unschedulable_message(c: &Cluster, pod: &str) -> Option<String> {
    let p = c.fake.pod(pod)?;
    let cond = p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodScheduled")?
        .clone();
    (p["status"]["phase"] == "Pending"
        && cond["status"] == "False"
        && cond["reason"] == "Unschedulable")
        .then(|| cond["message"].as_str().unwrap_or("").to_owned())
}

/// A pod whose volume claim is missing or not yet bound is not scheduled (Pending, PodScheduled
/// False, Unschedulable, the message naming the claim). The tenant's session waits for it and is
/// served once the claim binds; if it never binds within `start_timeout_secs`, the session's
/// requests are answered `-32001` scope `worker`, reason `nodeStarting`, and it is closed 1013,
/// as docs/kubernetes.md's "Culling" says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_waits_for_its_claim_to_bind_and_a_claim_that_never_binds_times_the_start_out(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        start_timeout_secs: 8,
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    // A pod whose claim does not exist is not scheduled either.
    let orphan = json!({ "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "orphan", "labels": { "app": "other" } },
        "spec": { "containers": [{ "name": "node", "image": "x" }],
            "volumes": [{ "name": "home", "persistentVolumeClaim": { "claimName": "nowhere" } }] } });
    let (code, _) = post(c.fake.addr, "/api/v1/namespaces/codex/pods", &orphan).await?;
    assert_eq!(code, 201);
    let message = unschedulable_message(&c, "orphan").context("orphan scheduled")?;
    assert!(
        message.contains("persistentvolumeclaim \"nowhere\" not found"),
        "{message}"
    );

    c.fake.claims_pending(true);
    let acme = async {
        let mut a = c.client(0, "acme").await?;
        let served = tokio::time::Instant::now();
        let thread = a.start_thread().await?;
        turn(&mut a, &thread, "once my volume is bound").await?;
        anyhow::Ok(served)
    };
    let binder = async {
        let pending = wait_until(Duration::from_secs(8), || {
            unschedulable_message(&c, POD).is_some_and(|m| m.contains("codex-fleet-home-acme"))
        })
        .await;
        assert!(pending, "{:?}", c.fake.pod(POD));
        let bound = tokio::time::Instant::now();
        assert!(c.fake.bind_claim("codex-fleet-home-acme"));
        bound
    };
    let beta = async {
        let mut b =
            Client::connect(&c.edges[0].url(), &c.files.ca, Some(&c.files.token("beta"))).await?;
        b.send(
            &json!({ "id": 1, "method": "initialize", "params": { "clientInfo": {
            "name": "t", "title": null, "version": "0" } } }),
        )
        .await?;
        let answer = b.wait_for(|v| v["id"] == 1).await?;
        let close = b.recv_close_frame(Duration::from_secs(5)).await?;
        anyhow::Ok((answer, close))
    };
    let (served, bound, refused) = tokio::join!(acme, binder, beta);
    assert!(served? > bound, "served before its claim was bound");
    let (answer, close) = refused?;
    assert_eq!(answer["error"]["code"], -32001, "{answer}");
    assert_eq!(answer["error"]["data"]["scope"], "worker", "{answer}");
    assert_eq!(
        answer["error"]["data"]["reason"], "nodeStarting",
        "{answer}"
    );
    assert_eq!(
        close.context("a close frame")?.0,
        router::edge::NODE_STARTING_CODE
    );
    let message = unschedulable_message(&c, "codex-fleet-node-beta").context("beta's pod")?;
    assert!(message.contains("codex-fleet-home-beta"), "{message}");
    Ok(())
}
