//! Typed errors of the worker supervisor: legs, configuration, starting a worker, the pool.

use std::io;
use std::path::PathBuf;

use thiserror::Error;
use tokio::time::Duration;

/// Failure to open a WebSocket leg over a worker's Unix socket.
#[derive(Debug, Error)]
pub enum LegError {
    /// The Unix socket did not accept the connection.
    #[error("connect to worker socket {path}: {source}")]
    Connect {
        /// Socket path that was dialled.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// The socket accepted but the WebSocket upgrade failed.
    #[error("websocket handshake on {path}: {source}")]
    Handshake {
        /// Socket path that was dialled.
        path: PathBuf,
        /// Underlying tungstenite error.
        #[source]
        source: Box<tokio_tungstenite::tungstenite::Error>,
    },
    /// Something other than the worker listens on its socket path (the path was replaced).
    #[error("socket {path} is not the worker's: expected {expected}, found {found}")]
    PeerMismatch {
        /// Socket path that was dialled.
        path: PathBuf,
        /// The worker that should listen there.
        expected: crate::id::Peer,
        /// Who does.
        found: String,
    },
}

impl LegError {
    /// True when the listener is not the worker: a fault of the worker's socket, never retried.
    pub fn is_peer_mismatch(&self) -> bool {
        matches!(self, LegError::PeerMismatch { .. })
    }

    /// True when the socket is not there or nobody listens yet: worth retrying while a worker starts.
    pub fn is_not_listening(&self) -> bool {
        match self {
            LegError::Connect { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
            ),
            LegError::Handshake { .. } | LegError::PeerMismatch { .. } => false,
        }
    }
}

/// An invalid [`PoolConfig`](crate::PoolConfig).
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Tenant ids become metric labels and file names: 1–64 of `[A-Za-z0-9_-]`.
    #[error("invalid tenant id {0:?}: use 1-64 characters of [A-Za-z0-9_-]")]
    InvalidTenant(String),
    /// Unix socket paths must stay short (the kernel limit is 108 bytes including the NUL).
    #[error("socket path {path} is {len} bytes; it must be shorter than {max} bytes (use a shorter socket_dir)")]
    SocketPathTooLong {
        /// The longest socket path this configuration would produce.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The exclusive limit.
        max: usize,
    },
    /// `max_workers` must be at least 1 and not below `min_workers`.
    #[error("invalid worker caps: min_workers {min} max_workers {max}")]
    Caps {
        /// Configured minimum.
        min: usize,
        /// Configured maximum.
        max: usize,
    },
    /// Paths handed to the worker must be absolute (it resolves them against its own cwd).
    #[error("{0} must be an absolute path")]
    RelativePath(&'static str),
    /// `load_mark` must be at least 1.
    #[error("load_mark must be at least 1")]
    ZeroLoadMark,
    /// A duration that must be positive is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
}

/// Failure to bring one worker process to ready.
#[derive(Debug, Error)]
pub enum StartError {
    /// Creating a directory or cleaning the socket path failed.
    #[error("prepare {path}: {source}")]
    Prepare {
        /// The path being prepared.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// Something that is not ours (a directory, or a live process) holds the socket path.
    #[error("socket path {path} is in use: {what}")]
    SocketInUse {
        /// The socket path.
        path: PathBuf,
        /// What was found there.
        what: &'static str,
    },
    /// `spawn` itself failed (missing binary, permissions, parent died during spawn). Through the
    /// exec shim this is the shim's own start; the worker's steps and exec fail later, as
    /// [`StartError::ExitedBeforeReady`] with the shim's reason in `stderr`.
    #[error("spawn {program}: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// The process exited before it answered `initialize`.
    #[error("worker exited before ready ({status}); last stderr: {stderr}")]
    ExitedBeforeReady {
        /// Exit status, e.g. `exit status: 1`.
        status: String,
        /// The last stderr lines, joined.
        stderr: String,
    },
    /// The process did not answer `initialize` within `ready_timeout`.
    #[error("worker not ready after {after:?}; last stderr: {stderr}")]
    ReadyTimeout {
        /// The ready timeout.
        after: Duration,
        /// The last stderr lines, joined.
        stderr: String,
    },
    /// The control leg failed during `initialize`.
    #[error("control leg: {0}")]
    Control(#[from] ControlError),
}

/// Failure on the supervisor's control leg to a worker.
#[derive(Debug, Error)]
pub enum ControlError {
    /// Opening the leg failed.
    #[error(transparent)]
    Leg(#[from] LegError),
    /// Reading or writing a frame failed.
    #[error("websocket: {0}")]
    Ws(#[source] Box<tokio_tungstenite::tungstenite::Error>),
    /// The worker closed the connection.
    #[error("connection closed by worker")]
    Closed,
    /// The worker answered a control request with a JSON-RPC error.
    #[error("{method} failed: {code} {message}")]
    Rpc {
        /// The request method.
        method: &'static str,
        /// JSON-RPC error code.
        code: i64,
        /// JSON-RPC error message.
        message: String,
    },
    /// A frame was not valid JSON.
    #[error("invalid JSON from worker: {0}")]
    Decode(#[from] serde_json::Error),
}

impl From<tokio_tungstenite::tungstenite::Error> for ControlError {
    fn from(e: tokio_tungstenite::tungstenite::Error) -> Self {
        ControlError::Ws(Box::new(e))
    }
}

/// Why [`Pool::acquire`](crate::Pool::acquire) could not return a ready worker.
#[derive(Debug, Clone, Error)]
pub enum PoolError {
    /// The pool's configuration is invalid; no worker will ever start.
    #[error("tenant {tenant}: invalid pool configuration: {source}")]
    Config {
        /// Tenant as configured.
        tenant: String,
        /// What is wrong.
        #[source]
        source: ConfigError,
    },
    /// `shutdown` was called or the pool is being dropped.
    #[error("tenant {tenant}: worker pool is shutting down")]
    ShuttingDown {
        /// Tenant.
        tenant: &'static str,
    },
    /// No worker is ready and the fleet-wide worker cap is reached.
    #[error("tenant {tenant}: no worker ready and the fleet-wide cap of {max} workers is reached")]
    FleetFull {
        /// Tenant.
        tenant: &'static str,
        /// The fleet cap.
        max: usize,
    },
    /// No worker became ready within `ready_timeout`.
    #[error("tenant {tenant}: no worker ready after {after:?}{}", last_error_suffix(.last_error))]
    Timeout {
        /// Tenant.
        tenant: &'static str,
        /// How long acquire waited.
        after: Duration,
        /// The most recent start or exit error of any slot.
        last_error: Option<String>,
    },
    /// Every slot is backing off past the acquire deadline.
    #[error("tenant {tenant}: worker restarting in {retry_in:?}{}", last_error_suffix(.last_error))]
    Unavailable {
        /// Tenant.
        tenant: &'static str,
        /// Time until the next start attempt.
        retry_in: Duration,
        /// The failure that caused the backoff.
        last_error: Option<String>,
    },
    /// Every slot is quarantined after a crash loop.
    #[error("tenant {tenant}: worker quarantined after repeated failures, retry in {retry_in:?}{}", last_error_suffix(.last_error))]
    Quarantined {
        /// Tenant.
        tenant: &'static str,
        /// Time until the quarantine ends.
        retry_in: Duration,
        /// The last failure.
        last_error: Option<String>,
    },
}

fn last_error_suffix(last_error: &Option<String>) -> String {
    last_error
        .as_deref()
        .map(|e| format!("; last error: {e}"))
        .unwrap_or_default()
}
