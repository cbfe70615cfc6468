//! Edges in front of nodes, as real processes on loopback ([`Split`]), and the link's
//! mutual-TLS material they share.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::client::{http_get, Client};
use crate::fleet::{FleetBuilder, FleetFiles, FleetProcess};
use crate::process::fleet_bin;

/// Edges in front of nodes (docs/decisions/0014-two-roles-one-binary.md), as real processes on loopback (see tests/tests/split.rs).
/// Two nodes, some edges, tenants assigned to nodes; every process real.
pub struct Split {
    /// The base files: client CA, tokens, the mock model.
    pub files: FleetFiles,
    base: String,
    /// The link's PEM files (`ca.pem`, `node.crt`, `node.key`, `edge.crt`, `edge.key`).
    pub link: PathBuf,
    /// The nodes `n1`, `n2`.
    pub nodes: Vec<Node>,
    /// The edges.
    pub edges: Vec<FleetProcess>,
    program: PathBuf,
}

/// One node of a [`Split`].
pub struct Node {
    /// `n1`, `n2`.
    pub name: String,
    /// Its link port.
    pub port: u16,
    /// Its config file.
    pub config: PathBuf,
    /// The running process.
    pub process: Option<FleetProcess>,
}

/// Makes the link's mutual-TLS material (a CA, a node certificate for `node_names`, an edge
/// client certificate) in `<dir>/link`: `ca.pem`, `node.crt`, `node.key`, `edge.crt`,
/// `edge.key`. Returns that directory.
pub fn write_link_pki(dir: &Path, node_names: &[&str]) -> anyhow::Result<PathBuf> {
    let link = dir.join("link");
    std::fs::create_dir(&link)?;
    let pki = router::cli::dev::generate_link_pki(node_names)?;
    for (name, pem) in [
        ("ca.pem", &pki.ca_pem),
        ("node.crt", &pki.node_cert_pem),
        ("node.key", &pki.node_key_pem),
        ("edge.crt", &pki.edge_cert_pem),
        ("edge.key", &pki.edge_key_pem),
    ] {
        router::fsutil::write_private(&link.join(name), pem)?;
    }
    Ok(link)
}

