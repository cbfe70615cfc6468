//! How a worker process is started without copying the supervisor.
//!
//! A worker gets its resource limits, CPU priority, uid and parent-death signal between `fork` and
//! `exec`. Done in the supervisor's own child (a `pre_exec` hook), that means a real `fork`:
//! the kernel copies the page tables of the whole supervisor and marks every page of it
//! copy-on-write, and the supervisor's threads then fault on each page they write. The bigger the
//! supervisor (every tenant's connections), the longer it takes: 4 ms a worker at 358 MiB
//! (BENCHMARKS.md, "A worker started without copying the router").
//!
//! So the supervisor starts an *exec shim* instead: its own binary (`/proc/self/exe`, which
//! still names it when the file was replaced), with [`SHIM_ARG`] and the steps as arguments. With
//! no `pre_exec` hook, std starts it with `posix_spawn` (a `vfork`: nothing is copied, the
//! supervisor waits only for the `exec`). The shim, a fresh process of a few pages, applies the
//! same steps (`Hygiene::apply`) and executes the worker in its place: same pid, same process
//! group, same pipes. Whatever fails there is written to stderr (the worker's stderr, which the
//! supervisor logs and reports as the start's failure) and the shim exits with [`SHIM_FAILED`].
//!
//! The binary's `main` calls [`exec_if_shim`] first, before it sets anything up. A process that
//! embeds the supervisor without that `main` (the test suites) names a binary that does with
//! [`spawn_through`], or keeps the `pre_exec` hook.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::stat::Mode;
use nix::unistd::Pid;

use crate::run_as::{Rlimits, WorkerUser};

/// The first argument that makes the binary an exec shim.
pub const SHIM_ARG: &str = "__codex-fleet-exec-worker";
/// The shim's exit code when a step or the exec failed (as a shell's "cannot execute").
pub const SHIM_FAILED: i32 = 126;
/// Separates the steps from the worker's program and arguments.
const SEPARATOR: &str = "--";

static THROUGH: OnceLock<PathBuf> = OnceLock::new();

/// Starts this process's workers through the exec shim in `binary` (a build of `codex-fleet`,
/// whose `main` calls [`exec_if_shim`]); `/proc/self/exe` for the binary itself. Set once; a later
/// call changes nothing.
pub fn spawn_through(binary: impl Into<PathBuf>) {
    let _ = THROUGH.set(binary.into());
}

/// The binary workers are started through, if [`spawn_through`] named one.
pub(crate) fn shim() -> Option<&'static Path> {
    THROUGH.get().map(PathBuf::as_path)
}

/// When this process was started as an exec shim: applies the steps and becomes the worker
/// (never returns), or exits with [`SHIM_FAILED`]. Otherwise returns at once.
pub fn exec_if_shim() {
    let mut args = std::env::args_os();
    if args.nth(1).as_deref() != Some(OsStr::new(SHIM_ARG)) {
        return;
    }
    let err = match Shim::parse(args) {
        Ok(shim) => shim.exec(),
        Err(e) => e,
    };
    eprintln!("codex-fleet: starting the worker: {err}");
    std::process::exit(SHIM_FAILED);
}

/// What the child does before it becomes the worker, in this order: resource limits and the lower
/// CPU priority, then the tenant's identity (no way back), then the parent-death signal, the
/// parent check and the umask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hygiene {
    /// The supervisor: the child must still be its child once the death signal is set.
    pub parent: Pid,
    pub nice: u8,
    pub rlimits: Rlimits,
    pub user: Option<WorkerUser>,
}

// === impl Hygiene ===

