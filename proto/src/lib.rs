//! The protocol core shared by the router, the worker supervisor and the simulator tools: what
//! app-server's JSON-RPC looks like on the wire, defined once.
//!
//! - [`rpc`]: frames parsed once into typed messages that keep their text for forwarding.
//! - [`method`]: the methods codex-fleet acts on; everything else is forwarded untouched.
//! - [`event`]: thread lifecycle and turn notifications, typed.
//! - [`initialize`]: the `initialize` params codex-fleet sends.
//! - [`codes`]: the JSON-RPC error codes on the wire.
//! - [`error`]: the error shapes codex-fleet answers with.
//! - [`ws`]: the WebSocket limits of every leg.
//! - [`names`]: tenant-id and socket-path rules.
//! - [`placement`]: how a tenant's pool answers each client method as one app-server.
//! - [`client`]: a small request/response client over any WebSocket stream.

#[doc(hidden)]
pub mod arbitrary;
pub mod client;
pub mod codes;
pub mod error;
pub mod event;
pub mod initialize;
pub mod method;
pub mod names;
pub mod placement;
pub mod rpc;
pub mod ws;

pub use method::Method;
pub use rpc::{Message, ParseError, RequestId};
