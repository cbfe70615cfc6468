//! End-to-end fixtures: a codex-fleet with real TLS, real `codex app-server` workers and the
//! offline mock model, and a wss JSON-RPC client that speaks the protocol as a real client does.

pub mod fake_kube;
pub mod kube_cluster;
pub mod link;
pub mod pki;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};

pub use mock_model::{reply_text, MockModel, MOCK_USAGE};

/// How long a test waits for any one expected message.
pub const STEP: Duration = Duration::from_secs(30);

/// Reads the first stdout line of a `codex-fleet serve`/`dev` child ("codex-fleet listening on
/// wss://ADDR/ admin http://ADDR/"), returns (wss address, admin address), and keeps draining the
/// rest of stdout so the child never blocks on it.
pub async fn read_addresses(
    child: &mut tokio::process::Child,
) -> anyhow::Result<(SocketAddr, SocketAddr)> {
    use tokio::io::AsyncBufReadExt;
    let stdout = child.stdout.take().context("stdout is not piped")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("codex-fleet did not report its address")??
        .context("codex-fleet exited before listening")?;
    let addr = |prefix: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(prefix))
            .and_then(|a| a.trim_end_matches('/').parse::<SocketAddr>().ok())
            .with_context(|| format!("unexpected first line {line:?}"))
    };
    let addrs = (addr("wss://")?, addr("http://")?);
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(addrs)
}

/// Polls `cond` every 20 ms until it holds or `within` passes; its last answer.
pub async fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

/// Ready workers of a tenant's pool.
pub fn ready_workers(fleet: &Fleet, tenant: &str) -> usize {
    fleet
        .tenant(tenant)
        .pool
        .workers()
        .iter()
        .filter(|w| w.state.as_str() == "ready")
        .count()
}

/// Waits (up to 30 s) until each `(tenant, n)` of `pools` has `n` ready workers.
pub async fn pools_ready(fleet: &Fleet, pools: &[(&str, usize)]) -> bool {
    wait_until(Duration::from_secs(30), || {
        pools.iter().all(|(t, n)| ready_workers(fleet, t) == *n)
    })
    .await
}

/// Sends SIGSTOP to `pid` and waits (up to 5 s) until the kernel reports it stopped: the signal
/// is delivered asynchronously, and a process may still answer a request or two after `kill`
/// returns.
pub async fn stop_process(pid: i32) -> anyhow::Result<()> {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid), Signal::SIGSTOP)?;
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
            .unwrap_or(false)
    };
    anyhow::ensure!(
        wait_until(Duration::from_secs(5), stopped).await,
        "process {pid} never showed as stopped"
    );
    Ok(())
}

/// Makes the link's mutual-TLS material (a CA, a node certificate for `node_names`, an edge
/// client certificate) in `<dir>/link`: `ca.pem`, `node.crt`, `node.key`, `edge.crt`,
/// `edge.key`. Returns that directory.
pub fn write_link_pki(dir: &Path, node_names: &[&str]) -> anyhow::Result<PathBuf> {
    let link = dir.join("link");
    std::fs::create_dir(&link)?;
    let pki = router::dev::generate_link_pki(node_names)?;
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

/// The pinned native codex binary; the test command installs it and sets `CODEX_BIN`.
pub fn codex_bin() -> PathBuf {
    match std::env::var_os("CODEX_BIN") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "CODEX_BIN is not set: run the suite with `bash ops/test.sh`, which installs the pinned \
             @openai/codex and exports the native binary's path"
        ),
    }
}

/// The `codex-fleet` binary built next to this test (the test command builds it first).
pub fn fleet_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CODEX_FLEET_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> → target/<profile>/codex-fleet
    let candidate = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("codex-fleet"))
        .expect("target dir");
    assert!(
        candidate.is_file(),
        "{} is missing: run `cargo build --bins` first (ops/test.sh does)",
        candidate.display()
    );
    candidate
}

/// Logs for tests, once (`CODEX_FLEET_LOG` filters).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CODEX_FLEET_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _already = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A tenant of a test fleet.
#[derive(Clone, Debug)]
pub struct TenantSpec {
    /// Its id.
    pub id: String,
    /// Its bearer token.
    pub token: String,
    /// min_workers.
    pub min_workers: usize,
    /// max_workers.
    pub max_workers: usize,
    /// Extra lines for the tenant's table (e.g. `[tenants.policy]`).
    pub extra: String,
}

/// `[workers]` lines for fast fault detection: a ping every second, one second to answer,
/// quick restarts.
pub const FAST_FAULTS: &str = "health_interval_secs = 1\nhealth_timeout_secs = 1\nrestart_backoff_initial_ms = 50\nrestart_backoff_max_ms = 200";

