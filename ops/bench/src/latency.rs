//! What the latency benchmarks share: the measured connections, percentiles, HAProxy.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::{TcpStream, UnixStream};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};

/// How long one answer may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// One measured connection.
pub enum Conn {
    /// wss or ws over TCP.
    Tcp(Box<WebSocketStream<MaybeTlsStream<TcpStream>>>),
    /// ws over a Unix socket.
    Unix(Box<WebSocketStream<UnixStream>>),
}

impl Conn {
    async fn send(&mut self, text: String) -> anyhow::Result<()> {
        match self {
            Conn::Tcp(ws) => ws.send(Message::text(text)).await?,
            Conn::Unix(ws) => ws.send(Message::text(text)).await?,
        }
        Ok(())
    }

    async fn next_text(&mut self) -> anyhow::Result<String> {
        loop {
            let frame = match self {
                Conn::Tcp(ws) => ws.next().await,
                Conn::Unix(ws) => ws.next().await,
            };
            match frame.context("connection closed")?? {
                Message::Text(t) => return Ok(t.to_string()),
                Message::Close(c) => bail!("closed: {c:?}"),
                _ => {}
            }
        }
    }

    /// Sends a request and waits for the answer with its id (notifications are skipped).
    pub async fn call(&mut self, id: u64, method: &str, params: Value) -> anyhow::Result<Value> {
        self.send(json!({"id": id, "method": method, "params": params}).to_string())
            .await?;
        loop {
            let text = tokio::time::timeout(TIMEOUT, self.next_text())
                .await
                .context("no answer")??;
            let v: Value = serde_json::from_str(&text)?;
            if v["id"] == id {
                if v.get("error").is_some() {
                    bail!("{method}: {v}");
                }
                return Ok(v);
            }
        }
    }

    async fn initialize(&mut self) -> anyhow::Result<()> {
        self.call(
            0,
            "initialize",
            json!({"clientInfo": {"name": "bench", "title": null, "version": "0"},
                   "capabilities": {"experimentalApi": true}}),
        )
        .await?;
        self.send(json!({"method": "initialized"}).to_string())
            .await
    }
}

/// An initialized connection to `url` (trusting `ca` for wss), with a bearer token.
pub async fn connect_ws(url: &str, ca: Option<&Path>, token: Option<&str>) -> anyhow::Result<Conn> {
    let tls = match ca {
        Some(ca) => Some(testkit::client_tls(ca)?),
        None => None,
    };
    connect_ws_with(
        url,
        tls,
        token.map(|t| ("authorization", format!("Bearer {t}"))),
    )
    .await
}

/// An initialized connection to `url` with a TLS configuration of its own (e.g. a client
/// certificate) and one extra header.
pub async fn connect_ws_with(
    url: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
    header: Option<(&'static str, String)>,
) -> anyhow::Result<Conn> {
    let mut req = url.into_client_request()?;
    if let Some((name, value)) = header {
        req.headers_mut().insert(name, value.parse()?);
    }
    let connector = tls.map(Connector::Rustls);
    // Nagle off, as an interactive client wants.
    let (ws, _) = tokio_tungstenite::connect_async_tls_with_config(req, None, true, connector)
        .await
        .with_context(|| format!("connect {url}"))?;
    let mut conn = Conn::Tcp(Box::new(ws));
    conn.initialize().await?;
    Ok(conn)
}

/// An initialized connection straight onto a worker's Unix socket.
pub async fn connect_unix(socket: &Path) -> anyhow::Result<Conn> {
    let stream = UnixStream::connect(socket).await?;
    let (ws, _) = tokio_tungstenite::client_async("ws://localhost/", stream).await?;
    let mut conn = Conn::Unix(Box::new(ws));
    conn.initialize().await?;
    Ok(conn)
}

/// The `p` quantile of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// How many bootstrap resamples [`added_ratio_interval`] draws.
pub const RESAMPLES: usize = 1000;

/// How far one run's ratio of two added medians can be trusted. A proxy that adds 10–30 µs to a
/// round trip of 850 (a fast machine's) has an added median only a few µs wide of its noise, so
/// a ratio like fleet/floor moves by half between runs with nothing changed. This is the 5th and
/// 95th percentile of `(median(a) - median(base)) / (median(b) - median(base))` over
/// [`RESAMPLES`] bootstrap resamples, each sample set drawn with replacement at its own size and
/// the one `base` resample shared by both differences, as in the ratio itself. A resample where
/// `b` adds nothing or less counts as an unbounded ratio. The generator is seeded, so the
/// interval is reproducible from the samples.
pub fn added_ratio_interval(a: &[f64], b: &[f64], base: &[f64]) -> (f64, f64) {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut scratch = Vec::new();
    let mut ratios: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let base = rng.resampled_median(base, &mut scratch);
            let a = rng.resampled_median(a, &mut scratch) - base;
            let b = rng.resampled_median(b, &mut scratch) - base;
            if b > 0.0 {
                a / b
            } else {
                f64::INFINITY
            }
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    (percentile(&ratios, 0.05), percentile(&ratios, 0.95))
}

/// An [`added_ratio_interval`] as the benches print it after a ratio's line.
pub fn within((lo, hi): (f64, f64)) -> String {
    format!("90% of {RESAMPLES} resamples within {lo:.2}–{hi:.2}")
}

/// A ratio with its [`added_ratio_interval`], as the benches' tables give it: `1.42 (1.10–1.90)`.
pub fn with_interval(ratio: f64, (lo, hi): (f64, f64)) -> String {
    format!("{ratio:.2} ({lo:.2}–{hi:.2})")
}

/// xorshift64*: enough for resampling, and no dependency.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((u128::from(x) * n as u128) >> 64) as usize
    }

    /// The median (as [`percentile`] takes it) of `samples` drawn with replacement.
    fn resampled_median(&mut self, samples: &[f64], scratch: &mut Vec<f64>) -> f64 {
        scratch.clear();
        scratch.extend((0..samples.len()).map(|_| samples[self.below(samples.len())]));
        let rank = ((scratch.len() as f64 - 1.0) * 0.5).round() as usize;
        *scratch.select_nth_unstable_by(rank, f64::total_cmp).1
    }
}

