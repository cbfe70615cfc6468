//! Costly synchronous work that a task serving one tenant must do itself (parsing a frame of
//! many megabytes), done without holding a runtime thread every other session it serves waits on.
//!
//! [`in_place`] hands the runtime thread's other tasks to another thread first
//! (`block_in_place`): the work still takes a core for as long as it takes, but the operating
//! system shares the cores between it and the runtime, rather than the runtime's tasks waiting it
//! out. Sessions bound the number of such steps running at once themselves, per tenant and in
//! all (`Session::costly_permits`); an edge's relays run one at a time in the process
//! ([`in_place_one_at_a_time`]).

/// Frames longer than this are parsed [`in_place`]; a frame of a MiB parses in a millisecond or
/// so, 32 MiB of escaped text in about 110 ms (release build; scaled from a 42 MB frame's 142 ms).
pub const LARGE_FRAME_BYTES: usize = 1 << 20;

/// Runs `work` with the runtime thread's other tasks handed to another thread first, on a
/// multi-thread runtime; inline on a runtime of one thread (tests), which has no other thread to
/// hand them to. Sessions and relays run as tasks of a multi-thread runtime, never in a
/// `LocalSet`, where `block_in_place` would panic.
pub fn in_place<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// [`in_place`], one at a time in the process: for callers that cannot wait for a permit
/// asynchronously (an edge's relay handles a frame synchronously). Without it, a tenant sending
/// large frames on many connections would have as many parses running at once, and starve the
/// process's own work (an edge found its nodes' probes timing out, and closed the tenant's
/// sessions as if its node had gone). The waiting happens off the runtime too.
pub fn in_place_one_at_a_time<R>(work: impl FnOnce() -> R) -> R {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    in_place(|| {
        let _one = ONE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        work()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn another_task_runs_on_the_thread_while_the_work_holds_it() {
        use std::sync::mpsc::channel;
        use std::time::Duration;
        let (started, is_started) = channel();
        let (done, is_done) = channel();
        // On the runtime's only worker thread: the work waits for another task.
        let work = tokio::spawn(async move {
            started.send(()).unwrap();
            in_place(|| is_done.recv_timeout(Duration::from_secs(5)).is_ok())
        });
        // The test's own thread is not a worker; it waits for the work to hold the worker.
        is_started.recv().unwrap();
        let other = tokio::spawn(async move { done.send(()).unwrap() });
        assert!(
            work.await.unwrap(),
            "the other task did not run while the work held the thread"
        );
        other.await.unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_runtime_of_one_thread_runs_the_work_inline() {
        assert_eq!(in_place(|| 7), 7);
    }
}
