//! Memory per idle authenticated connection (BENCHMARKS.md, bench 3): codex-fleet's resident
//! memory with no client, then with N wss connections open, upgraded and authenticated but idle
//! (no `initialize`, so no worker leg), for each N asked. Reports the growth per connection.
//!
//! Needs a built `codex-fleet` (release, beside this binary, or `CODEX_FLEET_BIN`) and `CODEX_BIN`.
//! It raises its own open-files limit; codex-fleet raises its own.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use testkit::{Client, FleetBuilder};
use tokio::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "codex-fleet's resident memory per idle authenticated connection")]
struct Args {
    /// Connection counts to measure, in order (each on top of the previous ones).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    connections: Vec<usize>,
    /// Connections opened at once.
    #[arg(long, default_value_t = 64)]
    batch: usize,
}

/// Resident memory of `pid` after a short settle, in KiB.
async fn settled_rss(pid: u32) -> anyhow::Result<u64> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    testkit::rss_kib(pid).context("codex-fleet's VmRSS")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let most = args.connections.iter().copied().max().unwrap_or(0);
    // This process holds every client socket.
    let hard = codex_fleet_bench::raise_nofile()?;
    if (most as u64) + 256 > hard {
        bail!("{most} connections need more open files than the hard limit {hard}");
    }
    let cap = most + 16;
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .limits_toml(&format!(
            "max_connections = {cap}\nmax_connections_per_tenant = {cap}\n\
             handshakes_per_sec_per_ip = 100000\nhandshake_burst = 100000"
        ))
        .prepare()
        .await?;
    let (child, wss, _admin) = codex_fleet_bench::spawn_fleet(&files).await?;
    let pid = child.id().context("pid")?;
    let url = format!("wss://localhost:{}/", wss.port());
    let token = files.token("acme");
    let base = settled_rss(pid).await?;
    println!(
        "codex-fleet with no client: {:.1} MiB",
        base as f64 / 1024.0
    );
    let mut held: Vec<Client> = Vec::with_capacity(most);
    for &n in &args.connections {
        let started = Instant::now();
        while held.len() < n {
            let k = args.batch.min(n - held.len());
            let opened = futures_util::future::try_join_all(
                (0..k).map(|_| Client::connect(&url, &files.ca, Some(&token))),
            )
            .await?;
            held.extend(opened);
        }
        let rss = settled_rss(pid).await?;
        let per = (rss.saturating_sub(base) as f64) * 1024.0 / n as f64;
        println!(
            "{n:>6} idle authenticated connections (opened in {:.1} s): RSS {:.1} MiB, {:.1} KiB per connection",
            started.elapsed().as_secs_f64(),
            rss as f64 / 1024.0,
            per / 1024.0
        );
    }
    drop(held);
    Ok(())
}
