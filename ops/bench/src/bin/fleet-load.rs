//! `fleet-load`: starts the built `codex-fleet` with simulated workers (`codex-app-server-sim`),
//! T tenants × W workers, runs S sessions of K turns each over wss, runs the same sessions
//! directly against simulator sockets, and prints readiness time, throughput, latency through
//! the fleet vs direct, and codex-fleet's memory. Loopback only; bounded in count and time.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Parser;
use proto::client::Client;
use proto::event::Event;
use proto::initialize::InitializeParams;
use proto::rpc::{Frame, Message as RpcMessage, ParseError, RequestId};
use proto::Method;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::{Connector, WebSocketStream};

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
    /// Simulator processes for the direct baseline (capped by tenants × workers).
    #[arg(long, default_value_t = 16)]
    direct_workers: usize,
    /// codex-fleet binary (default: target/{release,debug}/codex-fleet beside this tool).
    #[arg(long, env = "CODEX_FLEET_BIN")]
    fleet_bin: Option<PathBuf>,
    /// Simulator binary (default: beside this tool).
    #[arg(long, env = "CODEX_SIM_BIN")]
    sim_bin: Option<PathBuf>,
    /// Give up after this long in total.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// How often `/readyz` is polled while workers start (each poll renders every worker).
    #[arg(long, default_value_t = 50)]
    ready_poll_ms: u64,
    /// Keep the generated directory (config, logs) and print its path.
    #[arg(long)]
    keep: bool,
}

