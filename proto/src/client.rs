//! A small JSON-RPC request/response client over any WebSocket stream (a worker's Unix socket,
//! wss to codex-fleet): the supervisor's control and interrupt legs and the load tool use it.

use futures_util::{Sink, SinkExt, Stream, StreamExt};
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio_tungstenite::tungstenite::{Error as WsError, Message as WsMessage};

use crate::initialize::InitializeParams;
use crate::method::Method;
use crate::rpc::{Frame, Message, RequestId};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Reading or writing a frame failed.
    #[error("websocket: {0}")]
    Ws(#[source] Box<WsError>),
    /// The other side closed the connection.
    #[error("connection closed")]
    Closed,
    /// The answer was a JSON-RPC error.
    #[error("{method} failed: {code} {message}")]
    Rpc {
        /// The request method.
        method: String,
        /// JSON-RPC error code.
        code: i64,
        /// JSON-RPC error message.
        message: String,
    },
    /// A frame was not JSON, or a result not of the expected shape.
    #[error("invalid JSON: {0}")]
    Decode(#[from] serde_json::Error),
}

impl From<WsError> for ClientError {
    fn from(e: WsError) -> Self {
        ClientError::Ws(Box::new(e))
    }
}

/// The answer to a call: the whole response frame, its `result` read on demand.
#[derive(Debug, Clone)]
pub struct Reply {
    text: String,
}

#[derive(Serialize)]
struct Request<'a, P> {
    id: &'a RequestId,
    method: &'a str,
    params: P,
}

#[derive(Serialize)]
struct Notification<'a> {
    method: &'a str,
}

#[derive(Deserialize)]
struct ErrorBody {
    code: i64,
    message: String,
}

// === impl Reply ===

impl Reply {
    /// The `result`, unparsed.
    pub fn result_raw(&self) -> Option<&RawValue> {
        Frame::parse(&self.text).ok()?.result
    }

    /// The `result` as `T`.
    pub fn result<T: DeserializeOwned>(&self) -> Result<T, ClientError> {
        let raw = self.result_raw().map_or("null", RawValue::get);
        Ok(serde_json::from_str(raw)?)
    }

    /// The whole response frame.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// A JSON-RPC client over a WebSocket stream: integer ids from 0, one call at a time.
pub struct Client<S> {
    ws: S,
    next_id: i64,
}

// === impl Client ===

impl<S> Client<S>
where
    S: Stream<Item = Result<WsMessage, WsError>> + Sink<WsMessage, Error = WsError> + Unpin,
{
    /// A client over an upgraded stream.
    pub fn new(ws: S) -> Self {
        Client { ws, next_id: 0 }
    }

    /// The stream, for reading frames directly between calls.
    pub fn ws_mut(&mut self) -> &mut S {
        &mut self.ws
    }

    /// The next id [`Client::send_request`] will use.
    pub fn next_id(&mut self) -> RequestId {
        let id = RequestId::Int(self.next_id);
        self.next_id += 1;
        id
    }

    /// Sends one text frame.
    pub async fn send_text(&mut self, text: String) -> Result<(), ClientError> {
        self.ws.send(WsMessage::text(text)).await?;
        Ok(())
    }

    /// Sends a notification without params (`initialized`).
    pub async fn notify(&mut self, method: &Method<'_>) -> Result<(), ClientError> {
        let text = serde_json::to_string(&Notification {
            method: method.as_str(),
        })?;
        self.send_text(text).await
    }

    /// Sends a request with the next id, and returns the id without waiting for the answer.
    pub async fn send_request<P: Serialize>(
        &mut self,
        method: &Method<'_>,
        params: P,
    ) -> Result<RequestId, ClientError> {
        let id = self.next_id();
        self.send_request_with_id(&id, method, params).await?;
        Ok(id)
    }

    async fn send_request_with_id<P: Serialize>(
        &mut self,
        id: &RequestId,
        method: &Method<'_>,
        params: P,
    ) -> Result<(), ClientError> {
        let text = serde_json::to_string(&Request {
            id,
            method: method.as_str(),
            params,
        })?;
        self.send_text(text).await
    }

    /// The next text frame; a close frame or the end of the stream is [`ClientError::Closed`].
    pub async fn next_text(&mut self) -> Result<String, ClientError> {
        loop {
            match self.ws.next().await {
                None | Some(Ok(WsMessage::Close(_))) => return Err(ClientError::Closed),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(WsMessage::Text(text))) => return Ok(text.as_str().to_owned()),
                Some(Ok(_)) => continue,
            }
        }
    }

    /// Sends a request and reads until its answer; other frames are skipped.
    pub async fn call<P: Serialize>(
        &mut self,
        method: &Method<'_>,
        params: P,
    ) -> Result<Reply, ClientError> {
        self.call_with(method, params, |_, _| None).await
    }

