//! A worker's Unix socket, watched for writability only while a write waits.
//!
//! tokio registers every socket for both directions, edge-triggered. A Unix stream socket
//! signals "writable" each time its peer reads from it (the kernel wakes writers whenever the
//! peer's receive queue shrinks), so each request a session wrote to a worker came back as one
//! more epoll event when the worker read it: a third `epoll_wait` per round trip, and a wake-up
//! of the router's thread if it was already asleep, where HAProxy, which asks for write readiness
//! only when a write would block, makes two (BENCHMARKS.md, bench 1, "The writable wake-up").
//!
//! [`UnixIo`] keeps the socket registered for readability for its whole life, and registers a
//! second descriptor of the same socket for writability only when a write would block; it closes
//! that descriptor as soon as a write goes through. A worker that stops reading is waited on as
//! before, and a socket with room takes a write at once, without asking epoll first.
//!
//! When no descriptor is free for that wait (the process is at its limit, `EMFILE`, or the
//! system at its, `ENFILE`), the write is tried again on a short timer instead: the leg stays
//! whole and its frames are not lost while descriptors are short, only later.

use std::future::Future;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// How long a write that found the socket full waits before trying again, when no descriptor is
/// free to wait on writability with.
const RETRY_WITHOUT_DESCRIPTOR: Duration = Duration::from_millis(5);

/// A connected Unix stream socket, registered with tokio for reading, and for writing only while
/// a write waits for room.
#[derive(Debug)]
pub struct UnixIo {
    socket: AsyncFd<UnixStream>,
    /// How a write that found the socket full waits for room.
    waiting_write: Option<WriteWait>,
}

/// A blocked write's wait for room.
#[derive(Debug)]
enum WriteWait {
    /// A duplicate of the socket's descriptor, registered for writability.
    Writable(AsyncFd<UnixStream>),
    /// No descriptor was free for that: the write is tried again when this fires.
    Retry(Pin<Box<tokio::time::Sleep>>),
}

impl UnixIo {
    /// Takes `stream` over from tokio's own registration (it stays non-blocking).
    pub fn new(stream: tokio::net::UnixStream) -> io::Result<Self> {
        Ok(Self {
            socket: register(stream.into_std()?, Interest::READABLE)?,
            waiting_write: None,
        })
    }

    /// Whether a write is waiting for room (its descriptor is registered for writability).
    #[cfg(test)]
    fn waits_to_write(&self) -> bool {
        self.waiting_write.is_some()
    }
}

impl std::os::fd::AsFd for UnixIo {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.socket.get_ref().as_fd()
    }
}

/// Registers `socket` with tokio for `interest` alone.
///
/// tokio 1.54 deprecates its safe constructors in favour of `unsafe` ones, because a generic
/// `T`'s `as_raw_fd` could close or change its descriptor while registered. A std `UnixStream`
/// owns one descriptor for its whole life and closes it only when dropped, which the `AsyncFd`
/// does after deregistering it, so that hazard does not arise here, and the workspace allows no
/// `unsafe` code.
#[allow(deprecated)]
fn register(socket: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    AsyncFd::with_interest(socket, interest)
}

/// A second descriptor of `socket`, registered for writability alone.
fn writable(socket: &UnixStream) -> io::Result<AsyncFd<UnixStream>> {
    #[cfg(test)]
    if tests::NO_DESCRIPTORS.get() {
        return Err(io::Error::from_raw_os_error(nix::libc::EMFILE));
    }
    let second = socket.try_clone()?;
    // Not from the reserve: without a descriptor below the line the write waits on a timer.
    if crate::descriptors::check(&second).is_err() {
        return Err(io::Error::from_raw_os_error(nix::libc::EMFILE));
    }
    register(second, Interest::WRITABLE)
}

/// Whether `e` says that no descriptor was free (the process's limit or the system's).
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(nix::libc::EMFILE | nix::libc::ENFILE)
    )
}