/// Every run's samples as one set per path, each run first moved by the difference between its
/// `base` path's median and the mean of the runs' `base` medians. The machine's level moves
/// between runs (a worker's round trip of 960 µs in one run and 700 in the next, on 2026-12-06),
/// and a median taken straight over such a mix lands between the levels, where one path's share
/// of each run decides it: the floor's added median over "all runs" came out negative. Moved so,
/// each run keeps its own added medians, and the pooled ones are measured against one level.
pub fn pooled<const N: usize>(runs: &[[Vec<f64>; N]], base: usize) -> [Vec<f64>; N] {
    let medians: Vec<f64> = runs.iter().map(|r| summarize(&r[base]).p50).collect();
    let level = medians.iter().sum::<f64>() / medians.len().max(1) as f64;
    let mut all: [Vec<f64>; N] = std::array::from_fn(|_| Vec::new());
    for (run, median) in runs.iter().zip(&medians) {
        let shift = level - median;
        for (a, s) in all.iter_mut().zip(run) {
            a.extend(s.iter().map(|x| x + shift));
        }
    }
    all
}

/// p50, p99 and p99.9 of samples.
pub struct Summary {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

/// Summarizes samples (any order).
pub fn summarize(samples: &[f64]) -> Summary {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    Summary {
        p50: percentile(&s, 0.5),
        p99: percentile(&s, 0.99),
        p999: percentile(&s, 0.999),
    }
}

/// Calls each connection makes before its rounds are timed.
pub const WARM_UP: usize = 20;

/// Warms every connection up (TLS session state, caches, the worker's read path), then measures
/// `rounds` round trips of `method` on each, interleaved round by round with the order rotating
/// so no path always goes first; returns each connection's samples in µs.
pub async fn interleaved<const N: usize>(
    conns: &mut [Conn; N],
    rounds: usize,
    method: &str,
    params: &Value,
) -> anyhow::Result<[Vec<f64>; N]> {
    for conn in conns.iter_mut() {
        for i in 0..WARM_UP as u64 {
            conn.call(1_000_000 + i, method, params.clone()).await?;
        }
    }
    let mut samples: [Vec<f64>; N] = std::array::from_fn(|_| Vec::with_capacity(rounds));
    for round in 0..rounds {
        for k in 0..N {
            let i = (round + k) % N;
            let t = tokio::time::Instant::now();
            conns[i]
                .call(round as u64 + 1, method, params.clone())
                .await?;
            samples[i].push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
}

/// A loopback port free right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Polls until a loopback TCP port accepts.
pub async fn wait_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on {port}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Writes `cert` and `key` (PEM) into one file `dir/<name>.pem`, as HAProxy takes them.
pub fn pem_bundle(dir: &Path, name: &str, cert: &Path, key: &Path) -> anyhow::Result<PathBuf> {
    let pem = dir.join(format!("{name}.pem"));
    let mut combined = std::fs::read_to_string(cert)?;
    combined.push_str(&std::fs::read_to_string(key)?);
    router::fsutil::write_private(&pem, &combined)?;
    Ok(pem)
}

/// HAProxy (`bin`, in the foreground, killed on drop) terminating TLS on loopback `port` with the
/// certificate in `dir` (`tls.crt`, `tls.key`: the fleet's), in `mode` (`http`: a WebSocket
/// proxy; `tcp`: a byte tunnel) to the one server `server` (the rest of HAProxy's `server` line).
/// Its files are `dir/<name>.pem` and `dir/<name>.cfg`.
pub fn start_haproxy(
    bin: &Path,
    dir: &Path,
    name: &str,
    port: u16,
    mode: &str,
    server: &str,
) -> anyhow::Result<Child> {
    let pem = pem_bundle(dir, name, &dir.join("tls.crt"), &dir.join("tls.key"))?;
    let cfg = dir.join(format!("{name}.cfg"));
    std::fs::write(
        &cfg,
        format!(
            "global\n  maxconn 1000\n\
             defaults\n  mode {mode}\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n  timeout tunnel 1h\n\
             frontend fe\n  bind 127.0.0.1:{port} ssl crt {}\n  default_backend be\n\
             backend be\n  server s1 {server}\n",
            pem.display()
        ),
    )?;
    Command::new(bin)
        .arg("-db")
        .arg("-f")
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {} (ops/bench/latency.sh installs it)", bin.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` samples of `base` plus a spread of ±`spread` µs, in a fixed scrambled order.
    fn samples(base: f64, spread: f64, n: usize, seed: u64) -> Vec<f64> {
        let mut rng = XorShift(seed);
        (0..n)
            .map(|_| base + spread * (rng.below(2001) as f64 / 1000.0 - 1.0))
            .collect()
    }

    #[test]
    fn a_ratio_s_interval_holds_the_truth_and_narrows_with_less_noise() {
        // a adds 30, b adds 15: the ratio is 2.
        let (lo, hi) = added_ratio_interval(
            &samples(880.0, 5.0, 2000, 1),
            &samples(865.0, 5.0, 2000, 2),
            &samples(850.0, 5.0, 2000, 3),
        );
        assert!(lo < 2.0 && 2.0 < hi, "{lo}..{hi}");
        assert!(lo > 1.8 && hi < 2.2, "narrow with little noise: {lo}..{hi}");
        let (wide_lo, wide_hi) = added_ratio_interval(
            &samples(880.0, 200.0, 2000, 1),
            &samples(865.0, 200.0, 2000, 2),
            &samples(850.0, 200.0, 2000, 3),
        );
        assert!(wide_lo < 2.0 && 2.0 < wide_hi, "{wide_lo}..{wide_hi}");
        assert!(
            wide_hi - wide_lo > 5.0 * (hi - lo),
            "wider with noise: {wide_lo}..{wide_hi} against {lo}..{hi}"
        );
    }

    #[test]
    fn runs_at_different_levels_pool_to_their_added_medians() {
        // Two runs of [base, a proxy adding 50, a noisy one adding 10], the second 260 µs
        // faster throughout, as two runs of one day were.
        let run = |level: f64, seed: u64| {
            [(0.0, 20.0), (50.0, 20.0), (10.0, 200.0)]
                .map(|(added, spread)| samples(level + added, spread, 2000, seed + added as u64))
        };
        let runs = [run(960.0, 1), run(700.0, 2)];
        let added = |all: &[Vec<f64>; 3], i: usize| summarize(&all[i]).p50 - summarize(&all[0]).p50;
        // Taken straight, the pooled medians fall in the gap between the runs' levels.
        let mut straight: [Vec<f64>; 3] = Default::default();
        for r in &runs {
            for (a, s) in straight.iter_mut().zip(r) {
                a.extend(s);
            }
        }
        let (wrong_a, wrong_b) = (added(&straight, 1), added(&straight, 2));
        assert!(
            (wrong_a - 50.0).abs() > 15.0 || (wrong_b - 10.0).abs() > 15.0,
            "the straight pool should have misread this mix: {wrong_a}, {wrong_b}"
        );
        let all = pooled(&runs, 0);
        assert_eq!(all[1].len(), 4000);
        let (a, b) = (added(&all, 1), added(&all, 2));
        assert!((a - 50.0).abs() < 12.0, "{a}");
        assert!((b - 10.0).abs() < 12.0, "{b}");
        // One level, between the runs': the mean of their base medians.
        let level = summarize(&all[0]).p50;
        assert!((level - 830.0).abs() < 12.0, "{level}");
    }

    #[test]
    fn a_floor_that_adds_nothing_makes_the_ratio_unbounded() {
        let base = samples(850.0, 5.0, 500, 3);
        let (_, hi) = added_ratio_interval(&samples(880.0, 5.0, 500, 1), &base, &base);
        assert_eq!(hi, f64::INFINITY);
    }
}
