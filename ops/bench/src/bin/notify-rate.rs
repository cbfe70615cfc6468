//! `notify-rate` (BENCHMARKS.md, bench 2): notifications forwarded per second. Simulated workers
//! (`codex-app-server-sim`) stream turns of many small `item/agentMessage/delta` notifications
//! as fast as they can; S wss clients through codex-fleet (release, its own process) each run
//! turns back to back on their own thread and count every notification they receive. Then the
//! same clients do the same directly on as many bare simulators' Unix sockets: the anchor. Each
//! phase counts over a fixed window after a warm-up; codex-fleet's CPU (utime + stime) over its
//! window gives the CPU seconds per 100k messages.
//!
//! Needs a built `codex-fleet` and `codex-app-server-sim` (beside this binary, or
//! `CODEX_FLEET_BIN` / `CODEX_SIM_BIN`).

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use codex_fleet_bench::rpc::{connect_unix, connect_wss, Rpc};
use codex_fleet_bench::sim::{start_sims, wait_workers_ready, Script, SimFleet};
use codex_fleet_bench::Binaries;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The goal (BENCHMARKS.md, bench 2): notifications forwarded per second.
const GOAL_PER_SEC: f64 = 100_000.0;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "notify-rate",
    about = "Notifications per second through codex-fleet against directly on simulated workers"
)]
struct Args {
    /// Measured window of each phase, in seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_secs: f64,
    /// Warm-up before each window, in seconds (not counted).
    #[arg(long, default_value_t = 1.0)]
    warmup_secs: f64,
    /// Concurrent client sessions, each streaming turns on its own thread.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// Simulated workers (one tenant's pool; as many bare simulators for the anchor).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Deltas per turn (sim.deltas).
    #[arg(long, default_value_t = 1000)]
    deltas: u64,
    /// Reply length of every turn, in `MANY<n>` words of 72 characters (a delta carries
    /// n × 72 / deltas characters: 15 by default, a few tokens as a model streams them).
    #[arg(long, default_value_t = 200)]
    words: usize,
    /// Steps below codex-fleet's CPU priority the simulators run at, on every path
    /// (`workers.nice` of codex-fleet's config; the direct path's through `nice(1)`).
    #[arg(long, default_value_t = router::config::DEFAULT_WORKER_NICE)]
    worker_nice: u8,
    #[command(flatten)]
    bins: Binaries,
}

/// One phase's counts over its window.
struct Window {
    notifications: u64,
    deltas: u64,
    turns: u64,
    /// None when no turn completed.
    fewest_deltas: Option<u64>,
    wall: Duration,
}

impl Window {
    fn per_sec(&self) -> f64 {
        self.notifications as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

struct Counters {
    notifications: AtomicU64,
    deltas: AtomicU64,
    turns: AtomicU64,
    /// The fewest deltas a completed turn brought (a forwarder that dropped some shows here).
    fewest: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            notifications: AtomicU64::new(0),
            deltas: AtomicU64::new(0),
            turns: AtomicU64::new(0),
            fewest: AtomicU64::new(u64::MAX),
        }
    }
}

/// A session: initialize, thread/start, then turns back to back until `stop`.
async fn stream<S: AsyncRead + AsyncWrite + Unpin>(
    mut rpc: Rpc<S>,
    prompt: String,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    rpc.initialize("notify-rate").await?;
    let (thread, _) = rpc.start_thread().await?;
    while !stop.load(Ordering::Relaxed) {
        rpc.start_turn(&thread, &prompt).await?;
        let mut deltas = 0;
        rpc.until_turn_completed(&thread, |m| {
            counters.notifications.fetch_add(1, Ordering::Relaxed);
            if *m == proto::Method::AgentMessageDelta {
                counters.deltas.fetch_add(1, Ordering::Relaxed);
                deltas += 1;
            }
        })
        .await?;
        counters.turns.fetch_add(1, Ordering::Relaxed);
        counters.fewest.fetch_min(deltas, Ordering::Relaxed);
    }
    rpc.client.close().await?;
    Ok(())
}

