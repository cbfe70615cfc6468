//! The tenant boundary as configured: methods no rule classifies are refused, app-server's
//! remote control stays off unless a tenant's policy allows it, a removed tenant's sessions are
//! closed while a tenant re-added before they ended adopts its running pool, uid and
//! workspace-root mistakes are refused at start-up, and two instances on one host never hand out
//! one uid.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::FleetBuilder;

const REMOTE_CONTROL_DISABLED: &str = "CODEX_INTERNAL_APP_SERVER_REMOTE_CONTROL_DISABLED=1";

fn refused_with(resp: &Value, policy: &str) -> bool {
    resp["error"]["code"] == -32003
        && resp["error"]["data"]["reason"] == "hostAccessDenied"
        && resp["error"]["data"]["policy"] == policy
}

/// Whether a process was started with `kv` in its environment.
fn started_with(pid: i32, kv: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|e| e == kv.as_bytes()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_no_rule_classifies_are_refused_by_a_real_fleet() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("a").start().await?;
    let mut a = fleet.client("a").await?;
    // A method app-server does not know never reaches the worker: it gets app-server's answer.
    let r = a.call("thread/notAMethodYet", json!({})).await?;
    assert_eq!(r["error"]["code"], -32600, "{r}");
    let message = r["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("Invalid request: unknown variant `thread/notAMethodYet`"),
        "{r}"
    );
    // Methods that passed unclassified before, each now in the class that decides it.
    for (method, params, class) in [
        ("memory/reset", json!({}), "config_write"),
        ("config/mcpServer/reload", json!({}), "config_write"),
        ("rollout/compress", json!({}), "config_write"),
        (
            "mcpServer/oauth/login",
            json!({ "name": "x", "threadId": null }),
            "account",
        ),
        (
            "account/rateLimitResetCredit/consume",
            json!({ "creditId": "c", "idempotencyKey": "k" }),
            "account",
        ),
        (
            "mcpServer/tool/call",
            json!({ "server": "s", "tool": "t", "threadId": "x" }),
            "mcp",
        ),
        ("mock/experimentalMethod", json!({}), "unclassified"),
    ] {
        let r = a.call(method, params).await?;
        assert!(refused_with(&r, class), "{method}: {r}");
    }
    // Open methods and notifications still work, and the session is still usable.
    let r = a.request("thread/list", json!({})).await?;
    assert!(r["data"].is_array(), "{r}");
    a.request("thread/loaded/list", json!({})).await?;
    let thread = a.start_thread().await?;
    assert!(!thread.is_empty());
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_run_with_remote_control_off_unless_the_tenant_allows_it() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant("a")
        .tenant("b")
        .tenant_toml("[tenants.policy]\nremote_control = \"allow\"")
        .start()
        .await?;
    let mut a = fleet.client("a").await?;
    let mut b = fleet.client("b").await?;
    // The worker reports it off, right after initialize and when asked.
    let n = a.notification("remoteControl/status/changed").await?;
    assert_eq!(n["params"]["status"], "disabled", "{n}");
    let r = a.request("remoteControl/status/read", json!({})).await?;
    assert_eq!(r["status"], "disabled", "{r}");
    // Switching it on is refused by the policy...
    let r = a.call("remoteControl/enable", json!({})).await?;
    assert!(refused_with(&r, "remote_control"), "{r}");
    // ...and the worker itself started with remote control off for its whole life, whatever
    // its state database remembers.
    let workers_a = testkit::workers_under(&fleet.home("a"));
    assert!(!workers_a.is_empty(), "no worker of a");
    for pid in &workers_a {
        assert!(
            started_with(*pid, REMOTE_CONTROL_DISABLED),
            "worker {pid} of a started without {REMOTE_CONTROL_DISABLED}"
        );
    }
    // A tenant that allows it: the flag is not passed and the request reaches the worker
    // (which needs a ChatGPT login to go further, so nothing leaves this machine).
    let workers_b = testkit::workers_under(&fleet.home("b"));
    assert!(!workers_b.is_empty(), "no worker of b");
    for pid in &workers_b {
        assert!(
            !started_with(*pid, REMOTE_CONTROL_DISABLED),
            "worker {pid} of b"
        );
    }
    let r = b.call("remoteControl/enable", json!({})).await?;
    assert_ne!(r["error"]["code"], -32003, "{r}");
    let r = b.request("remoteControl/status/read", json!({})).await?;
    assert_eq!(r["status"], "disabled", "{r}");
    fleet.stop().await
}

