//! The `codex-fleet` binary: parses arguments, sets up tracing, binds sockets, runs the server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use mock_model::MockModel;
use prometheus::Registry;
use router::cli::dev::{self, DevOptions};
use router::config::Config;
use router::Server;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};

/// Exit code for a configuration that does not validate (sysexits EX_CONFIG).
const EX_CONFIG: u8 = 78;

#[derive(Parser)]
#[command(
    name = "codex-fleet",
    version,
    about = "Multi-tenant supervisor and router for codex app-server"
)]
struct Cli {
    /// How log lines are written to stderr: `text` (one line per event, control characters
    /// escaped) or `json` (one JSON object per line; the Helm chart's default).
    #[arg(
        long,
        global = true,
        env = "CODEX_FLEET_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The format of log lines (`--log-format`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable, one line per event.
    Text,
    /// One JSON object per line (`tracing-subscriber`'s json layer).
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve clients as the configuration file says: with their workers in this process, or,
    /// with a `[nodes]` section, as an edge in front of the tenants' nodes.
    Serve {
        /// The TOML configuration.
        #[arg(long, env = "CODEX_FLEET_CONFIG")]
        config: PathBuf,
    },
    /// Run a node: the tenants assigned to it (`[node] name`), serving edges only, over mutual
    /// TLS.
    Node {
        /// The TOML configuration (with a `[node]` section).
        #[arg(long, env = "CODEX_FLEET_CONFIG")]
        config: PathBuf,
        /// Serve exactly this tenant (a tenant pod on Kubernetes): the file's `[[tenants]]`
        /// entry of that id if it has one, else default limits.
        #[arg(long)]
        tenant: Option<String>,
        /// Exit 0 once there has been no session, no running turn and no loaded thread for
        /// `workers.worker_idle_secs`.
        #[arg(long)]
        exit_when_idle: bool,
    },
    /// Print the volume claim and pod the kubernetes backend would create for a tenant, as a
    /// JSON `v1/List` (for offline validation of the pod spec).
    RenderTenantPod {
        /// The edge's TOML configuration (`[nodes.kubernetes]`).
        #[arg(long, env = "CODEX_FLEET_CONFIG")]
        config: PathBuf,
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
    /// A terminal view of capacity from a running codex-fleet's admin endpoints: tenants,
    /// sessions, workers and turns against their limits, memory, CPU, refusals, refreshing like
    /// top (plain text when not a terminal).
    Top {
        /// The admin endpoint (plain HTTP).
        #[arg(
            long,
            env = "CODEX_FLEET_ADMIN",
            default_value = "http://127.0.0.1:9464"
        )]
        admin: String,
        /// Seconds between refreshes (and between the two samples of `--once`).
        #[arg(long, default_value_t = 2)]
        interval: u64,
        /// Print one report and exit.
        #[arg(long)]
        once: bool,
    },
    /// Validate a configuration file and exit (non-zero with the reason when invalid).
    CheckConfig {
        /// The TOML configuration.
        file: PathBuf,
    },
    /// Run locally with an embedded default: a dev tenant, self-signed TLS, a printed token.
    Dev {
        /// Where the CA, token, config and tenant state are kept.
        #[arg(long, env = "CODEX_FLEET_DEV_DIR", default_value = ".codex-fleet/dev")]
        state_dir: PathBuf,
        /// Client port on 127.0.0.1.
        #[arg(long, env = "CODEX_FLEET_DEV_PORT", default_value_t = 8443)]
        port: u16,
        /// Admin port on 127.0.0.1.
        #[arg(long, env = "CODEX_FLEET_DEV_ADMIN_PORT", default_value_t = 9464)]
        admin_port: u16,
        /// The codex program (the npm launcher is resolved to its native binary).
        #[arg(long, env = "CODEX_BIN", default_value = "codex")]
        codex: String,
    },
}