/// Builds a fleet configuration for tests.
pub struct FleetBuilder {
    tenants: Vec<TenantSpec>,
    extra_workers: String,
    drain: String,
    extra_limits: String,
}

impl Default for FleetBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl FleetBuilder {
    /// No tenants yet.
    pub fn new() -> Self {
        FleetBuilder {
            tenants: Vec::new(),
            extra_workers: String::new(),
            // Tests stop fleets often: no settle period unless a test asks for one.
            drain: "settle_secs = 0\n".to_owned(),
            extra_limits: String::new(),
        }
    }

    /// Adds a tenant with a fresh random token and one worker.
    pub fn tenant(mut self, id: &str) -> Self {
        self.tenants.push(TenantSpec {
            id: id.into(),
            token: router::dev::random_token(),
            min_workers: 0,
            max_workers: 1,
            extra: String::new(),
        });
        self
    }

    /// Extra TOML for the last added tenant (its own sub-tables, e.g. `[tenants.policy]`).
    pub fn tenant_toml(mut self, lines: &str) -> Self {
        if let Some(t) = self.tenants.last_mut() {
            t.extra.push_str(lines);
            t.extra.push('\n');
        }
        self
    }

    /// Adds a tenant with a fresh random token and the given pool bounds.
    pub fn tenant_pool(mut self, id: &str, min_workers: usize, max_workers: usize) -> Self {
        self = self.tenant(id);
        if let Some(t) = self.tenants.last_mut() {
            t.min_workers = min_workers;
            t.max_workers = max_workers;
        }
        self
    }

    /// Extra lines for the `[workers]` table.
    pub fn workers_toml(mut self, lines: &str) -> Self {
        self.extra_workers.push_str(lines);
        self.extra_workers.push('\n');
        self
    }

    /// The `[drain]` table (replaces the default `settle_secs = 0`).
    pub fn drain_toml(mut self, lines: &str) -> Self {
        self.drain = format!("{lines}\n");
        self
    }

    /// Lines for the `[limits]` table (message size, client queue, rates and caps).
    pub fn limits_toml(mut self, lines: &str) -> Self {
        self.extra_limits.push_str(lines);
        self.extra_limits.push('\n');
        self
    }

    /// Writes TLS material, the mock model and the config into a fresh directory.
    pub async fn prepare(self) -> anyhow::Result<FleetFiles> {
        router::tls::install_crypto_provider();
        let dir = tempfile::Builder::new().prefix("cf").tempdir_in("/tmp")?;
        // Workers may run under per-tenant uids: they must be able to pass through (not list).
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )?;
        let pki = router::dev::generate_pki(&["localhost", "127.0.0.1"])?;
        let ca = dir.path().join("ca.pem");
        let cert = dir.path().join("tls.crt");
        let key = dir.path().join("tls.key");
        std::fs::write(&ca, &pki.ca_pem)?;
        std::fs::write(&cert, &pki.cert_pem)?;
        router::fsutil::write_private(&key, &pki.key_pem)?;
        let mock = MockModel::start(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let q = |s: &str| serde_json::to_string(s).expect("string");
        let overrides: Vec<String> = mock.codex_config_overrides().iter().map(|o| q(o)).collect();
        let mut toml = format!(
            "[listen]\naddr = \"127.0.0.1:0\"\ntls_cert = {}\ntls_key = {}\nhandshake_timeout_secs = 5\n\n\
             [admin]\naddr = \"127.0.0.1:0\"\n\n\
             [workers]\ncommand = [{}, \"app-server\"]\nstate_dir = {}\nconfig_overrides = [{}]\n\
             ready_timeout_secs = 20\nstop_grace_secs = 5\n{}\n[drain]\n{}\n{}",
            q(&cert.display().to_string()),
            q(&key.display().to_string()),
            q(&codex_bin().display().to_string()),
            q(&dir.path().join("s").display().to_string()),
            overrides.join(", "),
            self.extra_workers,
            self.drain,
            // Only when asked for, so a test may still append its own [limits].
            if self.extra_limits.is_empty() {
                String::new()
            } else {
                format!("[limits]\n{}\n", self.extra_limits)
            },
        );
        for t in &self.tenants {
            toml.push_str(&format!(
                "[[tenants]]\nid = {}\ntoken_sha256 = [{}]\nmin_workers = {}\nmax_workers = {}\n{}\n",
                q(&t.id),
                q(&router::auth::token_digest_hex(&t.token)),
                t.min_workers,
                t.max_workers,
                t.extra,
            ));
        }
        let config = dir.path().join("config.toml");
        router::fsutil::write_private(&config, &toml)?;
        Ok(FleetFiles {
            dir,
            ca,
            config,
            tenants: self.tenants,
            mock,
        })
    }

