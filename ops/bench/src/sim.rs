//! codex-fleet over simulated workers (`codex-app-server-sim`), and the same simulators started
//! bare for the direct anchor: what `fleet-load` and `notify-rate` share.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// The simulator's script for every turn: `sim.turn_ms` and `sim.deltas`.
#[derive(Debug, Clone, Copy)]
pub struct Script {
    /// Duration of a turn; its deltas are spread over it (0: as fast as it can).
    pub turn_ms: u64,
    /// `item/agentMessage/delta` notifications per turn (at most one per character of the
    /// reply: ask for a long reply with `MANY<n>` in the prompt).
    pub deltas: u64,
}

impl Script {
    /// As `-c key=value` overrides.
    pub fn overrides(&self) -> [String; 2] {
        [
            format!("sim.turn_ms={}", self.turn_ms),
            format!("sim.deltas={}", self.deltas),
        ]
    }
}

/// A fleet configuration of `tenants` × `workers` simulated workers, every limit out of the way.
pub struct SimFleet {
    /// Tenants `t0`, `t1`, ….
    pub tenants: usize,
    /// Workers per tenant (min = max).
    pub workers: usize,
    /// The simulators' script.
    pub script: Script,
    /// The simulator binary.
    pub sim_bin: PathBuf,
    /// The node every tenant is on, for an edge in front ([`SimFleetFiles::behind_edge`]).
    pub node: Option<String>,
    /// `workers.nice`: steps below codex-fleet's CPU priority its workers run at.
    pub nice: u8,
}

/// What [`SimFleet::write`] wrote.
pub struct SimFleetFiles {
    /// The config file.
    pub config: PathBuf,
    /// The CA clients trust.
    pub ca: PathBuf,
    /// Tenant `t{i}`'s bearer token at index i.
    pub tokens: Vec<String>,
    /// The node every tenant is on, if any.
    pub node: Option<String>,
}

// === impl SimFleet ===

impl SimFleet {
    /// All workers.
    pub fn total_workers(&self) -> usize {
        self.tenants * self.workers
    }

    /// Writes TLS material and the config into `dir` (keep its path short: socket paths live
    /// under it).
    pub fn write(&self, dir: &Path) -> anyhow::Result<SimFleetFiles> {
        router::tls::install_crypto_provider();
        let pki = router::cli::dev::generate_pki(&["localhost", "127.0.0.1"])?;
        let ca = dir.join("ca.pem");
        let cert = dir.join("tls.crt");
        let key = dir.join("tls.key");
        std::fs::write(&ca, &pki.ca_pem)?;
        std::fs::write(&cert, &pki.cert_pem)?;
        router::fsutil::write_private(&key, &pki.key_pem)?;
        let q = |s: &Path| serde_json::to_string(&s.display().to_string()).expect("string");
        let [turn_ms, deltas] = self.script.overrides();
        let big = 1_000_000;
        let mut toml = format!(
            "[listen]\naddr = \"127.0.0.1:0\"\ntls_cert = {cert}\ntls_key = {key}\n\n\
             [admin]\naddr = \"127.0.0.1:0\"\n\n\
             [workers]\ncommand = [{sim}, \"app-server\"]\nstate_dir = {state}\n\
             config_overrides = [\"{turn_ms}\", \"{deltas}\"]\n\
             per_tenant_uid = false\nmax_workers = {total}\nnice = {nice}\nready_timeout_secs = 60\n\
             stop_grace_secs = 5\n\n\
             [drain]\nsettle_secs = 0\n\n\
             [limits]\nhandshakes_per_sec_per_ip = {big}\nhandshake_burst = {big}\n\
             max_connections = {big}\nmax_connections_per_tenant = {big}\n\
             tenant_rps = {big}\ntenant_burst = {big}\nconn_fps = {big}\nconn_burst = {big}\n\
             turn_start_per_min = {big}\nturn_start_burst = {big}\nmax_active_turns_per_tenant = {big}\n\n",
            cert = q(&cert),
            key = q(&key),
            sim = q(&self.sim_bin),
            state = q(&dir.join("s")),
            total = self.total_workers(),
            nice = self.nice,
        );
        let mut tokens = Vec::new();
        for t in 0..self.tenants {
            let token = router::cli::dev::random_token();
            toml.push_str(&format!(
                "[[tenants]]\nid = \"t{t}\"\ntoken_sha256 = [\"{}\"]\nmin_workers = {w}\nmax_workers = {w}\n",
                router::auth::token_digest_hex(&token),
                w = self.workers
            ));
            if let Some(node) = &self.node {
                toml.push_str(&format!("node = {node:?}\n"));
            }
            toml.push('\n');
            tokens.push(token);
        }
        let config = dir.join("config.toml");
        router::fsutil::write_private(&config, &toml)?;
        Ok(SimFleetFiles {
            config,
            ca,
            tokens,
            node: self.node.clone(),
        })
    }
}