fn beside_me(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("exe dir")?;
    let p = dir.join(name);
    if p.is_file() {
        return Ok(p);
    }
    bail!(
        "{} is missing: run `cargo build --bins` (or pass a path flag)",
        p.display()
    )
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

/// The protocol core's JSON-RPC client over any WebSocket stream (wss to the fleet, ws over a
/// unix socket to a simulator), so both paths are measured with the same code.
struct Rpc<S> {
    client: Client<WebSocketStream<S>>,
}

/// Answers every server request "accept".
fn accept_server_request(_text: &str, m: &RpcMessage<'_>) -> Option<String> {
    match m {
        RpcMessage::Request { id, .. } => {
            Some(json!({"id": id, "result": {"decision": "accept"}}).to_string())
        }
        _ => None,
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Rpc<S> {
    fn new(ws: WebSocketStream<S>) -> Self {
        Rpc {
            client: Client::new(ws),
        }
    }

    /// A request's result and its latency; notifications on the way are skipped, server
    /// requests are answered "accept".
    async fn call(
        &mut self,
        method: Method<'_>,
        params: Value,
    ) -> anyhow::Result<(Value, Duration)> {
        let t0 = Instant::now();
        let reply = self
            .client
            .call_with(&method, params, accept_server_request)
            .await?;
        let took = t0.elapsed();
        Ok((reply.result()?, took))
    }

    async fn until_turn_completed(&mut self, thread: &str) -> anyhow::Result<usize> {
        let mut deltas = 0;
        loop {
            let text = self.client.next_text().await?;
            let frame = match Frame::parse(&text) {
                Ok(frame) => frame,
                Err(ParseError::NotJson(e)) => bail!("invalid JSON: {e}"),
                Err(_) => continue,
            };
            if let Some(answer) = accept_server_request(&text, &frame.message) {
                self.client.send_text(answer).await?;
            }
            let RpcMessage::Notification { method, params } = frame.message else {
                continue;
            };
            if method == Method::AgentMessageDelta {
                deltas += 1;
            }
            if let Some(Event::TurnCompleted { thread: done }) = Event::parse(&method, params) {
                if done == thread {
                    return Ok(deltas);
                }
            }
        }
    }

    async fn initialize(&mut self) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        self.client
            .call_id(
                &RequestId::Str("initialize".into()),
                &Method::Initialize,
                InitializeParams::experimental("fleet-load", "0.0.1"),
                |_, _| None,
            )
            .await?;
        self.client.notify(&Method::Initialized).await?;
        Ok(t0.elapsed())
    }
}

#[derive(Default)]
struct SessionStats {
    latencies: Vec<Duration>,
    turn_latencies: Vec<Duration>,
    turns: usize,
    deltas: usize,
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
        stats.latencies.push(rpc.initialize().await?);
        let (started, took) = rpc.call(Method::ThreadStart, json!({})).await?;
        stats.latencies.push(took);
        let thread = started["thread"]["id"]
            .as_str()
            .context("thread id")?
            .to_owned();
        anyhow::Ok(thread)
    }
    .await;
    arrived.fetch_add(1, Ordering::SeqCst);
    let thread = r?;
    let _ = go.wait_for(|g| *g).await;
    for k in 0..args.turns {
        let t0 = Instant::now();
        let (_, took) = rpc
            .call(
                Method::TurnStart,
                json!({"threadId": thread, "input": [{"type": "text", "text": format!("load turn {k}"), "text_elements": []}]}),
            )
            .await?;
        stats.latencies.push(took);
        stats.deltas += rpc.until_turn_completed(&thread).await?;
        stats.turn_latencies.push(t0.elapsed());
        stats.turns += 1;
        for _ in 0..args.reads {
            let (_, took) = rpc
                .call(Method::ThreadRead, json!({"threadId": thread}))
                .await?;
            stats.latencies.push(took);
        }
    }
    let _ = rpc.client.close().await;
    Ok(stats)
}

struct PhaseResult {
    ok: usize,
    failed: usize,
    first_error: Option<String>,
    turns: usize,
    deltas: usize,
    turn_wall: Duration,
    latencies: Samples,
    turn_latencies: Samples,
    /// What `at_barrier` sampled: codex-fleet (VmRSS KiB, CPU ticks) with every session open.
    at_barrier: Option<(u64, u64)>,
}

/// Runs `n` sessions made by `connect(i)`; all connect and start a thread, then (after
/// `at_barrier` ran) all run their turns at once.
async fn phase<S, F, Fut>(
    args: &Args,
    connect: F,
    at_barrier: impl FnOnce() -> Option<(u64, u64)>,
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
    let t0 = Instant::now();
    let _ = go_tx.send(true);
    let mut res = PhaseResult {
        ok: 0,
        failed: 0,
        first_error: None,
        turns: 0,
        deltas: 0,
        turn_wall: Duration::ZERO,
        latencies: Samples(Vec::new()),
        turn_latencies: Samples(Vec::new()),
        at_barrier: sampled,
    };
    for t in tasks {
        match t.await? {
            Ok(s) => {
                res.ok += 1;
                res.turns += s.turns;
                res.deltas += s.deltas;
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
    Ok(res)
}

fn proc_status_kb(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// utime + stime of a process, in clock ticks (100 per second on Linux).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3; utime and stime are fields 14 and 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

async fn admin_ready_count(admin: std::net::SocketAddr) -> anyhow::Result<(usize, usize)> {
    let (_, body) = e2e::http_get(admin, "/readyz").await?;
    let v: Value = serde_json::from_str(&body)?;
    let mut ready = 0;
    let mut total = 0;
    for t in v["tenants"].as_array().into_iter().flatten() {
        for w in t["workers"].as_array().into_iter().flatten() {
            total += 1;
            if w["state"] == "ready" {
                ready += 1;
            }
        }
    }
    Ok((ready, total))
}

fn raise_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    raise_nofile();
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
    let fleet_bin = match &args.fleet_bin {
        Some(p) => p.clone(),
        None => beside_me("codex-fleet")?,
    };
    let sim_bin = match &args.sim_bin {
        Some(p) => p.clone(),
        None => beside_me("codex-app-server-sim")?,
    };
    router::tls::install_crypto_provider();
    // Short paths: socket paths must stay under ~100 bytes.
    let dir = tempfile::Builder::new().prefix("fl").tempdir_in("/tmp")?;
    let pki = router::dev::generate_pki(&["localhost", "127.0.0.1"])?;
    let ca = dir.path().join("ca.pem");
    let cert = dir.path().join("tls.crt");
    let key = dir.path().join("tls.key");
    std::fs::write(&ca, &pki.ca_pem)?;
    std::fs::write(&cert, &pki.cert_pem)?;
    router::dev::write_private(&key, &pki.key_pem)?;
    let q = |s: &Path| serde_json::to_string(&s.display().to_string()).expect("string");
    let total_workers = args.tenants * args.workers;
    let big = 1_000_000;
    let mut toml = format!(
        "[listen]\naddr = \"127.0.0.1:0\"\ntls_cert = {cert}\ntls_key = {key}\n\n\
         [admin]\naddr = \"127.0.0.1:0\"\n\n\
         [workers]\ncommand = [{sim}, \"app-server\"]\nstate_dir = {state}\n\
         config_overrides = [\"sim.turn_ms={turn_ms}\", \"sim.deltas={deltas}\"]\n\
         per_tenant_uid = false\nmax_workers = {total_workers}\nready_timeout_secs = 60\n\
         stop_grace_secs = 5\n\n\
         [drain]\nsettle_secs = 0\n\n\
         [limits]\nhandshakes_per_sec_per_ip = {big}\nhandshake_burst = {big}\n\
         max_connections = {big}\nmax_connections_per_tenant = {big}\n\
         tenant_rps = {big}\ntenant_burst = {big}\nconn_fps = {big}\nconn_burst = {big}\n\
         turn_start_per_min = {big}\nturn_start_burst = {big}\nmax_active_turns_per_tenant = {big}\n\n",
        cert = q(&cert),
        key = q(&key),
        sim = q(&sim_bin),
        state = q(&dir.path().join("s")),
        turn_ms = args.turn_ms,
        deltas = args.deltas,
    );
    let mut tokens = Vec::new();
    for t in 0..args.tenants {
        let token = router::dev::random_token();
        toml.push_str(&format!(
            "[[tenants]]\nid = \"t{t}\"\ntoken_sha256 = [\"{}\"]\nmin_workers = {w}\nmax_workers = {w}\n\n",
            router::auth::token_digest_hex(&token),
            w = args.workers
        ));
        tokens.push(token);
    }
    let config = dir.path().join("config.toml");
    router::dev::write_private(&config, &toml)?;

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
    let log = std::fs::File::create(dir.path().join("fleet.log"))?;
    let t_spawn = Instant::now();
    let mut child: Child = Command::new(&fleet_bin)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .env("CODEX_FLEET_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawning {}", fleet_bin.display()))?;
    let pid = child.id().context("fleet pid")?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("codex-fleet did not print its ports")??
        .ok_or_else(|| {
            anyhow!(
                "codex-fleet exited; see {}",
                dir.path().join("fleet.log").display()
            )
        })?;
    // "codex-fleet listening on wss://ADDR/ admin http://ADDR/"
    let words: Vec<&str> = line.split_whitespace().collect();
    let wss = words.get(3).context("wss addr")?.to_string();
    let admin: std::net::SocketAddr = words
        .get(5)
        .and_then(|a| a.strip_prefix("http://"))
        .and_then(|a| a.strip_suffix('/'))
        .context("admin addr")?
        .parse()?;
    let port = wss
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .context("port")?
        .to_owned();
    let url = format!("wss://localhost:{port}/");
    let listening_at = t_spawn.elapsed();
    let rss_listening = proc_status_kb(pid, "VmRSS:");
    let mut last = (0, 0);
    let ready_at = loop {
        if let Ok(Some(status)) = child.try_wait() {
            bail!(
                "codex-fleet exited early ({status}); see {}",
                dir.path().join("fleet.log").display()
            );
        }
        if let Ok(c) = admin_ready_count(admin).await {
            last = c;
            if c.0 == total_workers {
                break t_spawn.elapsed();
            }
        }
        if t_spawn.elapsed() > Duration::from_secs(120) {
            bail!("only {}/{} workers ready after 120 s", last.0, last.1);
        }
        tokio::time::sleep(Duration::from_millis(args.ready_poll_ms)).await;
    };
    // Let the pool settle (no starts in flight) before the idle sample.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_ready = proc_status_kb(pid, "VmRSS:");
    println!(
        "\ncodex-fleet printed its ports {} after spawn; all {total_workers} workers ready {} after spawn",
        ms(listening_at),
        ms(ready_at)
    );

    // --- phase 1: through codex-fleet ---
    let tls = e2e::client_tls(&ca)?;
    let tokens = Arc::new(tokens);
    let ntenants = args.tenants;
    let fleet = phase(
        &args,
        |i| {
            let url = url.clone();
            let tls = tls.clone();
            let token = tokens[i % ntenants].clone();
            async move {
                let mut req = url.into_client_request()?;
                req.headers_mut()
                    .insert("authorization", format!("Bearer {token}").parse()?);
                let (ws, _) = tokio_tungstenite::connect_async_tls_with_config(
                    req,
                    None,
                    true,
                    Some(Connector::Rustls(tls)),
                )
                .await?;
                Ok(Rpc::new(ws))
            }
        },
        || Some((proc_status_kb(pid, "VmRSS:")?, cpu_ticks(pid)?)),
    )
    .await?;
    let cpu_end = cpu_ticks(pid);
    let rss_end = proc_status_kb(pid, "VmRSS:");
    let hwm = proc_status_kb(pid, "VmHWM:");

    // --- phase 2: directly on simulator sockets ---
    let direct_n = args.direct_workers.clamp(1, total_workers);
    let ddir = dir.path().join("d");
    std::fs::create_dir_all(&ddir)?;
    let mut sims = Vec::new();
    let mut socks = Vec::new();
    for i in 0..direct_n {
        let sock = ddir.join(format!("{i}.sock"));
        let home = ddir.join(format!("h{i}"));
        std::fs::create_dir_all(&home)?;
        sims.push(
            Command::new(&sim_bin)
                .arg("app-server")
                .arg("--listen")
                .arg(format!("unix://{}", sock.display()))
                .args(["-c", &format!("sim.turn_ms={}", args.turn_ms)])
                .args(["-c", &format!("sim.deltas={}", args.deltas)])
                .env("CODEX_HOME", &home)
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .spawn()?,
        );
        socks.push(sock);
    }
    for s in &socks {
        let t0 = Instant::now();
        while tokio::net::UnixStream::connect(s).await.is_err() {
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("simulator at {} did not start", s.display());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let socks = Arc::new(socks);
    let direct = phase(
        &args,
        |i| {
            let sock = socks[i % socks.len()].clone();
            async move {
                let stream = tokio::net::UnixStream::connect(&sock).await?;
                let (ws, _) = tokio_tungstenite::client_async("ws://localhost/", stream).await?;
                Ok(Rpc::new(ws))
            }
        },
        || None,
    )
    .await?;
    drop(sims);

    // --- stop codex-fleet ---
    let t_term = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
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
            "  turns: {} in {:.2} s = {:.0} turns/s ({} deltas received)",
            r.turns,
            r.turn_wall.as_secs_f64(),
            r.turns as f64 / r.turn_wall.as_secs_f64().max(1e-9),
            r.deltas
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
    report("through codex-fleet (wss, TLS)", &fleet);
    report(
        &format!("direct on {direct_n} simulator sockets (ws over unix)"),
        &direct,
    );
    let ratio = |p: f64| {
        fleet.latencies.pct(p).as_secs_f64() / direct.latencies.pct(p).as_secs_f64().max(1e-9)
    };
    println!(
        "\nlatency ratio fleet/direct: p50 {:.1}×, p99 {:.1}×",
        ratio(0.5),
        ratio(0.99)
    );
    if let (Some((_, c0)), Some(c1)) = (fleet.at_barrier, cpu_end) {
        let cpu = (c1.saturating_sub(c0)) as f64 / 100.0;
        println!(
            "codex-fleet CPU during the turns: {cpu:.2} s in {:.2} s wall ({:.0}% of one core), {:.2} ms per turn",
            fleet.turn_wall.as_secs_f64(),
            100.0 * cpu / fleet.turn_wall.as_secs_f64().max(1e-9),
            1000.0 * cpu / (fleet.turns.max(1) as f64)
        );
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
        Ok(Ok(st)) => println!("\ncodex-fleet SIGTERM → exit in {} ({st})", ms(stop_took)),
        Ok(Err(e)) => println!("\ncodex-fleet wait failed: {e}"),
        Err(_) => {
            println!("\ncodex-fleet did not exit within 30 s of SIGTERM; killing it");
            let _ = child.kill().await;
        }
    }
    if args.keep {
        let kept = dir.keep();
        println!("kept {}", kept.display());
    }
    if fleet.failed > 0 || direct.failed > 0 {
        bail!("some sessions failed");
    }
    Ok(())
}
