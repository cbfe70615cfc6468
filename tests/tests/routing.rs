//! Pools and routing by threadId: placement, shared threads, tenant isolation, idle unloading,
//! reconnects and reconciliation, all against real workers.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context;
use futures_util::future::try_join_all;
use serde_json::{json, Value};
use testkit::{agent_text, ready_workers, reply_text, wait_until, Fleet, FleetBuilder};

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
            .filter_map(|(_, thread, _)| t.find_owner(thread).map(|w| w.to_string()))
            .collect();
        assert_eq!(
            owners.len(),
            2,
            "{tenant}'s threads should use both workers: {owners:?}"
        );
    }
    fleet.stop().await
}

/// A session's first leg (its home, opened for `initialize`) places no thread and is not counted
/// as a placement; the session's first thread then goes to that same worker while the workers are
/// loaded alike, so the session keeps to one connection (a second would get every broadcast of its
/// worker once more). Load still comes first: the next thread goes to the other worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_thread_goes_to_its_home_workers_leg_while_loads_are_alike() -> anyhow::Result<()>
{
    let fleet = two_ready_workers().await?;
    let legs = [("tenant", "acme")];
    let mut c = fleet.client("acme").await?;
    assert_eq!(
        fleet.metric("codex_fleet_legs_opened_total", &legs).await?,
        1.0
    );
    let first = c.start_thread().await?;
    assert_eq!(
        fleet.metric("codex_fleet_legs_opened_total", &legs).await?,
        1.0,
        "the first thread took the home leg's worker"
    );
    let second = c.start_thread().await?;
    let t = fleet.tenant("acme");
    let (a, b) = (t.find_owner(&first), t.find_owner(&second));
    assert!(a.is_some() && b.is_some() && a != b, "{a:?} {b:?}");
    assert_eq!(
        fleet.metric("codex_fleet_legs_opened_total", &legs).await?,
        2.0
    );
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_share_a_thread_and_the_first_answer_wins() -> anyhow::Result<()> {
    let fleet = two_ready_workers().await?;
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "first, so the thread is on disk")
        .await?;
    a.until_turn_completed(&thread).await?;
    let mut b = fleet.client("acme").await?;
    let owner = fleet
        .tenant("acme")
        .find_owner(&thread)
        .expect("owner known");
    // B's home leg went to the other worker (placement by load), so B reaches the thread
    // through a leg opened on demand.
    let homes = legs_per_worker(&fleet);
    assert!(
        homes.iter().all(|h| *h >= 1),
        "both workers hold a leg: {homes:?}"
    );
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    assert_eq!(
        fleet.tenant("acme").find_owner(&thread),
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
    // A's late answer is dropped and counted, not forwarded: the request is resolved for A's
    // session too, and the command below completes as B's accept decided.
    let unknown = [("reason", "unknown_response")];
    let before = fleet
        .metric("codex_fleet_client_errors_total", &unknown)
        .await?;
    a.send(&json!({ "id": ask_a["id"], "result": { "decision": "decline" } }))
        .await?;
    let counted = testkit::wait_until_async(Duration::from_secs(10), || async {
        fleet
            .metric("codex_fleet_client_errors_total", &unknown)
            .await
            .is_ok_and(|n| n == before + 1.0)
    })
    .await;
    assert!(
        counted,
        "A's late answer is counted once as unknown_response"
    );
    let mut msgs_a = a.until_turn_completed(&thread).await?;
    let mut msgs_b = b.until_turn_completed(&thread).await?;
    let mut msgs_c = Vec::new();
    while statuses(&msgs_c, &thread).last().map(String::as_str) != Some("idle") {
        msgs_c.push(c.wait_for(|_| true).await?);
    }
    // A and B get the thread's status relayed apart from their legs' frames: each reads until
    // the thread is idle, as C did, so no relayed status is left behind the request below.
    for (s, msgs) in [(&mut a, &mut msgs_a), (&mut b, &mut msgs_b)] {
        while statuses(msgs, &thread).last().map(String::as_str) != Some("idle") {
            msgs.push(s.wait_for(|_| true).await?);
        }
    }
    // Every session reads on, past the turn's end, up to the answer of a later request, so a
    // late second copy of a broadcast would be seen too.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (s, msgs) in [
        (&mut a, &mut msgs_a),
        (&mut b, &mut msgs_b),
        (&mut c, &mut msgs_c),
    ] {
        s.request("thread/loaded/list", json!({})).await?;
        msgs.extend(s.backlog.drain(..));
    }
    // What C got is the thread's broadcasts (it has no leg there); A and B, subscribed through
    // their legs, got each of those once too, in the same order. Status changes are compared as
    // their own stream: every session gets them relayed (their legs opt out), and app-server
    // itself orders them freely against its other notifications.
    let broadcasts = |msgs: &[Value], kinds: &HashSet<String>| -> [Vec<String>; 2] {
        let mut streams = [Vec::new(), Vec::new()];
        for m in msgs
            .iter()
            .filter(|m| m.get("id").is_none() && m["params"]["threadId"] == thread.as_str())
            .filter(|m| kinds.contains(m["method"].as_str().unwrap_or_default()))
        {
            let status = usize::from(m["method"] == "thread/status/changed");
            streams[status].push(format!("{} {}", m["method"], m["params"]));
        }
        streams
    };
    let kinds: HashSet<String> = msgs_c
        .iter()
        .filter(|m| m.get("id").is_none() && m["params"]["threadId"] == thread.as_str())
        .filter_map(|m| m["method"].as_str().map(str::to_owned))
        .collect();
    assert!(kinds.contains("thread/status/changed"), "{msgs_c:?}");
    let seen_c = broadcasts(&msgs_c, &kinds);
    assert_eq!(broadcasts(&msgs_a, &kinds), seen_c, "A and C differ");
    assert_eq!(
        broadcasts(&msgs_b, &kinds),
        seen_c,
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

/// A client that opted out of a notification method (`optOutNotificationMethods`) does not get
/// it from codex-fleet either: app-server leaves it out of every broadcast to that connection,
/// and codex-fleet must not relay it from another worker's control leg. A session without the
/// opt-out, in the same place, sees the thread's statuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_the_client_opted_out_of_is_not_relayed_to_it() -> anyhow::Result<()> {
    let fleet = two_ready_workers().await?;
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    let mut quiet = fleet.connect("acme").await?;
    quiet
        .initialize_opting_out("e2e-quiet", &["thread/status/changed"])
        .await?;
    // The quiet session's home leg went to the other worker (placement by load): the thread's
    // broadcasts can reach it only through the relay.
    let homes = legs_per_worker(&fleet);
    assert!(
        homes.iter().all(|h| *h >= 1),
        "a leg on each worker: {homes:?}"
    );
    // Neither asks anything (`thread/loaded/list` would open a leg to every worker).
    let mut plain = fleet.client("acme").await?;
    a.start_turn(&thread, "hello").await?;
    a.until_turn_completed(&thread).await?;
    let mut seen_plain = Vec::new();
    while statuses(&seen_plain, &thread).last().map(String::as_str) != Some("idle") {
        seen_plain.push(plain.wait_for(|_| true).await?);
    }
    assert!(statuses(&seen_plain, &thread).len() >= 2, "{seen_plain:?}");
    // A relayed copy would have reached the quiet session by now, as it reached the plain one.
    let relayed = status_change_within(&mut quiet, Duration::from_secs(2)).await;
    assert!(relayed.is_err(), "opted out, yet relayed: {relayed:?}");
    fleet.stop().await
}

/// A session's legs opt out of `thread/status/changed` (the worker's control leg carries it once,
/// and the tenant's relay hands it to every session), added to what the client itself opted out
/// of: the real app-server takes that initialize whether the client sent capabilities or not,
/// each session sees each of a turn's status changes once, in order, also the sessions whose
/// legs are on the thread's worker, and the client's own opt-outs still hold on its legs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_changes_reach_each_session_once_and_a_client_s_own_opt_outs_hold(
) -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .start()
        .await?;
    let mut a = fleet.connect("acme").await?;
    a.initialize_without_capabilities("e2e-bare").await?;
    let thread = a.start_thread().await?;
    // A thread has a rollout to resume once it ran a turn.
    a.start_turn(&thread, "first").await?;
    a.until_turn_completed(&thread).await?;
    let mut b = fleet.connect("acme").await?;
    b.initialize_opting_out("e2e-quiet-usage", &["thread/tokenUsage/updated"])
        .await?;
    b.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    // One worker: both sessions' legs are live on the thread's worker, and both follow it.
    a.start_turn(&thread, "hello").await?;
    let mut seen = Vec::new();
    for c in [&mut a, &mut b] {
        seen.push(c.until_turn_over(&thread).await?);
    }
    let usage = |msgs: &[Value]| {
        msgs.iter()
            .filter(|m| m["method"] == "thread/tokenUsage/updated")
            .count()
    };
    assert!(
        usage(&seen[0]) >= 1,
        "the turn reports its usage: {:?}",
        seen[0]
    );
    assert_eq!(usage(&seen[1]), 0, "opted out on its legs: {:?}", seen[1]);
    // From the turn's start (b's resume may have restated the thread's idle before it).
    let turn_statuses = |msgs: &[Value]| -> Vec<String> {
        statuses(msgs, &thread)
            .into_iter()
            .skip_while(|s| !s.starts_with("active"))
            .collect()
    };
    let (sa, sb) = (turn_statuses(&seen[0]), turn_statuses(&seen[1]));
    assert!(sa.iter().any(|s| s.starts_with("active")), "{sa:?}");
    assert!(
        sa.windows(2).all(|w| w[0] != w[1]),
        "each status change once: {sa:?}"
    );
    assert_eq!(
        sa, sb,
        "the same changes in the same order for every session"
    );
    // Nothing more comes: a second copy from a leg would arrive now.
    let late = status_change_within(&mut a, Duration::from_secs(1)).await;
    assert!(late.is_err(), "a status change twice: {late:?}");
    fleet.stop().await
}

