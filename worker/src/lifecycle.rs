//! Where a worker slot is in its life ([`WorkerState`]): what the supervisor drives and the
//! metrics count, named by both.

/// The lifecycle state of a worker slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerState {
    /// Spawned (or about to be), not yet answering `initialize`.
    Starting,
    /// Initialized and passing health checks.
    Ready,
    /// SIGTERM sent; finishing running turns.
    Draining,
    /// Failed; waiting before the next start.
    Backoff,
    /// Crash-looped; held down for a cool-down.
    Quarantined,
    /// No process, none wanted.
    Stopped,
}

impl WorkerState {
    /// Every state, so each series exists (at zero) from the start.
    pub const ALL: [WorkerState; 6] = [
        WorkerState::Starting,
        WorkerState::Ready,
        WorkerState::Draining,
        WorkerState::Backoff,
        WorkerState::Quarantined,
        WorkerState::Stopped,
    ];

    /// The `state` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Starting => "starting",
            WorkerState::Ready => "ready",
            WorkerState::Draining => "draining",
            WorkerState::Backoff => "backoff",
            WorkerState::Quarantined => "quarantined",
            WorkerState::Stopped => "stopped",
        }
    }
}
