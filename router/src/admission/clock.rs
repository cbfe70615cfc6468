//! A governor clock that reads tokio's time, so limiters follow `tokio::time::pause()` in tests.

use governor::clock::Clock;
use governor::nanos::Nanos;
use tokio::time::Instant;

/// Nanoseconds since the clock was made, measured with [`tokio::time::Instant`].
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    start: Instant,
}

impl TokioClock {
    /// A clock whose zero is now.
    pub fn new() -> TokioClock {
        TokioClock {
            start: Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::new()
    }
}

impl Clock for TokioClock {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        Nanos::from(self.start.elapsed())
    }
}