    /// Starts codex-fleet in this process, on ephemeral ports.
    pub async fn start(self) -> anyhow::Result<Fleet> {
        self.prepare().await?.start().await
    }
}

impl FleetFiles {
    /// Starts codex-fleet in this process from these files (edit `config` first if needed).
    pub async fn start(self) -> anyhow::Result<Fleet> {
        init_tracing();
        let files = self;
        let cfg = router::config::Config::load(&files.config)?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let admin_addr = admin.local_addr()?;
        let server = router::Server::build(cfg, prometheus_registry())?
            .with_config_path(files.config.clone());
        let tenants = server.tenants().clone();
        let reloader = server.reloader();
        let admission = server.admission().clone();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(listener, admin, async move {
            let _stopped = stop_rx.await;
        }));
        Ok(Fleet {
            files,
            tenants,
            reloader,
            admission,
            addr,
            admin_addr,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }
}

fn prometheus_registry() -> prometheus::Registry {
    prometheus::Registry::new()
}

/// Files of a prepared fleet (kept alive as long as the fleet runs).
pub struct FleetFiles {
    /// The temporary directory holding everything.
    pub dir: tempfile::TempDir,
    /// The CA clients trust.
    pub ca: PathBuf,
    /// The config file.
    pub config: PathBuf,
    /// Tenants and their tokens.
    pub tenants: Vec<TenantSpec>,
    /// The mock model the workers use.
    pub mock: MockModel,
}

impl FleetFiles {
    /// The token of a tenant.
    pub fn token(&self, tenant: &str) -> String {
        self.tenants
            .iter()
            .find(|t| t.id == tenant)
            .map(|t| t.token.clone())
            .unwrap_or_else(|| panic!("no tenant {tenant}"))
    }
}

/// A codex-fleet running inside the test process.
pub struct Fleet {
    /// Its files.
    pub files: FleetFiles,
    /// Its tenants (pools and thread tables), for assertions.
    pub tenants: Arc<router::tenants::TenantRegistry>,
    /// Reloads its configuration file (what SIGHUP does).
    pub reloader: Arc<router::reload::Reloader>,
    /// Its admission control, for assertions on connection and turn counts.
    pub admission: Arc<router::admission::Admission>,
    /// The wss address.
    pub addr: SocketAddr,
    /// The admin address.
    pub admin_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Fleet {
    /// `wss://localhost:PORT/`
    pub fn url(&self) -> String {
        format!("wss://localhost:{}/", self.addr.port())
    }

    /// A tenant by id.
    pub fn tenant(&self, id: &str) -> Arc<router::tenants::Tenant> {
        self.tenants
            .current()
            .iter()
            .find(|t| t.id == id)
            .cloned()
            .unwrap_or_else(|| panic!("no tenant {id}"))
    }

    /// The tenant's CODEX_HOME.
    pub fn home(&self, tenant: &str) -> PathBuf {
        self.files.dir.path().join("s/tenants").join(tenant)
    }

    /// The tenant's workspace (its workers' working directory).
    pub fn workspace(&self, tenant: &str) -> PathBuf {
        self.files.dir.path().join("s/workspaces").join(tenant)
    }

    /// Connects as a tenant (no initialize yet).
    pub async fn connect(&self, tenant: &str) -> anyhow::Result<Client> {
        Client::connect(&self.url(), &self.files.ca, Some(&self.files.token(tenant))).await
    }

    /// Connects and initializes as a tenant.
    pub async fn client(&self, tenant: &str) -> anyhow::Result<Client> {
        let mut c = self.connect(tenant).await?;
        c.initialize("e2e-client").await?;
        Ok(c)
    }

    /// GETs a path on the admin port: (status, body).
    pub async fn admin_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        http_get(self.admin_addr, path).await
    }

    /// Stops the fleet and waits for it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _sent = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await??;
        }
        Ok(())
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _sent = tx.send(());
        }
    }
}

/// A minimal HTTP/1.0 GET over loopback.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad HTTP response: {text}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_owned();
    Ok((status, body))
}

/// A rustls client configuration that trusts only `ca`.
pub fn client_tls(ca: &Path) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    router::tls::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for cert in router::tls::load_certs(ca)? {
        roots.add(cert)?;
    }
    Ok(Arc::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ))
}

/// A JSON-RPC client over wss, as the protocol manual describes one.
pub struct Client {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: i64,
    /// Messages received while waiting for something else, in order.
    pub backlog: std::collections::VecDeque<Value>,
}

/// What an upgrade attempt got.
pub enum Upgrade {
    /// Upgraded.
    Open(Box<Client>),
    /// Refused with an HTTP answer.
    Refused {
        /// The status code.
        status: u16,
        /// `Retry-After` in seconds, when sent.
        retry_after: Option<u64>,
        /// The body.
        body: String,
    },
}

