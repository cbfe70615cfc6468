//! The floor relay as a process (`codex_fleet_bench::floor`): TLS termination and a WebSocket
//! relay onto one Unix socket, frame by frame, with no routing. `added-latency` runs it in front
//! of the same worker socket as codex-fleet and HAProxy, as the floor both are measured against.
//! Prints `floor-relay listening on <addr>` on stdout once it accepts.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(about = "a minimal wss → Unix-socket WebSocket relay: the floor added-latency measures")]
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
    /// The Unix socket every client is relayed to, one WebSocket per client.
    #[arg(long)]
    upstream: PathBuf,
    /// Runtime threads: 1 runs tokio's current-thread runtime, more a multi-thread runtime of
    /// that size; unset, tokio's multi-thread default (one per core), as codex-fleet runs.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: Option<u16>,
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
    let tls = router::tls::server_config(&args.cert, &args.key)?;
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "floor-relay listening on {addr}")?;
    out.flush()?;
    drop(out);
    codex_fleet_bench::floor::serve(listener, tls, args.upstream).await
}