// === impl SimFleetFiles ===

impl SimFleetFiles {
    /// Splits the one-process config into a node's (on a free loopback port, with the link's
    /// certificates, written in `dir`) and an edge's in front of it (the clients' listener and
    /// tokens, no workers), as testkit's `Split` does; returns both paths.
    pub fn behind_edge(&self, dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
        let name = self
            .node
            .as_deref()
            .context("a SimFleet with a node to put behind an edge")?;
        let link = testkit::write_link_pki(dir, &["localhost", "127.0.0.1"])?;
        let base = std::fs::read_to_string(&self.config)?;
        let port = testkit::free_port()?;
        let node = dir.join(format!("{name}.toml"));
        router::fsutil::write_private(
            &node,
            &testkit::node_config_text(&base, dir, &link, name, port),
        )?;
        let edge = dir.join("edge.toml");
        router::fsutil::write_private(
            &edge,
            &testkit::edge_config_text(&base, &link, &[(name, port)]),
        )?;
        Ok((node, edge))
    }
}

/// Ready workers and all workers, from `/readyz`.
pub async fn ready_count(admin: SocketAddr) -> anyhow::Result<(usize, usize)> {
    let (_, body) = testkit::http_get(admin, "/readyz").await?;
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

/// Polls `/readyz` every `poll` until `want` workers are ready; fails if codex-fleet exits or
/// two minutes pass.
pub async fn wait_workers_ready(
    child: &mut Child,
    admin: SocketAddr,
    want: usize,
    poll: Duration,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut last = (0, 0);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("codex-fleet exited early ({status})");
        }
        if let Ok(c) = ready_count(admin).await {
            last = c;
            if c.0 == want {
                return Ok(());
            }
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("only {}/{} workers ready after 120 s", last.0, last.1);
        }
        tokio::time::sleep(poll).await;
    }
}

/// `n` bare simulators on sockets `dir/0.sock`… with `script`, `nice` steps below this process's
/// CPU priority (through `nice(1)`; as codex-fleet runs its workers with `workers.nice`, so the
/// direct path's simulators compete for the CPU as the fleet path's do), killed on drop, once
/// every socket accepts.
pub async fn start_sims(
    sim_bin: &Path,
    dir: &Path,
    n: usize,
    script: Script,
    nice: u8,
) -> anyhow::Result<(Vec<Child>, Vec<PathBuf>)> {
    std::fs::create_dir_all(dir)?;
    let mut sims = Vec::new();
    let mut socks = Vec::new();
    for i in 0..n {
        let sock = dir.join(format!("{i}.sock"));
        let home = dir.join(format!("h{i}"));
        std::fs::create_dir_all(&home)?;
        let mut cmd = Command::new("nice");
        cmd.arg("-n")
            .arg(nice.to_string())
            .arg(sim_bin)
            .arg("app-server")
            .arg("--listen")
            .arg(format!("unix://{}", sock.display()));
        for o in script.overrides() {
            cmd.arg("-c").arg(o);
        }
        sims.push(
            cmd.env("CODEX_HOME", &home)
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("spawning {}", sim_bin.display()))?,
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
    Ok((sims, socks))
}
