//! What a failed API request means for a waiting session: a transient error is retried with
//! jittered back-off, a refusal no retry can change ends the start at once with its cause, told
//! to the client bounded and without control characters.

use std::time::Duration;

/// Back-off between creates failed by a transient API error while a session waits: doubling
/// from the first to the most, each with up to half again of random jitter, so the edges
/// refused together do not return together.
pub(super) const CREATE_BACKOFF_FIRST: Duration = Duration::from_millis(250);

pub(super) const CREATE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The longest cause a refused client is told (the API server's message, bounded).
pub(super) const CAUSE_MAX: usize = 300;

/// Why no pod could be offered.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StartError {
    /// The pod was not ready within `start_timeout_secs`.
    #[error("the tenant's node is still starting after {0:?}")]
    Timeout(Duration),
    /// The API server refused the tenant's volume or pod for a reason retrying cannot change
    /// (a full quota, PodSecurity admission, an invalid spec).
    #[error("the tenant's node cannot start ({reason}): {cause}")]
    Refused {
        /// `forbidden` or `invalid` (a series of `codex_fleet_node_start_failures_total`).
        reason: &'static str,
        /// What the API server said, bounded and without control characters.
        cause: String,
    },
}

/// What a failed API request means for a waiting session.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// Retrying may succeed (5xx, 429, 401, a connection error, a timeout).
    Transient,
    /// It will not (`forbidden`: 403; `invalid`: 400, 404, 422), with its cause.
    Permanent(&'static str, String),
}

/// Sorts an API error: what a retry can change and what it cannot.
pub(super) fn classify(e: &::kube::Error) -> Failure {
    match e {
        ::kube::Error::Api(s) => {
            let reason = match s.code {
                403 => "forbidden",
                400 | 404 | 422 => "invalid",
                _ => return Failure::Transient,
            };
            Failure::Permanent(reason, cause(&format!("{} {}", s.code, s.message)))
        }
        // Connection errors, timeouts, an answer that did not parse: another try may do.
        _ => Failure::Transient,
    }
}

/// Why a tenant's volume or pod was not created.
#[derive(Debug, thiserror::Error)]
pub(super) enum CreateError {
    /// The API server's answer, or no answer.
    #[error("{0}")]
    Api(#[from] ::kube::Error),
    /// The spec could not be built from the template (our side: no retry mends it).
    #[error("the tenant's pod spec: {0:#}")]
    Spec(anyhow::Error),
    /// No answer within the session's deadline.
    #[error("no answer from the API server before the start timeout")]
    Timeout,
}

impl CreateError {
    pub(super) fn failure(&self) -> Failure {
        match self {
            CreateError::Api(e) => classify(e),
            CreateError::Spec(e) => Failure::Permanent("invalid", cause(&format!("{e:#}"))),
            CreateError::Timeout => Failure::Transient,
        }
    }
}

/// An API server's message as a client may read it: control characters as spaces, at most
/// [`CAUSE_MAX`] bytes (cut on a character boundary, marked).
pub(super) fn cause(message: &str) -> String {
    let clean: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.len() <= CAUSE_MAX {
        return clean;
    }
    let mut end = CAUSE_MAX;
    while !clean.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &clean[..end])
}

/// The next back-off after `prev` (none yet: the first), with its jitter.
pub(super) fn create_backoff(prev: Option<Duration>) -> (Duration, Duration) {
    use rand::Rng;
    let base = prev.map_or(CREATE_BACKOFF_FIRST, |p| (p * 2).min(CREATE_BACKOFF_MAX));
    let jitter_ms = rand::rng().random_range(0..=base.as_millis() as u64 / 2);
    (base, base + Duration::from_millis(jitter_ms))
}

/// An error with its causes, outermost first: kube's connection errors say only "client
/// error (Connect)" themselves, and the cause (a certificate the CA does not sign, a refused
/// connection) is what an operator reading `/readyz` needs.
pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

pub(super) fn already_exists(e: &::kube::Error) -> bool {
    matches!(e, ::kube::Error::Api(s) if s.code == 409)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    pub(super) fn api(code: u16, message: &str) -> ::kube::Error {
        ::kube::Error::Api(Box::new(
            serde_json::from_value::<::kube::core::Status>(json!({
                "status": "Failure", "message": message, "reason": "", "code": code,
            }))
            .expect("a Status"),
        ))
    }

    #[test]
    pub(super) fn api_errors_are_sorted_into_what_a_retry_can_change_and_what_it_cannot() {
        let quota = "pods \"codex-fleet-node-acme\" is forbidden: exceeded quota: compute";
        assert_eq!(
            classify(&api(403, quota)),
            Failure::Permanent("forbidden", format!("403 {quota}"))
        );
        for code in [400, 404, 422] {
            assert!(
                matches!(classify(&api(code, "x")), Failure::Permanent("invalid", _)),
                "{code}"
            );
        }
        for code in [401, 408, 429, 500, 502, 503, 504] {
            assert_eq!(classify(&api(code, "x")), Failure::Transient, "{code}");
        }
        // A cause is bounded and cannot break a line.
        let long = format!("line\none\r{}", "é".repeat(400));
        let Failure::Permanent(_, c) = classify(&api(422, &long)) else {
            panic!("permanent");
        };
        assert!(!c.contains('\n') && !c.contains('\r'), "{c}");
        assert!(c.len() <= CAUSE_MAX + '…'.len_utf8(), "{}", c.len());
        assert!(c.ends_with('…'));
    }

    #[test]
    pub(super) fn an_error_is_written_with_its_causes_once_each() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Outer(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("{0}")]
        struct Same(#[source] std::io::Error);
        let cert = || std::io::Error::other("invalid peer certificate: UnknownIssuer");
        assert_eq!(
            chain(&Outer(cert())),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
        // A cause its error already repeats is not written twice.
        assert_eq!(
            chain(&Same(cert())),
            "invalid peer certificate: UnknownIssuer"
        );
    }

    #[test]
    pub(super) fn the_create_backoff_doubles_to_its_bound_with_jitter() {
        let mut prev = None;
        let mut bases = Vec::new();
        for _ in 0..8 {
            let (base, sleep) = create_backoff(prev);
            assert!(
                sleep >= base && sleep <= base + base / 2,
                "{base:?} {sleep:?}"
            );
            bases.push(base.as_millis());
            prev = Some(base);
        }
        assert_eq!(bases, [250, 500, 1000, 2000, 4000, 5000, 5000, 5000]);
    }
}