/// Runs `codex-fleet <args> <config>` to its exit: the exit code and stderr.
async fn fleet_exit(args: &[&str], config: &Path) -> anyhow::Result<(Option<i32>, String)> {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(testkit::fleet_bin())
            .args(args)
            .arg(config)
            .env("CODEX_FLEET_LOG", "warn")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `check-config` and `serve` both refuse the configuration with exit 78, naming `needle`.
async fn refused_at_start_up(config: &Path, needle: &str) -> anyhow::Result<()> {
    for args in [&["check-config"][..], &["serve", "--config"][..]] {
        let (code, stderr) = fleet_exit(args, config).await?;
        assert_eq!(code, Some(78), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?} must name {needle:?}: {stderr}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_with_one_uid_are_refused_at_start_up() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant("a")
        .tenant_toml("uid = 431200")
        .tenant("b")
        .tenant_toml("uid = 431200")
        .prepare()
        .await?;
    refused_at_start_up(&files.config, "\"a\" and \"b\" both have uid 431200").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_workspace_roots_are_refused_at_start_up() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let srv = tmp.path().join("srv");
    let srv_b = srv.join("b");
    std::fs::create_dir_all(&srv_b)?;
    let files = FleetBuilder::new()
        .tenant("a")
        .tenant_toml(&format!(
            "workspace_roots = [{:?}]",
            srv.display().to_string()
        ))
        .tenant("b")
        .tenant_toml(&format!(
            "workspace_roots = [{:?}]",
            srv_b.display().to_string()
        ))
        .prepare()
        .await?;
    refused_at_start_up(&files.config, "overlaps tenant \"a\"'s").await?;
    // Side by side is fine.
    let ok = FleetBuilder::new()
        .tenant("a")
        .tenant_toml(&format!(
            "workspace_roots = [{:?}]",
            srv.join("a").display().to_string()
        ))
        .tenant("b")
        .tenant_toml(&format!(
            "workspace_roots = [{:?}]",
            srv_b.display().to_string()
        ))
        .prepare()
        .await?;
    let (code, stderr) = fleet_exit(&["check-config"], &ok.config).await?;
    assert_eq!(code, Some(0), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_another_tenant_remembers_is_refused_at_start_up() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant("a")
        .tenant("b")
        .tenant_toml("uid = 431300")
        .prepare()
        .await?;
    // codex-fleet allocated 431300 to "a" in an earlier run.
    let state = files.dir.path().join("s");
    std::fs::create_dir_all(&state)?;
    router::fsutil::write_private(&state.join("tenant-uids"), "a 431300\n")?;
    refused_at_start_up(&files.config, "uid 431300 is tenant \"a\"'s").await?;
    // Nothing was rewritten: "a" keeps its uid.
    assert_eq!(
        std::fs::read_to_string(state.join("tenant-uids"))?,
        "a 431300\n"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_skips_a_uid_something_else_runs_as() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("allocating per-tenant uids") {
        return Ok(());
    }
    // Another instance's worker (or any process) already runs as the first uid of the range.
    let mut other = std::process::Command::new("sleep")
        .arg("300")
        .uid(431400)
        .gid(431400)
        .spawn()?;
    let fleet = FleetBuilder::new()
        .workers_toml("uid_range = [431400, 431410]")
        .tenant("a")
        .start()
        .await;
    let result = async {
        let fleet = fleet?;
        let _a = fleet.client("a").await?;
        let remembered =
            std::fs::read_to_string(fleet.files.dir.path().join("s").join("tenant-uids"))?;
        assert_eq!(remembered, "a 431401\n", "431400 is in use");
        let workers = testkit::workers_under(&fleet.home("a"));
        assert!(!workers.is_empty());
        for pid in workers {
            let uid = std::fs::metadata(format!("/proc/{pid}"))?.uid();
            assert_eq!(uid, 431401, "worker {pid}");
        }
        fleet.stop().await
    }
    .await;
    other.kill()?;
    other.wait()?;
    result
}

/// The tenant's remembered uid in a fleet's `tenant-uids`.
fn remembered_uid(fleet: &testkit::Fleet, tenant: &str) -> anyhow::Result<u32> {
    let path = fleet.files.dir.path().join("s").join("tenant-uids");
    let uids = router::tenants::uids::read_uid_file(&path)?;
    uids.get(tenant)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("no uid for {tenant:?} in {uids:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tenant_s_uid_is_never_handed_to_another_instance_s_tenant() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("allocating per-tenant uids") {
        return Ok(());
    }
    // Two instances on one host with the same range (two nodes, say). The first one's tenant has
    // no worker yet, so no process shows that its uid is taken: only the first one's claim does.
    let range = "uid_range = [431500, 431510]";
    let one = FleetBuilder::new()
        .workers_toml(range)
        .tenant_pool("a", 0, 1)
        .start()
        .await?;
    let two = FleetBuilder::new()
        .workers_toml(range)
        .tenant_pool("b", 0, 1)
        .start()
        .await?;
    let (ua, ub) = (remembered_uid(&one, "a")?, remembered_uid(&two, "b")?);
    assert_ne!(ua, ub, "two tenants of two instances got one uid");
    // Both run workers; then the second instance's tenant loses its last worker, and its uid's
    // leftovers are swept. The first instance's worker must not be among them.
    let mut a = one.client("a").await?;
    a.start_thread().await?;
    let mut b = two.client("b").await?;
    b.start_thread().await?;
    let a_workers = testkit::workers_under(&one.home("a"));
    assert!(!a_workers.is_empty());
    for &pid in &a_workers {
        assert_eq!(std::fs::metadata(format!("/proc/{pid}"))?.uid(), ua);
    }
    drop(b);
    two.stop().await?;
    for pid in a_workers {
        // Alive, not a zombie awaiting its reaper.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").map(|(_, rest)| &rest[..1]);
        assert!(
            state.is_some_and(|s| s != "Z" && s != "X"),
            "the other instance's sweep killed worker {pid}: {stat:?}"
        );
    }
    a.start_thread().await?;
    one.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_re_added_before_its_old_session_ended_adopts_its_running_pool(
) -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 0, 1)
        .tenant_pool("back", 1, 1)
        .start()
        .await?;
    let ready = |fleet: &testkit::Fleet| {
        fleet
            .tenant("back")
            .pool
            .workers()
            .iter()
            .any(|w| w.state == worker::WorkerState::Ready)
    };
    assert!(testkit::wait_until(Duration::from_secs(30), || ready(&fleet)).await);
    let pool = fleet.tenant("back").pool.clone();
    let mut old = fleet.client("back").await?;
    let thread = old.start_thread().await?;
    let original = std::fs::read_to_string(&fleet.files.config)?;
    // Remove "back" while its session stays open...
    let (head, tenants) = original.split_once("[[tenants]]").expect("tenants");
    let acme = tenants
        .split("[[tenants]]")
        .find(|t| t.contains("\"acme\""))
        .expect("acme");
    std::fs::write(&fleet.files.config, format!("{head}[[tenants]]{acme}"))?;
    let summary = fleet.reloader.reload().await?;
    assert_eq!(summary.removed, ["back"]);
    // ...and add it back, as it was.
    std::fs::write(&fleet.files.config, &original)?;
    let summary = fleet.reloader.reload().await?;
    assert!(summary.removed.is_empty(), "{summary:?}");
    assert_eq!(summary.adopted, ["back"]);
    let back = fleet.tenant("back");
    assert!(
        Arc::ptr_eq(&back.pool, &pool),
        "the re-added tenant must adopt the pool that still serves its old session"
    );
    // The removal closed the old session (its tenant and token were gone: docs/operations.md); it
    // held the pool until it had ended, so the re-added tenant took it back. New sessions work.
    assert_eq!(
        old.recv_close_frame(Duration::from_secs(30)).await?,
        Some((1008, router::end::REVOKED_REASON.to_owned()))
    );
    // The old session's end does not stop the adopted pool (the tenant is configured again):
    // once the session is gone, the pass that stops removed tenants' unused pools finds nothing
    // of "back" to stop, and its worker is the same process, still ready.
    let before: Vec<_> = back.pool.workers().iter().map(|w| w.pid).collect();
    let gone = testkit::wait_until_async(Duration::from_secs(10), || async {
        fleet
            .metric("codex_fleet_sessions", &[("tenant", "back")])
            .await
            .is_ok_and(|n| n == 0.0)
    })
    .await;
    assert!(gone, "the old session ended");
    fleet.reloader.stop_unused(Duration::from_secs(5)).await;
    assert!(ready(&fleet), "{:?}", back.pool.workers());
    let after: Vec<_> = back.pool.workers().iter().map(|w| w.pid).collect();
    assert_eq!(before, after, "the adopted pool's worker was not restarted");
    let mut new = fleet.client("back").await?;
    let thread2 = new.start_thread().await?;
    new.start_turn(&thread2, "new session after re-adding")
        .await?;
    new.until_turn_completed(&thread2).await?;
    // The old session's thread is reachable from the new one too: one pool, one table.
    let r = new
        .request("thread/read", json!({ "threadId": thread }))
        .await?;
    assert_eq!(r["thread"]["id"], thread.as_str(), "{r}");
    let states: Vec<_> = back.pool.workers().iter().map(|w| w.state).collect();
    assert!(
        states
            .iter()
            .all(|s| *s != worker::WorkerState::Quarantined),
        "{states:?}"
    );
    new.close().await;
    drop((back, pool));
    fleet.stop().await
}