/// Runs the sessions, counts notifications over the window after the warm-up (and
/// `cpu` of the measured process around it), then stops them.
async fn phase<S, Fut>(
    args: &Args,
    connect: impl Fn(usize) -> Fut,
    cpu: impl Fn() -> Option<f64>,
) -> anyhow::Result<(Window, Option<f64>)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Rpc<S>>> + Send + 'static,
{
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let prompt = format!("notify-rate MANY{}", args.words);
    let mut tasks = JoinSet::new();
    for i in 0..args.sessions {
        let connecting = connect(i);
        let (prompt, counters, stop) = (prompt.clone(), counters.clone(), stop.clone());
        tasks.spawn(async move { stream(connecting.await?, prompt, counters, stop).await });
    }
    let window = async {
        tokio::time::sleep(Duration::from_secs_f64(args.warmup_secs)).await;
        let (n0, d0, t0, c0) = (
            counters.notifications.load(Ordering::Relaxed),
            counters.deltas.load(Ordering::Relaxed),
            counters.turns.load(Ordering::Relaxed),
            cpu(),
        );
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(args.duration_secs)).await;
        let (n1, d1, t1, c1, wall) = (
            counters.notifications.load(Ordering::Relaxed),
            counters.deltas.load(Ordering::Relaxed),
            counters.turns.load(Ordering::Relaxed),
            cpu(),
            started.elapsed(),
        );
        let cpu = c0.zip(c1).map(|(a, b)| b - a);
        (
            Window {
                notifications: n1 - n0,
                deltas: d1 - d0,
                turns: t1 - t0,
                fewest_deltas: Some(counters.fewest.load(Ordering::Relaxed))
                    .filter(|&n| n != u64::MAX),
                wall,
            },
            cpu,
        )
    };
    // A session that fails ends the phase at once, with its error.
    let measured = tokio::select! {
        m = window => m,
        Some(failed) = tasks.join_next() => {
            failed??;
            bail!("a session ended before the window closed");
        }
    };
    stop.store(true, Ordering::Relaxed);
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(measured)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.sessions == 0 || args.workers == 0 || args.deltas == 0 {
        bail!("sessions, workers and deltas must be at least 1");
    }
    let fleet_bin = args.bins.fleet()?;
    let sim_bin = args.bins.sim()?;
    // As fast as the simulator can: no pause between deltas.
    let script = Script {
        turn_ms: 0,
        deltas: args.deltas,
    };
    // Short paths: socket paths must stay under ~100 bytes.
    let dir = tempfile::Builder::new().prefix("nr").tempdir_in("/tmp")?;
    let files = SimFleet {
        tenants: 1,
        workers: args.workers,
        script,
        sim_bin: sim_bin.clone(),
        node: None,
        nice: args.worker_nice,
    }
    .write(dir.path())?;
    println!(
        "notify-rate: {} sessions on {} simulated workers, turns of {} deltas ({} words), {} s window after {} s warm-up",
        args.sessions, args.workers, args.deltas, args.words, args.duration_secs, args.warmup_secs
    );

    // --- through codex-fleet ---
    let log_path = dir.path().join("fleet.log");
    let (mut child, wss, admin) = codex_fleet_bench::spawn_fleet_config(
        &fleet_bin,
        &files.config,
        "warn",
        Stdio::from(std::fs::File::create(&log_path)?),
    )
    .await
    .with_context(|| format!("see {}", log_path.display()))?;
    let pid = child.id().context("fleet pid")?;
    wait_workers_ready(&mut child, admin, args.workers, Duration::from_millis(50))
        .await
        .with_context(|| format!("see {}", log_path.display()))?;
    let url = format!("wss://localhost:{}/", wss.port());
    let tls = testkit::client_tls(&files.ca)?;
    let token = files.tokens[0].clone();
    let (fleet, fleet_cpu) = phase(
        &args,
        |_| {
            let (url, tls, token) = (url.clone(), tls.clone(), token.clone());
            async move { connect_wss(&url, tls, &token).await }
        },
        || codex_fleet_bench::cpu_secs(pid),
    )
    .await
    .with_context(|| format!("through codex-fleet (see {})", log_path.display()))?;
    drop(child);

    // --- directly on bare simulators ---
    let (sims, socks) = start_sims(
        &sim_bin,
        &dir.path().join("d"),
        args.workers,
        script,
        args.worker_nice,
    )
    .await?;
    let (direct, _) = phase(
        &args,
        |i| {
            let sock = socks[i % socks.len()].clone();
            async move { connect_unix(&sock).await }
        },
        || None,
    )
    .await
    .context("directly on the simulators")?;
    drop(sims);

    // --- report ---
    for (name, w) in [
        ("through codex-fleet (wss, TLS)", &fleet),
        ("direct on simulator sockets (ws over unix)", &direct),
    ] {
        println!(
            "{name}: {} notifications ({} deltas, {} turns completed, fewest deltas in a turn {}) in {:.2} s = {:.0} notifications/s",
            w.notifications,
            w.deltas,
            w.turns,
            w.fewest_deltas
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            w.wall.as_secs_f64(),
            w.per_sec()
        );
    }
    if fleet.notifications == 0 || direct.notifications == 0 {
        bail!("a phase received no notification");
    }
    println!(
        "through/direct = {:.2}; forwarded {:.0}/s against the goal of ≥ {GOAL_PER_SEC:.0}/s: {}",
        fleet.per_sec() / direct.per_sec(),
        fleet.per_sec(),
        if fleet.per_sec() >= GOAL_PER_SEC {
            "met"
        } else {
            "not met"
        }
    );
    let cpu = fleet_cpu.context("codex-fleet's CPU time")?;
    println!(
        "codex-fleet CPU: {cpu:.2} s in the {:.2} s window ({:.0}% of one core) = {:.3} CPU s per 100k notifications",
        fleet.wall.as_secs_f64(),
        100.0 * cpu / fleet.wall.as_secs_f64(),
        cpu * 100_000.0 / fleet.notifications as f64
    );
    Ok(())
}
