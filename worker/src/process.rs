//! One codex app-server process: clean spawn, output forwarding, reaping, readiness, group kill.
//!
//! The child leads its own process group, so every signal targets the whole group. It gets
//! `PR_SET_PDEATHSIG=SIGKILL`, which the kernel ties to the *thread* that spawned it: every child
//! is started from one thread that lives as long as the process (module `spawner`), never from
//! `spawn_blocking`, whose threads retire, nor from a runtime thread, which the start would block.
//! Before exec it sets its resource limits and, when configured, drops to the tenant's uid/gid:
//! in an exec shim started with `posix_spawn`, or in a `pre_exec` hook (module [`exec`]).

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::time::{sleep, timeout, Duration};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info_span, warn, Instrument};

pub mod exec;
mod output;
mod spawner;

use crate::control::{ControlLeg, CONTROL_MAX_MESSAGE};
use crate::error::StartError;
use crate::id::WorkerId;
use crate::leg;
use crate::run_as::{Rlimits, WorkerUser};
use exec::Hygiene;
use output::{forward_stderr, forward_stdout, StderrTail};

/// Pause between connection attempts while a worker starts.
const CONNECT_POLL: Duration = Duration::from_millis(10);
/// How long to wait for a leftover socket to answer before calling it live.
const LIVE_PROBE: Duration = Duration::from_millis(200);
/// How long to let the exit status and the last stderr lines arrive after a failed start.
const EXIT_SETTLE: Duration = Duration::from_millis(300);

/// How a worker process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    /// Like `exit status: 1` or `signal: 9 (SIGKILL)`.
    pub status: String,
}

/// A worker's process group; signals go to the whole group until the leader has been reaped.
#[derive(Debug)]
pub(crate) struct ProcessGroup {
    pgid: Pid,
    gone: AtomicBool,
}

// === impl ProcessGroup ===

impl ProcessGroup {
    /// Signals every process in the group. A no-op once the leader is reaped and the group was swept,
    /// so a recycled process-group id is never hit.
    pub(crate) fn signal(&self, signal: Signal) {
        if self.gone.load(Ordering::Acquire) {
            return;
        }
        match killpg(self.pgid, signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => warn!(pgid = %self.pgid, %signal, error = %e, "killpg failed"),
        }
    }

    /// A group that is never signalled, for tests of the bookkeeping.
    #[cfg(test)]
    pub(crate) fn inert() -> Arc<Self> {
        Arc::new(Self {
            pgid: Pid::from_raw(i32::MAX),
            gone: AtomicBool::new(true),
        })
    }

    /// The leader was reaped: kill whatever it left in the group, then stop signalling.
    fn sweep(&self) {
        self.signal(Signal::SIGKILL);
        self.gone.store(true, Ordering::Release);
    }
}

/// What to run.
pub(crate) struct Spawn<'a> {
    pub id: WorkerId,
    pub program: &'a Path,
    pub args: Vec<OsString>,
    pub env: &'a [(String, String)],
    pub codex_home: &'a Path,
    pub cwd: &'a Path,
    pub user: Option<WorkerUser>,
    pub rlimits: Rlimits,
    /// Steps below this process's CPU priority (`nice`); 0 keeps it.
    pub nice: u8,
    /// Counts the stderr lines left out of the log (the tenant's series).
    pub log_lines_dropped: prometheus::IntCounter,
}

/// A running worker process. Dropping it kills its process group.
pub(crate) struct WorkerProcess {
    id: WorkerId,
    pid: u32,
    uid: u32,
    group: Arc<ProcessGroup>,
    exit: watch::Receiver<Option<ExitReport>>,
    stderr_tail: Arc<StderrTail>,
    stderr_done: CancellationToken,
    _reaper: AbortOnDropHandle<()>,
    _stdout: Option<AbortOnDropHandle<()>>,
    _stderr: Option<AbortOnDropHandle<()>>,
}

// === impl WorkerProcess ===

