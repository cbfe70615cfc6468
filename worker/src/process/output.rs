//! A worker's stdout and stderr, forwarded to codex-fleet's log: read at a pace, logged within a
//! budget.
//!
//! Whatever holds a worker's output pipes (app-server in a loop of errors, or any process that
//! inherited them) writes as fast as it likes, and each line it writes costs codex-fleet a read,
//! a conversion and a log line on the process and log stream that every tenant shares. So the
//! pipes are read at most [`OUTPUT_RATE`] bytes a second, each line counted as at least
//! [`LINE_COST`] bytes (so at most 4,096 lines a second however short): a worker that writes
//! faster than that waits on its own writes, as it would on a full disk. Of the stderr lines
//! read, at most [`LOG_LINES_PER_SEC`] a second after a burst of [`LOG_BURST`] reach the log. The
//! rest are counted in `codex_fleet_worker_log_lines_dropped_total` of the worker's tenant, and
//! their count is logged in a line's place when the budget next allows (and when the output
//! ends). The stderr tail kept for error reports takes every line.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, BufReader, ReadBuf};
use tokio::time::{sleep_until, Duration, Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Longest stdout/stderr line forwarded to tracing; the rest of a longer line is dropped.
pub(super) const MAX_LINE: usize = 4096;
/// stderr lines kept for error reports.
pub(super) const STDERR_TAIL_LINES: usize = 8;
/// Longest stderr line kept in the tail.
pub(super) const STDERR_TAIL_LINE: usize = 512;
/// Bytes a second read from each of a worker's output pipes, after a burst of as many.
pub(super) const OUTPUT_RATE: u64 = 1 << 20;
/// What a line costs of [`OUTPUT_RATE`] at least, however short.
pub(super) const LINE_COST: u64 = 256;
/// stderr lines a second logged per worker, after [`LOG_BURST`].
pub(super) const LOG_LINES_PER_SEC: u64 = 20;
/// stderr lines a worker may log at once.
pub(super) const LOG_BURST: u64 = 200;

/// A token bucket on tokio's clock that may go into debt.
#[derive(Debug)]
pub(super) struct Bucket {
    per_sec: f64,
    burst: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    /// Full: `burst` to spend at once, refilled at `per_sec`.
    pub(super) fn new(per_sec: u64, burst: u64) -> Bucket {
        Bucket {
            per_sec: per_sec as f64,
            burst: burst as f64,
            level: burst as f64,
            at: Instant::now(),
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * self.per_sec).min(self.burst);
        self.at = now;
    }

    /// Spends `n`, into debt if need be; when in debt, the instant it is paid off.
    pub(super) fn spend(&mut self, n: u64, now: Instant) -> Option<Instant> {
        self.refill(now);
        self.level -= n as f64;
        (self.level < 0.0).then(|| now + Duration::from_secs_f64(-self.level / self.per_sec))
    }

    /// Takes one if one is there.
    pub(super) fn try_take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.level >= 1.0 {
            self.level -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A reader that reads no faster than its [`Bucket`] of bytes allows: after a read that put the
/// bucket in debt, the next read waits until the debt is paid.
pub(super) struct Paced<R> {
    inner: R,
    bytes: Bucket,
    wait: Option<Pin<Box<Sleep>>>,
}

impl<R> Paced<R> {
    pub(super) fn new(inner: R) -> Paced<R> {
        Paced {
            inner,
            bytes: Bucket::new(OUTPUT_RATE, OUTPUT_RATE),
            wait: None,
        }
    }

    /// Counts `n` more bytes against the pace (a line's minimum cost).
    fn charge(&mut self, n: u64) {
        if let Some(paid) = self.bytes.spend(n, Instant::now()) {
            self.wait = Some(Box::pin(sleep_until(paid)));
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Paced<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(wait) = this.wait.as_mut() {
            ready!(wait.as_mut().poll(cx));
            this.wait = None;
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let read = buf.filled().len() - before;
        this.charge(read as u64);
        Poll::Ready(Ok(()))
    }
}

/// A worker's output, line by line, at its pace: the line (at most [`MAX_LINE`] bytes of it)
/// in `line`; false at its end.
async fn next_line<R: AsyncRead + Unpin>(
    reader: &mut BufReader<Paced<R>>,
    line: &mut Vec<u8>,
) -> io::Result<bool> {
    let more = read_line_bounded(reader, line, MAX_LINE).await?;
    if more {
        // The bytes were counted as they were read; a short line costs at least this much.
        let short = LINE_COST.saturating_sub(line.len() as u64 + 1);
        reader.get_mut().charge(short);
    }
    Ok(more)
}

pub(super) async fn forward_stdout(out: impl AsyncRead + Unpin) {
    let mut reader = BufReader::new(Paced::new(out));
    let mut line = Vec::with_capacity(256);
    loop {
        match next_line(&mut reader, &mut line).await {
            Ok(true) => debug!(line = %String::from_utf8_lossy(&line), "stdout"),
            Ok(false) => break,
            Err(e) => {
                debug!(error = %e, "stdout read failed");
                break;
            }
        }
    }
}

pub(super) async fn forward_stderr(
    err: impl AsyncRead + Unpin,
    tail: std::sync::Arc<StderrTail>,
    done: CancellationToken,
    dropped: prometheus::IntCounter,
) {
    let _done = done.drop_guard();
    let mut reader = BufReader::new(Paced::new(err));
    let mut line = Vec::with_capacity(256);
    let mut budget = Bucket::new(LOG_LINES_PER_SEC, LOG_BURST);
    let mut unlogged = 0u64;
    loop {
        match next_line(&mut reader, &mut line).await {
            Ok(true) => {
                let text = strip_ansi(&String::from_utf8_lossy(&line));
                let now = Instant::now();
                // The count of lines not logged takes its place in the budget, before the line.
                if unlogged > 0 && budget.try_take(now) {
                    log_unlogged(unlogged);
                    unlogged = 0;
                }
                if unlogged == 0 && budget.try_take(now) {
                    if looks_like_warning(&text) {
                        warn!(line = %text, "stderr");
                    } else {
                        info!(line = %text, "stderr");
                    }
                } else {
                    unlogged += 1;
                    dropped.inc();
                }
                tail.push(text);
            }
            Ok(false) => break,
            Err(e) => {
                debug!(error = %e, "stderr read failed");
                break;
            }
        }
    }
    if unlogged > 0 {
        log_unlogged(unlogged);
    }
}

/// The log line that stands in for `lines` stderr lines left out of the log.
fn log_unlogged(lines: u64) {
    warn!(lines, "stderr lines over the log budget, not logged");
}

/// Reads one line (without its newline) into `line`, keeping at most `max` bytes of it.
/// Returns `false` at end of input.
pub(super) async fn read_line_bounded<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
    max: usize,
) -> io::Result<bool> {
    line.clear();
    let mut read_any = false;
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(read_any);
        }
        read_any = true;
        let (chunk, consumed, complete) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = max.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        reader.consume(consumed);
        if complete {
            return Ok(true);
        }
    }
}

/// Removes ANSI escape sequences (app-server colours its log lines).
pub(super) fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if ('\u{40}'..='\u{7e}').contains(&c) {
                    break;
                }
            }
        }
    }
    out
}

/// app-server logs as `<timestamp> LEVEL target: message`; a few lines start with `WARNING:`.
pub(super) fn looks_like_warning(text: &str) -> bool {
    text.split_whitespace()
        .take(2)
        .any(|word| word.starts_with("WARN") || word.starts_with("ERROR"))
}

/// The last few stderr lines of a worker, for error reports.
#[derive(Debug, Default)]
pub(super) struct StderrTail(Mutex<VecDeque<String>>);

impl StderrTail {
    pub(super) fn push(&self, mut line: String) {
        if line.len() > STDERR_TAIL_LINE {
            let mut cut = STDERR_TAIL_LINE;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
        }
        let mut tail = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }

    pub(super) fn summary(&self) -> String {
        let tail = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if tail.is_empty() {
            return "(none)".to_owned();
        }
        tail.iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(" | ")
    }
}
