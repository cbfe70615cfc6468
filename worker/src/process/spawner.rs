//! Every worker is started from one thread of its own, never from a runtime thread.
//!
//! Starting a process blocks the calling thread: a `fork` while it copies the supervisor's page
//! tables, a `posix_spawn` until the child has been scheduled and reached its `exec` (on two busy
//! cores, milliseconds). On a runtime thread that is a stall of every session it serves; here it
//! is not. The thread lives as long as the process, which matters because the kernel ties a
//! child's parent-death signal to the thread that started it.

use std::io;
use std::sync::mpsc;
use std::sync::OnceLock;

use tokio::process::{Child, Command};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// A start asked of the spawner thread: in the caller's runtime (whose driver reaps the child).
struct Job {
    command: Command,
    runtime: Handle,
    reply: oneshot::Sender<io::Result<Child>>,
}

static SPAWNER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();

/// Starts `command` on the spawner thread. A caller that gives up before the answer leaves the
/// child to `kill_on_drop`.
pub(crate) async fn spawn(command: Command) -> io::Result<Child> {
    spawn_in(command, Handle::current()).await
}

async fn spawn_in(command: Command, runtime: Handle) -> io::Result<Child> {
    let gone = || io::Error::other("the worker spawner thread is gone");
    let spawner = match SPAWNER.get() {
        Some(spawner) => spawner,
        // Not kept when it fails, so a later start tries again.
        None => {
            let started = start()?;
            SPAWNER.get_or_init(|| started)
        }
    };
    let (reply, answer) = oneshot::channel();
    spawner
        .send(Job {
            command,
            runtime,
            reply,
        })
        .map_err(|_| gone())?;
    answer.await.map_err(|_| gone())?
}

fn start() -> io::Result<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("worker-spawner".to_owned())
        .spawn(move || {
            for mut job in rx {
                // The caller gave up (its runtime may be shutting down): nothing to start.
                if job.reply.is_closed() {
                    continue;
                }
                let _runtime = job.runtime.enter();
                // An answer nobody waits for drops the child, which kills it.
                let _ = job.reply.send(job.command.spawn());
            }
        })
        .map_err(|e| io::Error::other(format!("cannot start the worker spawner thread: {e}")))?;
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `sleep` that dies with the thread that started it (its parent-death signal).
    fn sleeper() -> Command {
        let mut c = Command::new("sleep");
        c.arg("30").kill_on_drop(true);
        // SAFETY: only prctl, async-signal-safe, in the forked child.
        #[allow(unsafe_code)]
        unsafe {
            c.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                Ok(())
            });
        }
        c
    }

    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| !s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
    }

    /// A child started from a runtime whose thread then ends lives on: it was started by the
    /// spawner thread, to which its parent-death signal is tied, not by the caller's thread.
    #[test]
    fn children_outlive_the_thread_that_asked_for_them() {
        let (pid, _child) = std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let child = rt.block_on(spawn(sleeper())).unwrap();
            let pid = child.id().unwrap();
            // Not killed on drop: the test ends it.
            (pid, std::mem::ManuallyDrop::new(child))
        })
        .join()
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let lived = alive(pid);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
        assert!(lived, "the child died with the thread that asked for it");
    }
}
