//! What one tenant's worker starts cost every other tenant (BENCHMARKS.md, "A worker started
//! without copying the router"): codex-fleet holding `--connections` idle connections (its heap,
//! as a busy router's), one tenant's `thread/read` round trips measured first while nothing
//! starts, then while, every second, a reload adds a tenant of `--burst` simulated workers (and
//! removes the previous one), so codex-fleet starts that many workers at once (and stops as many).
//!
//! Every `--fleet-bins` entry is measured in turn, alternated `--runs` times, on simulated workers
//! only (`codex-app-server-sim` beside this binary or `--sim-bin`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context};
use clap::Parser;
use codex_fleet_bench::latency::{connect_ws, percentile, Conn};
use codex_fleet_bench::sim::{wait_workers_ready, Script, SimFleet};
use serde_json::{json, Value};
use testkit::Client;
use tokio::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "another tenant's round trips while codex-fleet starts workers, at a given heap")]
struct Args {
    /// codex-fleet binaries to compare, each run in turn (default: the one beside this tool).
    #[arg(long, value_delimiter = ',', env = "CODEX_FLEET_BIN")]
    fleet_bins: Vec<PathBuf>,
    /// Simulator binary (default: beside this tool).
    #[arg(long, env = "CODEX_SIM_BIN")]
    sim_bin: Option<PathBuf>,
    /// Idle authenticated connections held open (each keeps about 20 KiB of codex-fleet).
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Connections opened at once.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Workers each reload starts.
    #[arg(long, default_value_t = 32)]
    burst: usize,
    /// Reloads, one a second (the measured phase with starts).
    #[arg(long, default_value_t = 8)]
    bursts: usize,
    /// Seconds measured before, with nothing starting.
    #[arg(long, default_value_t = 5)]
    quiet_secs: u64,
    /// Rounds over all binaries.
    #[arg(long, default_value_t = 1)]
    runs: usize,
}

/// One phase's round trips, in µs.
struct Phase(Vec<f64>);

impl Phase {
    fn line(&self) -> String {
        let mut s = self.0.clone();
        s.sort_by(f64::total_cmp);
        format!(
            "{:>6} round trips: p50 {:>6.0} µs, p99 {:>6.0}, p99.9 {:>6.0}, max {:>6.0}",
            s.len(),
            percentile(&s, 0.5),
            percentile(&s, 0.99),
            percentile(&s, 0.999),
            s.last().copied().unwrap_or(0.0)
        )
    }
}

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1_000);

