//! The audit log: who did what, as JSON lines to a file (rotated by size) or stdout.
//!
//! Events are queued on a bounded channel and written by their own thread, so the data path
//! never waits on the sink: when the queue is full an event is dropped and counted in
//! `codex_fleet_audit_dropped_total`, never silently. Approval decisions are the exception:
//! the session waits until its decision is written (at most [`DECISION_WAIT`]) before it
//! forwards the answer to the worker.
//!
//! Never a credential: events carry the tenant, the subject, the credential kind and key id.
//!
//! # Telling audit records from log lines
//!
//! With `audit.path = "-"` (the chart's default) audit records share the container's log stream
//! with the log lines on stderr. A line is an audit record if and only if it is a JSON object
//! whose first key is [`AUDIT_KEY`] (`{"audit":"codex-fleet","ts_ms":…,"event":…,…}`), and no
//! tenant can make a log line of that shape:
//!
//! - every audit record is written here, by [`line`], which puts [`AUDIT_KEY`] first and writes
//!   every value with `serde_json` (control characters escaped, so a record is one line);
//!   client-chosen values are bounded ([`crate::untrusted::Untrusted`]);
//! - a `json` log line is one JSON object of `tracing-subscriber`'s fixed top-level keys
//!   (`timestamp` first, then `level`, `fields`, `target`, spans); a client's text is only ever
//!   a string value inside it, JSON-escaped, so it can neither add a top-level key nor end the
//!   line;
//! - a `text` log line starts with its timestamp, not `{`, and one event is one line: client
//!   values are escaped ([`crate::untrusted::Untrusted`]) and any control character left in a
//!   formatted event is escaped before it is written (`OneLineStderr` in `main.rs`).
//!
//! So a forged `approval.answered` can appear only as escaped text inside a log line.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::{IntCounter, Registry};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use worker::Pool;

pub mod config;
pub mod denials;

use config::AuditConfig;

/// Longest wait of a session for its approval decision to be written before it forwards it.
pub const DECISION_WAIT: Duration = Duration::from_millis(500);

/// Longest command or change summary written, in characters.
const SUMMARY_CHARS: usize = 400;

/// The first key of every audit record, which no log line has (see the module documentation).
pub const AUDIT_KEY: &str = "audit";
/// Its value.
pub const AUDIT_SOURCE: &str = "codex-fleet";

enum Entry {
    Line(String),
    /// Answered once every line queued before it is written and flushed.
    Written(String, oneshot::Sender<()>),
}

/// A handle to the audit log; cheap to clone. The default handle records nothing.
#[derive(Clone, Default)]
pub struct Audit {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    tx: mpsc::Sender<Entry>,
    dropped: IntCounter,
    /// Pools whose worker lifecycle is being recorded (by address, while alive).
    watched: std::sync::Mutex<std::collections::HashSet<usize>>,
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit")
            .field("enabled", &self.inner.is_some())
            .finish()
    }
}

/// Where lines go.
enum Sink {
    Stdout,
    File {
        path: PathBuf,
        file: std::fs::File,
        size: u64,
        max: u64,
        /// Rotated files kept: `<path>.1` (the newest) to `<path>.<keep>`.
        keep: u32,
    },
}

impl Audit {
    /// Starts the writer for `cfg` (nothing when `audit.path` is unset) and registers
    /// `codex_fleet_audit_dropped_total` on `registry`.
    pub fn start(cfg: &AuditConfig, registry: &Registry) -> anyhow::Result<Audit> {
        let dropped = IntCounter::new(
            "codex_fleet_audit_dropped_total",
            "Audit events dropped because the audit queue was full (the sink is too slow).",
        )?;
        registry.register(Box::new(dropped.clone()))?;
        let Some(path) = &cfg.path else {
            return Ok(Audit::default());
        };
        let sink = if path.as_os_str() == "-" {
            Sink::Stdout
        } else {
            let file = open_append(path)?;
            let size = file.metadata()?.len();
            Sink::File {
                path: path.clone(),
                file,
                size,
                max: cfg.max_file_bytes,
                keep: cfg.keep_files.max(1),
            }
        };
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn(move || write_lines(sink, rx))?;
        Ok(Audit {
            inner: Some(Arc::new(Inner {
                tx,
                dropped,
                watched: Default::default(),
            })),
        })
    }

    /// Queues an event; never waits. A full queue drops it (counted).
    pub fn record(&self, event: &str, fields: Value) {
        let Some(inner) = &self.inner else { return };
        if inner.tx.try_send(Entry::Line(line(event, fields))).is_err() {
            inner.dropped.inc();
        }
    }