impl Hygiene {
    /// Runs the steps. Allocates nothing and takes no locks, and makes only async-signal-safe
    /// system calls (setrlimit, nice, setgroups, setgid, setuid, get*id, prctl, getppid, umask):
    /// the `pre_exec` hook runs it in a forked child of a multi-threaded process.
    pub(crate) fn apply(&self) -> io::Result<()> {
        if self.nice > 0 {
            // Relative to the thread that forked (the child's one thread inherits its value);
            // lowering a priority needs no privilege. `nice` returns the new value, which may be
            // -1, so only errno tells a failure.
            Errno::clear();
            // SAFETY: `nice` only changes this process's priority.
            #[allow(unsafe_code)]
            let set = unsafe { nix::libc::nice(i32::from(self.nice)) };
            if set == -1 && Errno::last_raw() != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for (resource, value) in self.rlimits.pairs() {
            if let Some(value) = value {
                nix::sys::resource::setrlimit(resource, value, value)?;
            }
        }
        if let Some(user) = self.user {
            drop_privileges(user)?;
        }
        // After the identity change: the kernel clears the parent-death signal when the
        // credentials change.
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
        // The parent may have died before prctl; then nobody would kill us later.
        if nix::unistd::getppid() != self.parent {
            return Err(io::Error::from_raw_os_error(Errno::ESRCH as i32));
        }
        nix::sys::stat::umask(Mode::from_bits_truncate(0o077));
        Ok(())
    }

    /// The steps as the shim's arguments: parent, nice, `uid:gid` or `-`, then each limit of
    /// [`Rlimits::pairs`] or `-`.
    pub(crate) fn to_args(self) -> Vec<OsString> {
        let or_dash = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
        let mut args = vec![
            self.parent.as_raw().to_string(),
            self.nice.to_string(),
            self.user
                .map_or_else(|| "-".to_owned(), |u| format!("{}:{}", u.uid, u.gid)),
        ];
        args.extend(self.rlimits.pairs().map(|(_, v)| or_dash(v)));
        args.into_iter().map(OsString::from).collect()
    }

    fn from_args(args: &[OsString]) -> io::Result<Self> {
        let [parent, nice, user, nofile, address_space, cpu_secs, processes] = args else {
            return Err(invalid(format!("{} steps, not 7", args.len())));
        };
        let user = match text(user)? {
            "-" => None,
            pair => {
                let (uid, gid) = pair
                    .split_once(':')
                    .ok_or_else(|| invalid(format!("user {pair:?}")))?;
                Some(WorkerUser {
                    uid: number(uid)?,
                    gid: number(gid)?,
                })
            }
        };
        let limit = |v: &OsString| match text(v)? {
            "-" => Ok(None),
            v => number(v).map(Some),
        };
        Ok(Self {
            parent: Pid::from_raw(number(text(parent)?)?),
            nice: number(text(nice)?)?,
            rlimits: Rlimits {
                nofile: limit(nofile)?,
                address_space: limit(address_space)?,
                cpu_secs: limit(cpu_secs)?,
                processes: limit(processes)?,
            },
            user,
        })
    }
}

/// The shim's whole command line after [`SHIM_ARG`]: the steps, the worker's working directory,
/// the separator, the worker. The directory is the shim's to enter: with a `posix_spawn` chdir
/// action std needs glibc 2.29, and without it would quietly fork instead.
pub(crate) fn shim_args(
    hygiene: Hygiene,
    cwd: &Path,
    program: &Path,
    args: &[OsString],
) -> Vec<OsString> {
    let mut all = hygiene.to_args();
    all.push(cwd.into());
    all.push(SEPARATOR.into());
    all.push(program.into());
    all.extend(args.iter().cloned());
    all
}

/// A parsed shim command line.
#[derive(Debug, PartialEq, Eq)]
struct Shim {
    hygiene: Hygiene,
    cwd: PathBuf,
    program: PathBuf,
    args: Vec<OsString>,
}

// === impl Shim ===

impl Shim {
    fn parse(args: impl Iterator<Item = OsString>) -> io::Result<Self> {
        let args: Vec<OsString> = args.collect();
        let at = args
            .iter()
            .position(|a| a == SEPARATOR)
            .ok_or_else(|| invalid("no program".to_owned()))?;
        let (steps, worker) = args.split_at(at);
        let Some((program, args)) = worker[1..].split_first() else {
            return Err(invalid("no program".to_owned()));
        };
        let Some((cwd, steps)) = steps.split_last() else {
            return Err(invalid("no steps".to_owned()));
        };
        let cwd = PathBuf::from(cwd);
        if !cwd.is_absolute() {
            return Err(invalid(format!("working directory {}", cwd.display())));
        }
        Ok(Self {
            hygiene: Hygiene::from_args(steps)?,
            cwd,
            program: program.into(),
            args: args.to_vec(),
        })
    }

