//! The supervisor's control leg to one worker: initialize, relay notifications, health pings that
//! double as `thread/loaded/list` reconciliation.

use std::sync::Arc;

use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{interval_at, sleep_until, timeout_at, Duration, Instant, MissedTickBehavior};
use tokio_tungstenite::tungstenite::Message;
use tracing::{debug, trace, warn};

use crate::error::ControlError;
use crate::leg::LegStream;
use crate::load::LoadedList;

/// app-server does not adopt this client name as the process originator (facts §3, §11).
pub const CLIENT_NAME: &str = "codex_app_server_daemon";
/// Largest message accepted on a control leg (`thread/started` carries a whole thread summary).
pub const CONTROL_MAX_MESSAGE: usize = 16 << 20;

const INITIALIZE: &str = "initialize";
const INITIALIZED: &str = "initialized";
/// Cheap request used as the health probe; it also lists loaded threads.
const HEALTH_METHOD: &str = "thread/loaded/list";
/// Capacity of a control leg's command queue.
pub const COMMAND_CAPACITY: usize = 16;
/// Most reconcile callers waiting on one control leg; more get no answer.
const MAX_WAITERS: usize = 256;

#[derive(Serialize)]
struct Request<'a, P> {
    id: u64,
    method: &'a str,
    params: P,
}

#[derive(Serialize)]
struct Notification<'a> {
    method: &'a str,
}

/// `params: {}`; app-server rejects requests without `params`.
#[derive(Serialize)]
struct EmptyParams {}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InitializeParams<'a> {
    client_info: ClientInfo<'a>,
    capabilities: Capabilities,
}

#[derive(Serialize)]
struct ClientInfo<'a> {
    name: &'a str,
    title: Option<&'a str>,
    version: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Capabilities {
    experimental_api: bool,
}

/// The fields that tell the kinds of JSON-RPC message apart.
#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    error: Option<RpcErrorBody>,
    #[serde(default)]
    result: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct RpcErrorBody {
    code: i64,
    message: String,
}

/// One inbound text frame, classified once.
enum Inbound {
    Notification(Value),
    Response {
        id: Option<u64>,
        error: Option<RpcErrorBody>,
        result: Option<Value>,
    },
    ServerRequest {
        method: String,
    },
    Unknown,
}