impl Client {
    /// Opens the wss connection; `token` goes in `Authorization: Bearer`.
    pub async fn connect(url: &str, ca: &Path, token: Option<&str>) -> anyhow::Result<Client> {
        Client::connect_over(url, ca, token, None).await
    }

    /// Opens the wss connection over a TCP socket with a small receive buffer, so a client
    /// that stops reading backs up into codex-fleet quickly.
    pub async fn connect_small_window(
        addr: SocketAddr,
        url: &str,
        ca: &Path,
        token: Option<&str>,
        rcvbuf: u32,
    ) -> anyhow::Result<Client> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_recv_buffer_size(rcvbuf)?;
        let tcp = socket.connect(addr).await?;
        Client::connect_over(url, ca, token, Some(tcp)).await
    }

    /// One upgrade attempt: the client, or the refusal's status and `Retry-After`.
    pub async fn try_connect(url: &str, ca: &Path, token: Option<&str>) -> anyhow::Result<Upgrade> {
        match Client::connect(url, ca, token).await {
            Ok(c) => Ok(Upgrade::Open(Box::new(c))),
            Err(e) => match e.downcast::<tokio_tungstenite::tungstenite::Error>() {
                Ok(tokio_tungstenite::tungstenite::Error::Http(resp)) => Ok(Upgrade::Refused {
                    status: resp.status().as_u16(),
                    retry_after: resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse().ok()),
                    body: String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default())
                        .into_owned(),
                }),
                Ok(other) => Err(other.into()),
                Err(e) => Err(e),
            },
        }
    }

    async fn connect_over(
        url: &str,
        ca: &Path,
        token: Option<&str>,
        tcp: Option<TcpStream>,
    ) -> anyhow::Result<Client> {
        let mut req = url.into_client_request()?;
        if let Some(t) = token {
            req.headers_mut()
                .insert("authorization", format!("Bearer {t}").parse()?);
        }
        req.headers_mut()
            .insert("x-codex-app-server-compression", "zstd-stream-v1".parse()?);
        let connector = Connector::Rustls(client_tls(ca)?);
        let connecting = async {
            match tcp {
                Some(tcp) => {
                    tokio_tungstenite::client_async_tls_with_config(req, tcp, None, Some(connector))
                        .await
                }
                None => {
                    // Nagle off, as interactive clients want: with it, a request written right
                    // after another small frame waits ~40 ms for the server's delayed ACK.
                    tokio_tungstenite::connect_async_tls_with_config(
                        req,
                        None,
                        true,
                        Some(connector),
                    )
                    .await
                }
            }
        };
        let (ws, resp) = tokio::time::timeout(STEP, connecting)
            .await
            .context("connect timed out")??;
        if resp
            .headers()
            .contains_key("x-codex-app-server-compression")
        {
            bail!("the router must not echo x-codex-app-server-compression");
        }
        Ok(Client {
            ws,
            next_id: 1,
            backlog: Default::default(),
        })
    }

    /// Sends a raw text frame.
    pub async fn send_text(&mut self, text: &str) -> anyhow::Result<()> {
        self.ws.send(Message::text(text)).await?;
        Ok(())
    }

    /// Sends a binary frame.
    pub async fn send_binary(&mut self, bytes: Vec<u8>) -> anyhow::Result<()> {
        self.ws.send(Message::binary(bytes)).await?;
        Ok(())
    }

    /// Sends a JSON value.
    pub async fn send(&mut self, v: &Value) -> anyhow::Result<()> {
        self.send_text(&v.to_string()).await
    }

    /// The next JSON message from the wire (not the backlog); errors on close or timeout.
    pub async fn recv_wire(&mut self, within: Duration) -> anyhow::Result<Value> {
        loop {
            let frame = tokio::time::timeout(within, self.ws.next())
                .await
                .context("timed out waiting for a message")?;
            match frame {
                Some(Ok(Message::Text(t))) => return Ok(serde_json::from_str(&t)?),
                Some(Ok(Message::Close(c))) => bail!("connection closed: {c:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("read error: {e}"),
                None => bail!("connection ended"),
            }
        }
    }

    /// Waits for the close frame (or end) and returns its code.
    pub async fn recv_close(&mut self, within: Duration) -> anyhow::Result<Option<u16>> {
        Ok(self.recv_close_frame(within).await?.map(|(code, _)| code))
    }

    /// Waits for the close frame (or end) and returns its code and reason; text frames on the
    /// way go to the backlog.
    pub async fn recv_close_frame(
        &mut self,
        within: Duration,
    ) -> anyhow::Result<Option<(u16, String)>> {
        loop {
            let frame = tokio::time::timeout(within, self.ws.next())
                .await
                .context("timed out waiting for close")?;
            match frame {
                Some(Ok(Message::Close(c))) => {
                    return Ok(c.map(|c| (u16::from(c.code), c.reason.to_string())))
                }
                Some(Ok(Message::Text(t))) => self.backlog.push_back(serde_json::from_str(&t)?),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Ok(None),
            }
        }
    }

    /// The next message matching `pred`, from the backlog first; others are kept in the backlog.
    pub async fn wait_for(
        &mut self,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        if let Some(pos) = self.backlog.iter().position(&mut pred) {
            return Ok(self.backlog.remove(pos).expect("position"));
        }
        let deadline = tokio::time::Instant::now() + STEP;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let v = self.recv_wire(left).await?;
            if pred(&v) {
                return Ok(v);
            }
            self.backlog.push_back(v);
        }
    }

    /// The next notification named `method`.
    pub async fn notification(&mut self, method: &str) -> anyhow::Result<Value> {
        self.wait_for(|v| v["method"] == method && v.get("id").is_none())
            .await
            .with_context(|| format!("waiting for {method}"))
    }

    /// Sends a request and returns its response (result or error object).
    pub async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        self.wait_for(|v| v["id"] == id && v.get("method").is_none())
            .await
            .with_context(|| format!("waiting for the answer to {method}"))
    }

    /// Sends a request and returns its result, failing on an error response.
    pub async fn request(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let resp = self.call(method, params).await?;
        if let Some(e) = resp.get("error") {
            bail!("{method} failed: {e}");
        }
        Ok(resp["result"].clone())
    }

    /// `initialize` + `initialized`, as the TUI does (string id "initialize").
    pub async fn initialize(&mut self, name: &str) -> anyhow::Result<Value> {
        self.send(&json!({
            "id": "initialize",
            "method": "initialize",
            "params": {
                "clientInfo": { "name": name, "title": null, "version": "0.0.1" },
                "capabilities": { "experimentalApi": true }
            }
        }))
        .await?;
        let resp = self
            .wait_for(|v| v["id"] == "initialize")
            .await
            .context("waiting for initialize")?;
        if resp.get("error").is_some() {
            bail!("initialize failed: {resp}");
        }
        self.send(&json!({ "method": "initialized" })).await?;
        Ok(resp["result"].clone())
    }

    /// `thread/start` with defaults; returns the thread id.
    pub async fn start_thread(&mut self) -> anyhow::Result<String> {
        let r = self.request("thread/start", json!({})).await?;
        r["thread"]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("thread/start without thread.id: {r}"))
    }

    /// `turn/start` with one text input; returns the turn id.
    pub async fn start_turn(&mut self, thread: &str, text: &str) -> anyhow::Result<String> {
        let r = self
            .request(
                "turn/start",
                json!({
                    "threadId": thread,
                    "input": [{ "type": "text", "text": text, "text_elements": [] }]
                }),
            )
            .await?;
        r["turn"]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("turn/start without turn.id: {r}"))
    }

    /// Collects every message until `turn/completed` for `thread`; returns them in order.
    pub async fn until_turn_completed(&mut self, thread: &str) -> anyhow::Result<Vec<Value>> {
        let mut seen = Vec::new();
        loop {
            let v = self
                .wait_for(|_| true)
                .await
                .context("waiting for turn/completed")?;
            let done = v["method"] == "turn/completed" && v["params"]["threadId"] == thread;
            seen.push(v);
            if done {
                return Ok(seen);
            }
        }
    }

    /// Sends a request without waiting for its answer; returns its id.
    pub async fn send_request(&mut self, method: &str, params: Value) -> anyhow::Result<i64> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        Ok(id)
    }

    /// Closes the connection politely.
    pub async fn close(mut self) {
        let _closed = self.ws.close(None).await;
    }
}

