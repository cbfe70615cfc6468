//! Supervision that survives faults, against real workers: a worker killed mid-turn, a hung
//! worker, a crash-looping command, a SIGTERM drain, a SIGHUP reload — and after each, no process
//! and no socket file left behind.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use testkit::{
    agent_text, metric_in, reply_text, wait_until, workers_under, Client, Fleet, FleetBuilder,
    FleetFiles,
};
use tokio::process::Command;
use tokio::time::Instant;

use testkit::FAST_FAULTS as FAST;

fn workers(fleet: &Fleet, tenant: &str) -> Vec<worker::WorkerInfo> {
    fleet.tenant(tenant).pool.workers()
}

fn ready_pid(fleet: &Fleet, tenant: &str) -> Option<u32> {
    workers(fleet, tenant)
        .into_iter()
        .find(|w| w.state == worker::WorkerState::Ready)
        .and_then(|w| w.pid)
}

/// The socket files our workers use now: each slot's path and the `/tmp/codex-daemon-<uid>/…`
/// socket it points to (docs/app-server-facts.md §11).
fn socket_files(state: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let Ok(tenants) = std::fs::read_dir(state.join("s/sockets")) else {
        return out;
    };
    for dir in tenants.flatten() {
        for sock in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = sock.path();
            if let Ok(target) = std::fs::read_link(&path) {
                out.insert(target);
            }
            out.insert(path);
        }
    }
    out
}

/// docs/decisions/0009-faults-visible-and-contained.md: nothing started by codex-fleet runs any
/// more, and no socket file remains.
async fn assert_clean(state: &Path, sockets: &BTreeSet<PathBuf>) {
    let gone = wait_until(Duration::from_secs(10), || {
        testkit::processes_under(state).is_empty()
    })
    .await;
    assert!(
        gone,
        "processes outlived codex-fleet: {:?}",
        testkit::processes_under(state)
    );
    let now = socket_files(state);
    let left: Vec<_> = sockets
        .iter()
        .chain(now.iter())
        .filter(|p| std::fs::symlink_metadata(p).is_ok())
        .collect();
    assert!(left.is_empty(), "socket files left behind: {left:?}");
}

fn is_thread_closed(v: &Value, thread: &str) -> bool {
    v["method"] == "thread/closed" && v["params"]["threadId"] == thread
}

fn is_system_error(v: &Value, thread: &str) -> bool {
    v["method"] == "thread/status/changed"
        && v["params"]["threadId"] == thread
        && v["params"]["status"]["type"] == "systemError"
}

/// Waits for `systemError` then `thread/closed` about `thread`; returns when the latter came.
async fn told_thread_failed(c: &mut Client, thread: &str) -> anyhow::Result<Instant> {
    c.wait_for(|v| is_system_error(v, thread))
        .await
        .context("systemError")?;
    c.wait_for(|v| is_thread_closed(v, thread))
        .await
        .context("thread/closed")?;
    Ok(Instant::now())
}

