//! Added latency, side by side in one run: the same `thread/read` round trip (a thread with one
//! turn) measured seven ways, interleaved round by round so that whatever else the machine does
//! hits every path alike:
//!
//! - `direct-unix`: WebSocket straight onto the codex-fleet worker's Unix socket;
//! - `fleet`: wss through codex-fleet (TLS, auth, session, admission, policy, routing, leg) to
//!   that same worker;
//! - `haproxy`: wss through HAProxy as a plain TLS WebSocket proxy in front of that same worker's
//!   Unix socket (`server … unix@…`);
//! - `floor`: wss through the floor relay (`floor-relay`, `codex_fleet_bench::floor`): TLS, the
//!   upgrade and a frame relay onto that same worker socket, one task per direction, no parsing:
//!   what tokio, rustls and tungstenite cost with no routing, on tokio's multi-thread runtime as
//!   codex-fleet runs;
//! - `floor-1t`: the same relay on tokio's current-thread runtime (`--worker-threads 1`): no
//!   wake-up crosses threads, so it shows what the runtime's flavour alone costs;
//! - `floor-route`: the floor relay reading every frame as any router that routes by thread must
//!   (`--route`, `codex_fleet_bench::floor::Routing::Read`: the envelope, the `threadId`, a
//!   table lookup, the id kept in flight) and relaying it unchanged: the least a parsing router
//!   adds to this stack;
//! - `direct-ws`: plain `ws://` onto a second app-server on the same CODEX_HOME, listening on
//!   loopback TCP (shown for reference only: app-server's TCP listener leaves Nagle on, so its
//!   two-part writes can wait for the client's delayed ACK, which makes it no fair baseline).
//!
//! Added latency is each proxy's time minus `direct-unix`. The ratios of codex-fleet's added
//! median to HAProxy's, to the floor's and to the routing floor's are the numbers to compare
//! across machines; absolute numbers are not. Needs `CODEX_BIN`, a built `codex-fleet` and
//! `floor-relay` (release, beside this binary, or `CODEX_FLEET_BIN` / `FLOOR_RELAY_BIN`) and
//! `haproxy` on PATH (`ops/bench/latency.sh` installs it from Debian).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use codex_fleet_bench::floor::{Routing, Upstream};
use codex_fleet_bench::latency::{
    added_ratio_interval, connect_unix, connect_ws, free_port, interleaved, pooled, start_haproxy,
    summarize, wait_port, with_interval, within, Summary, RESAMPLES, TIMEOUT, WARM_UP,
};
use serde_json::json;
use testkit::{FleetBuilder, FleetFiles};
use tokio::process::{Child, Command};
use tokio::time::Instant;

