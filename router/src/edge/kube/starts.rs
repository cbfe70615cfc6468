//! One tenant's pod start on this edge, shared by all of its waiting sessions.
//!
//! Sessions of a tenant arrive together (a team's morning, a client reconnecting its tabs, a
//! hostile tenant opening its whole connection allowance at once), and each finds no pod. Left to
//! themselves each would post the pod (one `201`, the rest `409 AlreadyExists`), and each refused
//! or timed-out session would write its own Event: API load that grows with the tenant's
//! sessions, not with its pods. Here a tenant's sessions take turns at the create instead: one
//! is in flight at a time, the sessions queued behind it look at the view again (a `201` put the
//! pod there), and the answer it got stands for them for a while:
//!
//! - `409 AlreadyExists` (another edge made the pod, and the watch has not shown it yet): no
//!   further create until [`EXISTS_FOR`] has passed; the sessions wait on the watch.
//! - a transient failure: no further create before its back-off ends (one back-off per tenant,
//!   doubling across the sessions' tries, not one per session).
//! - a refusal (quota, PodSecurity, an invalid spec): every session already waiting when it came
//!   (queued behind the create, or waiting on the watch) is refused with the same cause, counted
//!   and written as an Event once. A session that arrives after it tries again (an operator who
//!   mended the namespace's policy expects the next connection to start): one create at a time
//!   still.
//!
//! A session's own deadline still bounds its wait, the queue for the create included. A session
//! that leaves (its client closed) while posting drops its create; the next in the queue looks
//! again, so nothing waits on a session that is gone. Entries exist only for tenants configured
//! at some point (a reload drops the others; a session racing it may put one back until the
//! next), so a tenant's name cannot grow the map.
//!
//! `StartTimeout` Events are likewise one per pod that did not become ready (and per
//! `start_timeout_secs` it stays so), however many sessions it refused; every refused session is
//! still counted in `codex_fleet_node_start_failures_total{reason="timeout"}`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::StartError;

/// How long a `409 AlreadyExists` stands for the tenant's sessions: the watch normally shows the
/// other edge's pod well within it; past it, one session posts again (and, should the pod have
/// gone meanwhile, creates it).
pub(super) const EXISTS_FOR: Duration = Duration::from_millis(500);

/// The tenants' starts on this edge.
#[derive(Default)]
pub(super) struct Starts {
    tenants: Mutex<HashMap<String, Arc<TenantStart>>>,
}

/// One tenant's: the create's turn, and what the last create got.
#[derive(Default)]
pub(super) struct TenantStart {
    /// Held around a create, so one is in flight; holds the last one's answer.
    pub(super) create: tokio::sync::Mutex<Option<Last>>,
    /// The last `StartTimeout` Event written: when, and about which pod.
    timeout_event: Mutex<Option<(Instant, Option<String>)>>,
}

/// What the tenant's last create got, and when.
#[derive(Debug, Clone)]
pub(super) struct Last {
    pub(super) at: Instant,
    pub(super) answer: Answer,
}

/// A create's answer, as it concerns the next session that finds no pod.
#[derive(Debug, Clone)]
pub(super) enum Answer {
    /// `201`: the pod is in the view (if it is no longer, it went away, and is made again).
    Created,
    /// `409`: it exists; the watch will show it.
    Exists,
    /// A transient failure: no create before `retry_at`; `base` is the back-off reached.
    Transient { retry_at: Instant, base: Duration },
    /// A refusal no retry changes.
    Refused(StartError),
}

/// What a session that finds no pod does next.
#[derive(Debug)]
pub(super) enum Next {
    /// Post the pod, backing off from `base` should that fail transiently.
    Post { base: Option<Duration> },
    /// Wait on the watch: a create's answer still stands.
    Wait,
    /// Be refused as the last create was.
    Fail(StartError),
}

// === impl Starts ===

impl Starts {
    /// `tenant`'s start, if `known` (a configured tenant).
    pub(super) fn of(&self, tenant: &str, known: bool) -> Option<Arc<TenantStart>> {
        let mut tenants = self.tenants.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = tenants.get(tenant) {
            return Some(s.clone());
        }
        if !known {
            return None;
        }
        let s = Arc::new(TenantStart::default());
        tenants.insert(tenant.to_owned(), s.clone());
        Some(s)
    }

    /// Keeps only the entries of tenants `keep` says are configured.
    pub(super) fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|t, _| keep(t));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

// === impl TenantStart ===

impl TenantStart {
    /// Whether a `StartTimeout` Event about `pod` is due now: none yet, the last was about
    /// another pod, or it was `every` ago or longer (a pod late again, days after it served, is
    /// news; the sessions of one late start are not).
    pub(super) fn timeout_event_due(
        &self,
        pod: Option<&str>,
        now: Instant,
        every: Duration,
    ) -> bool {
        let mut last = self
            .timeout_event
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let due = match &*last {
            None => true,
            Some((at, about)) => {
                about.as_deref() != pod || now.saturating_duration_since(*at) >= every
            }
        };
        if due {
            *last = Some((now, pod.map(str::to_owned)));
        }
        due
    }
}

