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

static SPAWNER: OnceLock<Option<mpsc::Sender<Job>>> = OnceLock::new();

/// Starts `command` on the spawner thread. A caller that gives up before the answer leaves the
/// child to `kill_on_drop`.
pub(crate) async fn spawn(command: Command) -> io::Result<Child> {
    spawn_in(command, Handle::current()).await
}

async fn spawn_in(command: Command, runtime: Handle) -> io::Result<Child> {
    let gone = || io::Error::other("the worker spawner thread is gone");
    let spawner = SPAWNER.get_or_init(start).as_ref().ok_or_else(gone)?;
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

fn start() -> Option<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    let thread = std::thread::Builder::new()
        .name("worker-spawner".to_owned())
        .spawn(move || {
            for mut job in rx {
                let _runtime = job.runtime.enter();
                // A runtime shutting down meanwhile must fail this start, not every later one.
                let started =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.command.spawn()))
                        .unwrap_or_else(|_| {
                            Err(io::Error::other("the worker's runtime is shutting down"))
                        });
                // An answer nobody waits for drops the child, which kills it.
                let _ = job.reply.send(started);
            }
        });
    match thread {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the worker spawner thread");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper() -> Command {
        let mut c = Command::new("sleep");
        c.arg("30").kill_on_drop(true);
        c
    }

    /// Children come from the spawner thread, not the caller's; a start for a runtime that is
    /// gone (a test's, or one shutting down) does not take the thread with it.
    #[tokio::test]
    async fn starts_run_on_one_thread_of_their_own_and_survive_a_dead_runtime() {
        // Dropped outside this runtime, which may not block.
        let dead = std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.handle().clone()
        })
        .join()
        .unwrap();
        // Whatever the dead runtime makes of it, an answer comes back.
        if let Ok(mut child) = spawn_in(sleeper(), dead).await {
            let _ = child.start_kill();
        }
        let mut child = spawn(sleeper()).await.unwrap();
        let pid = child.id().unwrap();
        // The parent-death signal follows the thread that started the child: the spawner's.
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let ppid: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap();
        assert_eq!(ppid, std::process::id());
        let spawner_named = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .any(|name| name.trim() == "worker-spawner");
        assert!(spawner_named, "the spawner thread runs");
        child.kill().await.unwrap();
    }
}