/// The next `thread/status/changed` `c` gets within `within`.
async fn status_change_within(c: &mut testkit::Client, within: Duration) -> anyhow::Result<Value> {
    c.wait_for_within(|v| v["method"] == "thread/status/changed", within)
        .await
}

/// A fleet whose tenant `acme` has two workers, both ready.
async fn two_ready_workers() -> anyhow::Result<Fleet> {
    both_ready(FleetBuilder::new().tenant_pool("acme", 2, 2)).await
}

/// `fleet` started, once both of `acme`'s workers are ready.
async fn both_ready(fleet: FleetBuilder) -> anyhow::Result<Fleet> {
    let fleet = fleet.start().await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await
    );
    Ok(fleet)
}

/// How many legs each of `acme`'s workers holds.
fn legs_per_worker(fleet: &Fleet) -> Vec<usize> {
    fleet
        .tenant("acme")
        .pool
        .workers()
        .iter()
        .map(|w| w.handles)
        .collect()
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
    let fleet = both_ready(
        FleetBuilder::new()
            .tenant_pool("acme", 2, 2)
            .workers_toml("health_interval_secs = 1"),
    )
    .await?;
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    let tenant = fleet.tenant("acme");
    let owner = tenant.find_owner(&thread).expect("learned from the result");

    // Lost entry, no traffic: the periodic thread/loaded/list brings it back.
    assert_eq!(tenant.pool.forget_owner_for_tests(&thread), Some(owner));
    assert!(
        wait_until(Duration::from_secs(3), || tenant.find_owner(&thread)
            == Some(owner))
        .await,
        "the route should be back within one reconciliation period"
    );

    // Lost entry, then a request from a client whose home is on the other worker.
    let mut b = fleet.client("acme").await?;
    tenant.pool.forget_owner_for_tests(&thread);
    b.start_turn(&thread, "found you").await?;
    assert_eq!(tenant.find_owner(&thread), Some(owner));
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
    let first_worker = tenant.find_owner(&thread).expect("owner");
    // 12 s: longer than a second real worker takes to start on a loaded machine, so the turn is
    // still running when C leaves (checked below, not assumed).
    c.start_turn(&thread, "SLOW12 outlive the idle period")
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
    // C leaves mid-turn: the fleet still counts the turn as running and C was not told it ended.
    assert_eq!(
        fleet.admission.active_turns("acme"),
        1,
        "the turn must still be running when C leaves"
    );
    assert!(
        !c.backlog.iter().any(|v| v["method"] == "turn/completed"),
        "the turn ended before C left"
    );
    c.close().await;

    // The observer sees the thread go idle (the turn ended) and only then unload.
    let mut seen = Vec::new();
    loop {
        let v = observer.wait_for(|_| true).await?;
        let closed = v["method"] == "thread/closed" && v["params"]["threadId"] == thread;
        seen.push(v);
        if closed {
            break;
        }
    }
    // The last statuses before thread/closed: idle (the turn ended), then only notLoaded.
    let st = statuses(&seen, &thread);
    let idle_at = st.iter().rposition(|s| s == "idle");
    assert!(
        idle_at.is_some_and(|i| st[i + 1..].iter().all(|s| s == "notLoaded")),
        "thread/closed came only after the thread went idle: {st:?}"
    );
    assert_eq!(
        fleet.admission.active_turns("acme"),
        0,
        "the turn ended before the thread unloaded"
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
    d.request("thread/resume", json!({ "threadId": thread }))
        .await?;
    let read = d
        .request(
            "thread/read",
            json!({ "threadId": thread, "includeTurns": true }),
        )
        .await?;
    let last = read["thread"]["turns"]
        .as_array()
        .and_then(|t| t.last())
        .cloned()
        .with_context(|| format!("the long turn is on disk: {read}"))?;
    assert_eq!(
        last["status"], "completed",
        "the long turn completed: {last}"
    );
    d.start_turn(&thread, "back from disk").await?;
    let msgs = d.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("back from disk")));
    fleet.stop().await
}