fn main() -> ExitCode {
    // Started as a worker's exec shim: becomes the worker here, before anything is set up.
    worker::exec_if_shim();
    // Workers are started through this binary, without copying this process
    // (`worker::process::exec`); `CODEX_FLEET_EXEC_SHIM` names it where `/proc/self/exe` is not
    // this binary (under valgrind: ops/bench/footprint.sh).
    worker::spawn_through(
        std::env::var_os("CODEX_FLEET_EXEC_SHIM")
            .map_or_else(|| "/proc/self/exe".into(), PathBuf::from),
    );
    let mmap_threshold_set = fix_mmap_threshold();
    let cli = Cli::parse();
    let _log_writer = init_tracing(cli.log_format);
    if !mmap_threshold_set {
        tracing::warn!("cannot set the allocator's mapping threshold");
    }
    if !matches!(
        cli.command,
        Command::CheckConfig { .. } | Command::Top { .. } | Command::RenderTenantPod { .. }
    ) {
        raise_nofile_limit();
    }
    let node = matches!(cli.command, Command::Node { .. });
    match cli.command {
        Command::CheckConfig { file } => match load_checked(&file) {
            Ok(_) => {
                println!("{}: ok", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("invalid configuration: {e:#}");
                ExitCode::from(EX_CONFIG)
            }
        },
        Command::RenderTenantPod { config, tenant } => {
            let list = Config::load(&config)
                .map_err(anyhow::Error::from)
                .and_then(|cfg| {
                    router::edge::kube::spec::render(cfg.nodes.as_ref(), &cfg.tenants, &tenant)
                });
            match list.and_then(|l| Ok(serde_json::to_string_pretty(&l)?)) {
                Ok(text) => {
                    println!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("render-tenant-pod: {e:#}");
                    ExitCode::from(EX_CONFIG)
                }
            }
        }
        Command::Serve { config } => match load_checked(&config).and_then(|c| check_role(c, false))
        {
            Ok(cfg) => run_async(serve(cfg, config, false, None)),
            Err(e) => {
                eprintln!("invalid configuration: {e:#}");
                ExitCode::from(EX_CONFIG)
            }
        },
        Command::Node {
            config,
            tenant,
            exit_when_idle,
        } => {
            let cfg = load_checked(&config)
                .and_then(|c| check_role(c, node))
                .and_then(|c| match &tenant {
                    Some(t) => router::node::tenant::serve_only(c, t),
                    None => Ok(c),
                });
            match cfg {
                Ok(cfg) => run_async(serve(cfg, config, exit_when_idle, tenant)),
                Err(e) => {
                    eprintln!("invalid configuration: {e:#}");
                    ExitCode::from(EX_CONFIG)
                }
            }
        }
        Command::Top {
            admin,
            interval,
            once,
        } => run_async(router::cli::top::run(
            &admin,
            std::time::Duration::from_secs(interval.max(1)),
            once,
        )),
        Command::Dev {
            state_dir,
            port,
            admin_port,
            codex,
        } => run_async(dev_main(state_dir, port, admin_port, codex)),
    }
}

/// Loads and validates a configuration, including that every worker program can be run.
fn load_checked(path: &std::path::Path) -> anyhow::Result<Config> {
    let cfg = Config::load(path)?;
    let local = cfg.localized();
    router::tenants::check_worker_programs(&local)?;
    router::tenants::uids::check_remembered_uids(&local)?;
    if local.workers.per_tenant_uid {
        router::tenants::uids::check_login_users(&local)?;
    }
    // Token files, secrets and JWKS files are read now, so a bad one stops check-config too.
    router::credentials::Credentials::build(
        cfg.tenants.iter().map(router::config::Tenant::credentials),
        cfg.jwt_auth(),
        None,
    )?;
    Ok(cfg)
}

/// `codex-fleet node` runs `[node]` files, `codex-fleet serve` the others.
fn check_role(cfg: Config, node: bool) -> anyhow::Result<Config> {
    match (node, cfg.node.is_some()) {
        (true, false) => anyhow::bail!("codex-fleet node needs a [node] section"),
        (false, true) => anyhow::bail!("a [node] configuration runs with codex-fleet node"),
        _ => Ok(cfg),
    }
}

/// Raises the soft limit on open files to the hard limit: every session holds a TLS socket
/// and a Unix socket per leg, and the common soft default (1024) would refuse connections
/// long before `limits.max_connections`. Workers get the raised limit too (they inherit it).
fn raise_nofile_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-files limit");
            return;
        }
    };
    if soft >= hard {
        tracing::info!(limit = soft, "open-files limit already at its hard limit");
        return;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-files limit"),
        Err(e) => tracing::warn!(error = %e, soft, hard, "cannot raise the open-files limit"),
    }
}

