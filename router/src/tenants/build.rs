//! A tenant's pool from the configuration: sizes, the worker's command, uid, limits, environment
//! and host-access roots, and what a reload may change in place.

use std::path::Path;
use std::time::Duration;

use worker::{FleetCap, PoolConfig, Rlimits, Sizes, WorkerUser};

use super::program::resolve_program;
use crate::config::{self, Config};
use crate::fsutil::private_dir;
use crate::policy::TenantRoots;

/// Environment variables workers get from codex-fleet's own environment, when set.
const BASE_ENV: &[&str] = &["PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR"];

/// Starts app-server with remote control off for the life of the process, whatever the
/// tenant's state database remembers (`remoteControl/enable` persists a preference there, and
/// the tenant's uid can write that file). codex 0.171 reads it in
/// `app-server/src/transport/remote_control` (`take_remote_control_disabled_env`); the
/// `remote_control` feature flag is a removed no-op there.
pub const REMOTE_CONTROL_DISABLED: (&str, &str) =
    ("CODEX_INTERNAL_APP_SERVER_REMOTE_CONTROL_DISABLED", "1");

/// What a reload may change in a running pool.
pub(super) fn pool_sizes(cfg: &Config, t: &config::Tenant) -> Sizes {
    Sizes {
        min_workers: t.min_workers,
        max_workers: t.max_workers,
        load_mark: cfg.workers.load_mark,
        worker_idle: Duration::from_secs(cfg.workers.worker_idle_secs),
    }
}

/// Everything about a tenant's workers, policy and roots that a reload cannot change in place:
/// the configuration minus tokens and pool sizes.
pub(super) fn fingerprint(cfg: &Config, t: &config::Tenant) -> String {
    let mut w = cfg.workers.clone();
    w.worker_idle_secs = 0;
    w.load_mark = 0;
    w.max_workers = 0;
    let mut t = t.clone();
    t.token_sha256.clear();
    t.token_files.clear();
    t.allowed_origins.clear();
    t.close_on_expiry = true;
    t.min_workers = 0;
    t.max_workers = 0;
    format!("{w:?}|{t:?}")
}

/// Fails with a clear message when a worker command's program is missing or not executable (a
/// worker that cannot start at all is a configuration error, caught before anything starts).
pub fn check_worker_programs(cfg: &Config) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    // `workers.command` matters only when a tenant runs it (an edge runs none).
    let global = cfg.tenants.iter().any(|t| t.command.is_none());
    let commands = global
        .then_some((None, &cfg.workers.command))
        .into_iter()
        .chain(
            cfg.tenants
                .iter()
                .filter_map(|t| t.command.as_ref().map(|c| (Some(t.id.as_str()), c))),
        );
    for (tenant, command) in commands {
        let whose = tenant.map_or("workers.command".to_owned(), |t| {
            format!("tenant {t:?}: command")
        });
        let program = resolve_program(&command[0]).map_err(|e| anyhow::anyhow!("{whose}: {e}"))?;
        let meta = std::fs::metadata(&program)
            .map_err(|e| anyhow::anyhow!("{whose}: {}: {e}", program.display()))?;
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            anyhow::bail!("{whose}: {} is not an executable file", program.display());
        }
    }
    Ok(())
}

pub(super) fn pool_config(
    cfg: &Config,
    t: &config::Tenant,
    program: &Path,
    fleet: &FleetCap,
    user: Option<WorkerUser>,
) -> PoolConfig {
    let w = &cfg.workers;
    let mut overrides = w.config_overrides.clone();
    overrides.extend(t.config_overrides.iter().cloned());
    PoolConfig {
        tenant: t.id.clone(),
        program: program.to_owned(),
        args: cfg.worker_command(t)[1..].to_vec(),
        codex_home: cfg.tenant_home(&t.id),
        cwd: cfg.tenant_workspace(&t.id),
        socket_dir: cfg.socket_dir(),
        thread_unload_delay_secs: w.thread_unload_delay_secs,
        config_overrides: overrides,
        env: worker_env(cfg, t, program),
        min_workers: t.min_workers,
        max_workers: t.max_workers,
        ready_timeout: Duration::from_secs(w.ready_timeout_secs),
        health_interval: Duration::from_secs(w.health_interval_secs),
        health_timeout: Duration::from_secs(w.health_timeout_secs),
        restart_backoff_initial: Duration::from_millis(w.restart_backoff_initial_ms),
        restart_backoff_max: Duration::from_millis(w.restart_backoff_max_ms),
        stop_grace: Duration::from_secs(w.stop_grace_secs),
        load_mark: w.load_mark,
        worker_idle: Duration::from_secs(w.worker_idle_secs),
        fleet: fleet.clone(),
        max_worker_rss: w.max_worker_rss_bytes,
        user,
        nice: w.nice,
        rlimits: Rlimits {
            nofile: w.rlimit_nofile.map(within_hard_nofile),
            address_space: w.rlimit_as_bytes,
            cpu_secs: w.rlimit_cpu_secs,
            processes: Some(t.max_processes.unwrap_or(w.max_processes))
                .filter(|n| *n > 0)
                .map(within_hard_nproc),
        },
    }
}

