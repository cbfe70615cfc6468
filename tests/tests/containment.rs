//! Tenant containment: a tenant reaches nothing of another tenant or of codex-fleet, through the
//! router's host-access policy and, as root, through per-tenant Unix uids.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::{Client, FleetBuilder};

const SECRET: &str = "tenant-b-credential-9d1c";

fn write(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    Ok(())
}

fn denied_by_policy(resp: &Value) -> bool {
    resp["error"]["code"] == -32003 && resp["error"]["data"]["reason"] == "hostAccessDenied"
}

/// Starts both tenants' workers and plants B's secrets and a file in A's workspace.
async fn two_tenants(builder: FleetBuilder) -> anyhow::Result<(testkit::Fleet, Client, Client)> {
    let fleet = builder.start().await?;
    let a = fleet.client("a").await?;
    let b = fleet.client("b").await?;
    write(
        &fleet.home("b").join("auth.json"),
        &format!("{{\"token\":\"{SECRET}\"}}"),
        0o600,
    )?;
    write(&fleet.workspace("b").join("plans.txt"), SECRET, 0o600)?;
    write(&fleet.workspace("a").join("mine.txt"), "hello", 0o644)?;
    Ok((fleet, a, b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_access_reaches_only_the_tenants_own_workspace() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("the per-tenant uid boundary") {
        return Ok(());
    }
    let (fleet, mut a, _b) = two_tenants(FleetBuilder::new().tenant("a").tenant("b")).await?;
    let theirs = [
        fleet.home("b").join("auth.json"),
        fleet.workspace("b").join("plans.txt"),
        fleet.files.dir.path().join("tls.key"),
        fleet.files.config.clone(),
    ];
    for path in &theirs {
        let r = a.call("fs/readFile", json!({ "path": path })).await?;
        assert!(denied_by_policy(&r), "fs/readFile {}: {r}", path.display());
        assert!(!r.to_string().contains(SECRET));
        let r = a
            .call(
                "command/exec",
                json!({ "command": ["cat", path], "timeoutMs": 10_000 }),
            )
            .await?;
        let leaked = r.to_string().contains(SECRET) || r.to_string().contains("PRIVATE KEY");
        assert!(!leaked, "command/exec cat {} leaked: {r}", path.display());
        let refused = r.get("error").is_some() || r["result"]["exitCode"] != 0;
        assert!(
            refused,
            "command/exec cat {} must fail: {r}",
            path.display()
        );
    }
    let mine = fleet.workspace("a").join("mine.txt");
    let r = a.request("fs/readFile", json!({ "path": mine })).await?;
    assert_eq!(r["dataBase64"], "aGVsbG8=", "own file readable: {r}");
    let r = a
        .request(
            "command/exec",
            json!({ "command": ["cat", "mine.txt"], "timeoutMs": 10_000 }),
        )
        .await?;
    assert_eq!(r["exitCode"], 0, "own workspace usable: {r}");
    assert_eq!(r["stdout"], "hello");
    // A cwd outside the tenant's roots is refused too.
    let r = a
        .call("thread/start", json!({ "cwd": fleet.workspace("b") }))
        .await?;
    assert!(denied_by_policy(&r), "thread/start in B's workspace: {r}");
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_command_cannot_read_another_tenant_or_the_fleets_key() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("the per-tenant uid boundary") {
        return Ok(());
    }
    let (fleet, mut a, _b) = two_tenants(FleetBuilder::new().tenant("a").tenant("b")).await?;
    let thread = a.start_thread().await?;
    let key = fleet.files.dir.path().join("tls.key");
    // Also the host's uid claims: a tenant that could list them, or create or lock one, could
    // keep another instance from starting or take a uid from another tenant.
    let claims = router::tenants::uids::HOST_CLAIMS;
    let cmd = format!(
        "cat {} {}; ls {claims}; echo x > {claims}/1",
        fleet.home("b").join("auth.json").display(),
        key.display()
    );
    a.start_turn(&thread, &format!("RUNCMD:{cmd}")).await?;
    let ask = a
        .wait_for(|v| v["method"] == "item/commandExecution/requestApproval")
        .await?;
    a.send(&json!({ "id": ask["id"], "result": { "decision": "accept" } }))
        .await?;
    let msgs = a.until_turn_completed(&thread).await?;
    let item = msgs
        .iter()
        .find(|m| {
            m["method"] == "item/completed" && m["params"]["item"]["type"] == "commandExecution"
        })
        .map(|m| m["params"]["item"].clone())
        .expect("the command ran");
    let output = item["aggregatedOutput"].as_str().unwrap_or_default();
    assert_ne!(item["exitCode"], 0, "{item}");
    let denied = |what: &str| {
        output
            .lines()
            .filter(|l| l.contains(what) && l.contains("Permission denied"))
            .count()
    };
    assert_eq!(denied("auth.json"), 1, "{item}");
    assert_eq!(denied("tls.key"), 1, "{item}");
    assert_eq!(denied(claims), 2, "listing and creating a claim: {item}");
    assert!(
        !output.contains(SECRET) && !output.contains("PRIVATE KEY"),
        "{item}"
    );
    fleet.stop().await
}

fn status_field(pid: i32, field: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
}

fn environ(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|e| {
            e.split(|b| *b == 0)
                .map(|kv| String::from_utf8_lossy(kv).into_owned())
                .filter(|kv| !kv.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_workers_run_as_its_own_uid_with_a_clean_environment() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("the per-tenant uid boundary") {
        return Ok(());
    }
    let (fleet, _a, _b) = two_tenants(FleetBuilder::new().tenant("a").tenant("b")).await?;
    let workers = testkit::workers_under(fleet.files.dir.path());
    assert!(workers.len() >= 2, "both tenants' workers run: {workers:?}");
    let mut uid_of: HashMap<String, String> = HashMap::new();
    for pid in workers {
        let env = environ(pid);
        let home = env
            .iter()
            .find_map(|kv| kv.strip_prefix("CODEX_HOME="))
            .expect("CODEX_HOME")
            .to_owned();
        let tenant = home.rsplit('/').next().unwrap_or_default().to_owned();
        let uid = status_field(pid, "Uid:").expect("Uid");
        let first = uid.split_whitespace().next().unwrap_or_default().to_owned();
        assert!(
            uid.split_whitespace().all(|u| u == first),
            "real, effective, saved and fs uid agree: {uid}"
        );
        assert_ne!(first, "0", "{tenant}'s worker runs as root");
        assert_eq!(
            status_field(pid, "Groups:").unwrap_or_default(),
            "",
            "no supplementary groups"
        );
        if let Some(other) = uid_of.insert(tenant.clone(), first.clone()) {
            assert_eq!(other, first, "{tenant}'s workers share the tenant's uid");
        }
        // Nothing of codex-fleet's (here: the test process's) environment or secrets leaks.
        for kv in &env {
            let name = kv.split('=').next().unwrap_or_default();
            assert!(
                [
                    "PATH",
                    "LANG",
                    "LC_ALL",
                    "LC_CTYPE",
                    "TZ",
                    "TMPDIR",
                    "HOME",
                    "CODEX_HOME",
                    // Set by codex-fleet itself: remote control off (docs/security.md).
                    "CODEX_INTERNAL_APP_SERVER_REMOTE_CONTROL_DISABLED"
                ]
                .contains(&name),
                "{tenant}'s worker has {name} in its environment"
            );
            for t in &fleet.files.tenants {
                assert!(!kv.contains(&t.token), "a bearer token leaked into {name}");
            }
        }
    }
    assert_eq!(uid_of.len(), 2);
    assert_ne!(uid_of["a"], uid_of["b"], "tenants have distinct uids");
    let recorded = std::fs::read_to_string(fleet.files.dir.path().join("s/tenant-uids"))?;
    for (tenant, uid) in &uid_of {
        assert!(recorded.contains(&format!("{tenant} {uid}")), "{recorded}");
    }
    let mode = |p: &Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).expect("meta").permissions())
            & 0o777
    };
    for t in ["a", "b"] {
        assert_eq!(mode(&fleet.home(t)), 0o700);
        assert_eq!(mode(&fleet.workspace(t)), 0o700);
    }
    fleet.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_uid_denies_host_access_unless_the_tenant_policy_allows_it() -> anyhow::Result<()>
{
    let fleet = FleetBuilder::new()
        .workers_toml("per_tenant_uid = false")
        .tenant("a")
        .tenant("b")
        .tenant_toml("[tenants.policy]\nfs = \"confine\"")
        .start()
        .await?;
    let (status, body) = fleet.admin_get("/readyz").await?;
    assert_eq!(status, 200);
    assert!(body.contains("share one Unix uid"), "{body}");
    let mut a = fleet.client("a").await?;
    let mut b = fleet.client("b").await?;
    write(&fleet.workspace("a").join("mine.txt"), "hello", 0o644)?;
    write(&fleet.workspace("b").join("mine.txt"), "hello", 0o644)?;
    let r = a
        .call(
            "fs/readFile",
            json!({ "path": fleet.workspace("a").join("mine.txt") }),
        )
        .await?;
    assert!(denied_by_policy(&r), "shared uid: denied by default: {r}");
    assert_eq!(r["error"]["data"]["policy"], "fs");
    let r = a
        .call("command/exec", json!({ "command": ["true"] }))
        .await?;
    assert!(denied_by_policy(&r), "command/exec denied by default: {r}");
    // b opted in explicitly: confined to its own workspace.
    let r = b
        .request(
            "fs/readFile",
            json!({ "path": fleet.workspace("b").join("mine.txt") }),
        )
        .await?;
    assert_eq!(r["dataBase64"], "aGVsbG8=");
    let r = b
        .call(
            "fs/readFile",
            json!({ "path": fleet.workspace("a").join("mine.txt") }),
        )
        .await?;
    assert!(denied_by_policy(&r), "still confined to b's roots: {r}");
    tokio::time::sleep(Duration::from_millis(10)).await;
    fleet.stop().await
}

/// Gives a tree to `uid`/`gid` (the test runs as root).
fn chown_tree(path: &Path, uid: u32, gid: u32) -> anyhow::Result<()> {
    nix::unistd::chown(
        path,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_tree(&entry?.path(), uid, gid)?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_started_without_root_warns_and_denies_host_access() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("starting codex-fleet as another, unprivileged user") {
        return Ok(());
    }
    const NOBODY: u32 = 65534;
    let files = FleetBuilder::new().tenant("a").prepare().await?;
    // The binary goes where the unprivileged user can reach it (the checkout may be private).
    let bin = files.dir.path().join("codex-fleet");
    std::fs::copy(testkit::fleet_bin(), &bin)?;
    chown_tree(files.dir.path(), NOBODY, NOBODY)?;
    let proc = testkit::FleetProcess::spawn_program(&bin, &files, |cmd| {
        cmd.uid(NOBODY).gid(NOBODY);
    })
    .await?;
    // The loud start-up warning.
    assert!(
        proc.wait_for_stderr("not running as root", Duration::from_secs(5))
            .await,
        "no start-up warning about the shared uid: {}",
        proc.stderr()
    );
    let (_, body) = testkit::http_get(proc.admin, "/readyz").await?;
    assert!(body.contains("not running as root"), "{body}");

    let mut c = proc.client(&files, &files.token("a")).await?;
    let workspace = files.dir.path().join("s/workspaces/a");
    write(&workspace.join("mine.txt"), "hello", 0o644)?;
    let r = c
        .call("fs/readFile", json!({ "path": workspace.join("mine.txt") }))
        .await?;
    assert!(
        denied_by_policy(&r),
        "host access is denied by default: {r}"
    );
    let r = c.call("command/exec", json!({ "command": ["id"] })).await?;
    assert!(denied_by_policy(&r), "{r}");
    // Its workers run as the unprivileged user too (nothing can switch uids).
    let workers = testkit::workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker runs");
    for pid in workers {
        let uid = status_field(pid, "Uid:").unwrap_or_default();
        assert!(uid.starts_with(&NOBODY.to_string()), "worker {pid}: {uid}");
    }
    let mut proc = proc;
    proc.signal(nix::sys::signal::Signal::SIGTERM)?;
    let status = proc.wait(Duration::from_secs(30)).await?;
    assert!(status.success(), "{status:?}: {}", proc.stderr());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_keys_widen_only_what_they_name() -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("the per-tenant uid boundary") {
        return Ok(());
    }
    // a has the default policy; b names a network sandbox, one more profile and one more key.
    let fleet = FleetBuilder::new()
        .tenant("a")
        .tenant("b")
        .tenant_toml(
            "[tenants.policy]\nsandbox_network = true\n\
             permission_profiles = [\":read-only\", \":workspace\", \"team-profile\"]\n\
             thread_config_keys = [\"model\", \"team_key\"]",
        )
        .start()
        .await?;
    let mut a = fleet.client("a").await?;
    let mut b = fleet.client("b").await?;
    let network = |ws: &Path| {
        json!({ "command": ["true"], "cwd": ws, "timeoutMs": 10_000,
                "sandboxPolicy": { "type": "readOnly", "networkAccess": true } })
    };
    let cases = [
        (
            "command/exec",
            network(&fleet.workspace("a")),
            network(&fleet.workspace("b")),
        ),
        (
            "thread/start",
            json!({ "permissions": "team-profile" }),
            json!({ "permissions": "team-profile" }),
        ),
        (
            "thread/start",
            json!({ "config": { "team_key": 1 } }),
            json!({ "config": { "team_key": 1 } }),
        ),
    ];
    for (method, for_a, for_b) in cases {
        let r = a.call(method, for_a.clone()).await?;
        assert!(denied_by_policy(&r), "a: {method} {for_a}: {r}");
        let r = b.call(method, for_b.clone()).await?;
        assert!(
            !denied_by_policy(&r),
            "b's policy allows {method} {for_b}: {r}"
        );
    }
    // What b's lists do not name is still refused.
    let r = b
        .call("thread/start", json!({ "permissions": "other-profile" }))
        .await?;
    assert!(denied_by_policy(&r), "{r}");
    let r = b
        .call("thread/start", json!({ "config": { "other_key": 1 } }))
        .await?;
    assert!(denied_by_policy(&r), "{r}");
    fleet.stop().await
}

/// docs/decisions/0011-containment-by-the-os-first.md: RLIMIT_NPROC per tenant uid. A fork loop in
/// tenant a's worker stops at a's `max_processes`, while tenant b's worker, under its own uid,
/// still spawns as many as it likes; each worker shows its configured "Max processes".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_loop_stops_at_its_tenants_process_limit_and_the_neighbour_still_spawns(
) -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("the per-tenant uid boundary") {
        return Ok(());
    }
    let (fleet, mut a, mut b) = two_tenants(
        FleetBuilder::new()
            .tenant("a")
            .tenant_toml("max_processes = 128")
            .tenant("b"),
    )
    .await?;
    // Each fork is a `sleep` that stays for a while, printing how many it started; dash stops
    // ("Cannot fork") at the first refusal.
    let forks = |n: usize| {
        json!({
            "command": ["sh", "-c", format!(
                "i=0; while [ $i -lt {n} ]; do sleep 15 & i=$((i+1)); echo $i; done"
            )],
            "timeoutMs": 30_000,
        })
    };
    let started = |r: &Value| r["stdout"].as_str().unwrap_or_default().lines().count();
    let ra = a.request("command/exec", forks(400)).await?;
    let in_a = started(&ra);
    eprintln!(
        "tenant a (max_processes 128): {in_a} forks, exit {}, stderr {}",
        ra["exitCode"], ra["stderr"]
    );
    assert!(
        in_a > 0 && in_a < 128,
        "a's fork loop must stop at its limit: {ra}"
    );
    assert_ne!(ra["exitCode"], 0, "{ra}");
    // While a's processes still hold its uid at the limit, b spawns all it asks for.
    let rb = b.request("command/exec", forks(400)).await?;
    eprintln!(
        "tenant b (default 4096): {} forks, exit {}",
        started(&rb),
        rb["exitCode"]
    );
    assert_eq!(started(&rb), 400, "b is not walled by a's limit: {rb}");
    assert_eq!(rb["exitCode"], 0, "{rb}");
    // The limits, as the kernel shows them for each tenant's worker.
    for (tenant, want) in [("a", "128"), ("b", "4096")] {
        let home = format!("/tenants/{tenant}");
        let limits: Vec<String> = testkit::workers_under(fleet.files.dir.path())
            .into_iter()
            .filter(|pid| {
                environ(*pid)
                    .iter()
                    .any(|kv| kv.starts_with("CODEX_HOME=") && kv.ends_with(&home))
            })
            .map(|pid| std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default())
            .collect();
        assert!(!limits.is_empty(), "a worker of {tenant} runs");
        for l in limits {
            let line = l
                .lines()
                .find(|l| l.starts_with("Max processes"))
                .unwrap_or_default();
            let words: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(words.get(2..4), Some(&[want, want][..]), "{tenant}: {line}");
        }
    }
    fleet.stop().await
}

/// A process's nice value (`/proc/<pid>/stat`, field 19; `self` for this one).
fn nice_of(pid: &str) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after_name = stat.rsplit_once(')').expect("stat has a name").1;
    // Field 3 (state) is the first after the name, so field 19 is the 17th.
    after_name
        .split_whitespace()
        .nth(16)
        .and_then(|v| v.parse().ok())
        .expect("nice")
}

