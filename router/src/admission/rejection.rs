//! What a refused client learns: scope, reason and a jittered time to come back, as JSON-RPC
//! `-32001` data or as an HTTP status with `Retry-After`.

use std::time::Duration;

use rand::Rng;
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::jsonrpc::{self, codes, RequestId};

/// The message of every `-32001`, word for word as app-server sends it.
pub const OVERLOADED_MESSAGE: &str = "Server overloaded; retry later.";

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
}

impl Reason {
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
        json!({
            "retryAfterMs": self.retry_after_ms,
            "scope": self.scope,
            "reason": self.reason,
        })
    }

    /// The whole JSON-RPC error response to request `id`.
    pub fn to_error_response(&self, id: &RequestId) -> String {
        jsonrpc::error_response(
            Some(id),
            codes::OVERLOADED,
            OVERLOADED_MESSAGE,
            Some(self.to_error_data()),
        )
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
    // Cheap test first: this runs on every response from a worker.
    if !text.contains("-32001") {
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
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_quarter() {
        let mut rng = rand::rng();
        for ms in [0_u64, 1, 3, 40, 999, 1000, 12_345] {
            let d = Duration::from_millis(ms);
            let base = ms.max(1);
            let seen: Vec<u64> = (0..500).map(|_| jittered_ms(d, &mut rng)).collect();
            assert!(
                seen.iter().all(|&v| v >= base && v <= base + base / 4),
                "{ms}: {seen:?}"
            );
            if base >= 40 {
                assert!(seen.iter().any(|&v| v != seen[0]), "{ms}: no jitter at all");
            }
        }
        // Sub-millisecond waits round up, never to zero.
        assert_eq!(jittered_ms(Duration::from_micros(10), &mut rng), 1);
    }

    #[test]
    fn error_data_has_the_exact_shape() {
        let r = Rejection::rate(
            Scope::Tenant,
            Reason::TenantRateLimited,
            Duration::from_millis(80),
        );
        let data = r.to_error_data();
        let keys: Vec<&String> = data.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["reason", "retryAfterMs", "scope"]);
        assert_eq!(data["scope"], "tenant");
        assert_eq!(data["reason"], "tenantRateLimited");
        let ms = data["retryAfterMs"].as_u64().unwrap();
        assert!((80..=100).contains(&ms), "{ms}");
        assert_eq!(ms, r.retry_after_ms_jittered());

        let resp: Value =
            serde_json::from_str(&r.to_error_response(&RequestId::Str("a".into()))).unwrap();
        assert_eq!(
            resp,
            json!({"id": "a", "error": {"code": -32001, "message": "Server overloaded; retry later.", "data": data}})
        );
        for (scope, s) in [
            (Scope::Connection, "connection"),
            (Scope::Worker, "worker"),
            (Scope::Fleet, "fleet"),
        ] {
            let r = Rejection::cap(scope, Reason::WorkerBusy, Duration::ZERO);
            assert_eq!(r.to_error_data()["scope"], s);
            assert_eq!(r.to_error_data()["reason"], "workerBusy");
        }
        for reason in [
            Reason::HandshakeRateLimited,
            Reason::ConnectionRateLimited,
            Reason::TurnRateLimited,
            Reason::ActiveTurnLimit,
            Reason::WorkerOverloaded,
            Reason::TooManyConnections,
        ] {
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.as_str());
        }
    }

    #[test]
    fn http_status_and_retry_after() {
        let rate = Rejection::rate(
            Scope::Connection,
            Reason::HandshakeRateLimited,
            Duration::from_millis(1500),
        );
        assert_eq!(rate.http_status(), 429);
        // 1500..=1875 ms rounds up to 2 s.
        assert_eq!(rate.retry_after_secs(), 2);
        let cap = Rejection::cap(
            Scope::Fleet,
            Reason::TooManyConnections,
            Duration::from_millis(10),
        );
        assert_eq!(cap.http_status(), 503);
        assert_eq!(cap.retry_after_secs(), 1);
    }

    #[test]
    fn worker_overload_gets_the_same_shape() {
        let text = r#"{"id":7,"error":{"code":-32001,"message":"Server overloaded; retry later.","data":null}}"#;
        let out = rewrite_worker_overload(text, Duration::from_millis(200)).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["id"], 7);
        assert_eq!(v["error"]["code"], -32001);
        assert_eq!(v["error"]["message"], OVERLOADED_MESSAGE);
        assert_eq!(v["error"]["data"]["scope"], "worker");
        assert_eq!(v["error"]["data"]["reason"], "workerOverloaded");
        let ms = v["error"]["data"]["retryAfterMs"].as_u64().unwrap();
        assert!((200..=250).contains(&ms), "{ms}");
        // Without a data field at all, too.
        let bare = r#"{"id":"x","error":{"code":-32001,"message":"m"}}"#;
        assert!(rewrite_worker_overload(bare, Duration::from_millis(1)).is_some());
        // Everything else passes unchanged.
        for other in [
            r#"{"id":7,"result":{"n":-32001}}"#,
            r#"{"id":7,"error":{"code":-32600,"message":"-32001"}}"#,
            r#"{"id":7,"error":{"code":-32001,"message":"m","data":{"retryAfterMs":5}}}"#,
            r#"{"method":"x","params":{"n":-32001}}"#,
            "not json -32001",
        ] {
            assert_eq!(
                rewrite_worker_overload(other, Duration::ZERO),
                None,
                "{other}"
            );
        }
    }
}
