//! Side-by-side measurements of codex-fleet against the bare worker, in one run on one machine
//! (ratios, not absolute targets): `cargo bench -p codex-fleet-testkit --bench fleet` (needs CODEX_BIN and the
//! built binary, like the tests).
//!
//! - serve start → first worker ready (`min_workers = 1`, polled on `/readyz`);
//! - `thread/list` round trip through codex-fleet vs directly on the worker's socket;
//! - a request that must open a new leg vs one on an existing leg;
//! - codex-fleet's peak RSS with one worker, and its memory per open session leg.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use testkit::{Client, FleetBuilder, FleetFiles};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

const ROUND_TRIPS: usize = 400;
const LEGS: usize = 200;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

async fn spawn(files: &FleetFiles) -> anyhow::Result<(Child, String, String, Instant)> {
    let started = Instant::now();
    let mut child = Command::new(testkit::fleet_bin())
        .args(["serve", "--config"])
        .arg(&files.config)
        .env("CODEX_FLEET_LOG", "error")
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let line = lines.next_line().await?.context("no address line")?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let word = |prefix: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(prefix))
            .map(|a| a.trim_end_matches('/').to_owned())
            .context("address")
    };
    Ok((child, word("wss://")?, word("http://")?, started))
}

/// A JSON-RPC round trip on a raw worker leg.
async fn worker_call(leg: &mut worker::LegStream, id: i64, method: &str) -> anyhow::Result<()> {
    leg.send(Message::text(
        json!({ "id": id, "method": method, "params": {} }).to_string(),
    ))
    .await?;
    while let Some(frame) = leg.next().await {
        if let Message::Text(t) = frame? {
            let v: Value = serde_json::from_str(&t)?;
            if v["id"] == id {
                return Ok(());
            }
        }
    }
    anyhow::bail!("worker leg closed")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .workers_toml("per_tenant_uid = false")
        // The bench opens hundreds of sessions from one address on purpose.
        .limits_toml("handshakes_per_sec_per_ip = 100000\nhandshake_burst = 100000")
        .prepare()
        .await?;
    let (child, addr, admin, started) = spawn(&files).await?;
    let pid = child.id().context("pid")?;
    let admin: std::net::SocketAddr = admin.parse()?;
    let mut first_ready = false;
    loop {
        let (_, body) = testkit::http_get(admin, "/readyz").await?;
        if body.contains("\"state\": \"ready\"") && !first_ready {
            println!(
                "serve start -> first worker ready: {:.0} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
            first_ready = true;
        }
        if body.matches("\"state\": \"ready\"").count() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let url = format!("wss://{}/", addr.replace("127.0.0.1", "localhost"));
    let token = files.token("acme");
    let mut c = Client::connect(&url, &files.ca, Some(&token)).await?;
    c.initialize("bench").await?;
    let socket = std::fs::read_dir(files.dir.path().join("s/sockets/acme"))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "sock"))
        .context("worker socket")?;
    let mut direct = bare_leg(&socket).await?;
    direct
        .send(Message::text(
            json!({"id": 0, "method": "initialize", "params": {"clientInfo": {"name": "bench", "version": "0"}}})
                .to_string(),
        ))
        .await?;
    worker_call(&mut direct, 1, "thread/loaded/list").await?;

    // Interleaved, so both paths see the same machine noise.
    let (mut via, mut bare) = (Vec::new(), Vec::new());
    for i in 0..ROUND_TRIPS {
        let t = Instant::now();
        c.request("thread/list", json!({})).await?;
        via.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        worker_call(&mut direct, 10 + i as i64, "thread/list").await?;
        bare.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (mv, mb) = (median(via), median(bare));
    println!(
        "thread/list median over {ROUND_TRIPS}: via codex-fleet {mv:.0} us, direct {mb:.0} us, added {:.0} us ({:.2}x)",
        mv - mb,
        mv / mb
    );

    // New leg vs existing leg: the thread lives on the worker holding this session's home leg;
    // each new session is homed on the other (least-loaded) worker, so its first request for the
    // thread opens a leg (with the initialize replay) and its second uses it.
    let thread = c.start_thread().await?;
    let (mut first, mut again) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let mut s = Client::connect(&url, &files.ca, Some(&token)).await?;
        s.initialize("bench-leg").await?;
        let t = Instant::now();
        s.request("thread/read", json!({ "threadId": thread }))
            .await?;
        first.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        s.request("thread/read", json!({ "threadId": thread }))
            .await?;
        again.push(t.elapsed().as_secs_f64() * 1e6);
        s.close().await;
    }
    println!(
        "thread/read median: opening a new leg {:.0} us, on the open leg {:.0} us",
        median(first),
        median(again)
    );
    // What a new leg costs the worker itself: connect + initialize on its socket, no router.
    let mut bare_open = Vec::new();
    for i in 0..20 {
        let t = Instant::now();
        let mut leg = bare_leg(&socket).await?;
        leg.send(Message::text(
            json!({"id": 0, "method": "initialize", "params": {"clientInfo": {"name": "bench", "version": "0"}}})
                .to_string(),
        ))
        .await?;
        worker_call(&mut leg, 1000 + i, "thread/loaded/list").await?;
        bare_open.push(t.elapsed().as_secs_f64() * 1e6);
    }
    println!(
        "direct on the worker socket: connect + initialize + one request {:.0} us (median of 20)",
        median(bare_open)
    );

    println!(
        "codex-fleet peak RSS with one worker and {} session(s): {} KiB",
        2,
        kib(pid, "VmHWM:")
    );
    let before = kib(pid, "VmRSS:");
    let mut sessions = Vec::new();
    for _ in 0..LEGS {
        let mut s = Client::connect(&url, &files.ca, Some(&token)).await?;
        s.initialize("bench-mem").await?;
        sessions.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = kib(pid, "VmRSS:");
    println!(
        "codex-fleet memory per open session (TLS client side + one worker leg): {:.1} KiB ({} sessions, {} -> {} KiB)",
        (after.saturating_sub(before)) as f64 / LEGS as f64,
        LEGS,
        before,
        after
    );
    drop(sessions);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let mut child = child;
    child.wait().await?;
    Ok(())
}

/// A leg straight onto the worker's socket, as a bare client would open it (the bench is not the
/// router, so it checks no peer).
async fn bare_leg(socket: &std::path::Path) -> anyhow::Result<worker::LegStream> {
    let stream = tokio::net::UnixStream::connect(socket).await?;
    let (ws, _) = tokio_tungstenite::client_async_with_config(
        "ws://localhost/",
        worker::leg::buffered(stream)?,
        Some(worker::leg::leg_config(64 << 20)),
    )
    .await?;
    Ok(ws)
}