impl WorkerProcess {
    /// Spawns the process with exactly `env` plus `CODEX_HOME`, in its own process group.
    pub(crate) async fn spawn(spec: Spawn<'_>) -> Result<Self, StartError> {
        let hygiene = Hygiene {
            parent: nix::unistd::getpid(),
            nice: spec.nice,
            rlimits: spec.rlimits,
            user: spec.user,
        };
        let mut command = match exec::shim() {
            // No hook: std starts the shim with `posix_spawn` (module `exec`).
            Some(shim) => {
                let mut command = Command::new(shim);
                command.arg(exec::SHIM_ARG).args(exec::shim_args(
                    hygiene,
                    spec.cwd,
                    spec.program,
                    &spec.args,
                ));
                command
            }
            None => {
                let mut command = Command::new(spec.program);
                command.args(&spec.args).current_dir(spec.cwd);
                child_hygiene(&mut command, hygiene);
                command
            }
        };
        command
            .env_clear()
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .env("CODEX_HOME", spec.codex_home)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = spawner::spawn(command)
            .await
            .map_err(|source| StartError::Spawn {
                program: spec.program.to_path_buf(),
                source,
            })?;
        let pid = child.id().ok_or_else(|| StartError::Spawn {
            program: spec.program.to_path_buf(),
            source: io::Error::other("child exited before its pid was read"),
        })?;
        let group = Arc::new(ProcessGroup {
            pgid: Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX)),
            gone: AtomicBool::new(false),
        });
        let span = info_span!("worker", worker = %spec.id, pid);
        let stderr_tail = Arc::new(StderrTail::default());
        let stderr_done = CancellationToken::new();
        let stdout = child.stdout.take().map(|out| {
            AbortOnDropHandle::new(tokio::spawn(forward_stdout(out).instrument(span.clone())))
        });
        let stderr = child.stderr.take().map(|err| {
            let forward = forward_stderr(
                err,
                stderr_tail.clone(),
                stderr_done.clone(),
                spec.log_lines_dropped,
            );
            AbortOnDropHandle::new(tokio::spawn(forward.instrument(span.clone())))
        });
        let (exit_tx, exit) = watch::channel(None);
        let reaper = tokio::spawn(reap(child, group.clone(), exit_tx).instrument(span));
        Ok(Self {
            id: spec.id,
            pid,
            uid: spec
                .user
                .map_or_else(|| nix::unistd::geteuid().as_raw(), |user| user.uid),
            group,
            exit,
            stderr_tail,
            stderr_done,
            _reaper: AbortOnDropHandle::new(reaper),
            _stdout: stdout,
            _stderr: stderr,
        })
    }

    pub(crate) fn id(&self) -> WorkerId {
        self.id
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Who must listen on the worker's socket.
    pub(crate) fn peer(&self) -> crate::id::Peer {
        crate::id::Peer {
            pid: self.pid,
            uid: self.uid,
        }
    }

    pub(crate) fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// A receiver that turns `Some` when the process has been reaped.
    pub(crate) fn exit_watch(&self) -> watch::Receiver<Option<ExitReport>> {
        self.exit.clone()
    }

    /// Kills the whole process group with SIGKILL.
    pub(crate) fn kill(&self) {
        self.group.signal(Signal::SIGKILL);
    }

    /// Resolves when the process has been reaped.
    pub(crate) async fn exited(&self) -> ExitReport {
        wait_exit(self.exit.clone()).await
    }

    /// Polls the socket until it accepts, then initializes the control leg; fails early, with the exit
    /// status and last stderr lines, if the process exits first.
    pub(crate) async fn wait_ready(
        &self,
        socket: &Path,
        ready_timeout: Duration,
    ) -> Result<ControlLeg, StartError> {
        let attempt = async {
            let ws = connect_when_listening(socket, self.peer()).await?;
            Ok::<_, StartError>(ControlLeg::initialize(ws).await?)
        };
        let result = tokio::select! {
            result = timeout(ready_timeout, attempt) => match result {
                Ok(result) => result,
                Err(_elapsed) => Err(StartError::ReadyTimeout {
                    after: ready_timeout,
                    stderr: self.stderr_summary(),
                }),
            },
            report = self.exited() => return Err(self.exited_before_ready(report).await),
        };
        match result {
            Ok(leg) => Ok(leg),
            Err(e @ StartError::ReadyTimeout { .. }) => Err(e),
            // The leg broke; if the process is dying, its exit status is the better error.
            Err(e) => match timeout(EXIT_SETTLE, self.exited()).await {
                Ok(report) => Err(self.exited_before_ready(report).await),
                Err(_elapsed) => Err(e),
            },
        }
    }

    async fn exited_before_ready(&self, report: ExitReport) -> StartError {
        // stderr may still hold the reason; let the forwarder drain it (bounded: a grandchild may
        // keep the pipe open).
        if timeout(EXIT_SETTLE, self.stderr_done.cancelled())
            .await
            .is_err()
        {
            debug!("stderr still open after exit");
        }
        StartError::ExitedBeforeReady {
            status: report.status,
            stderr: self.stderr_summary(),
        }
    }

    fn stderr_summary(&self) -> String {
        self.stderr_tail.summary()
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.group.signal(Signal::SIGKILL);
    }
}

