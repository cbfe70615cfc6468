//! What every bench tool shares: finding the built `codex-fleet` and running it as a process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;

use anyhow::bail;
use e2e::FleetFiles;
use tokio::process::{Child, Command};

/// `CODEX_FLEET_BIN`, or the `codex-fleet` built beside the running bench binary.
pub fn fleet_bin() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("CODEX_FLEET_BIN") {
        return Ok(PathBuf::from(p));
    }
    let candidate = std::env::current_exe()?.with_file_name("codex-fleet");
    if !candidate.is_file() {
        bail!(
            "{} is missing: build it first (cargo build --release --bins)",
            candidate.display()
        );
    }
    Ok(candidate)
}

/// `codex-fleet serve` on `files`, quiet, killed on drop; with its wss and admin addresses.
pub async fn spawn_fleet(files: &FleetFiles) -> anyhow::Result<(Child, SocketAddr, SocketAddr)> {
    let mut child = Command::new(fleet_bin()?)
        .args(["serve", "--config"])
        .arg(&files.config)
        .env("CODEX_FLEET_LOG", "error")
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let (wss, admin) = e2e::read_addresses(&mut child).await?;
    Ok((child, wss, admin))
}
