//! How many of a tenant's host-access denials get an audit record of their own.
//!
//! Every tenant's records share one audit log (one queue, one file rotated by size). A tenant
//! sending denied requests at its full request rate would otherwise write a record for each
//! (200 a second at the default rate): it would fill the queue, so that another tenant's approval
//! decisions were dropped, and turn the file over every quarter of an hour, so that another
//! tenant's records were rotated away. So a tenant's denials are recorded one by one up to
//! [`PER_SECOND`] a second (after a burst of [`BURST`]); the rest are counted by the session
//! that was denied, and its count goes in its next denial record (`"suppressed": n`) or, if it
//! has none, in an `access.denied.suppressed` record when it ends: each count is under the
//! subject whose denials it counts, and none is lost when the denials stop.

use std::num::NonZeroU32;

use governor::{Quota, RateLimiter};

use crate::admission::{DirectLimiter, TokioClock};

/// Denial records a tenant gets a second, after [`BURST`].
pub const PER_SECOND: NonZeroU32 = NonZeroU32::new(10).unwrap();
/// Denial records a tenant may get at once.
pub const BURST: NonZeroU32 = NonZeroU32::new(100).unwrap();

/// One tenant's allowance of denial records.
pub struct DenialRecords {
    limiter: DirectLimiter,
}

impl DenialRecords {
    /// A full allowance.
    pub fn new() -> DenialRecords {
        let quota = Quota::per_second(PER_SECOND).allow_burst(BURST);
        DenialRecords {
            limiter: RateLimiter::direct_with_clock(quota, TokioClock::new()),
        }
    }

    /// A denial: whether it gets a record of its own (else its session only counts it).
    pub fn admit(&self) -> bool {
        self.limiter.check().is_ok()
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
    async fn a_burst_is_recorded_then_a_tenth_of_a_second_each() {
        let d = DenialRecords::new();
        for _ in 0..BURST.get() {
            assert!(d.admit());
        }
        for _ in 0..500 {
            assert!(!d.admit());
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(d.admit());
        assert!(!d.admit());
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(d.admit());
    }
}