    /// Applies the steps and executes the worker; returns only the error that stopped it.
    fn exec(self) -> io::Error {
        // Built before the steps: a small address-space limit must not fail this allocation.
        let mut worker = std::process::Command::new(&self.program);
        worker.args(&self.args);
        // With the supervisor's identity, as a `pre_exec` hook's child enters it.
        if let Err(e) = std::env::set_current_dir(&self.cwd) {
            return io::Error::new(e.kind(), format!("chdir {}: {e}", self.cwd.display()));
        }
        if let Err(e) = self.hygiene.apply() {
            return io::Error::new(e.kind(), format!("before exec: {e}"));
        }
        // The environment and descriptors are the ones the supervisor gave the shim.
        // The worker starts with no signal blocked whatever thread started the shim had blocked;
        // std sets SIGPIPE back to its default.
        if let Err(e) = nix::sys::signal::SigSet::empty().thread_set_mask() {
            return io::Error::other(format!("clearing the signal mask: {e}"));
        }
        let e = worker.exec();
        io::Error::new(e.kind(), format!("exec {}: {e}", self.program.display()))
    }
}

/// In the child: supplementary groups, then gid, then uid; then proves there is no way back.
fn drop_privileges(user: WorkerUser) -> io::Result<()> {
    use nix::unistd::{getegid, geteuid, getgid, getuid, setgid, setgroups, setuid, Gid, Uid};
    let (uid, gid) = (Uid::from_raw(user.uid), Gid::from_raw(user.gid));
    setgroups(&[])?;
    setgid(gid)?;
    setuid(uid)?;
    let switched = getuid() == uid && geteuid() == uid && getgid() == gid && getegid() == gid;
    let regained = !uid.is_root() && setuid(Uid::from_raw(0)).is_ok();
    if !switched || regained {
        return Err(io::Error::from_raw_os_error(Errno::EPERM as i32));
    }
    Ok(())
}

fn text(arg: &OsString) -> io::Result<&str> {
    std::str::from_utf8(arg.as_bytes()).map_err(|_| invalid(format!("{arg:?}")))
}

fn number<T: std::str::FromStr>(v: &str) -> io::Result<T> {
    v.parse()
        .map_err(|_| invalid(format!("{v:?} is not a number")))
}

fn invalid(what: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("bad shim arguments: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::resource::Resource;

    fn hygiene() -> Hygiene {
        Hygiene {
            parent: Pid::from_raw(4242),
            nice: 7,
            rlimits: Rlimits {
                nofile: Some(1024),
                address_space: None,
                cpu_secs: Some(60),
                processes: Some(128),
            },
            user: Some(WorkerUser {
                uid: 5001,
                gid: 5002,
            }),
        }
    }

    #[test]
    fn the_steps_and_the_worker_survive_the_command_line() {
        let worker = vec![OsString::from("app-server"), OsString::from("--")];
        for h in [
            hygiene(),
            Hygiene {
                user: None,
                rlimits: Rlimits::default(),
                nice: 0,
                ..hygiene()
            },
        ] {
            let args = shim_args(
                h,
                Path::new("/srv/t/work"),
                Path::new("/opt/codex"),
                &worker,
            );
            let parsed = Shim::parse(args.into_iter()).unwrap();
            assert_eq!(
                parsed,
                Shim {
                    hygiene: h,
                    cwd: "/srv/t/work".into(),
                    program: "/opt/codex".into(),
                    // A `--` of the worker's own stays the worker's.
                    args: worker.clone(),
                }
            );
        }
        // `from_args` reads the limits in this order.
        let order = hygiene().rlimits.pairs().map(|(r, _)| r);
        assert_eq!(
            order,
            [
                Resource::RLIMIT_NOFILE,
                Resource::RLIMIT_AS,
                Resource::RLIMIT_CPU,
                Resource::RLIMIT_NPROC,
            ]
        );
    }

    #[test]
    fn a_bad_command_line_is_refused_not_guessed() {
        let good = shim_args(hygiene(), Path::new("/w"), Path::new("/opt/codex"), &[]);
        let mut cases: Vec<Vec<OsString>> = vec![
            Vec::new(),
            good[..good.len() - 1].to_vec(), // no program
            good[1..].to_vec(),              // a step missing
        ];
        // A step that is no number, a user without its group, a negative limit, no parent, a
        // relative working directory.
        for (at, bad) in [(1, "x"), (2, "5001"), (3, "-1"), (0, ""), (7, "work")] {
            let mut c = good.clone();
            c[at] = bad.into();
            cases.push(c);
        }
        for c in cases {
            let err = Shim::parse(c.clone().into_iter()).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{c:?}");
        }
    }
}