/// Large allocations (a frame's buffers, up to `limits.max_message_bytes` each) are mapped on
/// their own and unmapped when freed. glibc's default raises its mapping threshold to the size
/// of the largest block freed (up to 32 MiB), after which such buffers come from the arenas,
/// and what a flood of large answers freed stays resident: the bounds on queued bytes hold, the
/// process's memory does not come back down.
/// Whether it was set (or there is nothing to set).
fn fix_mmap_threshold() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// Blocks at least this large are mapped on their own.
        const MMAP_THRESHOLD: nix::libc::c_int = 1 << 20;
        // SAFETY: mallopt only sets a parameter of the allocator; it is called before any
        // other thread exists.
        #[allow(unsafe_code)]
        let set = unsafe { nix::libc::mallopt(nix::libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
        set == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    true
}

/// Logs go to stderr, one event per line in either format, so that no client-chosen text can
/// start a line of its own (see [`router::audit`] for how audit records stay apart from them):
/// `json` escapes every value; `text` writes client-chosen values through
/// [`router::untrusted::Untrusted`] and, as a backstop, escapes any control character left in a
/// formatted event ([`OneLineStderr`]). Colours only on a terminal.
///
/// Lines are written by a thread of their own, from a queue of at most [`LOG_QUEUE_LINES`] (or
/// `CODEX_FLEET_LOG_QUEUE_LINES`): a stderr nobody takes (a stalled log collector, a full pipe)
/// drops lines, counted in `codex_fleet_log_lines_dropped_total`, and never stops a thread that
/// serves sessions. The returned guard writes what is queued when it is dropped, at exit.
fn init_tracing(format: LogFormat) -> tracing_appender::non_blocking::WorkerGuard {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("CODEX_FLEET_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let ansi = format == LogFormat::Text && std::io::stderr().is_terminal();
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(
            std::env::var("CODEX_FLEET_LOG_QUEUE_LINES")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&n| n > 0)
                .unwrap_or(LOG_QUEUE_LINES),
        )
        .thread_name("log-writer")
        .finish(OneLineStderr {
            ansi,
            escape: format == LogFormat::Text,
        });
    let _ = LOG_LINES_DROPPED.set(writer.error_counter());
    match format {
        LogFormat::Json => builder.json().with_writer(writer).init(),
        LogFormat::Text => builder.with_ansi(ansi).with_writer(writer).init(),
    }
    guard
}

/// Log lines queued for stderr at most by default; beyond, lines are dropped and counted.
/// A line is at most a worker's 4 KiB stderr line, escaped: a few dozen MiB at most.
const LOG_QUEUE_LINES: usize = 1_024;

/// How many log lines stderr did not take in time ([`init_tracing`]).
static LOG_LINES_DROPPED: std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter> =
    std::sync::OnceLock::new();

/// A registry for a server, with this process's own series: the log lines dropped.
fn registry() -> Registry {
    let registry = Registry::new();
    if let Some(dropped) = LOG_LINES_DROPPED.get() {
        if let Err(e) = registry.register(Box::new(LogLinesDropped(dropped.clone()))) {
            tracing::warn!(error = %e, "cannot export codex_fleet_log_lines_dropped_total");
        }
    }
    registry
}

/// `codex_fleet_log_lines_dropped_total`, read from the log writer's count when scraped.
struct LogLinesDropped(tracing_appender::non_blocking::ErrorCounter);

impl LogLinesDropped {
    fn counter(&self) -> prometheus::IntCounter {
        let counter = prometheus::IntCounter::new(
            "codex_fleet_log_lines_dropped_total",
            "Log lines codex-fleet dropped because stderr did not take them in time",
        )
        .expect("a valid metric name");
        counter.inc_by(u64::try_from(self.0.dropped_lines()).unwrap_or(u64::MAX));
        counter
    }
}

impl prometheus::core::Collector for LogLinesDropped {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        static DESC: std::sync::OnceLock<prometheus::core::Desc> = std::sync::OnceLock::new();
        vec![DESC.get_or_init(|| self.counter().desc()[0].clone())]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.counter().collect()
    }
}

/// stderr, written by the log thread one formatted event at a time; for the `text` format with
/// its control characters escaped by [`router::untrusted::one_line`] (`json` escapes its own).
struct OneLineStderr {
    ansi: bool,
    escape: bool,
}

impl std::io::Write for OneLineStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut err = std::io::stderr().lock();
        if self.escape {
            let text = String::from_utf8_lossy(buf);
            err.write_all(router::untrusted::one_line(&text, self.ansi).as_bytes())?;
        } else {
            err.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

fn run_async(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("codex-fleet: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// codex-fleet's own files must be out of every worker's reach (mode 0600 under per-tenant uids).
fn warn_if_readable(paths: &[&std::path::Path]) {
    use std::os::unix::fs::PermissionsExt;
    for path in paths {
        if let Ok(meta) = std::fs::metadata(path) {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    path = %path.display(),
                    mode = format!("{mode:o}"),
                    "codex-fleet's own file is readable by other users (workers included); chmod 600 it"
                );
            }
        }
    }
}

async fn serve(
    cfg: Config,
    path: PathBuf,
    exit_when_idle: bool,
    only_tenant: Option<String>,
) -> anyhow::Result<()> {
    warn_if_readable(&[&path, &cfg.listen.tls_key]);
    let listener = TcpListener::bind(cfg.listen.addr).await?;
    let admin = TcpListener::bind(cfg.admin.addr).await?;
    let addr = listener.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let cfg_idle_secs = cfg.workers.worker_idle_secs;
    let server = Server::build(cfg, registry())?
        .with_config_path(path)
        .with_only_tenant(only_tenant);
    let _reload_on_hup = reload_on_sighup(&server)?;
    // One machine-readable line on stdout: tools and tests read the bound ports from it.
    println!("codex-fleet listening on wss://{addr}/ admin http://{admin_addr}/");
    if exit_when_idle {
        let idle = router::node::idle::until_idle(
            server.tenants().clone(),
            server.admission().clone(),
            std::time::Duration::from_secs(cfg_idle_secs),
        );
        let stop = async move {
            tokio::select! {
                () = shutdown_signal() => {}
                () = idle => {}
            }
        };
        return server.run(listener, admin, stop).await;
    }
    server.run(listener, admin, shutdown_signal()).await
}

/// Reloads the configuration file on every SIGHUP, for as long as the returned handle lives.
fn reload_on_sighup(server: &Server) -> anyhow::Result<tokio_util::task::AbortOnDropHandle<()>> {
    let mut hup = signal(SignalKind::hangup())?;
    let reloader = server.reloader();
    Ok(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
        async move {
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading the configuration");
                // The outcome is logged and counted by the reloader.
                let _outcome = reloader.reload().await;
            }
        },
    )))
}

