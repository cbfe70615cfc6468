//! `fleet-load` (BENCHMARKS.md, bench 4): starts the built `codex-fleet` with simulated workers
//! (`codex-app-server-sim`), T tenants × W workers, runs S sessions of K turns each over wss, runs
//! the same sessions directly against simulator sockets (as many as the fleet path runs workers,
//! by default), then through the floor relay
//! (`floor-relay --upstream-dir`, wss and TLS but no routing, `codex_fleet_bench::floor`) onto
//! those same sockets, each session to the socket its direct run used, then through the routing
//! floor (the same relay reading every frame as a router that routes by thread must,
//! [`Routing::Read`]). Prints readiness time, turns per second and latency on the four paths, the
//! ratios of each to direct and of codex-fleet to each floor, the CPU codex-fleet and the floors
//! spent on the turns, and codex-fleet's memory. With `--edge` the sessions go through an edge in front of codex-fleet as a node (two
//! hops), as `ops/bench/pgo.sh` trains both roles. Loopback only; bounded in count and time.

use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use codex_fleet_bench::floor::{Routing, Upstream};
use codex_fleet_bench::rpc::{connect_unix, connect_wss, Rpc};
use codex_fleet_bench::sim::{start_sims, wait_workers_ready, Script, SimFleet};
use codex_fleet_bench::{
    cpu_secs, cpu_secs_named, machine_busy_secs, machine_irq_secs, peak_rss_kib, terminate,
    Binaries, Work,
};
use proto::Method;
use serde_json::json;
use testkit::rss_kib;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio::time::Instant;

/// The simulators' process name (`/proc/<pid>/comm`), on every path.
const SIM_NAME: &str = "codex-app-server-sim";

/// The goal (BENCHMARKS.md, bench 4): turns per second through the fleet at least this share of
/// direct.
const GOAL_RATIO: f64 = 0.7;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "fleet-load",
    about = "Load test of codex-fleet with simulated app-server workers"
)]
struct Args {
    /// Tenants.
    #[arg(long, default_value_t = 50)]
    tenants: usize,
    /// Workers per tenant (min_workers = max_workers = this).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Client sessions (spread round-robin over tenants), all concurrent.
    #[arg(long, default_value_t = 200)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// `thread/read` requests per turn (pure request/response latency samples).
    #[arg(long, default_value_t = 2)]
    reads: usize,
    /// Simulated turn duration (sim.turn_ms).
    #[arg(long, default_value_t = 20)]
    turn_ms: u64,
    /// Deltas per turn (sim.deltas).
    #[arg(long, default_value_t = 8)]
    deltas: u64,
    /// Simulator processes for the direct baseline and the floor relay (capped by tenants ×
    /// workers). By default as many as the fleet path runs, so every path spreads the sessions
    /// over as many processes: on 16 (the default until 2026-12-03) direct ran about 1.5× as
    /// fast as on 100, fewer processes waking for the same frames (BENCHMARKS.md, bench 4).
    #[arg(long)]
    direct_workers: Option<usize>,
    /// Steps below codex-fleet's CPU priority the simulators run at, on every path
    /// (`workers.nice` of codex-fleet's config; the direct path's through `nice(1)`).
    #[arg(long, default_value_t = router::config::DEFAULT_WORKER_NICE)]
    worker_nice: u8,
    #[command(flatten)]
    bins: Binaries,
    /// Give up after this long in total.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// How often `/readyz` is polled while workers start (each poll renders every worker).
    #[arg(long, default_value_t = 50)]
    ready_poll_ms: u64,
    /// Keep the generated directory (config, logs) and print its path.
    #[arg(long)]
    keep: bool,
    /// Sessions go through an edge in front of codex-fleet as a node (two hops: the edge's TLS,
    /// token and admission, then the mutual-TLS link), instead of straight to codex-fleet.
    #[arg(long)]
    edge: bool,
}

struct Samples(Vec<Duration>);