#[derive(Parser, Debug)]
#[command(
    about = "codex-fleet's added latency against HAProxy's and the floor's, side by side in one run"
)]
struct Args {
    /// Round trips per path and run (a median of 600 carries about ±10 µs, as large as the
    /// gaps compared; 2,000 take about 15 s a run).
    #[arg(long, default_value_t = 2000)]
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

/// codex-fleet as its own process; returns it with its wss URL once a worker is ready.
async fn start_fleet(files: &FleetFiles) -> anyhow::Result<(Child, String)> {
    let (child, wss, admin) = codex_fleet_bench::spawn_fleet(files).await?;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (_, body) = testkit::http_get(admin, "/readyz").await?;
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
    let mut cmd = Command::new(testkit::codex_bin());
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

/// The floor relay in front of `upstream`, with the fleet's certificate, on `threads` runtime
/// threads (1: current-thread; none: tokio's default), reading frames as `routing` says;
/// returns it with its port.
async fn start_floor(
    dir: &Path,
    upstream: &Path,
    threads: Option<u16>,
    routing: Routing,
) -> anyhow::Result<(Child, u16)> {
    let (child, addr) = codex_fleet_bench::floor::spawn(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        &Upstream::Socket(upstream.to_path_buf()),
        threads,
        routing,
        Stdio::inherit(),
    )
    .await?;
    Ok((child, addr.port()))
}

const PATHS: [&str; 7] = [
    "direct-unix",
    "fleet",
    "haproxy",
    "floor",
    "floor-1t",
    "floor-route",
    "direct-ws",
];

/// One run's (or all runs') added medians in µs: codex-fleet, HAProxy, the floors; and each
/// proxy's CPU time per round trip in µs, in the same order.
struct Added {
    /// The direct path's median round trip: the level the run's others are measured from.
    direct: f64,
    fleet: f64,
    haproxy: f64,
    floor: f64,
    floor_1t: f64,
    floor_route: f64,
    cpu: [f64; 5],
    /// [`added_ratio_interval`] of codex-fleet's against HAProxy, the floor and the routing floor.
    intervals: [(f64, f64); 3],
}

/// The proxies whose CPU time is counted, in [`Added::cpu`]'s order.
const PROXIES: [&str; 5] = [
    "codex-fleet",
    "HAProxy",
    "floor",
    "floor, 1 thread",
    "routing floor",
];

/// Every proxy's CPU time so far, in µs ([`codex_fleet_bench::cpu_micros`]).
fn cpu_now(pids: &[u32; 5]) -> anyhow::Result<[f64; 5]> {
    let mut cpu = [0.0; 5];
    for (c, pid) in cpu.iter_mut().zip(pids) {
        *c = codex_fleet_bench::cpu_micros(*pid)
            .ok_or_else(|| anyhow::anyhow!("no CPU time for pid {pid}: did it exit?"))?;
    }
    Ok(cpu)
}

fn report(label: &str, samples: &[Vec<f64>; 7], cpu: [f64; 5]) -> Added {
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
    let floor = added(&s[3], &s[0]);
    let floor_1t = added(&s[4], &s[0]);
    let floor_route = added(&s[5], &s[0]);
    for (name, a) in [
        ("codex-fleet:", fleet),
        ("HAProxy:", haproxy),
        ("the floor:", floor),
        ("the floor, 1 thread:", floor_1t),
        ("the routing floor:", floor_route),
    ] {
        println!(
            "  added by {name:<20} {:>6.0} {:>6.0} {:>6.0}",
            a.0, a.1, a.2
        );
    }
    let intervals = [2, 3, 5].map(|b| added_ratio_interval(&samples[1], &samples[b], &samples[0]));
    println!(
        "  codex-fleet added median / HAProxy added median = {:.2}; {}",
        fleet.0 / haproxy.0,
        within(intervals[0])
    );
    println!(
        "  codex-fleet added median / floor added median = {:.2}; {}",
        fleet.0 / floor.0,
        within(intervals[1])
    );
    println!(
        "  HAProxy added median / floor added median = {:.2}",
        haproxy.0 / floor.0
    );
    println!(
        "  codex-fleet added median / 1-thread floor added median = {:.2}",
        fleet.0 / floor_1t.0
    );
    println!(
        "  codex-fleet added median / routing floor added median = {:.2}; {}",
        fleet.0 / floor_route.0,
        within(intervals[2])
    );
    println!(
        "  routing floor added median / floor added median = {:.2}",
        floor_route.0 / floor.0
    );
    print!("  CPU per round trip, µs:");
    for (name, c) in PROXIES.iter().zip(cpu) {
        print!(" {name} {c:.1};");
    }
    println!();
    Added {
        direct: s[0].p50,
        fleet: fleet.0,
        haproxy: haproxy.0,
        floor: floor.0,
        floor_1t: floor_1t.0,
        floor_route: floor_route.0,
        cpu,
        intervals,
    }
}

/// The runs side by side: added medians and the two ratios the goal is stated in, each of
/// codex-fleet's ratios with the interval 90% of its resamples fall in.
fn table(rows: &[(String, Added)]) {
    println!("added median, µs, per run (BENCHMARKS.md, bench 1; codex-fleet's ratios with the interval 90% of {RESAMPLES} bootstrap resamples fall in):");
    println!(
        "  | run | direct p50 | codex-fleet | HAProxy | floor | floor, 1 thread | routing floor | fleet/HAProxy | fleet/floor | fleet/floor 1 thread | fleet/routing floor | routing floor/floor | CPU µs per round trip: fleet / HAProxy / floor / floor 1t / routing floor |"
    );
    println!("  |---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (label, a) in rows {
        println!(
            "  | {label} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {:.2} | {} | {:.2} | {:.1} / {:.1} / {:.1} / {:.1} / {:.1} |",
            a.direct,
            a.fleet,
            a.haproxy,
            a.floor,
            a.floor_1t,
            a.floor_route,
            with_interval(a.fleet / a.haproxy, a.intervals[0]),
            with_interval(a.fleet / a.floor, a.intervals[1]),
            a.fleet / a.floor_1t,
            with_interval(a.fleet / a.floor_route, a.intervals[2]),
            a.floor_route / a.floor,
            a.cpu[0],
            a.cpu[1],
            a.cpu[2],
            a.cpu[3],
            a.cpu[4]
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        // Both workers share the tenant's CODEX_HOME, so both run as this user.
        .workers_toml("per_tenant_uid = false")
        // Rates high enough that long runs measure the path, not the limiter's refusals (the
        // limiter still checks every frame).
        .limits_toml("tenant_rps = 1000000\ntenant_burst = 1000000\nconn_fps = 1000000\nconn_burst = 1000000")
        .prepare()
        .await?;
    let dir = files.dir.path().to_path_buf();
    let home = dir.join("s/tenants/acme");
    let socket = dir.join("s/sockets/acme/0.sock");
    let (fleet, url) = start_fleet(&files).await?;
    let token = files.token("acme");

    // A thread with one turn, made through the fleet; both workers read it from disk.
    let mut setup = testkit::Client::connect(&url, &files.ca, Some(&token)).await?;
    setup.initialize("bench-setup").await?;
    let thread = setup.start_thread().await?;
    setup.start_turn(&thread, "hello").await?;
    setup.until_turn_completed(&thread).await?;

    let ws_port = free_port()?;
    let _ws_worker = start_ws_worker(&files, &home, ws_port)?;
    wait_port(ws_port).await?;
    let proxy_port = free_port()?;
    let haproxy = start_haproxy(
        &args.haproxy,
        &dir,
        "haproxy",
        proxy_port,
        "http",
        &format!("unix@{}", socket.display()),
    )?;
    wait_port(proxy_port).await?;
    let (floor, floor_port) = start_floor(&dir, &socket, None, Routing::None).await?;
    let (floor_1t, floor_1t_port) = start_floor(&dir, &socket, Some(1), Routing::None).await?;
    let (floor_route, floor_route_port) = start_floor(&dir, &socket, None, Routing::Read).await?;
    let pid = |c: &Child| {
        c.id()
            .ok_or_else(|| anyhow::anyhow!("a proxy exited early"))
    };
    let pids = [
        pid(&fleet)?,
        pid(&haproxy)?,
        pid(&floor)?,
        pid(&floor_1t)?,
        pid(&floor_route)?,
    ];

    let params = json!({"threadId": thread, "includeTurns": args.include_turns});
    let mut runs = Vec::new();
    let mut all_cpu = [0.0; 5];
    let mut rows = Vec::new();
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
            connect_ws(
                &format!("wss://localhost:{floor_port}/"),
                Some(&files.ca),
                None,
            )
            .await?,
            connect_ws(
                &format!("wss://localhost:{floor_1t_port}/"),
                Some(&files.ca),
                None,
            )
            .await?,
            connect_ws(
                &format!("wss://localhost:{floor_route_port}/"),
                Some(&files.ca),
                None,
            )
            .await?,
            connect_ws(&format!("ws://127.0.0.1:{ws_port}/"), None, None).await?,
        ];
        let before = cpu_now(&pids)?;
        let samples = interleaved(&mut conns, args.rounds, "thread/read", &params).await?;
        let after = cpu_now(&pids)?;
        // Each connection's warm-up calls count too: the CPU time covers them.
        let calls = (args.rounds + WARM_UP) as f64;
        let cpu: [f64; 5] = std::array::from_fn(|i| (after[i] - before[i]) / calls);
        for (a, c) in all_cpu.iter_mut().zip(cpu) {
            *a += c / args.runs as f64;
        }
        rows.push((
            run.to_string(),
            report(&format!("run {run}"), &samples, cpu),
        ));
        runs.push(samples);
    }
    if args.runs > 1 {
        let a = report(
            "all runs (each moved to one level)",
            &pooled(&runs, 0),
            all_cpu,
        );
        rows.push(("all, pooled at one level".to_owned(), a));
    }
    table(&rows);
    Ok(())
}
