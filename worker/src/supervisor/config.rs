//! How to run one tenant's workers ([`PoolConfig`]): the command and its arguments, sizes,
//! sockets, the uid and limits, restart and idle policy; checked before any worker starts.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use tokio::time::Duration;

use super::{slot_number, MAX_SOCKET_PATH, MAX_WORKERS_PER_POOL};
use crate::error::ConfigError;
use crate::fleet::FleetCap;
use crate::process;
use crate::restart::RestartPolicy;
use crate::run_as::{Rlimits, WorkerUser};

/// Default [`PoolConfig::load_mark`].
pub const DEFAULT_LOAD_MARK: usize = 4;
/// Default [`PoolConfig::worker_idle`] (docs/decisions/0006-idle-unloading.md: the same 30 minutes
/// as thread unloading).
pub const DEFAULT_WORKER_IDLE: Duration = Duration::from_secs(1800);

/// How to run one tenant's workers.
#[derive(Clone)]
pub struct PoolConfig {
    /// Tenant id: a metric label and part of socket file names (1–64 of `[A-Za-z0-9_-]`).
    pub tenant: String,
    /// The native codex binary.
    pub program: PathBuf,
    /// Leading arguments, e.g. `["app-server"]`. The pool appends `--listen unix://<sock>`,
    /// `-c thread_unload_delay_secs=<n>` and one `-c <o>` per config override.
    pub args: Vec<String>,
    /// The worker's `CODEX_HOME`; created 0700 if missing. Absolute.
    pub codex_home: PathBuf,
    /// The worker's working directory; created 0700 if missing. Absolute.
    pub cwd: PathBuf,
    /// Folder of the workers' sockets (`<socket_dir>/<tenant>/<slot>.sock`); kept at 0700 (0711
    /// when workers run as their own uid), each tenant folder at 0700. Absolute.
    pub socket_dir: PathBuf,
    /// Passed as `-c thread_unload_delay_secs=<n>`.
    pub thread_unload_delay_secs: u64,
    /// Extra `-c key=value` overrides, passed in order.
    pub config_overrides: Vec<String>,
    /// The child's complete environment, besides `CODEX_HOME` (the caller builds the allowlist).
    pub env: Vec<(String, String)>,
    /// Workers started eagerly and kept running.
    pub min_workers: usize,
    /// Most workers this tenant may run.
    pub max_workers: usize,
    /// Spawn → socket accepts → `initialize` answered.
    pub ready_timeout: Duration,
    /// Period of the control-leg health probe.
    pub health_interval: Duration,
    /// Deadline of each probe; a miss means hung: the group is killed and the exit handled as a crash.
    pub health_timeout: Duration,
    /// First restart backoff (before jitter).
    pub restart_backoff_initial: Duration,
    /// Largest restart backoff (before jitter).
    pub restart_backoff_max: Duration,
    /// Grace between SIGTERM and SIGKILL for callers of
    /// [`Pool::shutdown`](super::Pool::shutdown), the idle stop and the memory guard.
    pub stop_grace: Duration,
    /// Active turns per worker at or above which placement starts another worker (caps allowing).
    pub load_mark: usize,
    /// A worker above `min_workers` with no loaded thread, no active turn and no handle for this
    /// long is drained and stopped.
    pub worker_idle: Duration,
    /// The fleet-wide worker cap this pool shares with every other pool.
    pub fleet: FleetCap,
    /// Memory guard: a worker whose resident memory (sampled at each health ping) exceeds this many
    /// bytes stops taking new threads and is drained once it has no active turn.
    pub max_worker_rss: Option<u64>,
    /// Run workers as this uid/gid (needs root). Their `codex_home`, `cwd` and socket folder are
    /// then owned by it (0700), and `socket_dir` becomes 0711 so it can reach its own folder.
    pub user: Option<WorkerUser>,
    /// Resource limits of each worker process.
    pub rlimits: Rlimits,
    /// Steps below the supervisor's own CPU priority each worker runs at (`nice`, 0 to 19).
    pub nice: u8,
}

