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
    let gone = || io::Error::other("the worker spawner thread is gone");
    let spawner = SPAWNER.get_or_init(start).as_ref().ok_or_else(gone)?;
    let (reply, answer) = oneshot::channel();
    spawner
        .send(Job {
            command,
            runtime: Handle::current(),
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
                // An answer nobody waits for drops the child, which kills it.
                let _ = job.reply.send(job.command.spawn());
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
