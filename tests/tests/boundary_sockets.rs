//! The worker-socket boundary, tried as a hostile tenant: a tenant owns its socket folder, so it can
//! point its socket path anywhere. codex-fleet must never reach another tenant's worker through it,
//! never follow it with root's privileges, and a tenant's processes end with its last worker.
//!
//! These run as root with per-tenant uids (the attack needs a uid of the tenant's own); the test
//! command runs as root. Set `CODEX_FLEET_SKIP_ROOT_TESTS=1` to skip them elsewhere.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;
use testkit::{ready_workers, wait_until, Fleet, FleetBuilder};

/// Root is needed for per-tenant uids; without it these tests fail unless explicitly skipped.
fn root_or_skip() -> anyhow::Result<bool> {
    Ok(testkit::root_or_explicit_skip(
        "the worker-socket boundary (per-tenant uids)",
    ))
}

/// The uid and gid a tenant's workers run as (from codex-fleet's record of allocated uids).
fn tenant_ids(fleet: &Fleet, tenant: &str) -> anyhow::Result<(u32, u32)> {
    let recorded = std::fs::read_to_string(fleet.files.dir.path().join("s/tenant-uids"))?;
    let uid: u32 = recorded
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{tenant} ")))
        .with_context(|| format!("no uid recorded for {tenant}: {recorded}"))?
        .trim()
        .parse()?;
    Ok((uid, uid))
}

/// Runs `program args` as `uid`/`gid` (std clears supplementary groups when it switches uid as
/// root), like a command the tenant's model ran; fails unless it succeeds.
fn run_as(uid: u32, gid: u32, program: &str, args: &[&Path]) -> anyhow::Result<()> {
    let status = std::process::Command::new(program)
        .args(args)
        .uid(uid)
        .gid(gid)
        .status()?;
    if !status.success() {
        bail!("{program} {args:?} as uid {uid}: {status}");
    }
    Ok(())
}

/// Tenants `a` (with `a_workers` workers) and `b` (one), every worker ready.
async fn tenants_a_and_b(a_workers: usize) -> anyhow::Result<Fleet> {
    let fleet = FleetBuilder::new()
        .tenant_pool("a", a_workers, a_workers)
        .tenant_pool("b", 1, 1)
        .start()
        .await?;
    anyhow::ensure!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "a")
            == a_workers
            && ready_workers(&fleet, "b") == 1)
        .await,
        "workers not ready"
    );
    Ok(fleet)
}

fn socket(fleet: &Fleet, tenant: &str) -> PathBuf {
    fleet
        .files
        .dir
        .path()
        .join(format!("s/sockets/{tenant}/0.sock"))
}

fn worker_pid(fleet: &Fleet, tenant: &str) -> Option<u32> {
    fleet
        .tenant(tenant)
        .pool
        .workers()
        .iter()
        .find(|w| w.state.as_str() == "ready")
        .and_then(|w| w.pid)
}

