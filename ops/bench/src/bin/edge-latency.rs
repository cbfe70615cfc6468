//! What the edge→node hop adds (docs/decisions/0014-two-roles-one-binary.md), against HAProxy as
//! the same second hop, side by side in one run: the same `thread/read` round trip (a thread with
//! one turn) measured four ways, interleaved round by round:
//!
//! - `direct-unix`: WebSocket straight onto the node's worker's Unix socket;
//! - `node`: wss onto the node itself with an edge's client certificate (one hop: what
//!   `codex-fleet serve` costs, the same session code behind mutual TLS);
//! - `edge`: wss through an edge (TLS, token, relay over the link) to that node: two hops;
//! - `haproxy`: wss through HAProxy in TCP mode in front of the node the way the edge is: it
//!   terminates the client's TLS with the edge's certificate and opens mutual TLS to the node with
//!   the edge's client certificate, then tunnels bytes (the client sends the tenant header the
//!   node reads, since HAProxy neither authenticates nor adds it): two hops, the second a dumb one.
//!
//! Real processes on loopback (`testkit::Split`: `codex-fleet node` and `codex-fleet serve` with
//! `[nodes]`). Added latency is a path's percentile minus `direct-unix`'s; a second hop's own cost
//! is its path minus `node`, and the edge hop's median over HAProxy's is the ratio to compare.
//! Needs `CODEX_BIN`, a built `codex-fleet` (beside this binary, or `CODEX_FLEET_BIN`) and
//! `haproxy` (`ops/bench/latency.sh` installs it from Debian).

use std::path::PathBuf;

use clap::Parser;
use codex_fleet_bench::latency::{
    added_ratio_interval, connect_unix, connect_ws, connect_ws_with, free_port, interleaved,
    pem_bundle, pooled, start_haproxy, summarize, wait_port, with_interval, within, Summary,
    RESAMPLES,
};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    about = "the edge→node hop's added latency, against HAProxy as the second hop, one hop and the bare worker"
)]
struct Args {
    /// Round trips per path and run.
    #[arg(long, default_value_t = 2000)]
    rounds: usize,
    /// Runs (fresh connections each run).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Then hold this many initialized sessions through the edge and report the edge's memory
    /// per session (0: skip).
    #[arg(long, default_value_t = 500)]
    sessions: usize,
    /// The HAProxy binary.
    #[arg(long, default_value = "haproxy")]
    haproxy: PathBuf,
}

/// Rates and caps out of the way: the bench measures latency, not admission.
const BENCH_LIMITS: &str = "tenant_rps = 1000000\ntenant_burst = 1000000\nconn_fps = 1000000\nconn_burst = 1000000\nmax_connections_per_tenant = 100000\nhandshakes_per_sec_per_ip = 1000000\nhandshake_burst = 1000000";

const PATHS: [&str; 4] = ["direct-unix", "node", "edge", "haproxy"];

/// One run's (or all runs') second hops alone, medians in µs: the edge's and HAProxy's, and
/// the node's round trip they are measured from.
struct Hops {
    /// The node's own round trip (median, µs): the level both hops are measured from. In the
    /// pooled row, the median of the node's samples once each run was moved to the mean of the
    /// runs' direct medians ([`pooled`]): not a mean of the runs' node medians.
    node: f64,
    edge: f64,
    haproxy: f64,
    /// [`added_ratio_interval`] of the edge hop against the HAProxy hop.
    interval: (f64, f64),
}