/// `workers.nice`: every tenant's workers, and the commands their models run, run below
/// codex-fleet's CPU priority, so one tenant's busy worker competes with its neighbours' and not
/// with the router that serves them all. A tenant cannot climb back: a lower nice value needs
/// `CAP_SYS_NICE`, which a tenant's uid does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_run_below_the_fleets_cpu_priority_and_a_tenant_cannot_climb_back(
) -> anyhow::Result<()> {
    if !testkit::root_or_explicit_skip("the per-tenant uid boundary") {
        return Ok(());
    }
    // The fleet runs in this process: its workers are forked from one of its threads.
    let own = nice_of("self");
    let want = (own + 7).min(19);
    let (fleet, mut a, _b) = two_tenants(
        FleetBuilder::new()
            .workers_toml("nice = 7")
            .tenant("a")
            .tenant("b"),
    )
    .await?;
    let workers = testkit::workers_under(fleet.files.dir.path());
    assert!(workers.len() >= 2, "both tenants' workers run: {workers:?}");
    for pid in workers {
        assert_eq!(nice_of(&pid.to_string()), want, "worker {pid}");
    }
    // a's command reports its priority, tries to take codex-fleet's back, and reports it again.
    let r = a
        .request(
            "command/exec",
            json!({
                "command": ["sh", "-c", format!(
                    "cut -d' ' -f19 /proc/self/stat; renice -n {own} -p $$ >/dev/null; \
                     echo renice=$?; cut -d' ' -f19 /proc/self/stat"
                )],
                "timeoutMs": 10_000,
            }),
        )
        .await?;
    let out: Vec<&str> = r["stdout"].as_str().unwrap_or_default().lines().collect();
    let want = want.to_string();
    assert_eq!(out.first(), Some(&want.as_str()), "{r}");
    assert_ne!(
        out.get(1),
        Some(&"renice=0"),
        "a tenant raised its priority: {r}"
    );
    assert_eq!(out.get(2), Some(&want.as_str()), "{r}");
    assert!(
        r["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("Permission denied"),
        "{r}"
    );
    fleet.stop().await
}
