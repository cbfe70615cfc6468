//! What the edge→node hop adds (docs/decisions/0014-two-roles-one-binary.md), side by side in one
//! run: the same `thread/read` round trip (a thread with one turn) measured three ways, interleaved
//! round by round:
//!
//! - `direct-unix`: WebSocket straight onto the node's worker's Unix socket;
//! - `node`: wss onto the node itself with an edge's client certificate (one hop: what
//!   `codex-fleet serve` costs, the same session code behind mutual TLS);
//! - `edge`: wss through an edge (TLS, token, relay over the link) to that node: two hops.
//!
//! Real processes on loopback (`e2e::Split`: `codex-fleet node` and `codex-fleet serve` with
//! `[nodes]`). Added latency is a path's percentile minus `direct-unix`'s; the edge's own cost is
//! `edge` minus `node`. Needs `CODEX_BIN` and a built `codex-fleet` (beside this binary, or
//! `CODEX_FLEET_BIN`).

use clap::Parser;
use codex_fleet_bench::latency::{
    connect_unix, connect_ws, connect_ws_with, interleaved, summarize, Summary,
};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "the edge→node hop's added latency, against one hop and the bare worker")]
struct Args {
    /// Round trips per path and run.
    #[arg(long, default_value_t = 600)]
    rounds: usize,
    /// Runs (fresh connections each run).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Then hold this many initialized sessions through the edge and report the edge's memory
    /// per session (0: skip).
    #[arg(long, default_value_t = 500)]
    sessions: usize,
}

/// Rates and caps out of the way: the bench measures latency, not admission.
const BENCH_LIMITS: &str = "tenant_rps = 1000000\ntenant_burst = 1000000\nconn_fps = 1000000\nconn_burst = 1000000\nmax_connections_per_tenant = 100000\nhandshakes_per_sec_per_ip = 1000000\nhandshake_burst = 1000000";

const PATHS: [&str; 3] = ["direct-unix", "node", "edge"];

fn report(label: &str, samples: &[Vec<f64>; 3]) {
    let s: Vec<Summary> = samples.iter().map(|v| summarize(v)).collect();
    println!(
        "{label}: round trip in µs (p50 / p99 / p99.9), {} rounds",
        samples[0].len()
    );
    for (name, s) in PATHS.iter().zip(&s) {
        println!("  {name:<12} {:>8.0} {:>8.0} {:>8.0}", s.p50, s.p99, s.p999);
    }
    let added = |a: &Summary, b: &Summary| (a.p50 - b.p50, a.p99 - b.p99);
    let node = added(&s[1], &s[0]);
    let edge = added(&s[2], &s[0]);
    let hop = added(&s[2], &s[1]);
    println!(
        "  added by the node (one hop, as serve): p50 {:>6.0} p99 {:>6.0}",
        node.0, node.1
    );
    println!(
        "  added by edge + node (two hops):       p50 {:>6.0} p99 {:>6.0}",
        edge.0, edge.1
    );
    println!(
        "  added by the edge hop alone:           p50 {:>6.0} p99 {:>6.0}",
        hop.0, hop.1
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let program = codex_fleet_bench::fleet_bin()?;
    let split = e2e::Split::start_with(&program, &[("acme", "n1")], 1, BENCH_LIMITS).await?;
    let token = split.token("acme");
    let edge_url = split.edges[0].url();
    let node_url = format!("wss://localhost:{}/", split.nodes[0].port);
    let link = &split.link;
    let node_tls = router::tls::client_config_mutual(
        &link.join("ca.pem"),
        &link.join("edge.crt"),
        &link.join("edge.key"),
    )?
    .0;
    let socket = split.files.dir.path().join("n1/sockets/acme/0.sock");

    // A thread with one turn, made through the edge.
    let mut setup = split.client(0, "acme").await?;
    let thread = setup.start_thread().await?;
    setup.start_turn(&thread, "hello").await?;
    setup.until_turn_completed(&thread).await?;
    let params = json!({"threadId": thread, "includeTurns": false});

    let mut all: [Vec<f64>; 3] = Default::default();
    for run in 1..=args.runs {
        let mut conns = [
            connect_unix(&socket).await?,
            connect_ws_with(
                &node_url,
                Some(node_tls.clone()),
                Some((router::edge::TENANT_HEADER, "acme".to_owned())),
            )
            .await?,
            connect_ws(&edge_url, Some(&split.files.ca), Some(&token)).await?,
        ];
        let samples = interleaved(&mut conns, args.rounds, "thread/read", &params).await?;
        report(&format!("run {run}"), &samples);
        for (a, s) in all.iter_mut().zip(samples) {
            a.extend(s);
        }
    }
    if args.runs > 1 {
        report("all runs", &all);
    }
    if args.sessions > 0 {
        let pid = split.edges[0]
            .pid()
            .ok_or_else(|| anyhow::anyhow!("the edge exited"))?;
        let before = e2e::rss_kib(pid).unwrap_or(0);
        let mut held = Vec::with_capacity(args.sessions);
        for _ in 0..args.sessions {
            held.push(split.client(0, "acme").await?);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let after = e2e::rss_kib(pid).unwrap_or(0);
        println!(
            "edge memory: {} initialized sessions relayed, RSS {before} KiB -> {after} KiB: {:.1} KiB per session",
            held.len(),
            after.saturating_sub(before) as f64 / held.len() as f64
        );
    }
    Ok(())
}