fn report(label: &str, samples: &[Vec<f64>; 4]) -> Hops {
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
    let haproxy = added(&s[3], &s[0]);
    let haproxy_hop = added(&s[3], &s[1]);
    println!(
        "  added by the node (one hop, as serve): p50 {:>6.0} p99 {:>6.0}",
        node.0, node.1
    );
    println!(
        "  added by edge + node (two hops):       p50 {:>6.0} p99 {:>6.0}",
        edge.0, edge.1
    );
    println!(
        "  added by HAProxy + node (two hops):    p50 {:>6.0} p99 {:>6.0}",
        haproxy.0, haproxy.1
    );
    println!(
        "  added by the edge hop alone:           p50 {:>6.0} p99 {:>6.0}",
        hop.0, hop.1
    );
    println!(
        "  added by the HAProxy hop alone:        p50 {:>6.0} p99 {:>6.0}",
        haproxy_hop.0, haproxy_hop.1
    );
    // Both hops are measured from the node's round trip, as their ratio is.
    let interval = added_ratio_interval(&samples[2], &samples[3], &samples[1]);
    println!(
        "  edge hop median / HAProxy hop median = {:.2}; {}",
        hop.0 / haproxy_hop.0,
        within(interval)
    );
    Hops {
        node: s[1].p50,
        edge: hop.0,
        haproxy: haproxy_hop.0,
        interval,
    }
}

/// HAProxy in TCP mode in front of the node at `node_port` as an edge is: the client's TLS ends
/// with the fleet's certificate, the node's starts with the edge's client certificate.
fn start_haproxy_hop(
    bin: &std::path::Path,
    split: &testkit::Split,
    port: u16,
    node_port: u16,
) -> anyhow::Result<tokio::process::Child> {
    let dir = split.files.dir.path();
    let link = &split.link;
    let client_pem = pem_bundle(
        dir,
        "haproxy-link",
        &link.join("edge.crt"),
        &link.join("edge.key"),
    )?;
    let server = format!(
        "127.0.0.1:{node_port} ssl crt {} ca-file {} verify required sni str(localhost) verifyhost localhost",
        client_pem.display(),
        link.join("ca.pem").display()
    );
    start_haproxy(bin, dir, "haproxy-hop", port, "tcp", &server)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let program = codex_fleet_bench::fleet_bin()?;
    let split = testkit::Split::start_with(&program, &[("acme", "n1")], 1, BENCH_LIMITS).await?;
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

    let proxy_port = free_port()?;
    let _haproxy = start_haproxy_hop(&args.haproxy, &split, proxy_port, split.nodes[0].port)?;
    wait_port(proxy_port).await?;
    let proxy_url = format!("wss://localhost:{proxy_port}/");
    let proxy_tls = testkit::client_tls(&split.files.ca)?;

    let mut runs = Vec::new();
    let mut rows = Vec::new();
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
            connect_ws_with(
                &proxy_url,
                Some(proxy_tls.clone()),
                Some((router::edge::TENANT_HEADER, "acme".to_owned())),
            )
            .await?,
        ];
        let samples = interleaved(&mut conns, args.rounds, "thread/read", &params).await?;
        rows.push((run.to_string(), report(&format!("run {run}"), &samples)));
        runs.push(samples);
    }
    if args.runs > 1 {
        let h = report("all runs (each moved to one level)", &pooled(&runs, 0));
        rows.push(("all, pooled at one level".to_owned(), h));
    }
    println!("the second hop alone, added median, µs, per run, beside the node's own round trip it is measured from (BENCHMARKS.md, bench 5; the ratio with the interval 90% of {RESAMPLES} bootstrap resamples fall in):");
    println!("  | run | node p50 | edge hop | HAProxy hop (TCP/TLS) | edge/HAProxy |");
    println!("  |---|---|---|---|---|");
    for (label, h) in &rows {
        println!(
            "  | {label} | {:.0} | {:.0} | {:.0} | {} |",
            h.node,
            h.edge,
            h.haproxy,
            with_interval(h.edge / h.haproxy, h.interval)
        );
    }
    if args.sessions > 0 {
        let pid = split.edges[0]
            .pid()
            .ok_or_else(|| anyhow::anyhow!("the edge exited"))?;
        let before = testkit::rss_kib(pid).unwrap_or(0);
        let mut held = Vec::with_capacity(args.sessions);
        for _ in 0..args.sessions {
            held.push(split.client(0, "acme").await?);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let after = testkit::rss_kib(pid).unwrap_or(0);
        println!(
            "edge memory: {} initialized sessions relayed, RSS {before} KiB -> {after} KiB: {:.1} KiB per session",
            held.len(),
            after.saturating_sub(before) as f64 / held.len() as f64
        );
    }
    Ok(())
}
