//! JSON-RPC frames as app-server speaks them: the protocol core's types (crate `proto`),
//! re-exported where the router's modules have always found them.

pub use proto::error::codes;
pub use proto::method::Method;
pub use proto::rpc::{
    error_response, message_of_error, params_request_id, parse, request, thread_id,
    thread_of_result, with_id, with_params_request_id, Frame, Message, ParseError, RequestId,
};
