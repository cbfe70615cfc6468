//! The tenant boundary as configured: methods no rule classifies are refused, app-server's
//! remote control stays off unless a tenant's policy allows it, re-adding a removed tenant keeps
//! its old sessions working, and uid and workspace-root mistakes are refused at start-up.

use e2e::FleetBuilder;
use serde_json::{json, Value};

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
    // A method the table does not name never reaches the worker.
    let r = a.call("thread/notAMethodYet", json!({})).await?;
    assert!(refused_with(&r, "unclassified"), "{r}");
    assert_eq!(r["error"]["data"]["method"], "thread/notAMethodYet");
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
    let workers_a = e2e::workers_under(&fleet.home("a"));
    assert!(!workers_a.is_empty(), "no worker of a");
    for pid in &workers_a {
        assert!(
            started_with(*pid, REMOTE_CONTROL_DISABLED),
            "worker {pid} of a started without {REMOTE_CONTROL_DISABLED}"
        );
    }
    // A tenant that allows it: the flag is not passed and the request reaches the worker
    // (which needs a ChatGPT login to go further, so nothing leaves this machine).
    let workers_b = e2e::workers_under(&fleet.home("b"));
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