impl AsyncRead for UnixIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.socket.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let wanted = unfilled.len();
            match guard.try_io(|s| s.get_ref().read(unfilled)) {
                Ok(Ok(n)) => {
                    // As tokio's own sockets do: a short read took all there was, so wait for
                    // the next edge instead of trying again into WouldBlock. An end of stream
                    // that arrived with the data stays flagged (epoll reported it in the same
                    // event), so it is not missed.
                    if n > 0 && n < wanted {
                        guard.clear_ready();
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for UnixIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            match &mut this.waiting_write {
                Some(WriteWait::Writable(waiting)) => {
                    let mut guard = ready!(waiting.poll_write_ready(cx))?;
                    let Ok(result) = guard.try_io(|s| s.get_ref().write(buf)) else {
                        continue; // still full: readiness cleared, wait for the next edge
                    };
                    drop(guard);
                    this.waiting_write = None;
                    return Poll::Ready(result);
                }
                Some(WriteWait::Retry(sleep)) => {
                    ready!(sleep.as_mut().poll(cx));
                    this.waiting_write = None;
                }
                None => {}
            }
            match this.socket.get_ref().write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Registered after the write failed: epoll reports a socket that already
                    // has room again at once, so no wake-up is lost in between.
                    this.waiting_write = Some(match writable(this.socket.get_ref()) {
                        Ok(waiting) => WriteWait::Writable(waiting),
                        Err(e) if out_of_descriptors(&e) => {
                            tracing::debug!(error = %e, "no descriptor to wait on a worker's socket with; retrying the write on a timer");
                            WriteWait::Retry(Box::pin(tokio::time::sleep(RETRY_WITHOUT_DESCRIPTOR)))
                        }
                        Err(e) => return Poll::Ready(Err(e)),
                    });
                }
                result => return Poll::Ready(result),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.socket.get_ref().shutdown(Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn pair() -> (UnixIo, tokio::net::UnixStream) {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        (UnixIo::new(ours).unwrap(), theirs)
    }

    #[tokio::test]
    async fn bytes_go_both_ways_and_the_end_is_seen() {
        let (mut io, mut peer) = pair();
        io.write_all(b"request").await.unwrap();
        let mut got = [0u8; 7];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"request");
        peer.write_all(b"answer").await.unwrap();
        // Data and the end of stream arrive together: both are read, the end is not missed.
        drop(peer);
        let mut all = Vec::new();
        // A missed end of stream would leave this waiting forever.
        tokio::time::timeout(std::time::Duration::from_secs(20), io.read_to_end(&mut all))
            .await
            .expect("the end of stream was seen")
            .unwrap();
        assert_eq!(all, b"answer");
    }

    thread_local! {
        /// Set by a test: no descriptor is free for a blocked write's wait (as at `EMFILE`).
        pub(super) static NO_DESCRIPTORS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_blocks_the_write_until_it_reads_again() {
        blocked_write_goes_through_once_the_peer_reads().await;
    }

    #[tokio::test]
    async fn without_a_free_descriptor_a_blocked_write_retries_on_a_timer_and_loses_nothing() {
        // This test's runtime runs on this thread alone, so only its writes see no descriptors.
        NO_DESCRIPTORS.set(true);
        blocked_write_goes_through_once_the_peer_reads().await;
    }

    /// Fills the socket until a write waits, then drains the peer: the waiting write goes
    /// through, nothing is lost, and the wait is dropped with it.
    async fn blocked_write_goes_through_once_the_peer_reads() {
        let (mut io, mut peer) = pair();
        let chunk = vec![7u8; 64 << 10];
        // Fill the socket until a write would block.
        let mut sent = 0usize;
        loop {
            let write = io.write(&chunk);
            match tokio::time::timeout(std::time::Duration::from_millis(50), write).await {
                Ok(n) => sent += n.unwrap(),
                Err(_) => break,
            }
        }
        assert!(sent > 0);
        assert!(io.waits_to_write(), "a blocked write waits for room");
        // The peer drains everything; the blocked write then goes through, and the
        // wait is dropped with it.
        let last = chunk.len();
        let writer = tokio::spawn(async move {
            io.write_all(&chunk).await.unwrap();
            assert!(!io.waits_to_write());
            io.shutdown().await.unwrap();
        });
        let drain = async {
            let mut total = 0usize;
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = peer.read(&mut buf).await.unwrap();
                if n == 0 {
                    return total;
                }
                total += n;
            }
        };
        // A write that missed its wake-up would leave this waiting forever.
        let total = tokio::time::timeout(std::time::Duration::from_secs(20), drain)
            .await
            .expect("the waiting write went through once the peer read");
        writer.await.unwrap();
        assert_eq!(total, sent + last);
    }
}