impl Samples {
    fn pct(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let mut v = self.0.clone();
        v.sort();
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        v[i]
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

#[derive(Default)]
struct SessionStats {
    latencies: Vec<Duration>,
    turn_latencies: Vec<Duration>,
    turns: usize,
    deltas: usize,
    /// Frames the session read over its turns that it did not ask for (notifications and server
    /// requests, deltas included).
    unasked: u64,
}

/// One session: initialize, thread/start, wait at the barrier, then K × (turn, reads).
async fn session<S: AsyncRead + AsyncWrite + Unpin>(
    mut rpc: Rpc<S>,
    args: &Args,
    arrived: &AtomicUsize,
    mut go: watch::Receiver<bool>,
) -> anyhow::Result<SessionStats> {
    let mut stats = SessionStats::default();
    let r = async {
        stats.latencies.push(rpc.initialize("fleet-load").await?);
        let (thread, took) = rpc.start_thread().await?;
        stats.latencies.push(took);
        anyhow::Ok(thread)
    }
    .await;
    arrived.fetch_add(1, Ordering::SeqCst);
    let thread = r?;
    let _ = go.wait_for(|g| *g).await;
    let unasked_before = rpc.unasked;
    for k in 0..args.turns {
        let t0 = Instant::now();
        let took = rpc.start_turn(&thread, &format!("load turn {k}")).await?;
        stats.latencies.push(took);
        rpc.until_turn_completed(&thread, |m| {
            if *m == Method::AgentMessageDelta {
                stats.deltas += 1;
            }
        })
        .await?;
        stats.turn_latencies.push(t0.elapsed());
        stats.turns += 1;
        for _ in 0..args.reads {
            let (_, took) = rpc
                .call(Method::ThreadRead, json!({"threadId": thread}))
                .await?;
            stats.latencies.push(took);
        }
    }
    stats.unasked = rpc.unasked - unasked_before;
    let _ = rpc.client.close().await;
    Ok(stats)
}

struct PhaseResult {
    ok: usize,
    failed: usize,
    first_error: Option<String>,
    turns: usize,
    deltas: usize,
    unasked: u64,
    turn_wall: Duration,
    latencies: Samples,
    turn_latencies: Samples,
    /// What `at_barrier` sampled: the proxy's VmRSS (KiB) and work so far, every session open.
    at_barrier: Option<(u64, Work)>,
    /// CPU seconds over the turns: the whole machine busy, this process (the clients), every
    /// simulator (the other path's idle ones too), and the machine's interrupts.
    machine_secs: Option<f64>,
    client_secs: Option<f64>,
    sims_secs: f64,
    irq_secs: Option<f64>,
}

/// Runs `n` sessions made by `connect(i)`; all connect and start a thread, then (after
/// `at_barrier` ran) all run their turns at once.
async fn phase<S, F, Fut>(
    args: &Args,
    connect: F,
    at_barrier: impl FnOnce() -> Option<(u64, Work)>,
) -> anyhow::Result<PhaseResult>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Rpc<S>>> + Send + 'static,
{
    let arrived = Arc::new(AtomicUsize::new(0));
    let (go_tx, go_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..args.sessions {
        let fut = connect(i);
        let arrived = arrived.clone();
        let go = go_rx.clone();
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            let rpc = match fut.await {
                Ok(r) => r,
                Err(e) => {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    return Err(e);
                }
            };
            session(rpc, &args, &arrived, go).await
        }));
    }
    while arrived.load(Ordering::SeqCst) < args.sessions {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sampled = at_barrier();
    let me = std::process::id();
    let (sims0, irq0) = (cpu_secs_named(SIM_NAME), machine_irq_secs());
    let (machine0, client0) = (machine_busy_secs(), cpu_secs(me));
    let t0 = Instant::now();
    let _ = go_tx.send(true);
    let mut res = PhaseResult {
        ok: 0,
        failed: 0,
        first_error: None,
        turns: 0,
        deltas: 0,
        unasked: 0,
        turn_wall: Duration::ZERO,
        latencies: Samples(Vec::new()),
        turn_latencies: Samples(Vec::new()),
        at_barrier: sampled,
        machine_secs: None,
        client_secs: None,
        sims_secs: 0.0,
        irq_secs: None,
    };
    for t in tasks {
        match t.await? {
            Ok(s) => {
                res.ok += 1;
                res.turns += s.turns;
                res.deltas += s.deltas;
                res.unasked += s.unasked;
                res.latencies.0.extend(s.latencies);
                res.turn_latencies.0.extend(s.turn_latencies);
            }
            Err(e) => {
                res.failed += 1;
                res.first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }
    res.turn_wall = t0.elapsed();
    res.machine_secs = machine0.zip(machine_busy_secs()).map(|(a, b)| b - a);
    res.client_secs = client0.zip(cpu_secs(me)).map(|(a, b)| b - a);
    res.sims_secs = cpu_secs_named(SIM_NAME) - sims0;
    res.irq_secs = irq0.zip(machine_irq_secs()).map(|(a, b)| b - a);
    Ok(res)
}

/// [`phase`] over wss to a proxy (`pid`): session `i` connects to `url(i)` with the `i`th token
/// (round robin), and the proxy's memory and work are sampled when all are open.
async fn wss_phase(
    args: &Args,
    tls: &Arc<rustls::ClientConfig>,
    tokens: &Arc<Vec<String>>,
    url: impl Fn(usize) -> String,
    pid: u32,
) -> anyhow::Result<PhaseResult> {
    phase(
        args,
        |i| {
            let url = url(i);
            let tls = tls.clone();
            let token = tokens[i % tokens.len()].clone();
            async move { connect_wss(&url, tls, &token).await }
        },
        || Some((rss_kib(pid)?, Work::of(pid)?)),
    )
    .await
}

fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

fn turns_per_sec(r: &PhaseResult) -> f64 {
    r.turns as f64 / r.turn_wall.as_secs_f64().max(1e-9)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    codex_fleet_bench::raise_nofile()?;
    let deadline = Duration::from_secs(args.timeout_secs);
    match tokio::time::timeout(deadline, run(args)).await {
        Ok(r) => r,
        Err(_) => bail!("gave up after the time limit (--timeout-secs)"),
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    if args.tenants == 0 || args.workers == 0 || args.sessions == 0 {
        bail!("tenants, workers and sessions must be at least 1");
    }
    let fleet_bin = args.bins.fleet()?;
    let sim_bin = args.bins.sim()?;
    // Short paths: socket paths must stay under ~100 bytes.
    let dir = tempfile::Builder::new().prefix("fl").tempdir_in("/tmp")?;
    let script = Script {
        turn_ms: args.turn_ms,
        deltas: args.deltas,
    };
    let spec = SimFleet {
        tenants: args.tenants,
        workers: args.workers,
        script,
        sim_bin: sim_bin.clone(),
        node: args.edge.then(|| "n1".to_owned()),
        nice: args.worker_nice,
    };
    let total_workers = spec.total_workers();
    let files = spec.write(dir.path())?;

    println!(
        "fleet-load: {} tenants × {} simulated workers = {total_workers} workers, {} sessions × {} turns ({} ms, {} deltas), {} thread/read per turn",
        args.tenants, args.workers, args.sessions, args.turns, args.turn_ms, args.deltas, args.reads
    );
    println!(
        "  codex-fleet: {}\n  simulator:   {}",
        fleet_bin.display(),
        sim_bin.display()
    );

    // --- start codex-fleet ---
    let log_path = dir.path().join("fleet.log");
    let log = std::fs::File::create(&log_path)?;
    let t_spawn = Instant::now();
    let (config, edge_config) = if args.edge {
        let (node, edge) = files.behind_edge(dir.path())?;
        (node, Some(edge))
    } else {
        (files.config.clone(), None)
    };
    let role = if args.edge { "node" } else { "serve" };
    let (mut child, wss, admin) =
        codex_fleet_bench::spawn_role_config(&fleet_bin, role, &config, "warn", Stdio::from(log))
            .await
            .with_context(|| format!("see {}", log_path.display()))?;
    let pid = child.id().context("fleet pid")?;
    let listening_at = t_spawn.elapsed();
    println!("  admin: http://{admin}/ (watch it with: codex-fleet top --admin http://{admin})");
    let rss_listening = rss_kib(pid);
    wait_workers_ready(
        &mut child,
        admin,
        total_workers,
        Duration::from_millis(args.ready_poll_ms),
    )
    .await
    .with_context(|| format!("see {}", log_path.display()))?;
    let ready_at = t_spawn.elapsed();
    // Let the pool settle (no starts in flight) before the idle sample.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_ready = rss_kib(pid);
    println!(
        "\ncodex-fleet printed its ports {} after spawn; all {total_workers} workers ready {} after spawn",
        ms(listening_at),
        ms(ready_at)
    );
    // With --edge, the clients' end is an edge in front of the node.
    let (mut edge, url) = match &edge_config {
        Some(edge_config) => {
            let edge_log = dir.path().join("edge.log");
            let (edge, edge_wss, _) = codex_fleet_bench::spawn_role_config(
                &fleet_bin,
                "serve",
                edge_config,
                "warn",
                Stdio::from(std::fs::File::create(&edge_log)?),
            )
            .await
            .with_context(|| format!("see {}", edge_log.display()))?;
            println!(
                "  an edge in front of it: wss://localhost:{}/",
                edge_wss.port()
            );
            (Some(edge), format!("wss://localhost:{}/", edge_wss.port()))
        }
        None => (None, format!("wss://localhost:{}/", wss.port())),
    };

    // --- phase 1: through codex-fleet ---
    let tls = testkit::client_tls(&files.ca)?;
    let tokens = Arc::new(files.tokens);
    let fleet = wss_phase(&args, &tls, &tokens, |_| url.clone(), pid).await?;
    let cpu_end = Work::of(pid);
    let rss_end = rss_kib(pid);
    let hwm = peak_rss_kib(pid);

    // --- phase 2: directly on simulator sockets ---
    let direct_n = args
        .direct_workers
        .unwrap_or(total_workers)
        .clamp(1, total_workers);
    let (sims, socks) = start_sims(
        &sim_bin,
        &dir.path().join("d"),
        direct_n,
        script,
        args.worker_nice,
    )
    .await?;
    let socks = Arc::new(socks);
    let direct = phase(
        &args,
        |i| {
            let sock = socks[i % socks.len()].clone();
            async move { connect_unix(&sock).await }
        },
        || None,
    )
    .await?;

    // --- phases 3 and 4: through the floor relay, then the routing floor, onto the same
    // simulator sockets ---
    let through_floor = |routing: Routing| {
        let log = dir.path().join(match routing {
            Routing::None => "floor.log",
            Routing::Read => "floor-route.log",
        });
        let (args, dir, tls, tokens, socks) = (&args, dir.path(), &tls, &tokens, &socks);
        async move {
            let (mut child, addr) = codex_fleet_bench::floor::spawn(
                &dir.join("tls.crt"),
                &dir.join("tls.key"),
                &Upstream::Dir(dir.join("d")),
                None,
                routing,
                Stdio::from(std::fs::File::create(&log)?),
            )
            .await
            .with_context(|| format!("see {}", log.display()))?;
            let pid = child.id().context("floor-relay pid")?;
            // `start_sims` names its sockets `d/0.sock`…: session i goes where its direct run did.
            let url = |i| format!("wss://localhost:{}/{}", addr.port(), i % socks.len());
            let result = wss_phase(args, tls, tokens, url, pid).await?;
            let cpu_end = Work::of(pid);
            if terminate(&mut child, Duration::from_secs(10))
                .await?
                .is_none()
            {
                println!("\nthe floor relay did not exit within 10 s of SIGTERM; killed it");
            }
            anyhow::Ok((result, cpu_end))
        }
    };
    let (floor, floor_cpu_end) = through_floor(Routing::None).await?;
    let (routed, routed_cpu_end) = through_floor(Routing::Read).await?;
    drop(sims);

    // --- stop codex-fleet (its edge first) ---
    if let Some(edge) = edge.as_mut() {
        if terminate(edge, Duration::from_secs(30)).await?.is_none() {
            println!("\nthe edge did not exit within 30 s of SIGTERM; killed it");
        }
    }
    let t_term = Instant::now();
    let status = terminate(&mut child, Duration::from_secs(30)).await;
    let stop_took = t_term.elapsed();

    // --- report ---
    let report = |name: &str, r: &PhaseResult| {
        println!(
            "\n{name}: {} sessions ok, {} failed{}",
            r.ok,
            r.failed,
            r.first_error
                .as_ref()
                .map(|e| format!(" (first error: {e})"))
                .unwrap_or_default()
        );
        println!(
            "  turns: {} in {:.2} s = {:.0} turns/s ({} deltas received; {:.1} frames per turn unasked for, deltas included)",
            r.turns,
            r.turn_wall.as_secs_f64(),
            turns_per_sec(r),
            r.deltas,
            r.unasked as f64 / r.turns.max(1) as f64
        );
        println!(
            "  request latency (initialize, thread/start, turn/start, thread/read; n={}): p50 {} p99 {}",
            r.latencies.0.len(),
            ms(r.latencies.pct(0.5)),
            ms(r.latencies.pct(0.99))
        );
        println!(
            "  turn latency (turn/start to turn/completed, sim.turn_ms={}): p50 {} p99 {}",
            args.turn_ms,
            ms(r.turn_latencies.pct(0.5)),
            ms(r.turn_latencies.pct(0.99))
        );
    };
    report(
        if args.edge {
            "through an edge and codex-fleet as its node (wss, TLS, the mutual-TLS link)"
        } else {
            "through codex-fleet (wss, TLS)"
        },
        &fleet,
    );
    report(
        &format!("direct on {direct_n} simulator sockets (ws over unix)"),
        &direct,
    );
    report(
        &format!("through the floor relay onto the same {direct_n} sockets (wss, TLS, no routing)"),
        &floor,
    );
    report(
        &format!(
            "through the routing floor onto the same {direct_n} sockets (wss, TLS, frames read to route)"
        ),
        &routed,
    );
    let through = turns_per_sec(&fleet) / turns_per_sec(&direct).max(1e-9);
    println!(
        "\nturns/s through/direct = {through:.2} (goal ≥ {GOAL_RATIO}: {})",
        if through >= GOAL_RATIO {
            "met"
        } else {
            "not met"
        }
    );
    for (name, a, b) in [
        ("floor/direct", &floor, &direct),
        ("through/floor", &fleet, &floor),
        ("routing floor/direct", &routed, &direct),
        ("through/routing floor", &fleet, &routed),
    ] {
        let r = turns_per_sec(a) / turns_per_sec(b).max(1e-9);
        println!("turns/s {name} = {r:.2}");
    }
    let ratio = |a: &PhaseResult, b: &PhaseResult, s: fn(&PhaseResult) -> &Samples, p: f64| {
        s(a).pct(p).as_secs_f64() / s(b).pct(p).as_secs_f64().max(1e-9)
    };
    for (name, a, b) in [
        ("fleet/direct", &fleet, &direct),
        ("floor/direct", &floor, &direct),
        ("fleet/floor", &fleet, &floor),
        ("routing floor/direct", &routed, &direct),
        ("fleet/routing floor", &fleet, &routed),
    ] {
        println!(
            "latency ratio {name}: requests p50 {:.1}×, p99 {:.1}×; turns p50 {:.1}×, p99 {:.1}×",
            ratio(a, b, |r| &r.latencies, 0.5),
            ratio(a, b, |r| &r.latencies, 0.99),
            ratio(a, b, |r| &r.turn_latencies, 0.5),
            ratio(a, b, |r| &r.turn_latencies, 0.99)
        );
    }
    for (name, r, end) in [
        ("codex-fleet", &fleet, cpu_end),
        ("floor relay", &floor, floor_cpu_end),
        ("routing floor", &routed, routed_cpu_end),
    ] {
        if let (Some((_, w0)), Some(w1)) = (r.at_barrier, end) {
            let w = w1.since(w0);
            let turns = r.turns.max(1) as f64;
            println!(
                "{name} CPU during the turns: {:.2} s in {:.2} s wall ({:.0}% of one core), {:.2} ms per turn (its own code {:.2}, the kernel {:.2}); per turn {:.1} waits and {:.1} preemptions (context switches)",
                w.cpu_secs(),
                r.turn_wall.as_secs_f64(),
                100.0 * w.cpu_secs() / r.turn_wall.as_secs_f64().max(1e-9),
                1000.0 * w.cpu_secs() / turns,
                1000.0 * w.user_secs / turns,
                1000.0 * w.kernel_secs / turns,
                w.voluntary as f64 / turns,
                w.preempted as f64 / turns,
            );
        }
    }
    // Where the machine's CPU went per turn on each path: the clients (this process), the proxy,
    // the simulators (every one: the other paths' idle beside), and the rest: kernel work no
    // process is charged for (interrupts, where the machine accounts them apart) and whatever
    // else ran (codex-fleet idles beside the last three paths).
    for (name, r, proxy) in [
        ("through codex-fleet", &fleet, cpu_end.zip(fleet.at_barrier)),
        ("direct", &direct, None),
        (
            "through the floor",
            &floor,
            floor_cpu_end.zip(floor.at_barrier),
        ),
        (
            "through the routing floor",
            &routed,
            routed_cpu_end.zip(routed.at_barrier),
        ),
    ] {
        if let (Some(m), Some(c)) = (r.machine_secs, r.client_secs) {
            let turns = r.turns.max(1) as f64;
            let p = proxy.map_or(0.0, |(w1, (_, w0))| w1.since(w0).cpu_secs());
            println!(
                "machine CPU per turn {name}: {:.2} ms = clients {:.2} + proxy {:.2} + simulators {:.2} + the rest {:.2} (interrupts {:.2}); cores busy {:.2}",
                1000.0 * m / turns,
                1000.0 * c / turns,
                1000.0 * p / turns,
                1000.0 * r.sims_secs / turns,
                1000.0 * (m - c - p - r.sims_secs) / turns,
                1000.0 * r.irq_secs.unwrap_or(0.0) / turns,
                m / r.turn_wall.as_secs_f64().max(1e-9),
            );
        }
    }
    if let (Some(l), Some(r), Some((s, _)), Some(e), Some(h)) =
        (rss_listening, rss_ready, fleet.at_barrier, rss_end, hwm)
    {
        println!("\ncodex-fleet memory (pid {pid}):");
        println!(
            "  VmRSS at first line {}, all workers ready {}, {} sessions open {}, end {}",
            mib(l),
            mib(r),
            args.sessions,
            mib(s),
            mib(e)
        );
        println!("  VmHWM (peak) {}", mib(h));
        println!(
            "  estimate per worker: {:.1} KiB ((ready - first line) / {total_workers}; an upper bound if workers were already starting)",
            r.saturating_sub(l) as f64 / total_workers as f64
        );
        println!(
            "  estimate per session: {:.1} KiB ((sessions open - ready) / {}; client conn + TLS + worker leg)",
            s.saturating_sub(r) as f64 / args.sessions as f64,
            args.sessions
        );
    }
    match status {
        Ok(Some(st)) => println!("\ncodex-fleet SIGTERM → exit in {} ({st})", ms(stop_took)),
        Ok(None) => println!("\ncodex-fleet did not exit within 30 s of SIGTERM; killed it"),
        Err(e) => println!("\ncodex-fleet stop failed: {e}"),
    }
    if args.keep {
        let kept = dir.keep();
        println!("kept {}", kept.display());
    }
    if fleet.failed > 0 || direct.failed > 0 || floor.failed > 0 || routed.failed > 0 {
        bail!("some sessions failed");
    }
    Ok(())
}
