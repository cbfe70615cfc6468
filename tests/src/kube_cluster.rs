//! A kubernetes-backend cluster for tests
//! (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md): real `codex-fleet serve` edges with
//! `[nodes] backend = "kubernetes"` against the in-process fake API server ([`crate::fake_kube`]),
//! whose pods are real `codex-fleet node --tenant … --exit-when-idle` processes on their own
//! loopback addresses, with the link's mutual TLS.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::fake_kube::{FakeKube, Kubelet, PodInfo};
use crate::{
    fleet_bin, free_port, http_get, wait_until_async, Client, FleetBuilder, FleetFiles,
    FleetProcess,
};

pub const SERVER_NAME: &str = "node.codex-fleet.internal";

/// A pod template as the chart renders it (the parts the edge does not fill in).
pub const TEMPLATE: &str = r#"{"apiVersion":"v1","kind":"Pod",
  "metadata":{"name":"tenant-node","labels":{"app.kubernetes.io/name":"codex-fleet",
    "app.kubernetes.io/instance":"test","app.kubernetes.io/component":"tenant-node"}},
  "spec":{"restartPolicy":"Never","automountServiceAccountToken":false,
    "securityContext":{"seccompProfile":{"type":"RuntimeDefault"}},
    "containers":[{"name":"node","image":"codex-fleet:test","command":["codex-fleet"],
      "resources":{"requests":{"cpu":"250m","memory":"512Mi"}},
      "readinessProbe":{"httpGet":{"path":"/readyz","port":9464}},
      "volumeMounts":[{"name":"tmp","mountPath":"/tmp"}]}],
    "volumes":[{"name":"tmp","emptyDir":{}}]}}"#;

/// Edges, a fake API server and its pods.
pub struct Cluster {
    pub files: FleetFiles,
    pub fake: FakeKube,
    pub edges: Vec<FleetProcess>,
    pub edge_config: PathBuf,
    /// Every pod's link port (on its own address).
    pub link_port: u16,
    /// Every pod's admin port (on its own address).
    pub admin_port: u16,
    /// How long a first session may wait for its tenant's pod: the edges' start timeout and a
    /// margin, so a slow start on a loaded machine is the edge's `-32001` to report, not a
    /// client timeout.
    pub first_answer: Duration,
}

pub struct Options {
    pub tenants: Vec<&'static str>,
    pub edges: usize,
    pub start_timeout_secs: u64,
    pub worker_idle_secs: u64,
    /// The first this many pods crash at start (exit 3) instead of running a node.
    pub crashing_pods: usize,
    /// Extra lines for a tenant's `[[tenants]]` entry in the edges' file (its own settings,
    /// which reach its pod through the edge).
    pub tenant_toml: Vec<(&'static str, &'static str)>,
    /// A tenant's `max_workers` (default 1).
    pub max_workers: Vec<(&'static str, usize)>,
    /// `nodes.kubernetes.max_pod_age_secs`.
    pub max_pod_age_secs: Option<u64>,
    /// The template's `terminationGracePeriodSeconds` (unset: the API server's 30).
    pub termination_grace_secs: Option<u64>,
    /// Extra `[limits]` lines, for the edges and the tenants' nodes alike.
    pub limits_toml: &'static str,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            tenants: vec!["acme"],
            edges: 1,
            start_timeout_secs: 40,
            // Long enough that no node exits while a test still uses it.
            worker_idle_secs: 300,
            crashing_pods: 0,
            tenant_toml: Vec::new(),
            max_workers: Vec::new(),
            max_pod_age_secs: None,
            termination_grace_secs: None,
            limits_toml: "",
        }
    }
}

pub fn q(p: &Path) -> String {
    serde_json::to_string(&p.display().to_string()).expect("string")
}