/// Tenant A links its socket path to tenant B's worker socket. A's next session must not reach B's
/// worker: the peer check refuses the listener before a byte is sent, A's worker is replaced (a
/// `fault` exit), and A's session goes on, on A's own new worker. B's worker is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_path_linked_to_another_tenants_worker_never_reaches_it() -> anyhow::Result<()> {
    if !root_or_skip()? {
        return Ok(());
    }
    let fleet = tenants_a_and_b(1).await?;
    let mut b = fleet.client("b").await?;
    let b_thread = b.start_thread().await?;
    // A turn, so the thread is on disk and `thread/list` shows it.
    b.start_turn(&b_thread, "hello from b").await?;
    b.until_turn_completed(&b_thread).await?;
    assert!(b
        .request("thread/list", json!({}))
        .await?
        .to_string()
        .contains(&b_thread));
    let b_pid = worker_pid(&fleet, "b").context("b's worker")?;
    let a_pid = worker_pid(&fleet, "a").context("a's worker")?;

    // The attack, as A's uid: A owns sockets/a/, so the link is A's to change.
    let (uid, gid) = tenant_ids(&fleet, "a")?;
    run_as(
        uid,
        gid,
        "ln",
        &[
            Path::new("-sfn"),
            &socket(&fleet, "b"),
            &socket(&fleet, "a"),
        ],
    )?;
    assert_eq!(
        std::fs::read_link(socket(&fleet, "a"))?,
        socket(&fleet, "b"),
        "the tenant could relink its socket path"
    );

    // A new session of A: its legs are opened by path, now leading to B's worker.
    let mut a = fleet.connect("a").await?;
    let mut home = None;
    for _ in 0..50 {
        // The first try may fail (its worker was found faulty); the client retries, as told.
        match a.initialize("attacker").await {
            Ok(result) => {
                home = Some(result);
                break;
            }
            Err(e) => {
                let text = e.to_string();
                assert!(
                    !text.contains(&fleet.home("b").display().to_string()),
                    "{text}"
                );
                assert!(
                    text.contains("-32002") || text.contains("-32001"),
                    "a retryable error: {text}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
                a = fleet.connect("a").await?;
            }
        }
    }
    let home = home.context("A's session never initialized on A's own worker")?;
    let b_home = fleet.home("b").display().to_string();
    assert!(
        !home.to_string().contains(&b_home),
        "A's session reached B's worker: {home}"
    );
    if let Some(codex_home) = home["codexHome"].as_str() {
        assert_eq!(Path::new(codex_home), fleet.home("a"), "{home}");
    }
    // Nothing of B's is visible to A.
    let list = a.request("thread/list", json!({})).await?;
    assert!(
        !list.to_string().contains(&b_thread),
        "A listed B's thread: {list}"
    );
    let read = a
        .call("thread/read", json!({ "threadId": b_thread }))
        .await?;
    assert!(read.get("error").is_some(), "A read B's thread: {read}");

    // A's worker was replaced (counted as a fault), B's kept running and serving.
    assert!(
        fleet
            .metric(
                "codex_fleet_worker_exits_total",
                &[("reason", "fault"), ("tenant", "a")]
            )
            .await?
            >= 1.0
    );
    assert_ne!(worker_pid(&fleet, "a"), Some(a_pid));
    assert_eq!(worker_pid(&fleet, "b"), Some(b_pid), "B's worker untouched");
    assert_eq!(
        fleet
            .metric(
                "codex_fleet_worker_exits_total",
                &[("reason", "fault"), ("tenant", "b")]
            )
            .await?,
        0.0
    );
    let again = b.request("thread/list", json!({})).await?;
    assert!(again.to_string().contains(&b_thread));
    // And A works on its own worker again.
    a.start_thread().await?;
    fleet.stop().await
}