/// A loopback port free right now, for a process started next to listen on. Taken below the
/// kernel's ephemeral range (`ip_local_port_range`) when there is room: a port from that range
/// (`bind` to port 0) can be handed to any outgoing connection on the machine before the process
/// binds it, which failed a node's start with "Address already in use" once in CI.
pub fn free_port() -> anyhow::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    // Ports [low - SPAN, low): none the kernel hands out by itself.
    const SPAN: u16 = 10_000;
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if low > SPAN + 1024 {
        for _ in 0..100 {
            // A random start, so runs do not all try the same ports first.
            let pick = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            let port = low - 1 - u16::try_from(pick % u64::from(SPAN))?;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn toml_path(p: &Path) -> String {
    serde_json::to_string(&p.display().to_string()).expect("string")
}

/// A node's config from `base` (a one-process config written in `dir`): its listener on
/// `port` with the link's node certificate, its `[node]` table trusting the link's CA.
pub fn node_config_text(base: &str, dir: &Path, link: &Path, name: &str, port: u16) -> String {
    base.replacen(
        "addr = \"127.0.0.1:0\"",
        &format!("addr = \"127.0.0.1:{port}\""),
        1,
    )
    .replace(
        &toml_path(&dir.join("tls.crt")),
        &toml_path(&link.join("node.crt")),
    )
    .replace(
        &toml_path(&dir.join("tls.key")),
        &toml_path(&link.join("node.key")),
    )
    .replace(&toml_path(&dir.join("s")), &toml_path(&dir.join(name)))
        + &format!(
            "\n[node]\nname = {name:?}\nedge_ca = {}\n",
            toml_path(&link.join("ca.pem"))
        )
}

/// An edge's config from `base`: no `[workers]`, and the static `nodes` (name, port on
/// loopback) reached over mutual TLS with the link's edge certificate.
pub fn edge_config_text(base: &str, link: &Path, nodes: &[(&str, u16)]) -> String {
    // An edge runs no worker: its file leaves `[workers]` out.
    let base = match (base.find("[workers]\n"), base.find("[drain]\n")) {
        (Some(w), Some(d)) if w < d => format!("{}{}", &base[..w], &base[d..]),
        _ => base.to_owned(),
    };
    let mut text = base
        + &format!(
            "\n[nodes]\nbackend = \"static\"\nca = {}\nclient_cert = {}\nclient_key = {}\n\
             probe_interval_secs = 1\nconnect_timeout_ms = 1000\n",
            toml_path(&link.join("ca.pem")),
            toml_path(&link.join("edge.crt")),
            toml_path(&link.join("edge.key")),
        );
    for (name, port) in nodes {
        text += &format!(
            "[[nodes.static]]\nname = {name:?}\naddr = \"127.0.0.1:{port}\"\nserver_name = \"localhost\"\n"
        );
    }
    text
}

// === impl Split ===

impl Split {
    /// `tenants` as (id, node); nodes `n1`, `n2`; `edges` edges.
    /// Starts the nodes, then `edges` edges.
    pub async fn start(
        tenants: &[(&str, &str)],
        edges: usize,
        limits: &str,
    ) -> anyhow::Result<Split> {
        Split::start_with(&fleet_bin(), tenants, edges, limits).await
    }

    /// Same, running `program` as codex-fleet.
    pub async fn start_with(
        program: &Path,
        tenants: &[(&str, &str)],
        edges: usize,
        limits: &str,
    ) -> anyhow::Result<Split> {
        Split::start_built(
            program,
            FleetBuilder::new().limits_toml(limits),
            tenants,
            edges,
        )
        .await
    }

    /// Same, from the one-process config `b` makes (its `[limits]`, `[workers]`, … reach every
    /// node and edge).
    pub async fn start_built(
        program: &Path,
        mut b: FleetBuilder,
        tenants: &[(&str, &str)],
        edges: usize,
    ) -> anyhow::Result<Split> {
        // Two nodes on one machine with one uid range, each allocating for its own tenants: as
        // root, their claims on the host keep the uids apart (an explicit uid per tenant would
        // collide between split tests run at once).
        for (id, node) in tenants {
            b = b
                .tenant_pool(id, 1, 1)
                .tenant_toml(&format!("node = {node:?}"));
        }
        let files = b.prepare().await?;
        let base = std::fs::read_to_string(&files.config)?;
        let link = write_link_pki(files.dir.path(), &["localhost", "127.0.0.1"])?;
        let mut split = Split {
            files,
            base,
            link,
            nodes: Vec::new(),
            edges: Vec::new(),
            program: program.to_owned(),
        };
        for name in ["n1", "n2"] {
            let node = split.node_config(name)?;
            split.nodes.push(node);
        }
        for i in 0..split.nodes.len() {
            split.start_node(i).await?;
        }
        for i in 0..edges {
            let path = split.files.dir.path().join(format!("edge{i}.toml"));
            std::fs::write(&path, split.edge_config())?;
            split
                .edges
                .push(FleetProcess::spawn_role(&split.program, "serve", &path, |_| {}).await?);
        }
        Ok(split)
    }

    fn node_config(&self, name: &str) -> anyhow::Result<Node> {
        let port = free_port()?;
        let dir = self.files.dir.path();
        let text = node_config_text(&self.base, dir, &self.link, name, port);
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, text)?;
        Ok(Node {
            name: name.to_owned(),
            port,
            config,
            process: None,
        })
    }

    fn edge_config(&self) -> String {
        let nodes: Vec<(&str, u16)> = self
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n.port))
            .collect();
        edge_config_text(&self.base, &self.link, &nodes)
    }

    /// (Re)starts node `i` on its port.
    pub async fn start_node(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[i];
        node.process =
            Some(FleetProcess::spawn_role(&self.program, "node", &node.config, |_| {}).await?);
        Ok(())
    }

    /// A tenant's token.
    pub fn token(&self, tenant: &str) -> String {
        self.files.token(tenant)
    }

    /// An initialized client of `tenant` through edge `edge`.
    pub async fn client(&self, edge: usize, tenant: &str) -> anyhow::Result<Client> {
        self.edges[edge]
            .client(&self.files, &self.token(tenant))
            .await
    }

    /// Edge `edge`'s `/readyz`.
    pub async fn edge_readyz(&self, edge: usize) -> anyhow::Result<Value> {
        let (_, body) = http_get(self.edges[edge].admin, "/readyz").await?;
        Ok(serde_json::from_str(&body)?)
    }
}