/// As [`within_hard_nofile`], for RLIMIT_NPROC (`max_processes`).
pub(super) fn within_hard_nproc(wanted: u64) -> u64 {
    use nix::sys::resource::{getrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NPROC) {
        Ok((_, hard)) if hard < wanted && !nix::unistd::geteuid().is_root() => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    wanted,
                    hard,
                    "max_processes is above codex-fleet's hard RLIMIT_NPROC; using the hard limit"
                );
            });
            hard
        }
        _ => wanted,
    }
}

/// Raising a hard limit needs CAP_SYS_RESOURCE, which containers often lack: ask for at most
/// what codex-fleet itself may have.
pub(super) fn within_hard_nofile(wanted: u64) -> u64 {
    use nix::sys::resource::{getrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((_, hard)) if hard < wanted => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    wanted,
                    hard,
                    "workers.rlimit_nofile is above codex-fleet's hard limit; using the hard limit"
                );
            });
            hard
        }
        _ => wanted,
    }
}

/// The loud warning for a fleet whose tenants share one Unix uid, if they do.
pub fn shared_uid_warning(cfg: &Config) -> Option<String> {
    if per_tenant_uid(cfg) {
        return None;
    }
    let why = if nix::unistd::geteuid().is_root() {
        "workers.per_tenant_uid is false"
    } else {
        "codex-fleet is not running as root"
    };
    Some(format!(
        "{why}: every tenant's workers share one Unix uid, so the operating system does not \
         separate tenants; host-access methods (fs, command/exec, process, …) are denied by \
         default and only each tenant's [tenants.policy] can allow them"
    ))
}

/// Whether workers run under per-tenant uids: codex-fleet is root and the config allows it.
pub fn per_tenant_uid(cfg: &Config) -> bool {
    cfg.workers.per_tenant_uid && nix::unistd::geteuid().is_root()
}

/// The tenant's workspace (created 0700) and configured extra roots; codex-fleet's own files and
/// every other tenant's directories are excluded even if a root contains them.
pub(super) fn tenant_roots(cfg: &Config, t: &config::Tenant) -> anyhow::Result<TenantRoots> {
    let workspace = cfg.tenant_workspace(&t.id);
    let home = cfg.tenant_home(&t.id);
    for dir in [&workspace, &home] {
        private_dir(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    }
    let mut dirs = vec![workspace];
    dirs.extend(t.workspace_roots.iter().cloned());
    let mut roots = TenantRoots::new(&dirs, &home)
        .map_err(|e| anyhow::anyhow!("tenant {:?}: workspace roots: {e}", t.id))?;
    let own = [
        cfg.listen.tls_key.clone(),
        cfg.listen.tls_cert.clone(),
        cfg.socket_dir(),
        cfg.workers.state_dir.join(crate::tenants::uids::UID_FILE),
    ];
    for path in &own {
        roots = roots.exclude(path);
    }
    // Other tenants' directories all live under state_dir, which the tenant's own workspace does
    // not contain; only an extra root that contains state_dir needs them excluded one by one
    // (doing it for every tenant made start-up quadratic in the number of tenants).
    let state = std::fs::canonicalize(&cfg.workers.state_dir)
        .unwrap_or_else(|_| cfg.workers.state_dir.clone());
    let covers_state = t.workspace_roots.iter().any(|r| {
        let r = std::fs::canonicalize(r).unwrap_or_else(|_| r.clone());
        state.starts_with(&r)
    });
    if covers_state {
        for o in cfg.tenants.iter().filter(|o| o.id != t.id) {
            roots = roots
                .exclude(&cfg.tenant_home(&o.id))
                .exclude(&cfg.tenant_workspace(&o.id));
        }
    }
    Ok(roots)
}

/// The complete environment of a tenant's workers: an allowlist, never codex-fleet's own.
pub(super) fn worker_env(
    cfg: &Config,
    t: &config::Tenant,
    program: &Path,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    let names = BASE_ENV
        .iter()
        .copied()
        .chain(cfg.workers.pass_env.iter().map(String::as_str));
    for name in names {
        if name == REMOTE_CONTROL_DISABLED.0 || env.iter().any(|(k, _)| k == name) {
            continue;
        }
        if let Ok(v) = std::env::var(name) {
            env.push((name.to_owned(), v));
        }
    }
    // The npm package ships helper tools (rg) beside the native binary; its launcher puts them on PATH.
    if let Some(tools) = program
        .parent()
        .and_then(Path::parent)
        .map(|vendor| vendor.join("codex-path"))
        .filter(|p| p.is_dir())
    {
        let path = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
        env.retain(|(k, _)| k != "PATH");
        env.push(("PATH".into(), format!("{}:{path}", tools.display())));
    }
    env.push((
        "HOME".into(),
        cfg.tenant_workspace(&t.id).display().to_string(),
    ));
    env
}
