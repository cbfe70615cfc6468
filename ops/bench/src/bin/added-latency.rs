//! Added latency, side by side in one run: the same `thread/read` round trip (a thread with one
//! turn) measured four ways, interleaved round by round so that whatever else the machine does
//! hits every path alike:
//!
//! - `direct-unix`: WebSocket straight onto the codex-fleet worker's Unix socket;
//! - `fleet`: wss through codex-fleet (TLS, auth, session, admission, policy, routing, leg) to
//!   that same worker;
//! - `haproxy`: wss through HAProxy as a plain TLS WebSocket proxy in front of that same worker's
//!   Unix socket (`server … unix@…`);
//! - `direct-ws`: plain `ws://` onto a second app-server on the same CODEX_HOME, listening on
//!   loopback TCP (shown for reference only: app-server's TCP listener leaves Nagle on, so its
//!   two-part writes can wait for the client's delayed ACK, which makes it no fair baseline).
//!
//! Added latency is each proxy's time minus `direct-unix`. The ratio of codex-fleet's added
//! median to HAProxy's is the number to compare across machines; absolute numbers are not.
//! Needs `CODEX_BIN`, a built `codex-fleet` (release, beside this binary, or `CODEX_FLEET_BIN`) and
//! `haproxy` on PATH (`ops/bench/latency.sh` installs it from Debian).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use codex_fleet_bench::latency::{connect_unix, connect_ws, interleaved, summarize, Summary};
use e2e::{FleetBuilder, FleetFiles};
use serde_json::json;
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "codex-fleet's added latency against HAProxy's, side by side in one run")]
struct Args {
    /// Round trips per path and run.
    #[arg(long, default_value_t = 600)]
    rounds: usize,
    /// Runs (fresh connections each run); every run is reported, then all rounds together.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The HAProxy binary.
    #[arg(long, default_value = "haproxy")]
    haproxy: PathBuf,
    /// Ask for the turns too (`includeTurns`), which reads the rollout from disk on every call.
    #[arg(long)]
    include_turns: bool,
}