/// The text of the last completed agent message among `msgs`.
pub fn agent_text(msgs: &[Value]) -> Option<String> {
    msgs.iter()
        .rev()
        .filter(|m| m["method"] == "item/completed")
        .find(|m| m["params"]["item"]["type"] == "agentMessage")
        .and_then(|m| m["params"]["item"]["text"].as_str().map(str::to_owned))
}

/// Whether a process exists (and is not a zombie).
pub fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // state is the field after the parenthesised command name
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            state != Some("Z")
        }
        Err(_) => false,
    }
}

/// Pids of processes whose executable is `exe`.
pub fn processes_running(exe: &Path) -> Vec<i32> {
    let Ok(target) = std::fs::canonicalize(exe) else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == target)
                && process_alive(*pid)
        })
        .collect()
}

/// Pids of every live process whose CODEX_HOME lies under `dir`: the workers of one test fleet
/// and whatever they started (the check that nothing of a fleet outlived it).
pub fn processes_under(dir: &Path) -> Vec<i32> {
    let needle = format!("CODEX_HOME={}", dir.display());
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|b| *b == 0)
                    .any(|kv| kv.starts_with(needle.as_bytes()))
            }) && process_alive(*pid)
        })
        .collect()
}

/// Pids of the workers of one test fleet: of [`processes_under`], the process-group leaders whose
/// parent is not one of them. A worker runs in its own group, started by the fleet; what a worker
/// starts (app-server's helpers, a command's shell) inherits CODEX_HOME but has a worker as its
/// parent, and is not a worker.
pub fn workers_under(dir: &Path) -> Vec<i32> {
    let all = processes_under(dir);
    all.iter()
        .copied()
        .filter(|&pid| {
            let Some((ppid, pgid)) = parent_and_group(pid) else {
                return false;
            };
            pgid == pid && !all.contains(&ppid)
        })
        .collect()
}

