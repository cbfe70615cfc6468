//! The supervisor's control leg to one worker: initialize, relay notifications, health pings that
//! double as `thread/loaded/list` reconciliation.

use std::sync::Arc;

use futures_util::StreamExt;
use proto::client::{Client, ClientError};
use proto::initialize::InitializeParams;
use proto::rpc::{Frame, Message as Rpc, RequestId};
use proto::Method;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{interval_at, sleep_until, timeout_at, Duration, Instant, MissedTickBehavior};
use tokio_tungstenite::tungstenite::Message;
use tracing::{debug, trace, warn};

use crate::error::ControlError;
use crate::leg::LegStream;
use crate::load::LoadedList;

/// app-server does not adopt this client name as the process originator (docs/app-server-facts.md
/// §3, §11).
pub const CLIENT_NAME: &str = "codex_app_server_daemon";
/// Largest message accepted on a control leg (`thread/started` carries a whole thread summary).
pub const CONTROL_MAX_MESSAGE: usize = 16 << 20;

/// Cheap request used as the health probe; it also lists loaded threads.
const HEALTH_METHOD: Method<'static> = Method::ThreadLoadedList;
/// Capacity of a control leg's command queue.
pub const COMMAND_CAPACITY: usize = 16;
/// Most reconcile callers waiting on one control leg; more get no answer.
const MAX_WAITERS: usize = 256;

/// `params: {}`; app-server rejects requests without `params`.
#[derive(Serialize)]
struct EmptyParams {}

/// `error` of a response, for the log.
#[derive(Debug, Deserialize)]
struct RpcErrorBody {
    code: i64,
    message: String,
}

/// Health probe timing.
#[derive(Debug, Clone, Copy)]
pub struct Health {
    /// Period between probes.
    pub interval: Duration,
    /// Deadline for each probe's answer.
    pub timeout: Duration,
}

/// Why [`ControlLeg::run`] returned.
#[derive(Debug)]
pub enum ControlEnd {
    /// A health probe missed its deadline: the worker is hung.
    Hung,
    /// The connection ended or failed.
    Lost(ControlError),
}

/// What the control leg learns, handed to its owner as it arrives.
#[derive(Debug)]
pub enum Observed {
    /// A notification, parsed once (its text kept for forwarding).
    Notification(proto::event::Notice),
    /// The answer to a `thread/loaded/list` probe: the worker's loaded threads.
    Loaded(Arc<Vec<String>>),
}

/// A request to a running control leg.
#[derive(Debug)]
pub enum ControlCommand {
    /// List loaded threads with a request sent after this command arrived; answer on the sender.
    Reconcile(oneshot::Sender<Arc<Vec<String>>>),
}

/// `thread/loaded/list` requests: at most one in flight; reconcile callers wait for a request sent
/// after they asked.
#[derive(Default)]
struct Probes {
    in_flight: Option<(RequestId, Instant)>,
    /// Waiting on the request in flight.
    current: Vec<oneshot::Sender<Arc<Vec<String>>>>,
    /// Waiting on the next request.
    next: Vec<oneshot::Sender<Arc<Vec<String>>>>,
    /// The health ticker fired.
    due: bool,
}

// === impl Probes ===

impl Probes {
    fn deadline(&self) -> Option<Instant> {
        self.in_flight.as_ref().map(|(_, deadline)| *deadline)
    }

    fn should_send(&self) -> bool {
        self.in_flight.is_none() && (self.due || !self.next.is_empty())
    }

    fn sent(&mut self, id: RequestId, deadline: Instant) {
        self.in_flight = Some((id, deadline));
        self.due = false;
        self.current = std::mem::take(&mut self.next);
    }

    fn wait(&mut self, command: ControlCommand) {
        let ControlCommand::Reconcile(reply) = command;
        if self.next.len() < MAX_WAITERS {
            self.next.push(reply);
        }
    }

    /// Whether `id` answers the probe in flight; if so the probe is over.
    fn answered(&mut self, id: &RequestId) -> bool {
        let hit = self
            .in_flight
            .as_ref()
            .is_some_and(|(probe, _)| probe == id);
        if hit {
            self.in_flight = None;
        }
        hit
    }

    fn reply(&mut self, loaded: &Arc<Vec<String>>) {
        for waiter in self.current.drain(..) {
            // The caller may have given up; that is fine.
            waiter.send(loaded.clone()).ok();
        }
    }
}

/// An initialized control connection to one worker.
pub struct ControlLeg {
    rpc: Client<LegStream>,
    probes: Probes,
}