const TIMEOUT: Duration = Duration::from_secs(30);

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Polls until a TCP port accepts.
async fn wait_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on {port}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// codex-fleet as its own process; returns it with its wss URL once a worker is ready.
async fn start_fleet(files: &FleetFiles) -> anyhow::Result<(Child, String)> {
    let (child, wss, admin) = codex_fleet_bench::spawn_fleet(files).await?;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (_, body) = e2e::http_get(admin, "/readyz").await?;
        if body.contains("\"state\": \"ready\"") {
            break;
        }
        if Instant::now() > deadline {
            bail!("no worker ready: {body}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((child, format!("wss://localhost:{}/", wss.port())))
}

/// A second app-server on the tenant's CODEX_HOME, listening on loopback TCP.
fn start_ws_worker(files: &FleetFiles, home: &Path, port: u16) -> anyhow::Result<Child> {
    let mut cmd = Command::new(e2e::codex_bin());
    cmd.arg("app-server")
        .arg("--listen")
        .arg(format!("ws://127.0.0.1:{port}"));
    for o in files.mock.codex_config_overrides() {
        cmd.arg("-c").arg(o);
    }
    Ok(cmd
        .env("CODEX_HOME", home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?)
}

/// HAProxy terminating TLS with the fleet's certificate, relaying to `backend`.
fn start_haproxy(bin: &Path, dir: &Path, port: u16, backend: &str) -> anyhow::Result<Child> {
    let pem = dir.join("haproxy.pem");
    let mut combined = std::fs::read_to_string(dir.join("tls.crt"))?;
    combined.push_str(&std::fs::read_to_string(dir.join("tls.key"))?);
    std::fs::write(&pem, combined)?;
    let cfg = dir.join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n  maxconn 1000\n\
             defaults\n  mode http\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n  timeout tunnel 1h\n\
             frontend fe\n  bind 127.0.0.1:{port} ssl crt {}\n  default_backend be\n\
             backend be\n  server w1 {backend}\n",
            pem.display()
        ),
    )?;
    Command::new(bin)
        .arg("-db")
        .arg("-f")
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {} (ops/bench/latency.sh installs it)", bin.display()))
}

const PATHS: [&str; 4] = ["direct-unix", "fleet", "haproxy", "direct-ws"];

fn report(label: &str, samples: &[Vec<f64>; 4]) -> f64 {
    let s: Vec<Summary> = samples.iter().map(|v| summarize(v)).collect();
    println!(
        "{label}: round trip in µs (p50 / p99 / p99.9), {} rounds",
        samples[0].len()
    );
    for (name, s) in PATHS.iter().zip(&s) {
        println!("  {name:<12} {:>8.0} {:>8.0} {:>8.0}", s.p50, s.p99, s.p999);
    }
    let added = |a: &Summary, b: &Summary| (a.p50 - b.p50, a.p99 - b.p99, a.p999 - b.p999);
    let fleet = added(&s[1], &s[0]);
    let haproxy = added(&s[2], &s[0]);
    println!(
        "  added by codex-fleet: {:>6.0} {:>6.0} {:>6.0}",
        fleet.0, fleet.1, fleet.2
    );
    println!(
        "  added by HAProxy:     {:>6.0} {:>6.0} {:>6.0}",
        haproxy.0, haproxy.1, haproxy.2
    );
    let ratio = fleet.0 / haproxy.0;
    println!("  codex-fleet added median / HAProxy added median = {ratio:.2}");
    ratio
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        // Both workers share the tenant's CODEX_HOME, so both run as this user.
        .workers_toml("per_tenant_uid = false")
        .prepare()
        .await?;
    let dir = files.dir.path().to_path_buf();
    let home = dir.join("s/tenants/acme");
    let socket = dir.join("s/sockets/acme/0.sock");
    let (_fleet, url) = start_fleet(&files).await?;
    let token = files.token("acme");

    // A thread with one turn, made through the fleet; both workers read it from disk.
    let mut setup = e2e::Client::connect(&url, &files.ca, Some(&token)).await?;
    setup.initialize("bench-setup").await?;
    let thread = setup.start_thread().await?;
    setup.start_turn(&thread, "hello").await?;
    setup.until_turn_completed(&thread).await?;

    let ws_port = free_port()?;
    let _ws_worker = start_ws_worker(&files, &home, ws_port)?;
    wait_port(ws_port).await?;
    let proxy_port = free_port()?;
    let _haproxy = start_haproxy(
        &args.haproxy,
        &dir,
        proxy_port,
        &format!("unix@{}", socket.display()),
    )?;
    wait_port(proxy_port).await?;

    let params = json!({"threadId": thread, "includeTurns": args.include_turns});
    let mut all: [Vec<f64>; 4] = Default::default();
    let mut ratios = Vec::new();
    for run in 1..=args.runs {
        let mut conns = [
            connect_unix(&socket).await?,
            connect_ws(&url, Some(&files.ca), Some(&token)).await?,
            connect_ws(
                &format!("wss://localhost:{proxy_port}/"),
                Some(&files.ca),
                None,
            )
            .await?,
            connect_ws(&format!("ws://127.0.0.1:{ws_port}/"), None, None).await?,
        ];
        let samples = interleaved(&mut conns, args.rounds, "thread/read", &params).await?;
        ratios.push(report(&format!("run {run}"), &samples));
        for (a, s) in all.iter_mut().zip(samples) {
            a.extend(s);
        }
    }
    if args.runs > 1 {
        report("all runs", &all);
        ratios.sort_by(f64::total_cmp);
        println!(
            "ratio range over runs: {:.2}–{:.2}",
            ratios[0],
            ratios[ratios.len() - 1]
        );
    }
    Ok(())
}