/// Two sessions resume the same unloaded thread at once. Neither the routing table nor the pool's
/// view knows where it lives, so the two resumes are placed on different workers. One of those
/// workers is stopped for a moment, so the other wins the writer lock; the stopped one then
/// answers app-server's "already has an active writer", and the router reconciles and sends that
/// resume to the owner once. Both clients see a plain success and share the thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_that_loses_the_writer_race_is_retried_on_the_owner() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        // The stopped worker must not be taken for hung.
        .workers_toml(
            "thread_unload_delay_secs = 1\nhealth_interval_secs = 30\nhealth_timeout_secs = 30",
        )
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await
    );
    let tenant = fleet.tenant("acme");
    let mut a = fleet.client("acme").await?;
    let mut b = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "on disk").await?;
    a.until_turn_completed(&thread).await?;
    let retries = || fleet.metric("codex_fleet_resume_retries_total", &[("tenant", "acme")]);
    assert_eq!(retries().await?, 0.0);
    // Unloaded everywhere, and the placements made so far no longer count as load.
    a.call("thread/unsubscribe", json!({ "threadId": thread }))
        .await?;
    assert!(
        wait_until(Duration::from_secs(15), || tenant
            .pool
            .loaded_threads()
            .iter()
            .all(|(_, threads)| threads.is_empty()))
        .await,
        "the thread never unloaded"
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let stopped = tenant
        .pool
        .workers()
        .iter()
        .find_map(|w| w.pid)
        .context("a worker pid")?;
    testkit::stop_process(i32::try_from(stopped)?).await?;
    // Both resumes on their way before either is answered; the running worker's wins.
    let ra = a
        .send_request("thread/resume", json!({ "threadId": thread }))
        .await?;
    let rb = b
        .send_request("thread/resume", json!({ "threadId": thread }))
        .await?;
    tokio::time::sleep(Duration::from_millis(700)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(stopped)?),
        nix::sys::signal::Signal::SIGCONT,
    )?;
    for (c, id) in [(&mut a, ra), (&mut b, rb)] {
        let resp = c.wait_for(|v| v["id"] == id).await?;
        assert_eq!(resp["result"]["thread"]["id"], thread.as_str(), "{resp}");
    }
    assert_eq!(
        retries().await?,
        1.0,
        "one resume lost the writer lock and was retried on the owner"
    );
    // Both sessions are subscribed on the owner: a turn started by one streams to the other.
    a.start_turn(&thread, "both see it").await?;
    let msgs = b.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("both see it")));
    fleet.stop().await
}

