//! codex-fleet as a real process: no worker outlives it, whether it is stopped or killed.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use e2e::{workers_under, Client, FleetBuilder, FleetFiles};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Starts `codex-fleet serve` and reads the bound address from its first stdout line.
async fn spawn_fleet(files: &FleetFiles) -> anyhow::Result<(Child, SocketAddr)> {
    let mut child = Command::new(e2e::fleet_bin())
        .args(["serve", "--config"])
        .arg(&files.config)
        .env("CODEX_FLEET_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let (addr, _admin) = e2e::read_addresses(&mut child).await?;
    Ok((child, addr))
}

async fn wait_gone(pids: &[i32], within: Duration) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let alive: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|p| e2e::process_alive(*p))
            .collect();
        if alive.is_empty() || tokio::time::Instant::now() >= deadline {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn fleet_with_a_busy_worker() -> anyhow::Result<(FleetFiles, Child, Client)> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let (child, addr) = spawn_fleet(&files).await?;
    let url = format!("wss://localhost:{}/", addr.port());
    let mut c = Client::connect(&url, &files.ca, Some(&files.token("acme"))).await?;
    c.initialize("process-test").await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "a turn before the signal").await?;
    c.until_turn_completed(&thread).await?;
    Ok((files, child, c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_every_worker_and_exits_zero() -> anyhow::Result<()> {
    let (files, mut child, mut client) = fleet_with_a_busy_worker().await?;
    let workers = workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker should be running");
    let pid = Pid::from_raw(child.id().context("pid")? as i32);
    kill(pid, Signal::SIGTERM)?;
    let code = client.recv_close(Duration::from_secs(15)).await?;
    assert_eq!(code, Some(1001), "sessions close with 1001 on shutdown");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    assert!(status.success(), "codex-fleet exited with {status:?}");
    let left = wait_gone(&workers, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "workers outlived codex-fleet: {left:?}");
    assert!(workers_under(files.dir.path()).is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_leaves_no_worker_behind() -> anyhow::Result<()> {
    let (files, mut child, _client) = fleet_with_a_busy_worker().await?;
    let workers = workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker should be running");
    child.start_kill()?;
    child.wait().await?;
    let left = wait_gone(&workers, Duration::from_secs(5)).await;
    assert!(
        left.is_empty(),
        "workers outlived a SIGKILLed codex-fleet: {left:?}"
    );
    assert!(workers_under(files.dir.path()).is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_names_the_bad_key() -> anyhow::Result<()> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let ok = Command::new(e2e::fleet_bin())
        .arg("check-config")
        .arg(&files.config)
        .output()
        .await?;
    assert!(ok.status.success(), "{ok:?}");
    let bad = files.dir.path().join("bad.toml");
    let text = std::fs::read_to_string(&files.config)? + "\n[limits]\nmax_conections = 5\n";
    std::fs::write(&bad, text)?;
    let out = Command::new(e2e::fleet_bin())
        .arg("check-config")
        .arg(&bad)
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("max_conections"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_serves_a_turn_with_the_printed_credentials() -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("cfdev")
        .tempdir_in("/tmp")?;
    let state = dir.path().join("dev");
    let mut child = Command::new(e2e::fleet_bin())
        .args(["dev", "--port", "0", "--admin-port", "0", "--state-dir"])
        .arg(&state)
        .env("CODEX_BIN", e2e::codex_bin())
        .env("CODEX_FLEET_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut banner = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !banner.contains("codex exec --remote") {
        let line = tokio::time::timeout_at(deadline, lines.next_line())
            .await
            .context("dev did not print its banner")??
            .context("dev exited early")?;
        banner.push_str(&line);
        banner.push('\n');
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let token = std::fs::read_to_string(state.join("token"))?
        .trim()
        .to_owned();
    assert!(
        banner.contains(&token),
        "the token is printed once:\n{banner}"
    );
    assert!(banner.contains("offline mock model"), "{banner}");
    let exec_line = banner
        .lines()
        .find(|l| l.contains("codex exec --remote"))
        .context("no exec line")?;
    let url = exec_line
        .split_whitespace()
        .find(|w| w.starts_with("wss://"))
        .context("no url")?;
    assert!(exec_line.contains(&format!("SSL_CERT_FILE={}", state.join("ca.pem").display())));
    let client_home = tempfile::tempdir()?;
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        Command::new(e2e::codex_bin())
            .args([
                "exec",
                "--skip-git-repo-check",
                "--remote",
                url,
                "--remote-auth-token-env",
                "CODEX_FLEET_TOKEN",
                "hello dev",
            ])
            .env("SSL_CERT_FILE", state.join("ca.pem"))
            .env("CODEX_FLEET_TOKEN", &token)
            .env("CODEX_HOME", client_home.path())
            .current_dir(client_home.path())
            .stdin(Stdio::null())
            .output(),
    )
    .await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains(&e2e::reply_text("hello dev")), "{stdout}");
    kill(
        Pid::from_raw(child.id().context("pid")? as i32),
        Signal::SIGTERM,
    )?;
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    assert!(status.success(), "{status:?}");
    Ok(())
}
