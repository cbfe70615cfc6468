//! Pools and routing by threadId: placement, shared threads, tenant isolation, idle unloading,
//! reconnects and reconciliation, all against real workers.

use std::collections::HashSet;
use std::time::Duration;

use e2e::{agent_text, ready_workers, reply_text, wait_until, FleetBuilder};
use futures_util::future::try_join_all;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_spread_across_workers_and_answers_reach_their_session() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .tenant_pool("beta", 2, 2)
        .start()
        .await?;
    for t in ["acme", "beta"] {
        assert!(
            wait_until(Duration::from_secs(30), || ready_workers(&fleet, t) == 2).await,
            "{t}: two workers should start"
        );
    }
    let runs = (0..10).map(|i| {
        let fleet = &fleet;
        async move {
            let tenant = if i % 2 == 0 { "acme" } else { "beta" };
            let mut c = fleet.client(tenant).await?;
            let thread = c.start_thread().await?;
            let prompt = format!("session {i} of {tenant}");
            c.start_turn(&thread, &prompt).await?;
            let msgs = c.until_turn_completed(&thread).await?;
            anyhow::ensure!(
                agent_text(&msgs) == Some(reply_text(&prompt)),
                "session {i} got {:?}",
                agent_text(&msgs)
            );
            // Nothing of another session's turn reached this one (lifecycle broadcasts about the
            // tenant's threads do reach every session of the tenant, as app-server sends them).
            for m in &msgs {
                let method = m["method"].as_str().unwrap_or_default();
                let scoped = method.starts_with("turn/") || method.starts_with("item/");
                if let Some(t) = m["params"]["threadId"].as_str().filter(|_| scoped) {
                    anyhow::ensure!(t == thread, "session {i} saw thread {t}");
                }
            }
            Ok::<_, anyhow::Error>((tenant, thread, c))
        }
    });
    let done = try_join_all(runs).await?;
    for tenant in ["acme", "beta"] {
        let t = fleet.tenant(tenant);
        let owners: HashSet<String> = done
            .iter()
            .filter(|(name, _, _)| *name == tenant)
            .filter_map(|(_, thread, _)| t.table.owner(thread).map(|w| w.to_string()))
            .collect();
        assert_eq!(
            owners.len(),
            2,
            "{tenant}'s threads should use both workers: {owners:?}"
        );
    }
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_share_a_thread_and_the_first_answer_wins() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await
    );
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "first, so the thread is on disk")
        .await?;
    a.until_turn_completed(&thread).await?;
    let mut b = fleet.client("acme").await?;
    let owner = fleet
        .tenant("acme")
        .table
        .owner(&thread)
        .expect("owner known");
    // B's home leg went to the other worker (placement by load), so B reaches the thread
    // through a leg opened on demand.
    let homes: Vec<usize> = fleet
        .tenant("acme")
        .pool
        .workers()
        .iter()
        .map(|w| w.handles)
        .collect();
    assert!(
        homes.iter().all(|h| *h >= 1),
        "both workers hold a leg: {homes:?}"
    );
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    assert_eq!(
        fleet.tenant("acme").table.owner(&thread),
        Some(owner),
        "the thread did not move"
    );

    // C never touches the thread and has no leg to its worker: it sees the thread's
    // broadcasts only through the control-leg relay. Every session must see each once.
    let mut c = fleet.client("acme").await?;
    for s in [&mut a, &mut b, &mut c] {
        s.request("thread/loaded/list", json!({})).await?;
        s.backlog.clear();
    }
    a.start_turn(&thread, "shared RUNSHELL").await?;
    let ask_a = a
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    let ask_b = b
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    assert_eq!(ask_a["params"]["itemId"], ask_b["params"]["itemId"]);
    b.send(&json!({ "id": ask_b["id"], "result": { "decision": "accept" } }))
        .await?;
    let resolved_b = b.notification("serverRequest/resolved").await?;
    assert_eq!(resolved_b["params"]["requestId"], ask_b["id"]);
    let resolved_a = a.notification("serverRequest/resolved").await?;
    assert_eq!(resolved_a["params"]["requestId"], ask_a["id"]);
    // A's late answer is not forwarded: the request is resolved for A's session too.
    a.send(&json!({ "id": ask_a["id"], "result": { "decision": "decline" } }))
        .await?;
    let msgs_a = a.until_turn_completed(&thread).await?;
    let msgs_b = b.until_turn_completed(&thread).await?;
    let mut msgs_c = Vec::new();
    while statuses(&msgs_c, &thread).last().map(String::as_str) != Some("idle") {
        msgs_c.push(c.wait_for(|_| true).await?);
    }
    assert_eq!(statuses(&msgs_a, &thread), statuses(&msgs_b, &thread));
    assert_eq!(
        statuses(&msgs_a, &thread),
        statuses(&msgs_c, &thread),
        "a session without a leg there sees the same broadcasts, once"
    );
    assert!(statuses(&msgs_c, &thread).len() >= 2, "{msgs_c:?}");
    for msgs in [&msgs_a, &msgs_b] {
        assert_eq!(agent_text(msgs), Some(reply_text("shared RUNSHELL")));
        let cmd = msgs
            .iter()
            .find(|m| {
                m["method"] == "item/completed" && m["params"]["item"]["type"] == "commandExecution"
            })
            .expect("command item completed");
        assert_eq!(
            cmd["params"]["item"]["status"], "completed",
            "accept won: {cmd}"
        );
    }
    fleet.stop().await
}

