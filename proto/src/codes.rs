//! The JSON-RPC error codes on the wire: a leaf that frames and error answers both name.

/// Invalid JSON.
pub const PARSE_ERROR: i64 = -32700;
/// Invalid request (app-server also uses it for unknown methods and "Not initialized").
pub const INVALID_REQUEST: i64 = -32600;
/// Internal error.
pub const INTERNAL_ERROR: i64 = -32603;
/// Saturated: retry later (app-server's own overload code).
pub const OVERLOADED: i64 = -32001;
/// The worker that held the request went away; retryable.
pub const WORKER_UNAVAILABLE: i64 = -32002;
/// A request refused by the host-access policy. Next to app-server's `-32001` (overloaded)
/// and the router's `-32002` (worker unavailable); unlike those it is not retryable, and
/// unlike `-32600` a client can tell a policy refusal from a malformed request.
pub const HOST_ACCESS_DENIED: i64 = -32003;