async fn busy_turn(c: &mut Client, prompt: &str) -> anyhow::Result<String> {
    let thread = c.start_thread().await?;
    c.start_turn(&thread, prompt).await?;
    c.notification("turn/started").await?;
    Ok(thread)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_turn_is_reported_and_its_thread_resumes_elsewhere(
) -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .tenant_pool("beta", 1, 1)
        .workers_toml(FAST)
        .start()
        .await?;
    for t in ["acme", "beta"] {
        assert!(wait_until(Duration::from_secs(30), || ready_pid(&fleet, t).is_some()).await);
    }
    let mut a = fleet.client("acme").await?;
    let mut b = fleet.client("beta").await?;
    let b_prompt = "SLOW2 beta carries on";
    let b_thread = busy_turn(&mut b, b_prompt).await?;
    let a_thread = busy_turn(&mut a, "SLOW5 acme is killed").await?;
    let old_owner = fleet
        .tenant("acme")
        .find_owner(&a_thread)
        .context("owner")?;
    let sockets = socket_files(fleet.files.dir.path());
    let pid = ready_pid(&fleet, "acme").context("acme pid")?;
    let killed = Instant::now();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL)?;
    // The turn ends (interrupted, with the reason); the thread is not closed (docs/operations.md,
    // "Threads outlive their worker").
    let ended = a.until_turn_completed(&a_thread).await?;
    let notified = killed.elapsed();
    assert_eq!(
        ended.last().expect("turn/completed")["params"]["turn"]["status"],
        "interrupted"
    );
    assert!(!ended.iter().any(|m| is_thread_closed(m, &a_thread)));
    eprintln!("measured: crash to client notified (turn/completed interrupted): {notified:?}");
    assert!(notified < Duration::from_secs(2), "{notified:?}");
    // The other tenant's turn on its own worker is untouched.
    let msgs = b.until_turn_completed(&b_thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text(b_prompt)));
    assert!(
        !b.backlog
            .iter()
            .chain(msgs.iter())
            .any(|m| is_system_error(m, &b_thread)),
        "beta was told about acme's crash"
    );
    // The thread loads again from disk on the restarted worker, without the client asking.
    let moved = wait_until(Duration::from_secs(20), || {
        fleet
            .tenant("acme")
            .find_owner(&a_thread)
            .is_some_and(|o| o != old_owner)
    })
    .await;
    assert!(moved, "re-homed on the replacement");
    let new_owner = fleet
        .tenant("acme")
        .find_owner(&a_thread)
        .context("owner")?;
    assert_ne!(new_owner, old_owner, "resumed on a new worker");
    a.start_turn(&a_thread, "after the crash").await?;
    let msgs = a.until_turn_completed(&a_thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("after the crash")));
    let exits = fleet.admin_get("/metrics").await?.1;
    assert!(
        exits.contains(r#"codex_fleet_worker_exits_total{reason="crash",tenant="acme"} 1"#),
        "{exits}"
    );
    let state = fleet.files.dir.path().to_owned();
    let sockets: BTreeSet<_> = sockets.union(&socket_files(&state)).cloned().collect();
    a.close().await;
    b.close().await;
    fleet.stop().await?;
    assert_clean(&state, &sockets).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_is_detected_killed_and_replaced() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .workers_toml(FAST)
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_pid(&fleet, "acme")
            .is_some())
        .await
    );
    let mut a = fleet.client("acme").await?;
    let thread = a.start_thread().await?;
    let sockets = socket_files(fleet.files.dir.path());
    let pid = ready_pid(&fleet, "acme").context("pid")?;
    let stopped = Instant::now();
    kill(Pid::from_raw(pid as i32), Signal::SIGSTOP)?;
    // A request on the stopped worker stays in flight until the hang is found, then fails.
    a.send(&json!({ "id": 999, "method": "thread/read", "params": { "threadId": thread } }))
        .await?;
    let told = told_thread_failed(&mut a, &thread).await?;
    let answer = a.wait_for(|v| v["id"] == 999).await?;
    assert_eq!(answer["error"]["code"], -32002, "{answer}");
    assert_eq!(
        answer["error"]["data"]["reason"], "workerExited",
        "{answer}"
    );
    assert_eq!(answer["error"]["data"]["retryable"], true, "{answer}");
    let detected = told - stopped;
    eprintln!("measured: hang (SIGSTOP) to detected, killed and client told: {detected:?} (ping every 1 s, 1 s deadline)");
    // Worst case: a whole interval before the next ping, then its deadline, then the reap.
    assert!(detected < Duration::from_millis(3500), "{detected:?}");
    assert!(
        !testkit::process_alive(pid as i32),
        "the hung worker was killed"
    );
    assert!(
        wait_until(Duration::from_secs(20), || {
            ready_pid(&fleet, "acme").is_some_and(|p| p != pid)
        })
        .await,
        "a new worker replaces it"
    );
    let last = workers(&fleet, "acme")[0]
        .last_error
        .clone()
        .unwrap_or_default();
    assert!(last.contains("hung"), "{last}");
    let t2 = a.start_thread().await?;
    a.start_turn(&t2, "on the replacement").await?;
    a.until_turn_completed(&t2).await?;
    let state = fleet.files.dir.path().to_owned();
    let sockets: BTreeSet<_> = sockets.union(&socket_files(&state)).cloned().collect();
    a.close().await;
    fleet.stop().await?;
    assert_clean(&state, &sockets).await;
    Ok(())
}