/// The `thread/status/changed` sequence a session saw for `thread` ("active:[flags]", "idle", …).
fn statuses(msgs: &[Value], thread: &str) -> Vec<String> {
    msgs.iter()
        .filter(|m| m["method"] == "thread/status/changed" && m["params"]["threadId"] == thread)
        .map(|m| {
            let st = &m["params"]["status"];
            match st["type"].as_str() {
                Some("active") => format!("active:{}", st["activeFlags"]),
                other => other.unwrap_or_default().to_owned(),
            }
        })
        .collect()
}

fn scrub(v: &Value, id: &str) -> String {
    v["error"].to_string().replace(id, "<id>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_thread_is_as_unknown_as_a_made_up_one() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("acme")
        .tenant("beta")
        .start()
        .await?;
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "acme's secret work").await?;
    a.until_turn_completed(&thread).await?;

    let mut b = fleet.client("beta").await?;
    let made_up = "019a0000-0000-7000-8000-000000000000";
    type Params = fn(&str) -> Value;
    let calls: [(&str, Params); 4] = [
        ("thread/resume", |t| json!({ "threadId": t })),
        (
            "thread/read",
            |t| json!({ "threadId": t, "includeTurns": true }),
        ),
        (
            "turn/start",
            |t| json!({ "threadId": t, "input": [{ "type": "text", "text": "steal", "text_elements": [] }] }),
        ),
        (
            "turn/interrupt",
            |t| json!({ "threadId": t, "turnId": "019a0000-0000-7000-8000-000000000001" }),
        ),
    ];
    for (method, params) in calls {
        let theirs = b.call(method, params(&thread)).await?;
        let unknown = b.call(method, params(made_up)).await?;
        assert!(
            theirs.get("error").is_some(),
            "{method} on acme's thread must fail: {theirs}"
        );
        assert_eq!(
            scrub(&theirs, &thread),
            scrub(&unknown, made_up),
            "{method}: another tenant's id must look unknown"
        );
    }
    let listed = b.request("thread/list", json!({})).await?;
    assert!(
        !listed.to_string().contains(&thread),
        "beta lists acme's thread: {listed}"
    );
    // acme's thread is untouched.
    a.start_turn(&thread, "still mine").await?;
    let msgs = a.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("still mine")));
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reconnects_mid_approval_answers_it() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "reconnect RUNSHELL").await?;
    let first = a
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    a.close().await;

    let mut b = fleet.client("acme").await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    let replayed = b
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    assert_eq!(replayed["params"]["itemId"], first["params"]["itemId"]);
    assert!(replayed["id"].is_i64());
    b.send(&json!({ "id": replayed["id"], "result": { "decision": "accept" } }))
        .await?;
    let resolved = b.notification("serverRequest/resolved").await?;
    assert_eq!(resolved["params"]["requestId"], replayed["id"]);
    let msgs = b.until_turn_completed(&thread).await?;
    assert_eq!(
        msgs.last().unwrap()["params"]["turn"]["status"],
        "completed"
    );
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_heals_a_lost_route() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .workers_toml("health_interval_secs = 1")
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await
    );
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    let tenant = fleet.tenant("acme");
    let owner = tenant
        .table
        .owner(&thread)
        .expect("learned from the result");

    // Lost entry, no traffic: the periodic thread/loaded/list brings it back.
    assert_eq!(tenant.table.remove_for_tests(&thread), Some(owner));
    assert!(
        wait_until(Duration::from_secs(3), || tenant.table.owner(&thread)
            == Some(owner))
        .await,
        "the route should be back within one reconciliation period"
    );

    // Lost entry, then a request from a client whose home is on the other worker.
    let mut b = fleet.client("acme").await?;
    tenant.table.remove_for_tests(&thread);
    b.start_turn(&thread, "found you").await?;
    assert_eq!(tenant.table.owner(&thread), Some(owner));
    let msgs = a.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("found you")));
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_threads_and_workers_unload_but_never_mid_turn() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 0, 2)
        .workers_toml("thread_unload_delay_secs = 2\nworker_idle_secs = 2\nload_mark = 1\nhealth_interval_secs = 1")
        .start()
        .await?;
    let tenant = fleet.tenant("acme");
    // C's thread runs a turn longer than every idle period, and C leaves in the middle of it.
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    let first_worker = tenant.table.owner(&thread).expect("owner");
    c.start_turn(&thread, "SLOW4 outlive the idle period")
        .await?;
    c.notification("turn/started").await?;
    // The busy worker is at the load mark: a newcomer is still served by it at once, and a
    // second worker starts in the background; the next newcomer lands there.
    let first_observer = fleet.client("acme").await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await
    );
    let mut observer = fleet.client("acme").await?;
    first_observer.close().await;
    let left_at = tokio::time::Instant::now();
    c.close().await;

    let idle = observer
        .wait_for(|v| {
            v["method"] == "thread/status/changed"
                && v["params"]["threadId"] == thread
                && v["params"]["status"]["type"] == "idle"
        })
        .await?;
    assert!(idle.is_object());
    let closed = observer
        .wait_for(|v| v["method"] == "thread/closed" && v["params"]["threadId"] == thread)
        .await?;
    assert!(closed.is_object());
    assert!(
        left_at.elapsed() >= Duration::from_secs(3),
        "the thread unloaded before its turn ended"
    );
    assert!(
        wait_until(Duration::from_secs(15), || tenant
            .pool
            .workers()
            .iter()
            .all(|w| w.id != first_worker || w.state.as_str() == "stopped"))
        .await,
        "the idle worker should stop: {:?}",
        tenant.pool.workers()
    );
    observer.close().await;
    assert!(
        wait_until(Duration::from_secs(15), || ready_workers(&fleet, "acme")
            == 0)
        .await,
        "with no client left every worker stops"
    );

    // The next client starts a worker again and resumes the thread from disk.
    let mut d = fleet.client("acme").await?;
    let resumed = d
        .request("thread/resume", json!({ "threadId": thread }))
        .await?;
    let turns = resumed["thread"]["turns"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if let Some(last) = turns.last() {
        assert_eq!(
            last["status"], "completed",
            "the long turn completed: {last}"
        );
    }
    d.start_turn(&thread, "back from disk").await?;
    let msgs = d.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("back from disk")));
    fleet.stop().await
}