impl Inbound {
    fn parse(text: &str) -> Result<Self, serde_json::Error> {
        let value: Value = serde_json::from_str(text)?;
        let envelope = Envelope::deserialize(&value)?;
        Ok(match (envelope.id, envelope.method) {
            (Some(_), Some(method)) => Inbound::ServerRequest { method },
            (None, Some(_)) => Inbound::Notification(value),
            (Some(id), None) => Inbound::Response {
                id: id.as_u64(),
                error: envelope.error,
                result: envelope.result,
            },
            (None, None) => Inbound::Unknown,
        })
    }
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
    /// A notification, as received.
    Notification(Value),
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
    in_flight: Option<(u64, Instant)>,
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
        self.in_flight.map(|(_, deadline)| deadline)
    }

    fn should_send(&self) -> bool {
        self.in_flight.is_none() && (self.due || !self.next.is_empty())
    }

    fn sent(&mut self, id: u64, deadline: Instant) {
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
    fn answered(&mut self, id: Option<u64>) -> bool {
        let hit = self.in_flight.is_some_and(|(probe, _)| Some(probe) == id);
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
    ws: LegStream,
    next_id: u64,
    probes: Probes,
}

// === impl ControlLeg ===

impl ControlLeg {
    /// Sends `initialize` (as [`CLIENT_NAME`], experimental API on), waits for its answer, then sends
    /// `initialized`. The caller bounds the time.
    pub async fn initialize(ws: LegStream) -> Result<Self, ControlError> {
        let mut leg = Self {
            ws,
            next_id: 0,
            probes: Probes::default(),
        };
        let params = InitializeParams {
            client_info: ClientInfo {
                name: CLIENT_NAME,
                title: None,
                version: env!("CARGO_PKG_VERSION"),
            },
            capabilities: Capabilities {
                experimental_api: true,
            },
        };
        let id = leg.send_request(INITIALIZE, params).await?;
        leg.await_response(id, INITIALIZE).await?;
        leg.send_json(&Notification {
            method: INITIALIZED,
        })
        .await?;
        Ok(leg)
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
                frame = self.ws.next() => {
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
                match timeout_at(deadline, self.send_request(HEALTH_METHOD, EmptyParams {})).await {
                    Ok(Ok(id)) => self.probes.sent(id, deadline),
                    Ok(Err(e)) => return ControlEnd::Lost(e),
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
        match Inbound::parse(text.as_str()) {
            Ok(Inbound::Notification(value)) => {
                trace!(method = ?value.get("method"), "notification");
                observe(Observed::Notification(value));
            }
            Ok(Inbound::Response { id, error, result }) => {
                if let Some(error) = &error {
                    // Any answer, even -32001 "overloaded", proves the worker is alive.
                    debug!(code = error.code, message = %error.message, "control request failed");
                }
                if self.probes.answered(id) {
                    self.on_probe_answer(result, observe);
                }
            }
            Ok(Inbound::ServerRequest { method }) => {
                warn!(%method, "ignoring server request on control leg");
            }
            Ok(Inbound::Unknown) => debug!("ignoring frame without id or method"),
            Err(e) => warn!(error = %e, "ignoring invalid JSON on control leg"),
        }
        None
    }

    fn on_probe_answer(
        &mut self,
        result: Option<Value>,
        observe: &mut (dyn FnMut(Observed) + Send),
    ) {
        match result.map(serde_json::from_value::<LoadedList>) {
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

    async fn send_request<P: Serialize>(
        &mut self,
        method: &'static str,
        params: P,
    ) -> Result<u64, ControlError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send_json(&Request { id, method, params }).await?;
        Ok(id)
    }

    async fn send_json<T: Serialize>(&mut self, message: &T) -> Result<(), ControlError> {
        let text = serde_json::to_string(message)?;
        self.ws.send(Message::text(text)).await?;
        Ok(())
    }

    /// Reads until the answer to `id`; frames before it (none are expected) are skipped.
    async fn await_response(&mut self, id: u64, method: &'static str) -> Result<(), ControlError> {
        loop {
            let text = match self.ws.next().await {
                None => return Err(ControlError::Closed),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) => return Err(ControlError::Closed),
                Some(Ok(_)) => continue,
            };
            match Inbound::parse(text.as_str())? {
                Inbound::Response {
                    id: Some(got),
                    error,
                    ..
                } if got == id => {
                    return match error {
                        None => Ok(()),
                        Some(e) => Err(ControlError::Rpc {
                            method,
                            code: e.code,
                            message: e.message,
                        }),
                    };
                }
                _ => debug!(%method, "skipping frame while waiting for response"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_messages() {
        assert!(matches!(
            Inbound::parse(r#"{"method":"thread/started","params":{},"emittedAtMs":1}"#).unwrap(),
            Inbound::Notification(_)
        ));
        assert!(matches!(
            Inbound::parse(r#"{"id":3,"result":{"data":[]}}"#).unwrap(),
            Inbound::Response {
                id: Some(3),
                error: None,
                result: Some(_)
            }
        ));
        assert!(matches!(
            Inbound::parse(r#"{"id":4,"error":{"code":-32001,"message":"Server overloaded"}}"#)
                .unwrap(),
            Inbound::Response {
                id: Some(4),
                error: Some(RpcErrorBody { code: -32001, .. }),
                ..
            }
        ));
        assert!(matches!(
            Inbound::parse(r#"{"id":0,"method":"item/tool/requestUserInput","params":{}}"#)
                .unwrap(),
            Inbound::ServerRequest { .. }
        ));
        assert!(matches!(Inbound::parse("{}").unwrap(), Inbound::Unknown));
        assert!(Inbound::parse("nope").is_err());
    }

    #[test]
    fn requests_carry_params() {
        let text = serde_json::to_string(&Request {
            id: 7,
            method: HEALTH_METHOD,
            params: EmptyParams {},
        })
        .unwrap();
        assert_eq!(
            text,
            r#"{"id":7,"method":"thread/loaded/list","params":{}}"#
        );
        let init = serde_json::to_value(InitializeParams {
            client_info: ClientInfo {
                name: CLIENT_NAME,
                title: None,
                version: "1",
            },
            capabilities: Capabilities {
                experimental_api: true,
            },
        })
        .unwrap();
        assert_eq!(
            init,
            serde_json::json!({
                "clientInfo": {"name": "codex_app_server_daemon", "title": null, "version": "1"},
                "capabilities": {"experimentalApi": true}
            })
        );
    }
}
