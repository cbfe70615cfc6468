//! What a refused client learns: scope, reason and a jittered time to come back, as JSON-RPC
//! `-32001` data or as an HTTP status with `Retry-After`; and, read back by an edge, what a
//! codex-fleet node answered an upgrade with (its refusal, or that it is draining).

use std::time::Duration;

use rand::Rng;
use serde::Serialize;
use serde_json::{Map, Value};
// The tests (`use super::*`) build expected frames with it.
#[cfg(test)]
use serde_json::json;

pub use proto::error::OVERLOADED_MESSAGE;

use proto::error::codes;
use proto::rpc::{Frame, RequestId};

/// The longest wait an upstream's refusal is passed on with: as the edge reads it
/// ([`Rejection::from_http`]), and as a static edge passes it on ([`bounded_refusal_header`],
/// [`bounded_retry_after`], [`bounded_refusal_body`]).
const MAX_UPSTREAM_RETRY_MS: u64 = 3_600_000;

/// The header on every codex-fleet refusal at the upgrade that says what it is, for an edge to
/// read without parsing the body's text: `overloaded; scope=…; reason=…; retry-after-ms=N`
/// ([`Rejection::http_header`]), or [`DRAINING_REFUSAL`].
pub const REFUSAL_HEADER: &str = "codex-fleet-refusal";

/// The first word of [`REFUSAL_HEADER`] on an admission refusal.
const OVERLOADED_REFUSAL: &str = "overloaded";

/// The [`REFUSAL_HEADER`] of the 503 an upgrade gets while codex-fleet drains (the door's
/// draining answer): what an edge reads to know a node is going ([`is_draining_answer`]).
pub const DRAINING_REFUSAL: &str = "draining";

/// The body of that answer, which an edge's link reads from a node older than
/// [`DRAINING_REFUSAL`]: the node is going, and a Kubernetes session looks for the tenant's next
/// pod.
pub const DRAINING_BODY: &str = "codex-fleet is shutting down";

/// Largest share of `retry_after` added as jitter (1/4 = up to +25 %).
const JITTER_DIVISOR: u64 = 4;

/// What was exhausted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Scope {
    /// This connection (its frame rate, or its source address before authentication).
    Connection,
    /// The client's tenant (its rates and caps).
    Tenant,
    /// The worker that would serve the request.
    Worker,
    /// codex-fleet as a whole.
    Fleet,
}

/// Why, in one word a client can switch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Reason {
    /// Too many upgrade attempts from one source address.
    HandshakeRateLimited,
    /// Too many frames on this connection.
    ConnectionRateLimited,
    /// Too many requests from this tenant.
    TenantRateLimited,
    /// Too many `turn/start` from this tenant.
    TurnRateLimited,
    /// The tenant already runs its maximum of turns.
    ActiveTurnLimit,
    /// The worker has its maximum of requests in flight.
    WorkerBusy,
    /// The worker itself answered `-32001`.
    WorkerOverloaded,
    /// Connection cap of the tenant (scope tenant) or of codex-fleet (scope fleet).
    TooManyConnections,
    /// This connection already has its maximum of requests awaiting an answer.
    TooManyRequestsInFlight,
    /// No worker of the tenant could be started (caps, or start failures).
    NoWorkerAvailable,
    /// The chosen worker did not accept a connection.
    WorkerUnreachable,
    /// Every worker slot of the fleet (`workers.max_workers`) is taken by other tenants.
    FleetWorkerLimit,
    /// The edge cannot reach the node that holds the tenant.
    NodeUnavailable,
    /// The tenant's node (its pod, on Kubernetes) is still starting.
    NodeStarting,
    /// The tenant's node cannot be started (the API server refused its pod or volume for a
    /// reason a retry cannot change; the error's `data.cause` says which).
    NodeStartFailed,
    /// The tenant's node refused the session under a limit this edge has no name for (a newer
    /// node's, while a rolling upgrade runs them beside older edges); the node's status and wait
    /// stand, so its client waits as the node asked rather than reconnecting at once.
    NodeOverloaded,
}

impl Scope {
    /// Every scope.
    pub const ALL: [Scope; 4] = [
        Scope::Connection,
        Scope::Tenant,
        Scope::Worker,
        Scope::Fleet,
    ];

    /// The wire spelling, e.g. `"tenant"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Connection => "connection",
            Scope::Tenant => "tenant",
            Scope::Worker => "worker",
            Scope::Fleet => "fleet",
        }
    }
}

