//! A test fleet: its configuration ([`FleetBuilder`]), its files ([`FleetFiles`]), and
//! codex-fleet running from them, in this process ([`Fleet`]) or as a child ([`FleetProcess`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::oneshot;

use crate::client::{http_get, Client};
use crate::metrics::metric_at;
use crate::process::{codex_bin, fleet_bin};
use crate::wait::wait_until;
use crate::MockModel;

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

// === impl FleetBuilder ===

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
            token: router::cli::dev::random_token(),
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
        let pki = router::cli::dev::generate_pki(&["localhost", "127.0.0.1"])?;
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

// === impl FleetFiles ===

impl FleetFiles {
    /// Starts codex-fleet in this process from these files (edit `config` first if needed).
    pub async fn start(self) -> anyhow::Result<Fleet> {
        init_tracing();
        // Workers start through the built binary's exec shim, as in `codex-fleet serve`.
        worker::spawn_through(crate::process::fleet_bin());
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

    /// The token of a tenant.
    pub fn token(&self, tenant: &str) -> String {
        self.tenants
            .iter()
            .find(|t| t.id == tenant)
            .map(|t| t.token.clone())
            .unwrap_or_else(|| panic!("no tenant {tenant}"))
    }
}

fn prometheus_registry() -> prometheus::Registry {
    prometheus::Registry::new()
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

// === impl Fleet ===

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

    /// [`crate::metric_in`] of this fleet's `/metrics`.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
        metric_at(self.admin_addr, name, labels).await
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

// === impl FleetProcess ===

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
        let (addr, admin) = match read_addresses(&mut child).await {
            Ok(addrs) => addrs,
            Err(e) => {
                // Why it did not listen is on its stderr (bounded: it may still be running).
                use tokio::io::AsyncReadExt;
                let mut said = String::new();
                if let Some(mut err) = child.stderr.take() {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), err.read_to_string(&mut said))
                            .await;
                }
                return Err(e.context(format!("{role} stderr: {said}")));
            }
        };
        let stderr = Arc::new(std::sync::Mutex::new(String::new()));
        // Kept unless `configure` sent stderr elsewhere (then `stderr()` stays empty).
        if let Some(err) = child.stderr.take() {
            let mut lines = tokio::io::BufReader::new(err).lines();
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
        }
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

/// Logs for tests, once (`CODEX_FLEET_LOG` filters).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CODEX_FLEET_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _already = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}
