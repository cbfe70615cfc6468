//! The floor relay as a process (`codex_fleet_bench::floor`): TLS termination and a WebSocket
//! relay onto a Unix socket, frame by frame, with no routing. `added-latency` runs it in front
//! of the same worker socket as codex-fleet and HAProxy (`--upstream`), `fleet-load` in front of
//! the simulators its direct path uses, one per session (`--upstream-dir`): the floor codex-fleet
//! is measured against. Prints `floor-relay listening on <addr>` on stdout once it accepts; exits
//! cleanly on SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use codex_fleet_bench::floor::{Routing, Upstream};
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(
    about = "a minimal wss → Unix-socket WebSocket relay: the floor added-latency and fleet-load measure"
)]
struct Args {
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Server certificate (PEM).
    #[arg(long)]
    cert: PathBuf,
    /// Its private key (PEM).
    #[arg(long)]
    key: PathBuf,
    #[command(flatten)]
    target: Target,
    /// Runtime threads: 1 runs tokio's current-thread runtime, more a multi-thread runtime of
    /// that size; unset, tokio's multi-thread default (one per core), as codex-fleet runs.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: Option<u16>,
    /// Read every frame as a router that routes by thread must (its envelope, its thread looked
    /// up, its id kept in flight until the answer), relaying it unchanged: the least a parsing
    /// router adds to this stack (`codex_fleet_bench::floor::Routing::Read`).
    #[arg(long)]
    route: bool,
}

/// Where clients go: one of the two.
#[derive(clap::Args, Debug)]
#[group(required = true, multiple = false)]
struct Target {
    /// The Unix socket every client is relayed to, one WebSocket per client.
    #[arg(long)]
    upstream: Option<PathBuf>,
    /// A directory of Unix sockets: a client asking for `/a/b` is relayed to `DIR/a/b.sock`
    /// (segments of letters, digits, `-`, `_`, `.`; anything else is answered 400).
    #[arg(long, value_name = "DIR")]
    upstream_dir: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut rt = match args.worker_threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(usize::from(n));
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    rt.enable_all().build()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let upstream = match (args.target.upstream, args.target.upstream_dir) {
        (Some(s), _) => Upstream::Socket(s),
        (None, Some(d)) => {
            if !d.is_dir() {
                bail!("--upstream-dir {}: not a directory", d.display());
            }
            Upstream::Dir(d)
        }
        (None, None) => bail!("--upstream or --upstream-dir is needed"),
    };
    // A session holds two sockets here; a bench may open thousands.
    codex_fleet_bench::raise_nofile()?;
    let tls = router::tls::server_config(&args.cert, &args.key)?;
    let routing = if args.route {
        Routing::Read
    } else {
        Routing::None
    };
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "floor-relay listening on {addr}")?;
    out.flush()?;
    drop(out);
    // SIGTERM ends it cleanly, so a profile-instrumented build (ops/bench/pgo.sh --floor) writes
    // its profile as it exits; the latency benches kill it outright.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        served = codex_fleet_bench::floor::serve(listener, tls, upstream, routing) => served,
        _ = term.recv() => Ok(()),
    }
}
