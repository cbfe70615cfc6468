//! What a long-lived task polls but almost never needs (shutdown, a credential's end, a tenant's
//! broadcasts, a worker's exit), behind a waker of its own, so the task polls it only when it
//! woke the task.
//!
//! Polled on every pass of a session's loop, those cost each round trip a lock per cancellation
//! token and one on the tenant's broadcast channel (the same lock for every session of the
//! tenant), and the code to get there: cold code the round trip fetches from memory
//! (BENCHMARKS.md, "Rare events behind a waker of their own"). Behind the gate, a pass in which
//! none of them woke costs one atomic swap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polls what it guards with its own waker, and again only after that waker was woken (or
/// after what it guards was ready, since it may be ready again at once).
pub(crate) struct Gate {
    flag: Arc<Flag>,
    waker: Waker,
}

/// Woken by what the gate guards: marks the gate open and wakes the task that polls it.
struct Flag {
    open: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.open.store(true, Ordering::Release);
        self.task.wake();
    }
}

// === impl Gate ===

impl Gate {
    /// A gate that lets the first poll through (nothing guarded has been polled yet).
    pub(crate) fn new() -> Gate {
        let flag = Arc::new(Flag {
            open: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        let waker = Waker::from(flag.clone());
        Gate { flag, waker }
    }

    /// Polls `guarded` with the gate's waker if the gate is open; pending otherwise. The task
    /// in `cx` is woken when anything `guarded` waits on is.
    pub(crate) fn poll<T>(
        &mut self,
        cx: &mut Context<'_>,
        guarded: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.flag.task.register(cx.waker());
        if !self.flag.open.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let ready = guarded(&mut Context::from_waker(&self.waker));
        if ready.is_ready() {
            // Nothing registered the gate's waker this time: look again on the next pass.
            self.flag.open.store(true, Ordering::Release);
        }
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::atomic::AtomicUsize;

    /// A waker that counts its wakes, standing for the session's task.
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn task() -> (Arc<Counting>, Waker) {
        let counting = Arc::new(Counting(AtomicUsize::new(0)));
        (counting.clone(), Waker::from(counting))
    }

    #[test]
    fn what_waits_is_polled_again_only_once_it_was_woken_and_its_wake_reaches_the_task() {
        let (woken, waker) = task();
        let mut cx = Context::from_waker(&waker);
        let mut gate = Gate::new();
        let mut polls = 0;
        let mut kept: Option<Waker> = None;
        let mut poll = |gate: &mut Gate, cx: &mut Context<'_>, kept: &mut Option<Waker>| {
            gate.poll(cx, |inner| {
                polls += 1;
                *kept = Some(inner.waker().clone());
                Poll::<()>::Pending
            })
        };
        assert!(poll(&mut gate, &mut cx, &mut kept).is_pending());
        for _ in 0..5 {
            assert!(poll(&mut gate, &mut cx, &mut kept).is_pending());
        }
        assert_eq!(polls, 1, "not woken: not polled again");
        assert_eq!(woken.0.load(Ordering::SeqCst), 0);
        kept.take().expect("the guarded future kept a waker").wake();
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "the task is woken");
        let mut polled_again = false;
        assert!(gate
            .poll(&mut cx, |_| {
                polled_again = true;
                Poll::<()>::Pending
            })
            .is_pending());
        assert!(polled_again, "woken: polled again");
    }

    #[test]
    fn what_was_ready_is_polled_again_on_the_next_pass_without_a_wake() {
        let (_woken, waker) = task();
        let mut cx = Context::from_waker(&waker);
        let mut gate = Gate::new();
        let mut queue = vec![2, 1];
        let mut next = |gate: &mut Gate, cx: &mut Context<'_>| {
            gate.poll(cx, |_| match queue.pop() {
                Some(n) => Poll::Ready(n),
                None => Poll::Pending,
            })
        };
        assert_eq!(next(&mut gate, &mut cx), Poll::Ready(1));
        assert_eq!(next(&mut gate, &mut cx), Poll::Ready(2));
        assert_eq!(next(&mut gate, &mut cx), Poll::Pending);
    }

    #[tokio::test]
    async fn a_broadcast_sent_while_the_task_waits_elsewhere_wakes_it() {
        let (tx, mut rx) = tokio::sync::broadcast::channel::<u32>(4);
        let mut gate = Gate::new();
        let mut receiving = Box::pin(async move { rx.recv().await.ok() });
        let sender = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            tx.send(7).unwrap();
            tx
        });
        let got = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            std::future::poll_fn(|cx| gate.poll(cx, |inner| receiving.as_mut().poll(inner))),
        )
        .await
        .expect("woken by the send");
        assert_eq!(got, Some(7));
        drop(sender.await);
    }
}