impl Reason {
    /// Every reason, so each series exists (at zero) from the start.
    pub const ALL: [Reason; 16] = [
        Reason::HandshakeRateLimited,
        Reason::ConnectionRateLimited,
        Reason::TenantRateLimited,
        Reason::TurnRateLimited,
        Reason::ActiveTurnLimit,
        Reason::WorkerBusy,
        Reason::WorkerOverloaded,
        Reason::TooManyConnections,
        Reason::TooManyRequestsInFlight,
        Reason::NoWorkerAvailable,
        Reason::WorkerUnreachable,
        Reason::FleetWorkerLimit,
        Reason::NodeUnavailable,
        Reason::NodeStarting,
        Reason::NodeStartFailed,
        Reason::NodeOverloaded,
    ];

    /// The wire spelling, e.g. `"tenantRateLimited"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::HandshakeRateLimited => "handshakeRateLimited",
            Reason::ConnectionRateLimited => "connectionRateLimited",
            Reason::TenantRateLimited => "tenantRateLimited",
            Reason::TurnRateLimited => "turnRateLimited",
            Reason::ActiveTurnLimit => "activeTurnLimit",
            Reason::WorkerBusy => "workerBusy",
            Reason::WorkerOverloaded => "workerOverloaded",
            Reason::TooManyConnections => "tooManyConnections",
            Reason::TooManyRequestsInFlight => "tooManyRequestsInFlight",
            Reason::NoWorkerAvailable => "noWorkerAvailable",
            Reason::WorkerUnreachable => "workerUnreachable",
            Reason::FleetWorkerLimit => "fleetWorkerLimit",
            Reason::NodeUnavailable => "nodeUnavailable",
            Reason::NodeStarting => "nodeStarting",
            Reason::NodeStartFailed => "nodeStartFailed",
            Reason::NodeOverloaded => "nodeOverloaded",
        }
    }
}

/// Whether a rate or a cap said no; decides the HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Rate,
    Cap,
}

/// A refusal. Its jittered retry time is fixed when it is made, so the JSON-RPC data and the
/// HTTP `Retry-After` of one refusal agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// What was exhausted.
    pub scope: Scope,
    /// Why.
    pub reason: Reason,
    /// When the limiter would say yes (rates), or the configured back-off (caps); unjittered.
    pub retry_after: Duration,
    kind: Kind,
    retry_after_ms: u64,
}

impl Rejection {
    /// A rate limiter said no; `wait` is how long until it would say yes.
    pub fn rate(scope: Scope, reason: Reason, wait: Duration) -> Rejection {
        Rejection::new(Kind::Rate, scope, reason, wait)
    }

    /// A cap said no; `retry_after` is the suggested back-off.
    pub fn cap(scope: Scope, reason: Reason, retry_after: Duration) -> Rejection {
        Rejection::new(Kind::Cap, scope, reason, retry_after)
    }

    fn new(kind: Kind, scope: Scope, reason: Reason, retry_after: Duration) -> Rejection {
        Rejection {
            scope,
            reason,
            retry_after,
            kind,
            retry_after_ms: jittered_ms(retry_after, &mut rand::rng()),
        }
    }

    /// `retry_after` in whole milliseconds (rounded up, at least 1) plus 0–25 % random jitter,
    /// so the clients refused together do not all return together.
    pub fn retry_after_ms_jittered(&self) -> u64 {
        self.retry_after_ms
    }

    /// The `data` of the `-32001` error:
    /// `{"retryAfterMs": N, "scope": "connection"|"tenant"|"worker"|"fleet", "reason": "…"}`.
    pub fn to_error_data(&self) -> Value {
        proto::error::overloaded_data(self.retry_after_ms, self.scope, self.reason)
    }

    /// The whole JSON-RPC error response to request `id`.
    pub fn to_error_response(&self, id: &RequestId) -> String {
        proto::error::overloaded_response(id, self.to_error_data())
    }

    /// The status for a refusal at the HTTP upgrade: 429 for rates, 503 for caps.
    pub fn http_status(&self) -> u16 {
        match self.kind {
            Kind::Rate => 429,
            Kind::Cap => 503,
        }
    }