/// Tenant A links its socket path to files it must not touch (B's auth.json, a root-owned file) and
/// kills its own worker. The cleanup after the exit runs as root: it must remove only the link,
/// never the files behind it or their `.lock` siblings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_after_a_worker_exit_never_follows_a_tenants_link() -> anyhow::Result<()> {
    if !root_or_skip()? {
        return Ok(());
    }
    let fleet = tenants_a_and_b(1).await?;
    let (uid, gid) = tenant_ids(&fleet, "a")?;
    // B's credentials, and a root-owned file with its lock beside it.
    let auth = fleet.home("b").join("auth.json");
    std::fs::write(&auth, "{\"token\":\"b-secret\"}")?;
    let mut auth_lock = auth.clone().into_os_string();
    auth_lock.push(".lock");
    std::fs::write(&auth_lock, "")?;
    let precious = fleet.files.dir.path().join("precious");
    std::fs::write(&precious, "root's")?;
    let mut precious_lock = precious.clone().into_os_string();
    precious_lock.push(".lock");
    std::fs::write(&precious_lock, "")?;

    for target in [&auth, &precious] {
        let a_pid = worker_pid(&fleet, "a").context("a's worker")?;
        run_as(
            uid,
            gid,
            "ln",
            &[Path::new("-sfn"), target, &socket(&fleet, "a")],
        )?;
        // A kills its own worker (it may: same uid).
        run_as(
            uid,
            gid,
            "kill",
            &[Path::new("-KILL"), Path::new(&a_pid.to_string())],
        )?;
        // The slot cleans up, then starts a replacement.
        assert!(
            wait_until(Duration::from_secs(30), || {
                worker_pid(&fleet, "a").is_some_and(|pid| pid != a_pid)
            })
            .await,
            "A's worker was not replaced"
        );
    }
    assert_eq!(std::fs::read_to_string(&auth)?, "{\"token\":\"b-secret\"}");
    assert!(Path::new(&auth_lock).exists(), "B's auth.json.lock deleted");
    assert_eq!(std::fs::read_to_string(&precious)?, "root's");
    assert!(Path::new(&precious_lock).exists(), "precious.lock deleted");
    // A's replacement serves A, through its own link again.
    let mut a = fleet.client("a").await?;
    a.start_thread().await?;
    let mut b = fleet.client("b").await?;
    b.start_thread().await?;
    fleet.stop().await
}

/// Pids of the processes running `sleep <marker>` (the marker is a unique duration).
fn sleepers(marker: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c == format!("sleep\0{marker}\0").as_bytes())
        })
        .collect()
}

/// A daemon started under the tenant's uid with `setsid` (as a model's command could) has left
/// every worker's process group. It must survive while the tenant has a worker, and end with the
/// tenant's last worker; a process of another uid is never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setsid_daemon_of_the_tenant_ends_with_its_last_worker() -> anyhow::Result<()> {
    if !root_or_skip()? {
        return Ok(());
    }
    let fleet = tenants_a_and_b(2).await?;
    let (uid, gid) = tenant_ids(&fleet, "a")?;
    let (b_uid, b_gid) = tenant_ids(&fleet, "b")?;
    let marker = format!("{}", 3000 + std::process::id() % 1000);
    let other = format!("{}", 5000 + std::process::id() % 1000);
    run_as(
        uid,
        gid,
        "setsid",
        &[Path::new("-f"), Path::new("sleep"), Path::new(&marker)],
    )?;
    // B's own daemon: B still has its worker, and it is B's uid.
    run_as(
        b_uid,
        b_gid,
        "setsid",
        &[Path::new("-f"), Path::new("sleep"), Path::new(&other)],
    )?;
    assert!(wait_until(Duration::from_secs(5), || sleepers(&marker).len() == 1).await);
    assert!(wait_until(Duration::from_secs(5), || sleepers(&other).len() == 1).await);

    // One of A's two workers dies: A still has a worker, so its daemon lives on.
    let victim = worker_pid(&fleet, "a").context("a's worker")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(victim)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    assert!(
        wait_until(Duration::from_secs(30), || {
            ready_workers(&fleet, "a") == 2
                && fleet
                    .tenant("a")
                    .pool
                    .workers()
                    .iter()
                    .all(|w| w.pid != Some(victim))
        })
        .await
    );
    assert_eq!(
        sleepers(&marker).len(),
        1,
        "killed while A still had a worker"
    );

    // A's pool stops (the tenant's last worker ends): its daemon goes with it; B's stays.
    fleet
        .tenant("a")
        .pool
        .shutdown(Duration::from_secs(5))
        .await;
    assert!(
        wait_until(Duration::from_secs(10), || sleepers(&marker).is_empty()).await,
        "the setsid daemon outlived the tenant's last worker"
    );
    let b_left = sleepers(&other);
    assert_eq!(b_left.len(), 1, "another tenant's process was killed");
    for pid in b_left {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )?;
    }
    fleet.stop().await
}