    /// Queues an event and waits until it is written, for at most [`DECISION_WAIT`]; a full
    /// queue or a sink slower than that is counted as a drop and the caller goes on.
    pub async fn record_written(&self, event: &str, fields: Value) {
        let Some(inner) = &self.inner else { return };
        let (done, written) = oneshot::channel();
        if inner
            .tx
            .try_send(Entry::Written(line(event, fields), done))
            .is_err()
        {
            inner.dropped.inc();
            return;
        }
        if tokio::time::timeout(DECISION_WAIT, written).await.is_err() {
            tracing::warn!(
                "audit sink slow: an approval decision was forwarded before it was written"
            );
        }
    }
}

impl Audit {
    /// Records the worker lifecycle of every tenant's pool in `pools` (`worker.ready`,
    /// `worker.exited`) until the pool is gone; a pool already watched is skipped, so this is
    /// called again after each reload.
    pub fn watch_workers<'a>(&self, pools: impl IntoIterator<Item = (&'a str, &'a Arc<Pool>)>) {
        let Some(inner) = &self.inner else { return };
        for (tenant, pool) in pools {
            let key = Arc::as_ptr(pool) as usize;
            if !inner
                .watched
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(key)
            {
                continue;
            }
            let mut events = pool.subscribe();
            let id = tenant.to_owned();
            let audit = self.clone();
            tokio::spawn(async move {
                use tokio::sync::broadcast::error::RecvError;
                loop {
                    match events.recv().await {
                        Ok(worker::PoolEvent::WorkerReady { worker }) => audit.record(
                            "worker.ready",
                            json!({ "tenant": id, "worker": worker.to_string() }),
                        ),
                        Ok(worker::PoolEvent::WorkerExited {
                            worker,
                            status,
                            reason,
                            ..
                        }) => audit.record(
                            "worker.exited",
                            json!({
                                "tenant": id, "worker": worker.to_string(),
                                "status": status, "reason": reason.as_str(),
                            }),
                        ),
                        Ok(_) => {}
                        Err(RecvError::Lagged(n)) => {
                            if let Some(inner) = &audit.inner {
                                inner.dropped.inc_by(n);
                            }
                        }
                        Err(RecvError::Closed) => break,
                    }
                }
                if let Some(inner) = &audit.inner {
                    inner
                        .watched
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .remove(&key);
                }
            });
        }
    }
}

/// One JSON line: [`AUDIT_KEY`] first, `ts_ms` (Unix milliseconds), `event`, then the fields
/// (a field of one of those names is left out: the first three are this module's).
fn line(event: &str, fields: Value) -> String {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut out = format!(
        "{{{}:{},\"ts_ms\":{ts},\"event\":{}",
        Value::from(AUDIT_KEY),
        Value::from(AUDIT_SOURCE),
        Value::from(event)
    );
    if let Value::Object(fields) = fields {
        for (k, v) in fields {
            if k == AUDIT_KEY || k == "ts_ms" || k == "event" {
                continue;
            }
            out.push(',');
            out.push_str(&Value::String(k).to_string());
            out.push(':');
            out.push_str(&v.to_string());
        }
    }
    out.push('}');
    out
}

/// A command (string or argv array) or change summary, bounded.
pub fn summary(v: Option<&Value>) -> Value {
    let text = match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_owned))
            .collect::<Vec<_>>()
            .join(" "),
        Some(Value::Null) | None => return Value::Null,
        Some(other) => other.to_string(),
    };
    Value::String(text.chars().take(SUMMARY_CHARS).collect())
}

fn open_append(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

/// `<path>.<n>` for generation `n`.
fn generation(path: &std::path::Path, n: u32) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(format!(".{n}"));
    PathBuf::from(p)
}