/// `thread/resume` with a `path` resumes the rollout at that path whatever `threadId` says
/// (app-server ignores it then): the router learns and follows the thread the worker names, not
/// the client's `threadId`. Before, each made-up id (as long as a message may be) was kept in
/// the tenant's owner table and the session's followed threads, for the session's life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_by_path_is_learned_by_the_thread_it_resumed() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .start()
        .await?;
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    a.start_turn(&thread, "on disk").await?;
    a.until_turn_completed(&thread).await?;
    let read = a
        .request("thread/read", json!({ "threadId": thread }))
        .await?;
    let path = read["thread"]["path"]
        .as_str()
        .with_context(|| format!("the rollout's path: {read:.300}"))?
        .to_owned();
    let mut b = fleet.client("acme").await?;
    for n in 0..20 {
        let made_up = format!("made-up-{n}-{}", "x".repeat(64 << 10));
        let r = b
            .request(
                "thread/resume",
                json!({ "threadId": made_up, "path": path }),
            )
            .await?;
        assert_eq!(r["thread"]["id"], thread.as_str(), "{r:.300}");
        assert!(
            fleet.tenant("acme").find_owner(&made_up).is_none(),
            "a made-up thread id was learned"
        );
    }
    assert!(fleet.tenant("acme").find_owner(&thread).is_some());
    // B follows the thread it resumed: A's next turn reaches it.
    a.start_turn(&thread, "both see it").await?;
    let msgs = b.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("both see it")));
    fleet.stop().await
}
