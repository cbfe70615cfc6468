//! The JSON-RPC error codes on the wire and the error answers codex-fleet builds, defined once.

use serde::Serialize;
use serde_json::{json, Value};

use crate::rpc::{error_response, RequestId};

/// Error codes used on the wire ([`crate::codes`], named here too).
pub use crate::codes;

/// The message of every `-32001`, word for word as app-server sends it.
pub const OVERLOADED_MESSAGE: &str = "Server overloaded; retry later.";
/// The message of `-32002`.
pub const WORKER_EXITED_MESSAGE: &str = "The worker serving this request exited; retry.";

/// app-server's answer to `thread/resume` when another process holds the thread's writer lock
/// is a plain `-32600` with this in its message (docs/app-server-facts.md §7); no structured field
/// tells it apart, so this is the one place that reads app-server's English.
pub const WRITER_CONFLICT: &str = "already has an active writer";

/// Whether an error message is app-server's writer-lock conflict ([`WRITER_CONFLICT`]).
pub fn is_writer_conflict(message: &str) -> bool {
    message.contains(WRITER_CONFLICT)
}

/// The `data` of a `-32001`:
/// `{"retryAfterMs": N, "scope": "connection"|"tenant"|"worker"|"fleet", "reason": "…"}`.
pub fn overloaded_data(
    retry_after_ms: u64,
    scope: impl Serialize,
    reason: impl Serialize,
) -> Value {
    json!({
        "retryAfterMs": retry_after_ms,
        "scope": scope,
        "reason": reason,
    })
}

/// A whole `-32001` answer to request `id`, with `data` from [`overloaded_data`].
pub fn overloaded_response(id: &RequestId, data: Value) -> String {
    error_response(Some(id), codes::OVERLOADED, OVERLOADED_MESSAGE, Some(data))
}

/// The `data` of a `-32002`: `{"reason": "workerExited", "retryable": true}`.
pub fn worker_exited_data() -> Value {
    json!({ "reason": "workerExited", "retryable": true })
}

/// A whole `-32002` answer to request `id`: its worker exited before answering.
pub fn worker_exited_response(id: &RequestId) -> String {
    error_response(
        Some(id),
        codes::WORKER_UNAVAILABLE,
        WORKER_EXITED_MESSAGE,
        Some(worker_exited_data()),
    )
}

/// The `data` of a `-32003`:
/// `{"reason": "hostAccessDenied", "policy": "<class>", "method": "<method>"}`.
pub fn host_access_denied_data(policy: &str, method: &str) -> Value {
    json!({
        "reason": "hostAccessDenied",
        "policy": policy,
        "method": method,
    })
}

/// A whole `-32003` answer to request `id`.
pub fn host_access_denied_response(
    id: &RequestId,
    message: &str,
    policy: &str,
    method: &str,
) -> String {
    error_response(
        Some(id),
        codes::HOST_ACCESS_DENIED,
        message,
        Some(host_access_denied_data(policy, method)),
    )
}

/// A `-32600` answer (`id` is `null` when the request's id could not be read).
pub fn invalid_request_response(id: Option<&RequestId>, message: &str) -> String {
    error_response(id, codes::INVALID_REQUEST, message, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn writer_conflicts_are_recognised() {
        assert!(is_writer_conflict(
            "thread t-1 already has an active writer"
        ));
        assert!(!is_writer_conflict("thread not found: t-1"));
    }

    #[test]
    fn the_shapes_are_fixed() {
        let id = RequestId::Int(4);
        assert_eq!(
            parsed(&overloaded_response(
                &id,
                overloaded_data(120, "worker", "workerBusy")
            )),
            json!({"id": 4, "error": {"code": -32001, "message": "Server overloaded; retry later.",
                "data": {"retryAfterMs": 120, "scope": "worker", "reason": "workerBusy"}}})
        );
        assert_eq!(
            parsed(&worker_exited_response(&RequestId::Str("a".into()))),
            json!({"id": "a", "error": {"code": -32002,
                "message": "The worker serving this request exited; retry.",
                "data": {"reason": "workerExited", "retryable": true}}})
        );
        assert_eq!(
            parsed(&host_access_denied_response(&id, "m", "fs", "fs/readFile")),
            json!({"id": 4, "error": {"code": -32003, "message": "m",
                "data": {"reason": "hostAccessDenied", "policy": "fs", "method": "fs/readFile"}}})
        );
        assert_eq!(
            invalid_request_response(None, "Not initialized"),
            r#"{"error":{"code":-32600,"message":"Not initialized"},"id":null}"#
        );
    }
}