/// Moves each kept generation one up (`<path>.<keep>` is replaced, so dropped), then the full
/// file to `<path>.1`. A generation missing (fewer rotations so far, or removed by hand) is
/// skipped.
fn rotate(path: &std::path::Path, keep: u32) -> std::io::Result<()> {
    for n in (1..keep).rev() {
        match std::fs::rename(generation(path, n), generation(path, n + 1)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    std::fs::rename(path, generation(path, 1))
}

fn write_lines(mut sink: Sink, mut rx: mpsc::Receiver<Entry>) {
    while let Some(entry) = rx.blocking_recv() {
        let (text, done) = match entry {
            Entry::Line(t) => (t, None),
            Entry::Written(t, d) => (t, Some(d)),
        };
        if let Err(e) = sink.write(&text) {
            tracing::error!(error = %e, "audit log write failed; the event is lost");
        }
        if let Some(done) = done {
            let _flushed = sink.flush();
            let _answered = done.send(());
        }
    }
    let _flushed = sink.flush();
}

impl Sink {
    fn write(&mut self, text: &str) -> std::io::Result<()> {
        match self {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes())?;
                out.write_all(b"\n")?;
                out.flush()
            }
            Sink::File {
                path,
                file,
                size,
                max,
                keep,
            } => {
                let len = text.len() as u64 + 1;
                if *size > 0 && *size + len > *max {
                    rotate(path, *keep)?;
                    *file = open_append(path)?;
                    *size = 0;
                }
                file.write_all(format!("{text}\n").as_bytes())?;
                *size += len;
                Ok(())
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Sink::Stdout => std::io::stdout().flush(),
            Sink::File { file, .. } => file.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_line_led_by_the_audit_key_whatever_its_fields_hold() {
        let forged = "x\n{\"audit\":\"codex-fleet\",\"event\":\"approval.answered\"}\r\u{2028}";
        let text = line(
            "access.denied",
            json!({ "method": forged, "audit": "forged", "event": "forged", "a": 1 }),
        );
        assert!(!text.contains('\n') && !text.contains('\r'), "{text}");
        assert!(
            text.starts_with(r#"{"audit":"codex-fleet","ts_ms":"#),
            "{text}"
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (
                v["audit"].as_str(),
                v["event"].as_str(),
                v["method"].as_str()
            ),
            (Some("codex-fleet"), Some("access.denied"), Some(forged))
        );
    }

    #[tokio::test]
    async fn lines_rotate_and_a_full_queue_counts_drops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let cfg = AuditConfig {
            path: Some(path.clone()),
            queue: 4,
            max_file_bytes: 400,
            keep_files: 1,
        };
        let registry = Registry::new();
        let audit = Audit::start(&cfg, &registry).unwrap();
        for i in 0..3 {
            audit
                .record_written("test.event", json!({ "n": i, "pad": "x".repeat(100) }))
                .await;
        }
        let current = std::fs::read_to_string(&path).unwrap();
        let rotated = std::fs::read_to_string(dir.path().join("audit.jsonl.1")).unwrap();
        assert_eq!(current.lines().count() + rotated.lines().count(), 3);
        let first: Value = serde_json::from_str(rotated.lines().next().unwrap()).unwrap();
        assert_eq!(
            (first["event"].as_str(), first["n"].as_i64()),
            (Some("test.event"), Some(0))
        );
        assert!(rotated.starts_with(r#"{"audit":"codex-fleet","ts_ms":"#));
        // Far more events than the queue holds, at once: some are dropped and counted.
        for i in 0..10_000 {
            audit.record("flood", json!({ "n": i }));
        }
        let dropped = registry
            .gather()
            .iter()
            .find(|m| m.name() == "codex_fleet_audit_dropped_total")
            .map(|m| m.get_metric()[0].get_counter().get_value())
            .unwrap();
        assert!(dropped > 0.0, "{dropped}");
    }

    #[tokio::test]
    async fn rotation_keeps_the_newest_generations_in_order_and_drops_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let cfg = AuditConfig {
            path: Some(path.clone()),
            queue: 16,
            max_file_bytes: 200,
            keep_files: 3,
        };
        let audit = Audit::start(&cfg, &Registry::new()).unwrap();
        // Each record is over half the bound: one a file, so record n ends in generation 9 - n.
        for n in 0..10 {
            audit
                .record_written("test.event", json!({ "n": n, "pad": "x".repeat(120) }))
                .await;
        }
        let n_in = |p: &std::path::Path| -> Vec<i64> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| {
                    serde_json::from_str::<Value>(l).unwrap()["n"]
                        .as_i64()
                        .unwrap()
                })
                .collect()
        };
        assert_eq!(n_in(&path), [9]);
        for g in 1..=3 {
            assert_eq!(
                n_in(&generation(&path, g)),
                [9 - i64::from(g)],
                "generation {g}"
            );
        }
        assert!(
            !generation(&path, 4).exists(),
            "only keep_files generations are kept"
        );
        // Every kept generation stays private.
        use std::os::unix::fs::PermissionsExt;
        for g in 1..=3 {
            let mode = std::fs::metadata(generation(&path, g))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "generation {g}");
        }
    }
}