/// `thread/read` round trips on `conn` until `until` resolves; their durations in µs.
async fn measure(
    conn: &mut Conn,
    params: &Value,
    until: impl std::future::Future<Output = anyhow::Result<usize>>,
) -> anyhow::Result<(Phase, usize)> {
    let mut samples = Vec::new();
    tokio::pin!(until);
    loop {
        // A call cut off at the phase's end leaves its answer behind: a fresh id each call, so it
        // is never taken for the next one's.
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = Instant::now();
        tokio::select! {
            biased;
            done = &mut until => return Ok((Phase(samples), done?)),
            r = conn.call(id, "thread/read", params.clone()) => {
                r?;
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
}

/// Ready workers of `tenant`, from `/readyz`.
async fn ready_of(admin: std::net::SocketAddr, tenant: &str) -> anyhow::Result<usize> {
    let (_, body) = testkit::http_get(admin, "/readyz").await?;
    let v: Value = serde_json::from_str(&body)?;
    Ok(v["tenants"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["id"] == tenant)
        .flat_map(|t| t["workers"].as_array().into_iter().flatten())
        .filter(|w| w["state"] == "ready")
        .count())
}

async fn run(args: &Args, bin: &Path, sim: &Path) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new().prefix("ss").tempdir_in("/tmp")?;
    let fleet = SimFleet {
        tenants: 2,
        workers: 1,
        script: Script {
            turn_ms: 0,
            deltas: 0,
        },
        sim_bin: sim.to_path_buf(),
        node: None,
        nice: 0,
    };
    let files = fleet.write(dir.path())?;
    // Room for every burst's workers beside the two tenants'.
    let base = std::fs::read_to_string(&files.config)?;
    ensure!(
        base.contains("max_workers = 2\nnice"),
        "the config's shape changed"
    );
    let base = base.replace("max_workers = 2\nnice", "max_workers = 100000\nnice");
    std::fs::write(&files.config, &base)?;
    let (mut child, wss, admin) =
        codex_fleet_bench::spawn_fleet_config(bin, &files.config, "error", Stdio::inherit())
            .await?;
    let pid = child.id().context("pid")?;
    wait_workers_ready(&mut child, admin, 2, Duration::from_millis(50)).await?;
    let url = format!("wss://localhost:{}/", wss.port());
    let t0 = Instant::now();
    let mut held: Vec<Client> = Vec::with_capacity(args.connections);
    while held.len() < args.connections {
        let k = args.batch.min(args.connections - held.len());
        let opened = futures_util::future::try_join_all(
            (0..k).map(|_| Client::connect(&url, &files.ca, Some(&files.tokens[1]))),
        )
        .await?;
        held.extend(opened);
    }
    let rss = testkit::rss_kib(pid).context("VmRSS")?;
    println!(
        "  {} idle connections opened in {:.1} s; codex-fleet's RSS {:.0} MiB",
        held.len(),
        t0.elapsed().as_secs_f64(),
        rss as f64 / 1024.0
    );
    let mut conn = connect_ws(&url, Some(&files.ca), Some(&files.tokens[0])).await?;
    let started = conn.call(1, "thread/start", json!({})).await?;
    let thread = started["result"]["thread"]["id"]
        .as_str()
        .context("thread id")?
        .to_owned();
    let params = json!({"threadId": thread, "includeTurns": false});
    let quiet = tokio::time::sleep(Duration::from_secs(args.quiet_secs));
    let (quiet, _) = measure(&mut conn, &params, async {
        quiet.await;
        Ok(0)
    })
    .await?;
    // Each reload adds burst `i` (and, leaving it out, removes burst `i - 1`); a second later the
    // lowest count of ready workers seen says whether the starts kept up.
    let reloads = async {
        let mut fewest = usize::MAX;
        for i in 0..args.bursts {
            let token = router::cli::dev::random_token();
            let text = format!(
                "{base}[[tenants]]\nid = \"burst{i}\"\ntoken_sha256 = [\"{}\"]\n\
                 min_workers = {n}\nmax_workers = {n}\n",
                router::auth::token_digest_hex(&token),
                n = args.burst
            );
            router::fsutil::write_private(&files.config, &text)?;
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(pid)?),
                nix::sys::signal::Signal::SIGHUP,
            )?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            fewest = fewest.min(ready_of(admin, &format!("burst{i}")).await?);
        }
        Ok(fewest)
    };
    let (starting, fewest) = measure(&mut conn, &params, reloads).await?;
    println!("  nothing starting:     {}", quiet.line());
    println!("  {:>2} workers a second: {}", args.burst, starting.line());
    println!(
        "  a burst's workers ready a second after its reload: at least {fewest} of {}",
        args.burst
    );
    drop(held);
    codex_fleet_bench::terminate(&mut child, Duration::from_secs(10)).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    let hard = codex_fleet_bench::raise_nofile()?;
    ensure!(
        (args.connections as u64) + 256 <= hard,
        "{} connections need more open files than the hard limit {hard}",
        args.connections
    );
    if args.fleet_bins.is_empty() {
        args.fleet_bins.push(codex_fleet_bench::fleet_bin()?);
    }
    let sim = match &args.sim_bin {
        Some(s) => s.clone(),
        None => codex_fleet_bench::sim_bin()?,
    };
    for round in 0..args.runs {
        for bin in &args.fleet_bins {
            println!("run {} of {}: {}", round + 1, args.runs, bin.display());
            run(&args, bin, &sim).await?;
        }
    }
    Ok(())
}