/// The resident set size of `pid` (`VmRSS` in `/proc/PID/status`), in bytes.
pub(crate) fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_rss(&status)
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib.saturating_mul(1024))
}

/// Waits until the reaper reports the exit. If the reaper is gone (its owner was dropped, which kills
/// the group), the process is gone too.
pub(crate) async fn wait_exit(mut exit: watch::Receiver<Option<ExitReport>>) -> ExitReport {
    match exit.wait_for(Option::is_some).await {
        Ok(report) => report.clone().unwrap_or_else(killed_by_owner),
        Err(_closed) => killed_by_owner(),
    }
}

fn killed_by_owner() -> ExitReport {
    ExitReport {
        status: "killed: supervisor dropped".to_owned(),
    }
}

/// Installs the one `pre_exec` hook: [`Hygiene::apply`] in the forked child.
fn child_hygiene(command: &mut Command, hygiene: Hygiene) {
    // SAFETY: the closure runs in the forked child before exec; `apply` only makes
    // async-signal-safe system calls and touches errno; it allocates nothing and takes no locks.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(move || hygiene.apply());
    }
}

async fn reap(mut child: Child, group: Arc<ProcessGroup>, exit: watch::Sender<Option<ExitReport>>) {
    let status = match child.wait().await {
        Ok(status) => status.to_string(),
        Err(e) => format!("wait failed: {e}"),
    };
    group.sweep();
    debug!(%status, "worker process reaped");
    exit.send_replace(Some(ExitReport { status }));
}

/// Connects as soon as the socket accepts; retries while it is missing or refusing.
async fn connect_when_listening(
    socket: &Path,
    peer: crate::id::Peer,
) -> Result<leg::LegStream, StartError> {
    loop {
        match leg::connect(socket, peer, CONTROL_MAX_MESSAGE).await {
            Ok(ws) => return Ok(ws),
            Err(e) if e.is_not_listening() => sleep(CONNECT_POLL).await,
            Err(e) => return Err(StartError::Control(e.into())),
        }
    }
}

/// Clears a leftover socket path (docs/app-server-facts.md §11) before a spawn: a regular file, a
/// symlink that is not this slot's own (a tenant may point the path anywhere), a dangling or stale
/// link, or a dead socket would make the new worker exit 1. This slot's own live listener, or a
/// directory, is an error. Only the path itself is unlinked: nothing a link points to is touched.
pub(crate) async fn clean_socket_path(path: &Path, uid: u32) -> Result<(), StartError> {
    let prepare = |source| StartError::Prepare {
        path: path.to_path_buf(),
        source,
    };
    let meta = match tokio::fs::symlink_metadata(path).await {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(prepare(e)),
    };
    let kind = meta.file_type();
    if kind.is_dir() {
        return Err(StartError::SocketInUse {
            path: path.to_path_buf(),
            what: "a directory",
        });
    }
    let ours = if kind.is_symlink() {
        daemon_socket(path, uid).is_some()
    } else {
        kind.is_socket()
    };
    if ours && socket_is_live(path).await {
        return Err(StartError::SocketInUse {
            path: path.to_path_buf(),
            what: "a live listener",
        });
    }
    debug!(path = %path.display(), "removing leftover socket path");
    match tokio::fs::remove_file(path).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(prepare(e)),
    }
}

