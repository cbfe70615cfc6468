//! JSON-RPC frames as app-server speaks them: the protocol core's types (crate `proto`),
//! re-exported where the router's modules have always found them.

pub use proto::error::codes;
pub use proto::method::Method;
pub use proto::rpc::{
    error_message, error_response, params_request_id, parse, request, result_thread_id, thread_id,
    with_id, with_params_request_id, Frame, Message, ParseError, RequestId,
};