/// Appends a tenant whose workers run `command` to a prepared config; returns its token.
fn add_tenant_with_command(
    files: &FleetFiles,
    id: &str,
    command: &[&str],
) -> anyhow::Result<String> {
    let token = router::cli::dev::random_token();
    let text = std::fs::read_to_string(&files.config)?
        + &format!(
            "\n[[tenants]]\nid = {id:?}\ntoken_sha256 = [{:?}]\nmin_workers = 1\nmax_workers = 1\ncommand = {}\n",
            router::auth::token_digest_hex(&token),
            serde_json::to_string(command)?
        );
    std::fs::write(&files.config, text)?;
    Ok(token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_exits_at_once_is_quarantined_and_shown() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .workers_toml("restart_backoff_initial_ms = 20\nrestart_backoff_max_ms = 100")
        .prepare()
        .await?;
    let broken_token = add_tenant_with_command(&files, "broken", &["/bin/false"])?;
    let config_text = std::fs::read_to_string(&files.config)?;
    let fleet = files.start().await?;
    let quarantined = wait_until(Duration::from_secs(15), || {
        workers(&fleet, "broken")
            .iter()
            .all(|w| w.state == worker::WorkerState::Quarantined)
    })
    .await;
    assert!(quarantined, "{:?}", workers(&fleet, "broken"));
    let (status, body) = fleet.admin_get("/readyz").await?;
    assert_eq!(status, 200, "acme still serves: {body}");
    let detail: Value = serde_json::from_str(&body)?;
    let broken = detail["tenants"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["id"] == "broken"))
        .context("broken in /readyz")?;
    let why = broken["unavailable"].as_str().unwrap_or_default();
    assert!(why.contains("quarantined"), "{broken:#}");
    assert_eq!(broken["workers"][0]["state"], "quarantined");
    assert!(
        broken["workers"][0]["lastError"]
            .as_str()
            .is_some_and(|e| e.contains("exit status: 1")),
        "{broken:#}"
    );
    let metrics = fleet.admin_get("/metrics").await?.1;
    let restarts = metric_in(
        &metrics,
        "codex_fleet_worker_restarts_total",
        &[("tenant", "broken")],
    );
    assert!(restarts >= 4.0, "restarts counted: {restarts}");
    assert_eq!(
        metric_in(
            &metrics,
            "codex_fleet_workers",
            &[("state", "quarantined"), ("tenant", "broken")]
        ),
        1.0
    );
    // A client of the quarantined tenant is told -32001 noWorkerAvailable, with a retry time,
    // and its connection stays open.
    let mut b = Client::connect(&fleet.url(), &fleet.files.ca, Some(&broken_token)).await?;
    for _ in 0..2 {
        let r = b
            .call(
                "initialize",
                json!({ "clientInfo": { "name": "broken-client", "version": "1" } }),
            )
            .await?;
        assert_eq!(r["error"]["code"], -32001, "{r}");
        assert_eq!(r["error"]["data"]["scope"], "worker", "{r}");
        assert_eq!(r["error"]["data"]["reason"], "noWorkerAvailable", "{r}");
        assert!(
            r["error"]["data"]["retryAfterMs"]
                .as_u64()
                .is_some_and(|ms| ms >= 1),
            "{r}"
        );
    }
    b.close().await;
    // The other tenant works throughout.
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "unaffected").await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("unaffected")));
    c.close().await;
    let state = fleet.files.dir.path().to_owned();
    let sockets = socket_files(&state);
    fleet.stop().await?;
    assert_clean(&state, &sockets).await;

    // A fleet whose only tenant cannot get a worker is not ready, and says why.
    let only = FleetBuilder::new()
        .workers_toml("restart_backoff_initial_ms = 20\nrestart_backoff_max_ms = 100")
        .prepare()
        .await?;
    add_tenant_with_command(&only, "broken", &["/bin/false"])?;
    let fleet = only.start().await?;
    let unready = testkit::wait_until_async(Duration::from_secs(15), || async {
        fleet.admin_get("/readyz").await.is_ok_and(|r| r.0 == 503)
    })
    .await;
    let last = fleet.admin_get("/readyz").await?;
    assert!(unready, "{last:?}");
    assert!(last.1.contains("no capacity"), "{}", last.1);
    fleet.stop().await?;

    // A command that cannot start at all is refused before anything starts.
    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("missing.toml");
    let text = config_text.replace("/bin/false", "/nonexistent/codex");
    std::fs::write(&bad, text)?;
    let out = Command::new(testkit::fleet_bin())
        .arg("check-config")
        .arg(&bad)
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("broken") && stderr.contains("/nonexistent/codex"),
        "{stderr}"
    );
    let out = Command::new(testkit::fleet_bin())
        .args(["serve", "--config"])
        .arg(&bad)
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(78));
    Ok(())
}