// === impl Last ===

impl Last {
    /// What a session that finds no pod does, `now`, after this answer; it has waited for the
    /// tenant's pod since `waiting_since` (a refusal stands for the sessions already waiting).
    pub(super) fn next(&self, now: Instant, waiting_since: Instant) -> Next {
        let since = now.saturating_duration_since(self.at);
        match &self.answer {
            Answer::Created => Next::Post { base: None },
            Answer::Exists if since < EXISTS_FOR => Next::Wait,
            Answer::Exists => Next::Post { base: None },
            Answer::Transient { retry_at, .. } if now < *retry_at => Next::Wait,
            Answer::Transient { base, .. } => Next::Post { base: Some(*base) },
            Answer::Refused(e) if waiting_since <= self.at => Next::Fail(e.clone()),
            Answer::Refused(_) => Next::Post { base: None },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last(at: Instant, answer: Answer) -> Last {
        Last { at, answer }
    }

    #[test]
    fn an_answer_stands_for_the_sessions_behind_it_for_a_while_then_one_posts_again() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // A pod created and gone from the view since: made again at once.
        assert!(matches!(
            last(t0, Answer::Created).next(t0, t0),
            Next::Post { base: None }
        ));
        // Another edge's pod, not yet in the view: wait for the watch, then look once more.
        assert!(matches!(
            last(t0, Answer::Exists).next(t0 + ms(499), t0),
            Next::Wait
        ));
        assert!(matches!(
            last(t0, Answer::Exists).next(t0 + EXISTS_FOR, t0),
            Next::Post { base: None }
        ));
        // A transient failure: nobody posts before its back-off ends; then the back-off goes on
        // from where it was.
        let transient = Answer::Transient {
            retry_at: t0 + ms(300),
            base: ms(250),
        };
        assert!(matches!(
            last(t0, transient.clone()).next(t0 + ms(299), t0),
            Next::Wait
        ));
        assert!(matches!(
            last(t0, transient).next(t0 + ms(300), t0),
            Next::Post { base: Some(b) } if b == ms(250)
        ));
        // A refusal: the same answer for the sessions already waiting (however long), a new try
        // for one that came after it.
        let refused = Answer::Refused(StartError::Refused {
            reason: "forbidden",
            cause: "403 quota".into(),
        });
        for waiting_since in [t0 - ms(5000), t0] {
            assert!(matches!(
                last(t0, refused.clone()).next(t0 + ms(10), waiting_since),
                Next::Fail(StartError::Refused {
                    reason: "forbidden",
                    ..
                })
            ));
        }
        assert!(matches!(
            last(t0, refused).next(t0 + ms(10), t0 + ms(1)),
            Next::Post { base: None }
        ));
    }

    #[test]
    fn one_start_timeout_event_per_late_pod_and_period() {
        let s = TenantStart::default();
        let t0 = Instant::now();
        let every = Duration::from_secs(120);
        // No pod yet (the API server refuses or is down): once per period.
        assert!(s.timeout_event_due(None, t0, every));
        assert!(!s.timeout_event_due(None, t0 + Duration::from_secs(119), every));
        assert!(s.timeout_event_due(None, t0 + every, every));
        // A pod that does not become ready: once per period, however many sessions it refuses.
        assert!(s.timeout_event_due(Some("uid-1"), t0 + every, every));
        for later in [1, 60, 119] {
            assert!(!s.timeout_event_due(
                Some("uid-1"),
                t0 + every + Duration::from_secs(later),
                every
            ));
        }
        // Late again, a period on (or days later, after it served): news again.
        assert!(s.timeout_event_due(Some("uid-1"), t0 + every * 2, every));
        // Its replacement is news at once.
        assert!(s.timeout_event_due(
            Some("uid-2"),
            t0 + every * 2 + Duration::from_secs(1),
            every
        ));
    }

    #[test]
    fn only_configured_tenants_get_an_entry_and_a_reload_drops_the_rest() {
        let starts = Starts::default();
        for n in 0..1000 {
            assert!(starts.of(&format!("made-up-{n}"), false).is_none());
        }
        assert_eq!(starts.len(), 0);
        let a = starts.of("acme", true).expect("configured");
        assert!(Arc::ptr_eq(&a, &starts.of("acme", true).expect("the same")));
        starts.of("beta", true).expect("configured");
        starts.retain(|t| t == "beta");
        assert_eq!(starts.len(), 1);
        assert!(starts.of("acme", false).is_none(), "dropped on reload");
    }
}