/// The parent pid and the process group of `pid`, from `/proc/<pid>/stat`.
fn parent_and_group(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let _state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some((ppid, pgid))
}

impl Client {
    /// Sends a WebSocket ping frame.
    pub async fn send_ping(&mut self, payload: Vec<u8>) -> anyhow::Result<()> {
        self.ws.send(Message::Ping(payload.into())).await?;
        Ok(())
    }
}

/// Resident memory of a process in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The variable that lets a non-root run skip the tests that need root, explicitly.
pub const SKIP_ROOT_TESTS: &str = "CODEX_FLEET_SKIP_ROOT_TESTS";

/// Whether a test that needs root should run: true as root; without root it panics (so the test
/// fails instead of passing unchecked) unless `CODEX_FLEET_SKIP_ROOT_TESTS=1` asks to skip it.
pub fn root_or_explicit_skip(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var(SKIP_ROOT_TESTS).as_deref() == Ok("1") {
        eprintln!("skipped ({SKIP_ROOT_TESTS}=1): {what} needs root");
        return false;
    }
    panic!(
        "{what} needs root and this run is not root: run the suite as root (e.g. `sudo -E bash \
         ops/test.sh`), or set {SKIP_ROOT_TESTS}=1 to skip the root-only tests knowingly"
    );
}