/// Resolves on the first SIGTERM or SIGINT; a second one exits at once (workers die with us
/// through their parent-death signal).
async fn shutdown_signal() {
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot install SIGTERM handler");
            return std::future::pending().await;
        }
    };
    let mut int = match signal(SignalKind::interrupt()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot install SIGINT handler");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        // Said from a thread of its own, and not waited for long: stderr may be the reason the
        // drain hangs.
        let (said, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            eprintln!("codex-fleet: second signal, exiting now");
            let _ = said.send(());
        });
        let _ = done.recv_timeout(std::time::Duration::from_millis(200));
        std::process::exit(130);
    });
}

async fn dev_main(
    state_dir: PathBuf,
    port: u16,
    admin_port: u16,
    codex: String,
) -> anyhow::Result<()> {
    let state_dir = std::path::absolute(&state_dir)?;
    let mut overrides = Vec::new();
    let mock = if dev::has_model_credentials(&state_dir) {
        tracing::info!("the dev tenant has its own credentials (auth.json); using the real model");
        None
    } else {
        let mock = MockModel::start(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        tracing::info!(
            url = %mock.base_url(),
            "no model credentials configured: the dev tenant uses the built-in offline mock model"
        );
        overrides = mock.codex_config_overrides();
        Some(mock)
    };
    let opts = DevOptions {
        state_dir: state_dir.clone(),
        listen: SocketAddr::from(([127, 0, 0, 1], port)),
        admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
        command: vec![codex.clone(), "app-server".into()],
        overrides,
    };
    // The same CLI is the client: print `codex` when it is on PATH, else the pinned binary.
    let client = if router::tenants::resolve_program("codex").is_ok() {
        "codex".to_owned()
    } else {
        router::tenants::resolve_program(&codex)
            .map(|p| p.display().to_string())
            .unwrap_or(codex)
    };
    let setup = dev::prepare(&opts)?;
    let cfg = Config::load(&setup.config_path)?;
    let listener = TcpListener::bind(cfg.listen.addr).await?;
    let admin = TcpListener::bind(cfg.admin.addr).await?;
    let addr = listener.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let server = Server::build(cfg, registry())?.with_config_path(setup.config_path.clone());
    let _reload_on_hup = reload_on_sighup(&server)?;
    let ca = setup.ca_path.display();
    let token = &setup.token;
    let port = addr.port();
    println!("codex-fleet listening on wss://{addr}/ admin http://{admin_addr}/");
    println!(
        r#"
codex-fleet dev is running.
  tenant:  dev   token (printed once, also in {token_file}, mode 0600):
           {token}
  model:   {model}

Connect the Codex TUI:
  SSL_CERT_FILE={ca} CODEX_FLEET_TOKEN={token} {client} --remote wss://localhost:{port}/ --remote-auth-token-env CODEX_FLEET_TOKEN

Run one prompt:
  SSL_CERT_FILE={ca} CODEX_FLEET_TOKEN={token} {client} exec --remote wss://localhost:{port}/ --remote-auth-token-env CODEX_FLEET_TOKEN "say hello"

Health and metrics: curl http://{admin_addr}/readyz   curl http://{admin_addr}/metrics
Stop with Ctrl-C.
"#,
        token_file = setup.token_path.display(),
        model = if mock.is_some() {
            "built-in offline mock model (no credentials found)"
        } else {
            "the tenant's own credentials"
        },
    );
    let result = server.run(listener, admin, shutdown_signal()).await;
    drop(mock);
    result
}