impl Default for PoolConfig {
    /// Defaults for everything but the tenant and the program (which must be set).
    fn default() -> Self {
        Self {
            tenant: String::new(),
            program: PathBuf::new(),
            args: vec!["app-server".into()],
            codex_home: PathBuf::new(),
            cwd: PathBuf::new(),
            socket_dir: PathBuf::new(),
            thread_unload_delay_secs: DEFAULT_WORKER_IDLE.as_secs(),
            config_overrides: Vec::new(),
            env: Vec::new(),
            min_workers: 0,
            max_workers: 1,
            ready_timeout: Duration::from_secs(10),
            health_interval: Duration::from_secs(5),
            health_timeout: Duration::from_secs(2),
            restart_backoff_initial: Duration::from_millis(100),
            restart_backoff_max: Duration::from_secs(30),
            stop_grace: Duration::from_secs(30),
            load_mark: DEFAULT_LOAD_MARK,
            worker_idle: DEFAULT_WORKER_IDLE,
            fleet: FleetCap::unlimited(),
            max_worker_rss: None,
            user: None,
            rlimits: Rlimits::default(),
            nice: 0,
        }
    }
}

// === impl PoolConfig ===

impl PoolConfig {
    /// Checks the configuration; [`Pool::new`](super::Pool::new) refuses to start workers for an
    /// invalid one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !valid_tenant(&self.tenant) {
            return Err(ConfigError::InvalidTenant(self.tenant.clone()));
        }
        if self.max_workers == 0
            || self.max_workers > MAX_WORKERS_PER_POOL
            || self.min_workers > self.max_workers
        {
            return Err(ConfigError::Caps {
                min: self.min_workers,
                max: self.max_workers,
            });
        }
        for (name, path) in [
            ("codex_home", &self.codex_home),
            ("cwd", &self.cwd),
            ("socket_dir", &self.socket_dir),
        ] {
            if !path.is_absolute() {
                return Err(ConfigError::RelativePath(name));
            }
        }
        let longest = self.socket_path(slot_number(self.max_workers - 1));
        let len = longest.as_os_str().len();
        if !proto::names::socket_path_fits(len) {
            return Err(ConfigError::SocketPathTooLong {
                path: longest,
                len,
                max: MAX_SOCKET_PATH,
            });
        }
        if self.load_mark == 0 {
            return Err(ConfigError::ZeroLoadMark);
        }
        for (name, value) in [
            ("ready_timeout", self.ready_timeout),
            ("health_interval", self.health_interval),
            ("health_timeout", self.health_timeout),
            ("worker_idle", self.worker_idle),
        ] {
            if value.is_zero() {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        Ok(())
    }

    /// The uid the workers run as (the tenant's, or codex-fleet's own).
    pub fn worker_uid(&self) -> u32 {
        self.user
            .map_or_else(|| nix::unistd::geteuid().as_raw(), |user| user.uid)
    }

    /// The socket path of `slot`.
    pub fn socket_path(&self, slot: u32) -> PathBuf {
        process::socket_path(&self.socket_dir, &self.tenant, slot)
    }

    /// The restart policy these settings describe.
    pub fn restart_policy(&self) -> RestartPolicy {
        RestartPolicy::new(self.restart_backoff_initial, self.restart_backoff_max)
    }

    /// The full argument list for a worker listening on `socket`.
    pub fn worker_args(&self, socket: &Path) -> Vec<OsString> {
        let mut args: Vec<OsString> = self.args.iter().map(OsString::from).collect();
        args.push("--listen".into());
        args.push(process::listen_arg(socket));
        args.push("-c".into());
        args.push(format!("thread_unload_delay_secs={}", self.thread_unload_delay_secs).into());
        for o in &self.config_overrides {
            args.push("-c".into());
            args.push(o.into());
        }
        args
    }
}

impl fmt::Debug for PoolConfig {
    /// Environment values may hold secrets; only their names are shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolConfig")
            .field("tenant", &self.tenant)
            .field("program", &self.program)
            .field("args", &self.args)
            .field("codex_home", &self.codex_home)
            .field("cwd", &self.cwd)
            .field("socket_dir", &self.socket_dir)
            .field("thread_unload_delay_secs", &self.thread_unload_delay_secs)
            .field("config_overrides", &self.config_overrides)
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("min_workers", &self.min_workers)
            .field("max_workers", &self.max_workers)
            .field("ready_timeout", &self.ready_timeout)
            .field("health_interval", &self.health_interval)
            .field("health_timeout", &self.health_timeout)
            .field("restart_backoff_initial", &self.restart_backoff_initial)
            .field("restart_backoff_max", &self.restart_backoff_max)
            .field("stop_grace", &self.stop_grace)
            .field("load_mark", &self.load_mark)
            .field("worker_idle", &self.worker_idle)
            .field("fleet", &self.fleet)
            .field("max_worker_rss", &self.max_worker_rss)
            .field("user", &self.user)
            .field("rlimits", &self.rlimits)
            .field("nice", &self.nice)
            .finish()
    }
}

fn valid_tenant(tenant: &str) -> bool {
    proto::names::valid_pool_tenant_id(tenant)
}
