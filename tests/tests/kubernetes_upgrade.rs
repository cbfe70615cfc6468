//! docs/decisions/0017-settings-travel-with-the-tenant.md: a tenant pod made from an older template
//! (its `codex-fleet.io/template-hash` is not the edge's current one) is replaced at its next idle
//! moment (no session, no running turn, no loaded thread on its node), never while it serves; the
//! next session lands on a pod of the current template. Against the fake API server, with real
//! nodes and a real client.

use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use testkit::kube_cluster::{Cluster, Options};
use testkit::{agent_text, http_get, metric_in, reply_text, wait_until, Client};
use tokio::time::Instant;

async fn turn(c: &mut Client, thread: &str, prompt: &str) -> anyhow::Result<()> {
    c.start_turn(thread, prompt).await?;
    let msgs = c.until_turn_completed(thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(prompt)));
    Ok(())
}

fn uid(p: &Value) -> Value {
    p["metadata"]["uid"].clone()
}

fn hash(p: &Value) -> Value {
    p["metadata"]["labels"]["codex-fleet.io/template-hash"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_of_an_older_template_is_kept_while_it_serves_and_replaced_when_idle(
) -> anyhow::Result<()> {
    let c = Cluster::start(Options {
        tenants: vec!["acme", "beta"],
        ..Options::default()
    })
    .await?;
    assert!(c.synced(0).await);
    let (acme_pod, beta_pod) = ("codex-fleet-node-acme", "codex-fleet-node-beta");
    // beta: a pod of the current template, left without a session.
    c.client(0, "beta").await?.close().await;
    let beta_first = c.fake.pod(beta_pod).context("beta's pod")?;
    let mut a = c.client(0, "acme").await?;
    let thread = a.start_thread().await?;
    turn(&mut a, &thread, "on the old template").await?;
    let first = c.fake.pod(acme_pod).context("acme's pod")?;

    // acme's entry changes (max_workers 1 → 2) and the edge reloads: acme's pod is now of an
    // older template; beta's is not.
    let text = std::fs::read_to_string(&c.edge_config)?;
    let acme_at = text.find("id = \"acme\"").context("acme's entry")?;
    let beta_at = text.find("id = \"beta\"").context("beta's entry")?;
    let (start, end) = if acme_at < beta_at {
        (acme_at, beta_at)
    } else {
        (acme_at, text.len())
    };
    let edited = format!(
        "{}{}{}",
        &text[..start],
        text[start..end].replacen("max_workers = 1\n", "max_workers = 2\n", 1),
        &text[end..]
    );
    assert_ne!(edited, text, "acme's max_workers not found: {text}");
    std::fs::write(&c.edge_config, edited)?;
    let reloads = |m: &str| metric_in(m, "codex_fleet_config_reloads_total", &[("result", "ok")]);
    let before = reloads(&c.metrics(0).await?);
    c.edges[0].signal(nix::sys::signal::Signal::SIGHUP)?;
    assert!(
        testkit::wait_until_async(Duration::from_secs(10), || async {
            c.metrics(0).await.is_ok_and(|m| reloads(&m) > before)
        })
        .await,
        "the edge did not reload"
    );

    // While its session is open (turns run, threads loaded), the old pod is kept.
    for i in 0..3 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        turn(&mut a, &thread, &format!("still on the old template {i}")).await?;
        let kept = c.fake.pod(acme_pod).is_some_and(|p| uid(&p) == uid(&first));
        assert!(kept, "replaced while it serves");
    }
    // A session with no thread keeps it too (sessions count, not only threads): the thread
    // closes with `a` and unloads within a second, the pod stays while `quiet` is open.
    let quiet = c.client(0, "acme").await?;
    a.close().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let kept = c.fake.pod(acme_pod).is_some_and(|p| uid(&p) == uid(&first));
    assert!(kept, "replaced while a session is open");
    quiet.close().await;
    let closed = Instant::now();

    // Idle now: replaced.
    let replaced = wait_until(Duration::from_secs(30), || {
        c.fake.pod(acme_pod).is_none_or(|p| uid(&p) != uid(&first))
    })
    .await;
    assert!(replaced, "the idle pod of an older template was kept");
    let replaced_after = closed.elapsed();
    // Events are written in the background: wait for it.
    let written = |events: &[(String, String, String)]| {
        events.iter().any(|(ty, reason, note)| {
            ty == "Normal" && reason == "Replaced" && note.contains("older template")
        })
    };
    wait_until(Duration::from_secs(5), || {
        written(&c.fake.events_about(acme_pod))
    })
    .await;
    let events = c.fake.events_about(acme_pod);
    assert!(written(&events), "{events:?}");
    let m = c.metrics(0).await?;
    assert_eq!(
        metric_in(&m, "codex_fleet_tenant_pod_upgrades_total", &[]),
        1.0,
        "{m}"
    );

    // The next session lands on a pod of the current template, which serves the new entry, and
    // resumes the thread from the volume.
    let starts = |m: &str| {
        (
            metric_in(m, "codex_fleet_node_start_seconds_sum", &[]),
            metric_in(m, "codex_fleet_node_start_seconds_count", &[]),
        )
    };
    let (sum0, n0) = starts(&m);
    let t0 = Instant::now();
    let mut b = c.client(0, "acme").await?;
    let ready_after = t0.elapsed();
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    turn(&mut b, &thread, "on the new template").await?;
    let second = c.fake.pod(acme_pod).context("acme's new pod")?;
    assert_ne!(uid(&second), uid(&first));
    assert_ne!(hash(&second), hash(&first));
    let node = http_get(c.pod_admin(acme_pod).context("podIP")?, "/metrics")
        .await?
        .1;
    assert_eq!(
        metric_in(
            &node,
            "codex_fleet_tenant_limit",
            &[("tenant", "acme"), ("limit", "max_workers")]
        ),
        2.0,
        "{node}"
    );
    let m = c.metrics(0).await?;
    assert_eq!(
        metric_in(
            &m,
            "codex_fleet_tenant_pod_recreations_total",
            &[("reason", "upgraded")]
        ),
        1.0,
        "{m}"
    );
    let (sum1, n1) = starts(&m);
    assert_eq!(n1, n0 + 1.0, "{m}");
    // beta's pod, idle but of the current template, is left to idle out.
    let beta_now = c.fake.pod(beta_pod).context("beta's pod")?;
    assert_eq!(uid(&beta_now), uid(&beta_first));
    eprintln!(
        "measured: an idle pod of an older template replaced {replaced_after:?} after its last \
         session closed; the replacement pod created to ready in {:.3} s (edge's \
         node_start_seconds), the next session initialized {ready_after:?} after it connected",
        sum1 - sum0
    );
    Ok(())
}