    /// The `Retry-After` header value: the jittered wait in whole seconds, rounded up.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after_ms.div_ceil(1000)
    }

    /// The body of the HTTP refusal at the upgrade, which [`Rejection::from_http`] reads back.
    pub fn http_body(&self) -> String {
        format!(
            "{OVERLOADED_MESSAGE} (scope {}, reason {}); retry after {} ms",
            self.scope.as_str(),
            self.reason.as_str(),
            self.retry_after_ms
        )
    }

    /// The value of [`REFUSAL_HEADER`] on the HTTP refusal at the upgrade, which
    /// [`Rejection::from_http`] reads back.
    pub fn http_header(&self) -> String {
        format!(
            "{OVERLOADED_REFUSAL}; scope={}; reason={}; retry-after-ms={}",
            self.scope.as_str(),
            self.reason.as_str(),
            self.retry_after_ms
        )
    }

    /// The refusal a codex-fleet upstream (a node, to an edge's link) answered an upgrade with:
    /// its `status`, its [`REFUSAL_HEADER`] when it has one, and its body. The header alone
    /// decides when present; a node from before the header is read by the body
    /// [`Rejection::http_body`] wrote. The jittered wait it sent stands for both waits. `None`
    /// for any other answer.
    ///
    /// A header's reason this edge does not know (a newer node's) is still the node's refusal,
    /// with its status and wait, as [`Reason::NodeOverloaded`] under the node's scope; an unknown
    /// scope makes it scope `worker` (the node, as for the edge's other node failures) and
    /// reason `nodeOverloaded` whatever the reason, so no stand-in pairs an unknown scope with a
    /// reason. (A node's known scope and known reason are passed on as it paired them.)
    /// Read as no refusal, the client would be told the node went away and reconnect at once,
    /// to the node that is refusing it. A body is read strictly: only nodes older than the
    /// header send it alone, and they name nothing this edge does not know.
    pub fn from_http(status: u16, header: Option<&str>, body: &str) -> Option<Rejection> {
        let kind = match status {
            429 => Kind::Rate,
            503 => Kind::Cap,
            _ => return None,
        };
        let ((scope, reason, ms), by_header) = match header {
            Some(h) => (parse_refusal_header(h)?, true),
            None => (parse_refusal_body(body)?, false),
        };
        // At most an hour: what a client is told to wait stays sane whatever the node says.
        let ms = ms.min(MAX_UPSTREAM_RETRY_MS);
        let scope = Scope::ALL.into_iter().find(|s| s.as_str() == scope);
        let reason = Reason::ALL.into_iter().find(|r| r.as_str() == reason);
        let (scope, reason) = match (scope, reason) {
            (Some(s), Some(r)) => (s, r),
            _ if !by_header => return None,
            (Some(s), None) => (s, Reason::NodeOverloaded),
            (None, _) => (Scope::Worker, Reason::NodeOverloaded),
        };
        Some(Rejection {
            scope,
            reason,
            retry_after: Duration::from_millis(ms),
            kind,
            retry_after_ms: ms,
        })
    }
}

/// Whether a codex-fleet upstream (a node, to an edge's link) answered an upgrade that it is
/// draining: a 503 with [`DRAINING_REFUSAL`] as its [`REFUSAL_HEADER`]'s first word (a newer
/// node's fields after it are not this edge's to judge), or, from a node older than the header,
/// [`DRAINING_BODY`]. As in [`Rejection::from_http`], the header alone decides when present. Never
/// true of an answer `from_http` reads as a refusal.
pub fn is_draining_answer(status: u16, header: Option<&str>, body: &str) -> bool {
    status == 503
        && match header {
            Some(h) => refusal_kind(h) == DRAINING_REFUSAL,
            None => body == DRAINING_BODY,
        }
}

/// The first word of a [`REFUSAL_HEADER`] value (`overloaded`, `draining`): what the answer is.
fn refusal_kind(header: &str) -> &str {
    header.split(';').next().unwrap_or_default().trim()
}

/// `overloaded; scope=S; reason=R; retry-after-ms=N` into its three values. Fields in any order,
/// and fields it does not know ignored, so a newer node may add some without older edges
/// misreading its refusals.
fn parse_refusal_header(h: &str) -> Option<(&str, &str, u64)> {
    if refusal_kind(h) != OVERLOADED_REFUSAL {
        return None;
    }
    let (mut scope, mut reason, mut ms) = (None, None, None);
    for field in h.split(';').skip(1) {
        match field.trim().split_once('=') {
            Some(("scope", v)) => scope = Some(v),
            Some(("reason", v)) => reason = Some(v),
            Some(("retry-after-ms", v)) => ms = Some(wait_ms(v)?),
            _ => {}
        }
    }
    Some((scope?, reason?, ms?))
}

/// [`Rejection::http_body`]'s text into its three values.
fn parse_refusal_body(body: &str) -> Option<(&str, &str, u64)> {
    let rest = body
        .strip_prefix(OVERLOADED_MESSAGE)?
        .strip_prefix(" (scope ")?;
    let (scope, rest) = rest.split_once(", reason ")?;
    let (reason, rest) = rest.split_once("); retry after ")?;
    let ms = wait_ms(rest.strip_suffix(" ms")?)?;
    Some((scope, reason, ms))
}

