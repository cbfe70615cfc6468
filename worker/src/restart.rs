//! Restart policy: exponential backoff with jitter, and quarantine of crash-looping slots.

use std::collections::VecDeque;

use tokio::time::{Duration, Instant};

/// Failures within this window count towards a crash loop.
pub const CRASH_LOOP_WINDOW: Duration = Duration::from_secs(60);
/// This many failures within [`CRASH_LOOP_WINDOW`] quarantine a slot.
pub const CRASH_LOOP_FAILURES: usize = 5;
/// How long a quarantined slot stays down.
pub const QUARANTINE: Duration = Duration::from_secs(60);

/// The knobs of the restart policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Backoff after the first failure (before jitter).
    pub backoff_initial: Duration,
    /// Upper bound of the backoff (before jitter).
    pub backoff_max: Duration,
    /// Failures counted for crash-loop detection are those within this window.
    pub crash_loop_window: Duration,
    /// This many failures within the window quarantine the slot.
    pub crash_loop_failures: usize,
    /// How long a quarantine lasts.
    pub quarantine: Duration,
}

/// What to do after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartDecision {
    /// Wait this long, then start again if the slot is still needed.
    Backoff(Duration),
    /// Crash loop: keep the slot down for this long.
    Quarantine(Duration),
}

// === impl RestartPolicy ===

impl RestartPolicy {
    /// A policy with the given backoff bounds and the default crash-loop rule (5 in 60 s → 60 s).
    pub fn new(backoff_initial: Duration, backoff_max: Duration) -> Self {
        Self {
            backoff_initial,
            backoff_max,
            crash_loop_window: CRASH_LOOP_WINDOW,
            crash_loop_failures: CRASH_LOOP_FAILURES,
            quarantine: QUARANTINE,
        }
    }

    /// Backoff before retry number `attempt` (0-based), with "equal jitter":
    /// half the exponential delay is fixed, `jitter` (in `[0, 1)`) scales the other half.
    pub fn backoff(&self, attempt: u32, jitter: f64) -> Duration {
        let factor = 2u32.saturating_pow(attempt.min(31));
        let base = self
            .backoff_initial
            .saturating_mul(factor)
            .min(self.backoff_max);
        let half = base / 2;
        half + half.mul_f64(jitter.clamp(0.0, 1.0))
    }
}

/// Recent failures of one slot; feed it every failure and follow its decision.
#[derive(Debug, Default)]
pub struct RestartTracker {
    failures: VecDeque<Instant>,
    /// The slot came out of quarantine and has not yet run a worker that got ready: the next
    /// failure is the failed probe, and quarantines again at once.
    probing: bool,
}

// === impl RestartTracker ===

impl RestartTracker {
    /// Records a failure at `now` and decides the next step.
    pub fn record_failure(
        &mut self,
        policy: &RestartPolicy,
        now: Instant,
        jitter: f64,
    ) -> RestartDecision {
        self.prune(policy, now);
        self.failures.push_back(now);
        if self.probing || self.failures.len() >= policy.crash_loop_failures {
            self.failures.clear();
            self.probing = true;
            return RestartDecision::Quarantine(policy.quarantine);
        }
        let attempt = u32::try_from(self.failures.len() - 1).unwrap_or(u32::MAX);
        RestartDecision::Backoff(policy.backoff(attempt, jitter))
    }

    /// A worker of the slot got ready: a quarantine probe succeeded.
    pub fn record_ready(&mut self) {
        self.probing = false;
    }

    /// Failures still inside the crash-loop window at `now`.
    pub fn recent_failures(&mut self, policy: &RestartPolicy, now: Instant) -> usize {
        self.prune(policy, now);
        self.failures.len()
    }

    fn prune(&mut self, policy: &RestartPolicy, now: Instant) {
        while let Some(&oldest) = self.failures.front() {
            if now.saturating_duration_since(oldest) < policy.crash_loop_window {
                break;
            }
            self.failures.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::{advance, sleep};

    fn policy() -> RestartPolicy {
        RestartPolicy::new(Duration::from_millis(100), Duration::from_secs(2))
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let p = policy();
        assert_eq!(p.backoff(0, 1.0), Duration::from_millis(100));
        assert_eq!(p.backoff(1, 1.0), Duration::from_millis(200));
        assert_eq!(p.backoff(3, 1.0), Duration::from_millis(800));
        assert_eq!(p.backoff(10, 1.0), Duration::from_secs(2));
        assert_eq!(p.backoff(u32::MAX, 1.0), Duration::from_secs(2));
    }

    #[test]
    fn jitter_stays_within_half_and_full() {
        let p = policy();
        assert_eq!(p.backoff(2, 0.0), Duration::from_millis(200));
        let mid = p.backoff(2, 0.5);
        assert!(mid > Duration::from_millis(200) && mid < Duration::from_millis(400));
        assert_eq!(p.backoff(2, 7.0), Duration::from_millis(400));
    }

    #[tokio::test(start_paused = true)]
    async fn five_quick_failures_quarantine() {
        let p = policy();
        let mut t = RestartTracker::default();
        let mut waits = Vec::new();
        for _ in 0..4 {
            match t.record_failure(&p, Instant::now(), 1.0) {
                RestartDecision::Backoff(d) => {
                    waits.push(d);
                    sleep(d).await;
                }
                other => panic!("expected backoff, got {other:?}"),
            }
        }
        assert_eq!(waits[0], Duration::from_millis(100));
        assert_eq!(waits[3], Duration::from_millis(800));
        assert_eq!(
            t.record_failure(&p, Instant::now(), 1.0),
            RestartDecision::Quarantine(QUARANTINE)
        );
        // After quarantine one probe start: its failure quarantines again at once.
        assert_eq!(t.recent_failures(&p, Instant::now()), 0);
        assert_eq!(
            t.record_failure(&p, Instant::now(), 1.0),
            RestartDecision::Quarantine(QUARANTINE)
        );
        // A probe that gets ready ends it; the count starts over.
        t.record_ready();
        assert_eq!(
            t.record_failure(&p, Instant::now(), 1.0),
            RestartDecision::Backoff(Duration::from_millis(100))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn failures_outside_the_window_are_forgotten() {
        let p = policy();
        let mut t = RestartTracker::default();
        for _ in 0..4 {
            t.record_failure(&p, Instant::now(), 0.0);
            advance(Duration::from_secs(1)).await;
        }
        assert_eq!(t.recent_failures(&p, Instant::now()), 4);
        advance(CRASH_LOOP_WINDOW).await;
        assert_eq!(t.recent_failures(&p, Instant::now()), 0);
        // A fifth failure long after the others is the first of a new series.
        assert_eq!(
            t.record_failure(&p, Instant::now(), 1.0),
            RestartDecision::Backoff(Duration::from_millis(100))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn slow_failures_never_quarantine() {
        let p = policy();
        let mut t = RestartTracker::default();
        for _ in 0..20 {
            let d = t.record_failure(&p, Instant::now(), 1.0);
            assert!(matches!(d, RestartDecision::Backoff(_)), "{d:?}");
            advance(Duration::from_secs(16)).await;
        }
    }
}
