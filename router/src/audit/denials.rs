//! How many of a tenant's host-access denials get an audit record of their own.
//!
//! Every tenant's records share one audit log (one queue, one file rotated by size). A tenant
//! sending denied requests at its full request rate would otherwise write a record for each
//! (200 a second at the default rate): it would fill the queue, so that another tenant's approval
//! decisions were dropped, and turn the file over every quarter of an hour, so that another
//! tenant's records were rotated away. So a tenant's denials are recorded one by one up to
//! [`PER_SECOND`] a second (after a burst of [`BURST`]); the rest are counted, and the count goes
//! in the tenant's next denial record (`"suppressed": n`), so none goes unrecorded for long while
//! the tenant keeps being denied.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use crate::admission::TokioClock;

/// Denial records a tenant gets a second, after [`BURST`].
pub const PER_SECOND: NonZeroU32 = NonZeroU32::new(10).unwrap();
/// Denial records a tenant may get at once.
pub const BURST: NonZeroU32 = NonZeroU32::new(100).unwrap();

/// One tenant's allowance of denial records.
pub struct DenialRecords {
    limiter: RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Nanos>>,
    suppressed: AtomicU64,
}

impl DenialRecords {
    /// A full allowance.
    pub fn new() -> DenialRecords {
        let quota = Quota::per_second(PER_SECOND).allow_burst(BURST);
        DenialRecords {
            limiter: RateLimiter::direct_with_clock(quota, TokioClock::new()),
            suppressed: AtomicU64::new(0),
        }
    }

    /// A denial: `Some(n)` when it gets a record of its own, `n` being how many of the tenant's
    /// denials since the last record did not; `None` when it is only counted.
    pub fn admit(&self) -> Option<u64> {
        if self.limiter.check().is_ok() {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

impl Default for DenialRecords {
    fn default() -> Self {
        DenialRecords::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_recorded_then_a_tenth_of_a_second_each_and_the_rest_counted() {
        let d = DenialRecords::new();
        for _ in 0..BURST.get() {
            assert_eq!(d.admit(), Some(0));
        }
        for _ in 0..500 {
            assert_eq!(d.admit(), None);
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(d.admit(), Some(500), "the next record carries the count");
        assert_eq!(d.admit(), None);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(d.admit(), Some(1));
    }
}