/// A codex-fleet upstream's [`REFUSAL_HEADER`] as an edge passes it on to its client: every
/// `retry-after-ms=` field (whatever its case and the spaces about its `=`) a wait of at most an
/// hour, the longest [`Rejection::from_http`] reads from an upstream. One over the hour says an
/// hour; one that is not a number of milliseconds is emptied (`retry-after-ms=`), so that every
/// field keeps its place and the header reads as it came to this edge, as a refusal or not, as
/// draining or not. Every other field, the first word included, keeps its text, spaces included.
/// `None` when nothing needed bounding (pass the header on as it came).
pub fn bounded_refusal_header(h: &str) -> Option<String> {
    let mut changed = false;
    let fields: Vec<std::borrow::Cow<'_, str>> = h
        .split(';')
        .map(|field| {
            let Some((key, value)) = field.split_once('=') else {
                return field.into();
            };
            if !key.trim().eq_ignore_ascii_case("retry-after-ms") || value.trim().is_empty() {
                return field.into();
            }
            let trail = &value[value.trim_end().len()..];
            match wait_ms(value.trim()) {
                Some(ms) if ms <= MAX_UPSTREAM_RETRY_MS => field.into(),
                Some(_) => {
                    changed = true;
                    format!("{key}={MAX_UPSTREAM_RETRY_MS}{trail}").into()
                }
                None => {
                    changed = true;
                    format!("{key}={trail}").into()
                }
            }
        })
        .collect();
    changed.then(|| fields.join(";"))
}

/// The body of a codex-fleet upstream's refusal ([`Rejection::http_body`]) as an edge passes it
/// on to its client: its wait at most an hour, as [`bounded_refusal_header`] bounds the header's.
/// `None` when it needed no bounding or is not such a body (pass it on as it came).
pub fn bounded_refusal_body(body: &str) -> Option<String> {
    let (scope, reason, ms) = parse_refusal_body(body)?;
    (ms > MAX_UPSTREAM_RETRY_MS).then(|| {
        format!(
            "{OVERLOADED_MESSAGE} (scope {scope}, reason {reason}); retry after \
             {MAX_UPSTREAM_RETRY_MS} ms"
        )
    })
}

/// A codex-fleet upstream's `Retry-After` as an edge passes it on to its client: its seconds,
/// at most an hour (as [`bounded_refusal_header`] bounds the milliseconds). `None` for anything
/// that is not a number of seconds (HTTP's digits alone; an HTTP date, which a codex-fleet node
/// never sends), which the edge leaves out.
pub fn bounded_retry_after(value: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(value).ok()?;
    if text.starts_with('+') {
        return None;
    }
    wait_ms(text).map(|secs| secs.min(MAX_UPSTREAM_RETRY_MS / 1000))
}

/// An upstream's wait (milliseconds, or a `Retry-After`'s seconds), as `u64` reads one (digits,
/// after an optional `+`), but digits too many for a `u64` are the longest wait there is (bounded
/// by its reader, as every wait). `None` if it is not a number.
fn wait_ms(v: &str) -> Option<u64> {
    let digits = v.strip_prefix('+').unwrap_or(v);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(digits.parse().unwrap_or(u64::MAX))
}

/// Whole milliseconds, rounded up and at least 1, plus up to a quarter more at random.
fn jittered_ms(d: Duration, rng: &mut impl Rng) -> u64 {
    let base = u64::try_from(d.as_nanos().div_ceil(1_000_000))
        .unwrap_or(u64::MAX)
        .max(1);
    base.saturating_add(rng.random_range(0..=base / JITTER_DIVISOR))
}

/// Gives a worker's own `-32001` (app-server sends it with `data: null`) the same `data` shape
/// as the router's, with scope `worker` and reason `workerOverloaded`. Returns the rewritten
/// frame, or `None` when `text` is not such an error (forward it unchanged).
pub fn rewrite_worker_overload(text: &str, retry_after: Duration) -> Option<String> {
    // The session only calls this for a parsed `-32001`; other callers get the same check.
    if Frame::parse(text).ok()?.error_code() != Some(codes::OVERLOADED) {
        return None;
    }
    let mut msg: Map<String, Value> = serde_json::from_str(text).ok()?;
    let error = msg.get_mut("error")?.as_object_mut()?;
    if error.get("code")?.as_i64()? != codes::OVERLOADED {
        return None;
    }
    if error.get("data").is_some_and(|d| !d.is_null()) {
        return None;
    }
    let rejection = Rejection::rate(Scope::Worker, Reason::WorkerOverloaded, retry_after);
    error.insert("data".into(), rejection.to_error_data());
    Some(Value::Object(msg).to_string())
}

#[cfg(test)]
mod tests;