/// The sum of the samples of `name` whose labels include every pair of `labels`, in a Prometheus
/// text exposition; 0 when there is none (a labelled series appears with its first event).
pub fn metric_in(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut total = 0.0;
    for line in text.lines().filter(|l| l.starts_with(name)) {
        let (series, value) = line.rsplit_once(' ').unwrap_or((line, "0"));
        let rest = &series[name.len()..];
        if !(rest.is_empty() || rest.starts_with('{')) {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")))
        {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

/// [`metric_in`] of the `/metrics` served on an admin address.
pub async fn metric_at(
    admin: SocketAddr,
    name: &str,
    labels: &[(&str, &str)],
) -> anyhow::Result<f64> {
    let (status, text) = http_get(admin, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    Ok(metric_in(&text, name, labels))
}

/// Ready workers per tenant in a `/readyz` body.
pub fn readyz_ready_workers(
    body: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, usize>> {
    let v: Value = serde_json::from_str(body).with_context(|| format!("/readyz body {body:?}"))?;
    let tenants = v["tenants"]
        .as_array()
        .with_context(|| format!("/readyz without tenants: {v}"))?;
    Ok(tenants
        .iter()
        .map(|t| {
            let ready = t["workers"]
                .as_array()
                .map_or(0, |ws| ws.iter().filter(|w| w["state"] == "ready").count());
            (t["id"].as_str().unwrap_or_default().to_owned(), ready)
        })
        .collect())
}

// === impl Fleet: metrics ===

impl Fleet {
    /// [`metric_in`] of this fleet's `/metrics`.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
        metric_at(self.admin_addr, name, labels).await
    }
}

/// [`wait_until`] for a condition that must await (a metric, `/readyz`, a process' state over
/// a socket): polls every 20 ms until it holds or `within` passes; its last answer.
pub async fn wait_until_async<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond().await
}

/// `codex-fleet serve` as a child process: its ports, and its stderr collected as it comes.
pub struct FleetProcess {
    /// The child (killed on drop).
    pub child: tokio::process::Child,
    /// The wss address.
    pub addr: SocketAddr,
    /// The admin address.
    pub admin: SocketAddr,
    stderr: Arc<std::sync::Mutex<String>>,
}

impl FleetProcess {
    /// Starts `codex-fleet serve --config FILE` with `CODEX_FLEET_LOG=warn`.
    pub async fn spawn(files: &FleetFiles) -> anyhow::Result<FleetProcess> {
        FleetProcess::spawn_with(files, |_| {}).await
    }

    /// Same, after `configure` adjusted the command (environment, uid).
    pub async fn spawn_with(
        files: &FleetFiles,
        configure: impl FnOnce(&mut tokio::process::Command),
    ) -> anyhow::Result<FleetProcess> {
        FleetProcess::spawn_program(&fleet_bin(), files, configure).await
    }

    /// Same, running `program` (a copy of the codex-fleet binary) instead of [`fleet_bin`].
    pub async fn spawn_program(
        program: &Path,
        files: &FleetFiles,
        configure: impl FnOnce(&mut tokio::process::Command),
    ) -> anyhow::Result<FleetProcess> {
        FleetProcess::spawn_role(program, "serve", &files.config, configure).await
    }

    /// Starts `program <role> --config <config>` (`serve` or `node`) with `CODEX_FLEET_LOG=warn`.
    pub async fn spawn_role(
        program: &Path,
        role: &str,
        config: &Path,
        configure: impl FnOnce(&mut tokio::process::Command),
    ) -> anyhow::Result<FleetProcess> {
        use tokio::io::AsyncBufReadExt;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args([role, "--config"])
            .arg(config)
            .env("CODEX_FLEET_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        configure(&mut cmd);
        let mut child = cmd.spawn()?;
        let (addr, admin) = read_addresses(&mut child).await?;
        let stderr = Arc::new(std::sync::Mutex::new(String::new()));
        let mut lines = tokio::io::BufReader::new(child.stderr.take().context("stderr")?).lines();
        let sink = stderr.clone();
        tokio::spawn(async move {
            while let Ok(Some(l)) = lines.next_line().await {
                let mut s = sink
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                s.push_str(&l);
                s.push('\n');
            }
        });
        Ok(FleetProcess {
            child,
            addr,
            admin,
            stderr,
        })
    }

    /// `wss://localhost:PORT/`
    pub fn url(&self) -> String {
        format!("wss://localhost:{}/", self.addr.port())
    }

    /// Connects and initializes with `token`.
    pub async fn client(&self, files: &FleetFiles, token: &str) -> anyhow::Result<Client> {
        let mut c = Client::connect(&self.url(), &files.ca, Some(token)).await?;
        c.initialize("fleet-process-test").await?;
        Ok(c)
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Sends `sig` to codex-fleet.
    pub fn signal(&self, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = self.child.id().context("codex-fleet already exited")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)?;
        Ok(())
    }

    /// Its stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Waits until `stderr` has a line containing `needle`, up to `within`.
    pub async fn wait_for_stderr(&self, needle: &str, within: Duration) -> bool {
        wait_until(within, || self.stderr().contains(needle)).await
    }

    /// Waits for it to exit, up to `within`.
    pub async fn wait(&mut self, within: Duration) -> anyhow::Result<std::process::ExitStatus> {
        Ok(tokio::time::timeout(within, self.child.wait())
            .await
            .context("codex-fleet did not exit")??)
    }
}

/// Sends `request` (raw HTTP/1.1 text) over TLS to `addr` (trusting `ca`, SNI `localhost`) and
/// returns everything the server sent until it closed, as text.
pub async fn https_raw(addr: SocketAddr, ca: &Path, request: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connector = tokio_rustls::TlsConnector::from(client_tls(ca)?);
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut tls = tokio::time::timeout(STEP, connector.connect(name, tcp))
        .await
        .context("TLS handshake timed out")??;
    tls.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    // A server that answers and closes ends the read; one that keeps the connection open
    // after its answer is read up to the timeout.
    let _read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut buf)).await;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// A tmux server of our own (`-L`), so nothing else on the machine is touched.
pub struct Tmux {
    socket: String,
    /// The TUI's CODEX_HOME and working directory, kept while it runs.
    dirs: Vec<tempfile::TempDir>,
}

impl Tmux {
    /// A tmux server named after this process and `name`.
    pub fn new(name: &str) -> Tmux {
        Tmux {
            socket: format!("cf-{name}-{}", std::process::id()),
            dirs: Vec::new(),
        }
    }

    /// Starts the real Codex TUI (`codex --remote url`, trusting `ca`, with `token`) in the
    /// pane `tui`, in fresh directories, and waits for its prompt. When it exits the pane shows
    /// `TUI-EXITED`.
    pub async fn start_tui(&mut self, url: &str, ca: &Path, token: &str) -> anyhow::Result<()> {
        let home = tempfile::tempdir()?;
        let work = tempfile::tempdir()?;
        let command = format!(
            "cd {work} && SSL_CERT_FILE={ca} CODEX_HOME={home} FLEET_TOKEN={token} {codex} \
             --remote {url} --remote-auth-token-env FLEET_TOKEN; echo TUI-EXITED $?; sleep 600",
            work = work.path().display(),
            ca = ca.display(),
            home = home.path().display(),
            codex = codex_bin().display(),
        );
        self.dirs.extend([home, work]);
        self.run(&[
            "new-session",
            "-d",
            "-s",
            "tui",
            "-x",
            "160",
            "-y",
            "45",
            &command,
        ])?;
        self.until_screen_has("Ask Codex to do anything", Duration::from_secs(60))
            .await?;
        Ok(())
    }

    /// Runs a tmux command on this server.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .context("tmux must be installed (ops/test.sh installs it)")?;
        if !out.status.success() {
            anyhow::bail!("tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The pane `tui` as text.
    pub fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "tui"])
            .unwrap_or_default()
    }

    /// Types `text` into the pane `tui`, then Enter.
    pub fn type_line(&self, text: &str) -> anyhow::Result<()> {
        self.run(&["send-keys", "-t", "tui", "-l", text])?;
        std::thread::sleep(Duration::from_millis(300));
        self.run(&["send-keys", "-t", "tui", "Enter"])?;
        Ok(())
    }

    /// Waits until the pane shows `needle`; returns the screen.
    pub async fn until_screen_has(&self, needle: &str, within: Duration) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let screen = self.screen();
            if screen.contains(needle) {
                return Ok(screen);
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("the TUI never showed {needle:?}; screen:\n{screen}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// Issue 11: edges in front of nodes, as real processes on loopback (see tests/tests/split.rs).
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

/// A loopback port free right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn toml_path(p: &Path) -> String {
    serde_json::to_string(&p.display().to_string()).expect("string")
}

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
        let root = nix::unistd::geteuid().is_root();
        let mut b = FleetBuilder::new().limits_toml(limits);
        for (i, (id, node)) in tenants.iter().enumerate() {
            b = b
                .tenant_pool(id, 1, 1)
                .tenant_toml(&format!("node = {node:?}"));
            if root {
                // Two nodes on one machine: their tenants' uids must differ (each node remembers
                // its own allocations).
                b = b.tenant_toml(&format!("uid = {}", 64_000 + i));
            }
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
        let text = self
            .base
            .replacen(
                "addr = \"127.0.0.1:0\"",
                &format!("addr = \"127.0.0.1:{port}\""),
                1,
            )
            .replace(
                &toml_path(&dir.join("tls.crt")),
                &toml_path(&self.link.join("node.crt")),
            )
            .replace(
                &toml_path(&dir.join("tls.key")),
                &toml_path(&self.link.join("node.key")),
            )
            .replace(&toml_path(&dir.join("s")), &toml_path(&dir.join(name)))
            + &format!(
                "\n[node]\nname = {name:?}\nedge_ca = {}\n",
                toml_path(&self.link.join("ca.pem"))
            );
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
        // An edge runs no worker: its file leaves `[workers]` out.
        let base = match (self.base.find("[workers]\n"), self.base.find("[drain]\n")) {
            (Some(w), Some(d)) if w < d => format!("{}{}", &self.base[..w], &self.base[d..]),
            _ => self.base.clone(),
        };
        let mut text = base
            + &format!(
                "\n[nodes]\nbackend = \"static\"\nca = {}\nclient_cert = {}\nclient_key = {}\n\
                 probe_interval_secs = 1\nconnect_timeout_ms = 1000\n",
                toml_path(&self.link.join("ca.pem")),
                toml_path(&self.link.join("edge.crt")),
                toml_path(&self.link.join("edge.key")),
            );
        for n in &self.nodes {
            text += &format!(
                "[[nodes.static]]\nname = {:?}\naddr = \"127.0.0.1:{}\"\nserver_name = \"localhost\"\n",
                n.name, n.port
            );
        }
        text
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

/// Runs the real `codex exec --remote URL --remote-auth-token-env … PROMPT` with `token` in that
/// variable, trusting the CA bundle `ca`, in a fresh CODEX_HOME; its output (within 90 s).
pub async fn codex_exec_remote(
    url: &str,
    ca: &Path,
    token: &str,
    prompt: &str,
) -> anyhow::Result<std::process::Output> {
    let client_home = tempfile::tempdir()?;
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(codex_bin())
            .args(["exec", "--skip-git-repo-check", "--remote", url])
            .args(["--remote-auth-token-env", "CODEX_FLEET_TOKEN", prompt])
            .env("SSL_CERT_FILE", ca)
            .env("CODEX_FLEET_TOKEN", token)
            .env("CODEX_HOME", client_home.path())
            .current_dir(client_home.path())
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .context("codex exec did not finish within 90 s")??;
    Ok(out)
}