impl Cluster {
    pub async fn start(o: Options) -> anyhow::Result<Cluster> {
        let mut b = FleetBuilder::new().workers_toml(&format!(
            "worker_idle_secs = {}\nthread_unload_delay_secs = 1",
            o.worker_idle_secs
        ));
        if !o.limits_toml.is_empty() {
            b = b.limits_toml(o.limits_toml);
        }
        for t in &o.tenants {
            let max = o
                .max_workers
                .iter()
                .find(|(id, _)| id == t)
                .map_or(1, |(_, m)| *m);
            b = b.tenant_pool(t, 0, max);
            for (_, lines) in o.tenant_toml.iter().filter(|(id, _)| id == t) {
                b = b.tenant_toml(lines);
            }
        }
        let files = b.prepare().await?;
        let dir = files.dir.path().to_owned();
        let base = std::fs::read_to_string(&files.config)?;
        let link = crate::write_link_pki(&dir, &[SERVER_NAME])?;
        // The node config the chart mounts in every tenant pod: no tenants (`--tenant` names
        // the one it serves, and the edge puts that tenant's own entry in the pod's env), its
        // link and admin on the pod's own address.
        let tenants_at = base.find("[[tenants]]").unwrap_or(base.len());
        let node_base = base[..tenants_at]
            .replace(&q(&dir.join("tls.crt")), &q(&link.join("node.crt")))
            .replace(&q(&dir.join("tls.key")), &q(&link.join("node.key")))
            + &format!(
                "\n[node]\nname = \"tenant-node\"\nedge_ca = {}\n",
                q(&link.join("ca.pem"))
            );
        let link_port = free_port()?;
        let admin_port = free_port()?;
        let pods_dir = dir.join("pods");
        let volumes = dir.join("volumes");
        std::fs::create_dir(&pods_dir)?;
        std::fs::create_dir(&volumes)?;
        let state_dir_line = q(&dir.join("s"));
        let crashes = std::sync::atomic::AtomicUsize::new(o.crashing_pods);
        let kubelet: Kubelet = Arc::new(move |pod: &PodInfo| {
            let crash = crashes
                .fetch_update(
                    std::sync::atomic::Ordering::AcqRel,
                    std::sync::atomic::Ordering::Acquire,
                    |n| n.checked_sub(1),
                )
                .is_ok();
            if crash {
                let mut cmd = tokio::process::Command::new("sh");
                cmd.args(["-c", "sleep 0.3; exit 3"]);
                return Ok((cmd, SocketAddr::from((pod.ip, admin_port))));
            }
            let home = volumes.join(&pod.claim);
            std::fs::create_dir_all(&home)?;
            std::fs::set_permissions(&home, std::os::unix::fs::PermissionsExt::from_mode(0o711))?;
            let text = node_base
                .replacen(
                    "addr = \"127.0.0.1:0\"",
                    &format!("addr = \"{}:{link_port}\"", pod.ip),
                    1,
                )
                .replacen(
                    "addr = \"127.0.0.1:0\"",
                    &format!("addr = \"{}:{admin_port}\"", pod.ip),
                    1,
                )
                .replace(&state_dir_line, &q(&home));
            let config = pods_dir.join(format!("{}-{}.toml", pod.name, pod.ip));
            std::fs::write(&config, text)?;
            // The pod's args, with the mounted config path pointing at this pod's file.
            let mut args = pod.args.clone();
            if let Some(i) = args.iter().position(|a| a == "--config") {
                args[i + 1] = config.display().to_string();
            }
            let log = std::fs::File::create(pods_dir.join(format!("{}-{}.log", pod.name, pod.ip)))?;
            let mut cmd = tokio::process::Command::new(fleet_bin());
            cmd.args(&args)
                .envs(pod.env.iter().map(|(k, v)| (k, v)))
                .env("CODEX_FLEET_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(log);
            Ok((cmd, SocketAddr::from((pod.ip, admin_port))))
        });
        let fake = FakeKube::start(kubelet).await?;
        let template = dir.join("pod.json");
        // The readiness probe names the pods' admin port, as the chart's template does (the
        // edge asks it whether a node is idle).
        let mut pod: Value = serde_json::from_str(
            &TEMPLATE.replace("\"port\":9464", &format!("\"port\":{admin_port}")),
        )?;
        if let Some(grace) = o.termination_grace_secs {
            pod["spec"]["terminationGracePeriodSeconds"] = grace.into();
        }
        std::fs::write(&template, pod.to_string())?;
        // An edge runs no worker: its file leaves `[workers]` out.
        let edge_base = match (base.find("[workers]\n"), base.find("[drain]\n")) {
            (Some(w), Some(d)) if w < d => format!("{}{}", &base[..w], &base[d..]),
            _ => base.clone(),
        };
        let max_age = o
            .max_pod_age_secs
            .map(|s| format!("max_pod_age_secs = {s}\n"))
            .unwrap_or_default();
        let edge_text = edge_base
            + &format!(
                "\n[nodes]\nbackend = \"kubernetes\"\nca = {}\nclient_cert = {}\nclient_key = {}\n\
                 connect_timeout_ms = 2000\nprobe_interval_secs = 1\n\n[nodes.kubernetes]\nnamespace = \"codex\"\n\
                 api_url = {:?}\npod_template = {}\nlink_port = {link_port}\n\
                 server_name = {SERVER_NAME:?}\nstart_timeout_secs = {}\nstorage_size = \"1Gi\"\n",
                q(&link.join("ca.pem")),
                q(&link.join("edge.crt")),
                q(&link.join("edge.key")),
                fake.url(),
                q(&template),
                o.start_timeout_secs,
            )
            + &max_age;
        let edge_config = dir.join("edge.toml");
        std::fs::write(&edge_config, edge_text)?;
        let mut c = Cluster {
            files,
            fake,
            edges: Vec::new(),
            edge_config,
            link_port,
            admin_port,
            first_answer: Duration::from_secs(o.start_timeout_secs + 15),
        };
        for _ in 0..o.edges {
            c.add_edge().await?;
        }
        Ok(c)
    }

    pub async fn add_edge(&mut self) -> anyhow::Result<()> {
        let edge =
            FleetProcess::spawn_role(&fleet_bin(), "serve", &self.edge_config, |_| {}).await?;
        self.edges.push(edge);
        Ok(())
    }

    /// An initialized client of `tenant` through edge `edge`.
    pub async fn client(&self, edge: usize, tenant: &str) -> anyhow::Result<Client> {
        let mut c = Client::connect(
            &self.edges[edge].url(),
            &self.files.ca,
            Some(&self.files.token(tenant)),
        )
        .await?;
        c.initialize_within("kubernetes-test", self.first_answer)
            .await?;
        Ok(c)
    }

    pub async fn metrics(&self, edge: usize) -> anyhow::Result<String> {
        Ok(http_get(self.edges[edge].admin, "/metrics").await?.1)
    }

    pub async fn readyz(&self, edge: usize) -> anyhow::Result<(u16, Value)> {
        let (status, body) = http_get(self.edges[edge].admin, "/readyz").await?;
        Ok((status, serde_json::from_str(&body)?))
    }

    pub async fn synced(&self, edge: usize) -> bool {
        wait_until_async(Duration::from_secs(20), || async {
            self.readyz(edge)
                .await
                .is_ok_and(|(s, r)| s == 200 && r["edge"]["watchSynced"] == true)
        })
        .await
    }

    /// A pod's phase and readiness, as the fake API server has it.
    pub fn phase(&self, pod: &str) -> Option<(String, bool)> {
        let p = self.fake.pod(pod)?;
        let ready = p["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
        Some((p["status"]["phase"].as_str()?.to_owned(), ready))
    }

    /// A pod's admin address (its `/metrics`, `/readyz`), once it has a podIP.
    pub fn pod_admin(&self, pod: &str) -> Option<SocketAddr> {
        let ip: std::net::Ipv4Addr = self.fake.pod(pod)?["status"]["podIP"]
            .as_str()?
            .parse()
            .ok()?;
        Some(SocketAddr::from((ip, self.admin_port)))
    }

    pub fn pod_log(&self, pod: &str) -> String {
        let dir = self.files.dir.path().join("pods");
        let mut out = String::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(pod) && name.ends_with(".log") {
                out += &std::fs::read_to_string(e.path()).unwrap_or_default();
            }
        }
        out
    }
}