// === impl ControlLeg ===

impl ControlLeg {
    /// Sends `initialize` (as [`CLIENT_NAME`], experimental API on), waits for its answer, then sends
    /// `initialized`. The caller bounds the time.
    pub async fn initialize(ws: LegStream) -> Result<Self, ControlError> {
        let mut rpc = Client::new(ws);
        rpc.initialize(&InitializeParams::experimental(
            CLIENT_NAME,
            env!("CARGO_PKG_VERSION"),
        ))
        .await
        .map_err(control_error)?;
        Ok(Self {
            rpc,
            probes: Probes::default(),
        })
    }

    /// Reads every frame and hands notifications and loaded-thread lists to `observe`; probes health
    /// (`thread/loaded/list`) every `health.interval` and whenever a [`ControlCommand::Reconcile`]
    /// arrives. Returns when the worker misses a probe deadline or the leg ends.
    pub async fn run(
        mut self,
        health: Health,
        commands: &mut mpsc::Receiver<ControlCommand>,
        observe: &mut (dyn FnMut(Observed) + Send),
    ) -> ControlEnd {
        let mut ticker = interval_at(Instant::now() + health.interval, health.interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut commands_open = true;
        loop {
            let deadline = self.probes.deadline();
            tokio::select! {
                frame = self.rpc.ws_mut().next() => {
                    let message = match frame {
                        None => return ControlEnd::Lost(ControlError::Closed),
                        Some(Err(e)) => return ControlEnd::Lost(e.into()),
                        Some(Ok(message)) => message,
                    };
                    if let Some(end) = self.on_message(message, observe) {
                        return end;
                    }
                }
                command = commands.recv(), if commands_open => match command {
                    Some(command) => self.probes.wait(command),
                    None => commands_open = false,
                },
                _ = ticker.tick(), if self.probes.in_flight.is_none() => self.probes.due = true,
                () = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    return ControlEnd::Hung;
                }
            }
            if self.probes.should_send() {
                let deadline = Instant::now() + health.timeout;
                match timeout_at(
                    deadline,
                    self.rpc.send_request(&HEALTH_METHOD, EmptyParams {}),
                )
                .await
                {
                    Ok(Ok(id)) => self.probes.sent(id, deadline),
                    Ok(Err(e)) => return ControlEnd::Lost(control_error(e)),
                    Err(_elapsed) => return ControlEnd::Hung,
                }
            }
        }
    }

