//! The session's side of the router's metrics: the series whose labels only the session knows
//! (how sessions end, which per-connection notifications a replay drops, what a fan-out misses)
//! exist from the start, at zero, so dashboards and alerts read 0 rather than no data.

use super::{End, FanOutMethod, FanOutMissing, PER_CONNECTION};
use crate::metrics::RouterMetrics;

/// Creates every session-labelled series of `m` at zero.
pub(crate) fn init_series(m: &RouterMetrics) {
    for end in End::ALL {
        m.sessions_closed.with_label_values(&[end.label()]);
    }
    for method in PER_CONNECTION {
        m.replayed_notifications_dropped
            .with_label_values(&[method]);
    }
    for merge in FanOutMethod::ALL {
        for why in FanOutMissing::ALL {
            m.fanout_missing
                .with_label_values(&[merge.as_str(), why.as_str()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way a session ends is a series at zero before the first session ends.
    #[test]
    fn every_end_and_fan_out_miss_exists_at_zero() {
        let registry = prometheus::Registry::new();
        let m = RouterMetrics::register(&registry).unwrap();
        init_series(&m);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        for end in End::ALL {
            let series = format!(
                "{}{{reason=\"{}\"}} 0",
                crate::metrics::names::SESSIONS_CLOSED,
                end.label()
            );
            assert!(text.lines().any(|l| l == series), "{series} missing");
        }
        let misses = text
            .lines()
            .filter(|l| l.starts_with("codex_fleet_fanout_missing") && l.ends_with(" 0"))
            .count();
        assert_eq!(misses, FanOutMethod::ALL.len() * FanOutMissing::ALL.len());
    }
}