/// After a worker is gone: removes what it leaves when killed (docs/app-server-facts.md §11) — the
/// socket path, and the `codex-daemon-<uid>/<sha256 of the path>` socket it links to with that
/// socket's lock file — so no socket file outlives its worker. Best effort; a live listener is
/// never touched.
///
/// The socket folder and the daemon folder belong to the worker's uid, so everything in them is the
/// tenant's to change. Nothing is followed: the link must name exactly the file app-server would
/// have made, in a folder named for `uid`; that folder is opened without following links and must be
/// owned by `uid`; the two names are unlinked inside it. Anything else is left alone.
pub(crate) async fn remove_socket_leftovers(path: &Path, uid: u32) {
    let Ok(meta) = tokio::fs::symlink_metadata(path).await else {
        return;
    };
    if socket_is_live(path).await {
        return;
    }
    if meta.file_type().is_symlink() {
        match daemon_socket(path, uid) {
            Some((dir, name)) => remove_in_dir(&dir, &name, uid),
            None => {
                warn!(path = %path.display(), "socket path links somewhere unexpected; removing only the link")
            }
        }
    }
    if let Err(e) = tokio::fs::remove_file(path).await {
        if e.kind() != io::ErrorKind::NotFound {
            debug!(path = %path.display(), error = %e, "cannot remove socket path");
        }
    }
}

/// The daemon folder and socket name that the link at `path` names, if they are exactly the ones
/// app-server makes for `path` under `uid`: `<tmp>/codex-daemon-<uid>/<sha256 hex of path>`.
fn daemon_socket(path: &Path, uid: u32) -> Option<(PathBuf, String)> {
    use sha2::Digest;
    let target = std::fs::read_link(path).ok()?;
    let name = hex::encode(sha2::Sha256::digest(path.as_os_str().as_encoded_bytes()));
    let dir = target.parent()?;
    let expected_dir = format!("codex-daemon-{uid}");
    let named_right = target.file_name()? == name.as_str()
        && dir.file_name()? == expected_dir.as_str()
        && target.is_absolute();
    named_right.then(|| (dir.to_path_buf(), name))
}

/// Unlinks `name` and `name.lock` inside `dir`, opened without following a link and only if `uid`
/// owns it.
fn remove_in_dir(dir: &Path, name: &str, uid: u32) {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(dir);
    let dir_fd = match opened {
        Ok(fd) => fd,
        Err(e) => {
            debug!(dir = %dir.display(), error = %e, "cannot open the daemon socket folder");
            return;
        }
    };
    match dir_fd.metadata() {
        Ok(meta) if meta.uid() == uid => {}
        Ok(meta) => {
            warn!(dir = %dir.display(), owner = meta.uid(), uid, "daemon socket folder has another owner; left alone");
            return;
        }
        Err(e) => {
            debug!(dir = %dir.display(), error = %e, "cannot stat the daemon socket folder");
            return;
        }
    }
    for leftover in [name.to_owned(), format!("{name}.lock")] {
        let removed = nix::unistd::unlinkat(
            &dir_fd,
            leftover.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        match removed {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => {
                debug!(dir = %dir.display(), name = %leftover, error = %e, "cannot remove socket leftover")
            }
        }
    }
}

/// A connect that does not answer promptly counts as live: better to refuse than to steal the path.
async fn socket_is_live(path: &Path) -> bool {
    !matches!(
        timeout(LIVE_PROBE, UnixStream::connect(path)).await,
        Ok(Err(_))
    )
}

/// The socket path argument: `unix://` followed by the path.
pub(crate) fn listen_arg(socket: &Path) -> OsString {
    let mut arg = OsString::from("unix://");
    arg.push(socket);
    arg
}

/// The tenant's own folder of sockets inside `socket_dir`.
pub(crate) fn socket_tenant_dir(socket_dir: &Path, tenant: &str) -> PathBuf {
    socket_dir.join(tenant)
}

/// Path of a slot's socket.
pub(crate) fn socket_path(socket_dir: &Path, tenant: &str, slot: u32) -> PathBuf {
    socket_tenant_dir(socket_dir, tenant).join(format!("{slot}.sock"))
}

#[cfg(test)]
mod tests;