    fn on_message(
        &mut self,
        message: Message,
        observe: &mut (dyn FnMut(Observed) + Send),
    ) -> Option<ControlEnd> {
        let text = match message {
            Message::Text(text) => text,
            Message::Close(_) => return Some(ControlEnd::Lost(ControlError::Closed)),
            Message::Binary(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {
                return None
            }
        };
        let frame = match Frame::parse(text.as_str()) {
            Ok(frame) => frame,
            Err(e) => {
                warn!(error = %e, "ignoring invalid frame on control leg");
                return None;
            }
        };
        match frame.message {
            Rpc::Notification { method, params } => {
                trace!(%method, "notification");
                observe(Observed::Notification(proto::event::Notice::new(
                    text.as_str(),
                    method,
                    params,
                )));
            }
            Rpc::Response { id } => {
                if let Some(error) = frame.error {
                    // Any answer, even -32001 "overloaded", proves the worker is alive.
                    match serde_json::from_str::<RpcErrorBody>(error.get()) {
                        Ok(e) => {
                            debug!(code = e.code, message = %e.message, "control request failed")
                        }
                        Err(_) => debug!(error = error.get(), "control request failed"),
                    }
                }
                if self.probes.answered(&id) {
                    self.on_probe_answer(frame.result, observe);
                }
            }
            Rpc::Request { method, .. } => {
                warn!(%method, "ignoring server request on control leg");
            }
        }
        None
    }

    fn on_probe_answer(
        &mut self,
        result: Option<&RawValue>,
        observe: &mut (dyn FnMut(Observed) + Send),
    ) {
        match result.map(|r| serde_json::from_str::<LoadedList>(r.get())) {
            Some(Ok(list)) => {
                let loaded = Arc::new(list.data);
                observe(Observed::Loaded(loaded.clone()));
                self.probes.reply(&loaded);
            }
            Some(Err(e)) => {
                warn!(error = %e, "unexpected thread/loaded/list answer");
                self.probes.current.clear();
            }
            // An error answer: alive, but no list. Waiters get none (their senders drop).
            None => self.probes.current.clear(),
        }
    }
}

/// A client failure as a control-leg failure (only `initialize` waits for an answer).
fn control_error(e: ClientError) -> ControlError {
    match e {
        ClientError::Ws(e) => ControlError::Ws(e),
        ClientError::Closed => ControlError::Closed,
        ClientError::Rpc { code, message, .. } => ControlError::Rpc {
            method: Method::Initialize.known_name().unwrap_or_default(),
            code,
            message,
        },
        ClientError::Decode(e) => ControlError::Decode(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::SinkExt;
    use serde_json::Value;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::WebSocketStream;

    async fn next_text(ws: &mut WebSocketStream<tokio::net::UnixStream>) -> Value {
        loop {
            if let Message::Text(t) = ws.next().await.unwrap().unwrap() {
                return serde_json::from_str(t.as_str()).unwrap();
            }
        }
    }

    /// A control leg against a scripted worker: initialize, a probe answered with the loaded
    /// threads, a broadcast relayed, an error answer that proves liveness, then the end.
    #[tokio::test]
    async fn initializes_probes_and_relays() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let client =
            WebSocketStream::from_raw_socket(crate::leg::buffered(a).unwrap(), Role::Client, None)
                .await;
        let mut server = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let worker = tokio::spawn(async move {
            let init = next_text(&mut server).await;
            assert_eq!(init["method"], "initialize");
            assert_eq!(init["params"]["clientInfo"]["name"], CLIENT_NAME);
            assert_eq!(init["params"]["capabilities"]["experimentalApi"], true);
            // A broadcast before the answer is skipped by initialize.
            server
                .send(Message::text(r#"{"method":"thread/started","params":{}}"#))
                .await
                .unwrap();
            let answer = serde_json::json!({"id": init["id"], "result": {}});
            server
                .send(Message::text(answer.to_string()))
                .await
                .unwrap();
            assert_eq!(
                next_text(&mut server).await,
                serde_json::json!({"method": "initialized"})
            );
            let probe = next_text(&mut server).await;
            assert_eq!(probe["method"], "thread/loaded/list");
            assert_eq!(probe["params"], serde_json::json!({}));
            server
                .send(Message::text(
                    r#"{"method":"thread/status/changed","params":{"threadId":"a","status":{"type":"idle"}}}"#,
                ))
                .await
                .unwrap();
            let answer = serde_json::json!({"id": probe["id"], "result": {"data": ["a", "b"], "nextCursor": null}});
            server
                .send(Message::text(answer.to_string()))
                .await
                .unwrap();
            // The next probe gets an error: alive, no list.
            let probe = next_text(&mut server).await;
            let answer = serde_json::json!({"id": probe["id"], "error": {"code": -32001, "message": "Server overloaded; retry later."}});
            server
                .send(Message::text(answer.to_string()))
                .await
                .unwrap();
            server.close(None).await.unwrap();
        });
        let leg = ControlLeg::initialize(client).await.unwrap();
        let (_tx, mut commands) = mpsc::channel(1);
        let mut seen = Vec::new();
        let end = leg
            .run(
                Health {
                    interval: Duration::from_millis(10),
                    timeout: Duration::from_secs(60),
                },
                &mut commands,
                &mut |o| seen.push(o),
            )
            .await;
        worker.await.unwrap();
        assert!(
            matches!(end, ControlEnd::Lost(ControlError::Closed)),
            "{end:?}"
        );
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(
            matches!(&seen[0], Observed::Notification(n) if n.method == proto::Method::ThreadStatusChanged)
        );
        assert!(matches!(&seen[1], Observed::Loaded(l) if **l == ["a", "b"]));
    }

    #[tokio::test]
    async fn an_initialize_error_is_a_control_error() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let client =
            WebSocketStream::from_raw_socket(crate::leg::buffered(a).unwrap(), Role::Client, None)
                .await;
        let mut server = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let worker = tokio::spawn(async move {
            let init = next_text(&mut server).await;
            let answer =
                serde_json::json!({"id": init["id"], "error": {"code": -32600, "message": "nope"}});
            server
                .send(Message::text(answer.to_string()))
                .await
                .unwrap();
        });
        let err = ControlLeg::initialize(client).await.err().unwrap();
        worker.await.unwrap();
        assert!(
            matches!(&err, ControlError::Rpc { method: "initialize", code: -32600, message } if message == "nope"),
            "{err}"
        );
    }
}