/// `codex-fleet serve` as a child process (the shared fixture).
type Proc = testkit::FleetProcess;

/// Ready workers over all tenants, from `/readyz`.
async fn ready_workers_of(proc: &Proc) -> anyhow::Result<usize> {
    let (_, body) = testkit::http_get(proc.admin, "/readyz").await?;
    Ok(testkit::readyz_ready_workers(&body)?.values().sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_running_turns_finish_then_closes_with_1001() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant("acme")
        .drain_toml("settle_secs = 2\ntimeout_secs = 10")
        .prepare()
        .await?;
    let proc = Proc::spawn(&files).await?;
    let token = files.token("acme");
    let mut c = proc.client(&files, &token).await?;
    let thread = busy_turn(&mut c, "SLOW6 finish me").await?;
    let sockets = socket_files(files.dir.path());
    let signalled = Instant::now();
    proc.signal(Signal::SIGTERM)?;
    // Not ready at once; new connections are still served during the settle period.
    let mut readyz = testkit::http_get(proc.admin, "/readyz").await?;
    while readyz.0 != 503 && signalled.elapsed() < Duration::from_millis(500) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        readyz = testkit::http_get(proc.admin, "/readyz").await?;
    }
    let unready_after = signalled.elapsed();
    assert_eq!(readyz.0, 503, "{}", readyz.1);
    assert!(readyz.1.contains("draining"), "{}", readyz.1);
    eprintln!("measured: SIGTERM to /readyz 503: {unready_after:?}");
    let late = proc.client(&files, &token).await?;
    tokio::time::sleep_until(signalled + Duration::from_millis(2300)).await;
    match Client::try_connect(&proc.url(), &files.ca, Some(&token)).await? {
        testkit::Upgrade::Refused {
            status,
            retry_after,
            body,
        } => {
            assert_eq!(status, 503, "{body}");
            assert!(
                retry_after.is_some_and(|s| s >= 1),
                "the draining 503 carries Retry-After: {retry_after:?}"
            );
        }
        testkit::Upgrade::Open(_) => panic!("a connection after the settle period is refused"),
    }
    // The same answer by its head, as an edge's link reads it (and looks for the next node).
    let raw =
        testkit::https_raw(proc.addr, &files.ca, &testkit::upgrade_request("/", &token)).await?;
    assert!(
        raw.starts_with("HTTP/1.1 503")
            && raw
                .to_ascii_lowercase()
                .contains("\r\ncodex-fleet-refusal: draining\r\n"),
        "{raw}"
    );
    // The running turn completes, then the session closes with 1001.
    let msgs = c.until_turn_completed(&thread).await?;
    let done = msgs.last().context("turn/completed")?;
    assert_eq!(done["params"]["turn"]["status"], "completed", "{done}");
    assert_eq!(agent_text(&msgs), Some(reply_text("SLOW6 finish me")));
    assert_eq!(c.recv_close(Duration::from_secs(10)).await?, Some(1001));
    let mut late = late;
    assert_eq!(late.recv_close(Duration::from_secs(10)).await?, Some(1001));
    let mut proc = proc;
    let status = tokio::time::timeout(Duration::from_secs(10), proc.child.wait()).await??;
    let took = signalled.elapsed();
    eprintln!("measured: drain with one running SLOW6 turn: SIGTERM to exit {took:?}");
    assert!(status.success(), "{status:?}: {}", proc.stderr());
    assert!(took < Duration::from_secs(10), "within drain.timeout_secs");
    assert_clean(files.dir.path(), &sockets).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_outlives_the_drain_timeout_is_interrupted() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant("acme")
        .drain_toml("settle_secs = 0\ntimeout_secs = 2")
        .prepare()
        .await?;
    let proc = Proc::spawn(&files).await?;
    let mut c = proc.client(&files, &files.token("acme")).await?;
    let thread = busy_turn(&mut c, "SLOW60 too long").await?;
    let sockets = socket_files(files.dir.path());
    let signalled = Instant::now();
    proc.signal(Signal::SIGTERM)?;
    let msgs = c
        .until_turn_completed(&thread)
        .await
        .with_context(|| format!("codex-fleet stderr:\n{}", proc.stderr()))?;
    let done = msgs.last().context("turn/completed")?;
    assert_eq!(done["params"]["turn"]["status"], "interrupted", "{done}");
    let at = signalled.elapsed();
    assert!(
        at >= Duration::from_secs(2),
        "not before the timeout: {at:?}"
    );
    assert_eq!(c.recv_close(Duration::from_secs(10)).await?, Some(1001));
    let mut proc = proc;
    let status = tokio::time::timeout(Duration::from_secs(15), proc.child.wait()).await??;
    let took = signalled.elapsed();
    eprintln!("measured: drain with a turn past drain.timeout_secs=2: interrupted at {at:?}, exit at {took:?}");
    assert!(status.success(), "{status:?}: {}", proc.stderr());
    assert_clean(files.dir.path(), &sockets).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_tenants_tokens_and_sizes_and_refuses_a_bad_file() -> anyhow::Result<()> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let proc = Proc::spawn(&files).await?;
    let old_token = files.token("acme");
    let mut c = proc.client(&files, &old_token).await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "before the reload").await?;
    c.until_turn_completed(&thread).await?;

    // New token for acme, two workers kept for it, and a new tenant.
    let new_token = router::cli::dev::random_token();
    let beta_token = router::cli::dev::random_token();
    let text = std::fs::read_to_string(&files.config)?
        .replace(
            &router::auth::token_digest_hex(&old_token),
            &router::auth::token_digest_hex(&new_token),
        )
        .replace(
            "min_workers = 0\nmax_workers = 1",
            "min_workers = 2\nmax_workers = 2",
        )
        + &format!(
            "\n[[tenants]]\nid = \"beta\"\ntoken_sha256 = [{:?}]\n",
            router::auth::token_digest_hex(&beta_token)
        );
    let good = text.clone();
    std::fs::write(&files.config, &text)?;
    proc.signal(Signal::SIGHUP)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut beta = loop {
        match proc.client(&files, &beta_token).await {
            Ok(b) => break b,
            Err(e) if Instant::now() > deadline => return Err(e.context("beta after reload")),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let bt = beta.start_thread().await?;
    beta.start_turn(&bt, "beta is new").await?;
    assert_eq!(
        agent_text(&beta.until_turn_completed(&bt).await?),
        Some(reply_text("beta is new"))
    );
    let mut c2 = proc.client(&files, &new_token).await?;
    let t2 = c2.start_thread().await?;
    let old = Client::connect(&proc.url(), &files.ca, Some(&old_token)).await;
    assert!(old.is_err(), "the old token no longer authenticates");
    // The session of the removed token was closed by the reload (docs/operations.md); the new
    // token's session serves.
    assert_eq!(
        c.recv_close_frame(Duration::from_secs(30)).await?,
        Some((1008, router::end::REVOKED_REASON.to_owned()))
    );
    c2.start_turn(&t2, "after the reload").await?;
    assert_eq!(
        agent_text(&c2.until_turn_completed(&t2).await?),
        Some(reply_text("after the reload"))
    );
    testkit::wait_until_async(Duration::from_secs(30), || async {
        ready_workers_of(&proc).await.is_ok_and(|n| n >= 3)
    })
    .await;
    let grown = ready_workers_of(&proc).await?;
    assert_eq!(grown, 3, "acme min_workers 2 + beta 1");

    // An invalid file is refused; the running configuration stays.
    std::fs::write(
        &files.config,
        good.replace("[workers]", "[workers]\nload_mark = 0"),
    )?;
    proc.signal(Signal::SIGHUP)?;
    let refused = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = testkit::http_get(proc.admin, "/metrics").await?.1;
            let n = metric_in(
                &m,
                "codex_fleet_config_reloads_total",
                &[("result", "invalid")],
            );
            if n >= 1.0 || Instant::now() > deadline {
                break (
                    n,
                    metric_in(&m, "codex_fleet_config_reloads_total", &[("result", "ok")]),
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    assert_eq!(refused, (1.0, 1.0));
    // Log lines reach stderr from a thread of their own, a moment after the metric counts it.
    assert!(
        proc.wait_for_stderr("configuration reload refused", Duration::from_secs(10))
            .await,
        "{}",
        proc.stderr()
    );
    let mut c3 = proc.client(&files, &new_token).await?;
    let t3 = c3.start_thread().await?;
    c3.start_turn(&t3, "still serving").await?;
    c3.until_turn_completed(&t3).await?;
    c2.request("thread/read", json!({ "threadId": thread }))
        .await?;

    let sockets = socket_files(files.dir.path());
    let mut proc = proc;
    proc.signal(Signal::SIGTERM)?;
    let status = tokio::time::timeout(Duration::from_secs(30), proc.child.wait()).await??;
    assert!(status.success(), "{status:?}");
    assert_clean(files.dir.path(), &sockets).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_fleet_of_twenty_workers_drains_quickly() -> anyhow::Result<()> {
    let mut b = FleetBuilder::new();
    for i in 0..10 {
        b = b.tenant_pool(&format!("t{i}"), 2, 2);
    }
    let files = b.prepare().await?;
    let proc = Proc::spawn(&files).await?;
    let started = Instant::now();
    let all_ready = testkit::wait_until_async(Duration::from_secs(60), || async {
        ready_workers_of(&proc).await.is_ok_and(|n| n == 20)
    })
    .await;
    let n = ready_workers_of(&proc).await?;
    anyhow::ensure!(all_ready, "only {n} of 20 workers got ready");
    eprintln!("measured: 20 workers ready after {:?}", started.elapsed());
    let sockets = socket_files(files.dir.path());
    let pids = workers_under(files.dir.path());
    assert!(pids.len() >= 20, "{pids:?}");
    let signalled = Instant::now();
    proc.signal(Signal::SIGTERM)?;
    let mut proc = proc;
    let status = tokio::time::timeout(Duration::from_secs(30), proc.child.wait()).await??;
    let took = signalled.elapsed();
    eprintln!("measured: idle fleet of 20 workers, SIGTERM to exit: {took:?}");
    assert!(status.success(), "{status:?}: {}", proc.stderr());
    // Measured 0.12-0.18 s. An idle fleet has nothing to wait for: not the settle period (0 here)
    // nor a worker's stop grace (5 s, which a worker ignoring SIGTERM would cost). The bound
    // stays below that grace with a wide margin for a loaded machine.
    assert!(
        took < Duration::from_secs(4),
        "an idle fleet of 20 workers took {took:?} from SIGTERM to exit"
    );
    assert_clean(files.dir.path(), &sockets).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_runs_hooks_applies_new_limits_and_closes_a_removed_tenants_sessions_and_workers(
) -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 0, 1)
        .tenant_pool("gone", 1, 1)
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_pid(&fleet, "gone")
            .is_some())
        .await
    );
    let gone_pool = fleet.tenant("gone").pool.clone();
    let mut session = fleet.client("gone").await?;
    let seen = Arc::new(Mutex::new(None));
    let hook_seen = seen.clone();
    fleet.reloader.on_reload(Box::new(move |cfg| {
        *hook_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(cfg.limits.admission.max_connections);
    }));
    // Before the reload the default per-tenant cap (256) lets acme open two sessions.
    let first = fleet.client("acme").await?;
    let second = fleet.client("acme").await?;
    first.close().await;
    second.close().await;
    let acme_sessions = || fleet.admission.connections("acme").0;
    assert!(
        wait_until(Duration::from_secs(10), || acme_sessions() == 0).await,
        "acme's sessions are released"
    );
    // Drop tenant "gone" and change limits.
    let text = std::fs::read_to_string(&fleet.files.config)?;
    let (head, tenants) = text.split_once("[[tenants]]").context("tenants")?;
    let acme = tenants
        .split("[[tenants]]")
        .find(|t| t.contains("\"acme\""))
        .context("acme")?;
    std::fs::write(
        &fleet.files.config,
        format!(
            "{head}[[tenants]]{acme}\n[limits]\nmax_connections = 77\nmax_connections_per_tenant = 1\n"
        ),
    )?;
    let summary = fleet.reloader.reload().await?;
    assert_eq!(summary.removed, vec!["gone".to_owned()]);
    assert_eq!(
        *seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
        Some(77)
    );
    assert!(fleet.tenants.current().iter().all(|t| t.id != "gone"));
    // The new limits apply to the running fleet: acme now gets one session, the second is
    // refused at the door with the tenant cap.
    assert_eq!(fleet.admission.config().max_connections, 77);
    let only = fleet.client("acme").await?;
    match Client::try_connect(
        &fleet.url(),
        &fleet.files.ca,
        Some(&fleet.files.token("acme")),
    )
    .await?
    {
        testkit::Upgrade::Refused { status, body, .. } => {
            assert_eq!(status, 503, "{body}");
            assert!(body.contains("tooManyConnections"), "{body}");
            assert!(body.contains("tenant"), "{body}");
        }
        testkit::Upgrade::Open(_) => panic!("the reloaded per-tenant cap of 1 was not applied"),
    }
    only.close().await;
    // Its open session was closed by the reload (its token and tenant are gone:
    // docs/operations.md); its workers stop once the session has ended.
    assert_eq!(
        session.recv_close_frame(Duration::from_secs(30)).await?,
        Some((1008, router::end::REVOKED_REASON.to_owned()))
    );
    let stopped = wait_until(Duration::from_secs(10), || {
        gone_pool.workers().iter().all(|w| w.pid.is_none())
    })
    .await;
    assert!(stopped, "{:?}", gone_pool.workers());
    let state = fleet.files.dir.path().to_owned();
    let sockets = socket_files(&state);
    drop(gone_pool);
    fleet.stop().await?;
    assert_clean(&state, &sockets).await;
    Ok(())
}