    /// As [`Client::call`]; every other frame on the way goes to `on_other`, and what it returns
    /// is sent (an answer to a server request, say).
    pub async fn call_with<P: Serialize>(
        &mut self,
        method: &Method<'_>,
        params: P,
        on_other: impl FnMut(&str, &Message<'_>) -> Option<String>,
    ) -> Result<Reply, ClientError> {
        let id = self.next_id();
        self.call_id(&id, method, params, on_other).await
    }

    /// As [`Client::call_with`], with a given id.
    pub async fn call_id<P: Serialize>(
        &mut self,
        id: &RequestId,
        method: &Method<'_>,
        params: P,
        on_other: impl FnMut(&str, &Message<'_>) -> Option<String>,
    ) -> Result<Reply, ClientError> {
        self.send_request_with_id(id, method, params).await?;
        self.answer_to(id, method, on_other).await
    }

    /// Reads until the answer to `id`; other frames go to `on_other` (frames that are JSON but
    /// not JSON-RPC are skipped).
    pub async fn answer_to(
        &mut self,
        id: &RequestId,
        method: &Method<'_>,
        mut on_other: impl FnMut(&str, &Message<'_>) -> Option<String>,
    ) -> Result<Reply, ClientError> {
        loop {
            let text = self.next_text().await?;
            let frame = match Frame::parse(&text) {
                Ok(frame) => frame,
                Err(_) => {
                    serde_json::from_str::<IgnoredAny>(&text)?;
                    continue;
                }
            };
            if matches!(&frame.message, Message::Response { id: got } if got == id) {
                if let Some(error) = frame.error {
                    let e: ErrorBody = serde_json::from_str(error.get())?;
                    return Err(ClientError::Rpc {
                        method: method.as_str().to_owned(),
                        code: e.code,
                        message: e.message,
                    });
                }
                return Ok(Reply { text });
            }
            if let Some(answer) = on_other(&text, &frame.message) {
                self.send_text(answer).await?;
            }
        }
    }

    /// `initialize` with `params`, then `initialized`.
    pub async fn initialize(
        &mut self,
        params: &InitializeParams<'_>,
    ) -> Result<Reply, ClientError> {
        let reply = self.call(&Method::Initialize, params).await?;
        self.notify(&Method::Initialized).await?;
        Ok(reply)
    }

    /// Closes the connection.
    pub async fn close(&mut self) -> Result<(), ClientError> {
        self.ws.close().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};

    /// A scripted server: the frames it will send, and what the client sent.
    struct Scripted {
        frames: VecDeque<String>,
        sent: Arc<Mutex<Vec<String>>>,
    }

    fn scripted(frames: &[&str]) -> (Scripted, Arc<Mutex<Vec<String>>>) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let s = Scripted {
            frames: frames.iter().map(|f| f.to_string()).collect(),
            sent: sent.clone(),
        };
        (s, sent)
    }

    impl Stream for Scripted {
        type Item = Result<WsMessage, WsError>;
        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            Poll::Ready(self.frames.pop_front().map(|f| Ok(WsMessage::text(f))))
        }
    }

    impl Sink<WsMessage> for Scripted {
        type Error = WsError;
        fn poll_ready(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            Poll::Ready(Ok(()))
        }
        fn start_send(self: Pin<&mut Self>, m: WsMessage) -> Result<(), WsError> {
            self.sent
                .lock()
                .unwrap()
                .push(m.into_text()?.as_str().to_owned());
            Ok(())
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            Poll::Ready(Ok(()))
        }
        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_call_skips_other_frames_answers_server_requests_and_reads_its_result() {
        let (ws, sent) = scripted(&[
            r#"{"method":"thread/started","params":{}}"#,
            r#"{"id":9,"method":"item/tool/requestUserInput","params":{}}"#,
            r#"{"id":1,"result":{"other":true}}"#,
            r#"{"id":0,"result":{"thread":{"id":"t"}}}"#,
            r#"{"id":1,"error":{"code":-32001,"message":"Server overloaded; retry later."}}"#,
        ]);
        let mut c = Client::new(ws);
        let mut seen = Vec::new();
        let reply = c
            .call_with(&Method::ThreadStart, serde_json::json!({}), |text, m| {
                seen.push(text.to_owned());
                match m {
                    Message::Request { id, .. } => Some(format!(
                        r#"{{"id":{},"result":{{}}}}"#,
                        serde_json::to_string(id).unwrap()
                    )),
                    _ => None,
                }
            })
            .await
            .unwrap();
        assert_eq!(seen.len(), 3);
        let result: Value = reply.result().unwrap();
        assert_eq!(result["thread"]["id"], "t");
        let err = c
            .call(&Method::ThreadRead, serde_json::json!({"threadId": "t"}))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Rpc { code: -32001, method, .. } if method == "thread/read"),
            "{err}"
        );
        assert!(matches!(
            c.call(&Method::ThreadList, serde_json::json!({})).await,
            Err(ClientError::Closed)
        ));
        assert_eq!(
            *sent.lock().unwrap(),
            [
                r#"{"id":0,"method":"thread/start","params":{}}"#,
                r#"{"id":9,"result":{}}"#,
                r#"{"id":1,"method":"thread/read","params":{"threadId":"t"}}"#,
                r#"{"id":2,"method":"thread/list","params":{}}"#,
            ]
        );
    }

    #[tokio::test]
    async fn invalid_json_fails_the_call() {
        let (ws, _) = scripted(&["nope"]);
        let err = Client::new(ws)
            .call(&Method::ThreadList, serde_json::json!({}))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Decode(_)), "{err}");
    }
}
