//! Where a session's requests go (docs/decisions/0003-sessions-and-legs.md,
//! docs/decisions/0004-the-tenant-table.md): the thread's owner, the least-loaded worker for new
//! threads, or the home leg; legs opened on demand with the client's initialize replayed; and what
//! responses teach the tenant table.

use std::borrow::Cow;

use serde_json::value::RawValue;
use serde_json::Value;
use tokio_tungstenite::tungstenite::Utf8Bytes;
use worker::WorkerId;

use super::legs::Leg;
use super::{Answer, End, InFlight, Init, Session, Target, LEG_OPT_OUTS, REPLAY_INIT_ID};
use proto::rpc::{self, Message as Rpc, RequestId};
use proto::Method;

use crate::admission::Reason;

/// How long a resume that lost the writer lock waits for the winner to show as the owner.
const OWNER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// Pause between looks.
const OWNER_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// The notifications app-server sends a connection right after its `initialize` is answered,
/// to that connection only (docs/app-server-facts.md §3; seen on the pinned worker): on a leg whose
/// initialize the router replayed, the client already had them.
pub(crate) const PER_CONNECTION: [&str; 2] = ["configWarning", "remoteControl/status/changed"];

/// What a response teaches the tenant table.
pub(super) enum Learn {
    Nothing,
    /// `thread/start`, `thread/fork`: the new thread lives on the worker that answered.
    NewThread,
    /// `thread/resume`: the thread is now loaded where it was sent; the text is kept for one
    /// retry on the real owner if the worker answers "already has an active writer".
    Resume {
        thread: String,
        retry: Option<String>,
    },
    /// `thread/unsubscribe`: the client no longer follows the thread.
    Unsubscribe {
        thread: String,
    },
    /// A request merged from every worker's answer (`fanout.rs`); the client's id learns nothing.
    FanOut(super::fanout::Merge),
}

impl Learn {
    /// The merge of a fanned-out request.
    pub(super) fn fan_out(&self) -> Option<super::fanout::Merge> {
        match self {
            Learn::FanOut(m) => Some(*m),
            _ => None,
        }
    }
}

// === impl Session: routing ===

impl Session {
    /// Routing (docs/decisions/0003-sessions-and-legs.md, docs/decisions/0004-the-tenant-table.md):
    /// thread-scoped requests go to the thread's owner, new threads to the least-loaded worker,
    /// everything else (and unknown threads) to the home leg, so an unknown id and another tenant's
    /// id get the same answer from the tenant's own worker.
    pub(super) fn target(&self, method: &Method<'_>, thread: Option<&str>) -> Target {
        match (method, thread) {
            (Method::Initialize, _) => Target::Home,
            (Method::ThreadStart, _) => Target::Place,
            (_, None) => Target::Home,
            (_, Some(t)) => match self.ctx.tenant.find_owner(t) {
                Some(w) => Target::Owner(w),
                None if *method == Method::ThreadResume => Target::Place,
                None => Target::Home,
            },
        }
    }

    /// The worker other than `loser` that has `thread` loaded, reconciling until one shows up or
    /// [`OWNER_WAIT`] passes.
    async fn find_other_owner(&self, thread: &str, loser: WorkerId) -> Option<WorkerId> {
        let deadline = tokio::time::Instant::now() + OWNER_WAIT;
        loop {
            self.ctx.tenant.reconcile_now().await;
            let owner = self.ctx.tenant.find_owner(thread).filter(|o| *o != loser);
            if owner.is_some() || tokio::time::Instant::now() >= deadline {
                return owner;
            }
            tokio::time::sleep(OWNER_POLL).await;
        }
    }

    /// The leg a target resolves to when the session already has it: nothing to wait for.
    pub(super) fn leg_at_hand(&self, target: &Target) -> Option<WorkerId> {
        match *target {
            Target::Home => self.home.filter(|h| self.legs.contains_key(h)),
            Target::Owner(w) => self.legs.contains_key(&w).then_some(w),
            Target::Place => None,
        }
    }

    /// The leg a target resolves to, opened on demand (with the client's initialize replayed).
    pub(super) async fn leg_for(
        &mut self,
        target: Target,
        place_if_gone: bool,
    ) -> Result<WorkerId, Reason> {
        match target {
            Target::Home => self.home_leg().await,
            Target::Owner(w) if self.legs.contains_key(&w) => Ok(w),
            Target::Owner(w) => match self.ctx.tenant.pool.get(w) {
                Some(handle) => self.open_leg(handle).await,
                None => {
                    // The owner is gone: the thread is not loaded anywhere any more.
                    self.ctx.tenant.reconcile_soon();
                    if place_if_gone {
                        self.placed_leg().await
                    } else {
                        self.home_leg().await
                    }
                }
            },
            Target::Place => self.placed_leg().await,
        }
    }

    /// A leg for a new thread: to the least-loaded worker, and of those loaded alike to one this
    /// session already has a leg to (its home leg's, usually), so a session keeps to one
    /// connection where it can.
    pub(super) async fn placed_leg(&mut self) -> Result<WorkerId, Reason> {
        let mine: Vec<WorkerId> = self.legs.keys().copied().collect();
        self.acquired_leg(worker::Purpose::Thread { prefer: &mine })
            .await
    }

    /// A leg to the worker the pool picks for `purpose`, opened unless the session has it.
    async fn acquired_leg(&mut self, purpose: worker::Purpose<'_>) -> Result<WorkerId, Reason> {
        let handle = self.ctx.tenant.pool.acquire_for(purpose).await.map_err(|e| {
            tracing::warn!(tenant = %self.ctx.tenant.id, error = %e, ?purpose, "no worker to open a leg to");
            match e {
                worker::PoolError::FleetFull { .. } => Reason::FleetWorkerLimit,
                _ => Reason::NoWorkerAvailable,
            }
        })?;
        if self.legs.contains_key(&handle.id) {
            return Ok(handle.id);
        }
        self.open_leg(handle).await
    }

    /// Updates the tenant table from a response; may retry a resume on the real owner, in
    /// which case the client sees only the retry's answer.
    pub(super) async fn learn(
        &mut self,
        worker: WorkerId,
        id: &RequestId,
        f: InFlight,
        answer: &Answer<'_>,
    ) -> Option<Result<(), End>> {
        let pool = &self.ctx.tenant.pool;
        match f.learn {
            Learn::Nothing | Learn::FanOut(_) => None,
            Learn::NewThread => {
                if let Some(thread) = answer.result.and_then(rpc::thread_of_result) {
                    pool.learn(&thread, worker);
                    self.follow(&thread, worker);
                }
                None
            }
            Learn::Unsubscribe { thread } => {
                if answer.result.is_some() {
                    self.unfollow(&thread);
                }
                None
            }
            Learn::Resume { thread, retry } => {
                // The thread the worker resumed, as it names it: with a `path` (or `history`)
                // app-server ignores the request's `threadId`, which may then be anything the
                // client chose (kept, it would grow this session's and the tenant's maps).
                if let Some(resumed) = answer.result.and_then(rpc::thread_of_result) {
                    if resumed != thread {
                        tracing::debug!(%worker, "a resume named another thread than it resumed");
                    }
                    pool.learn(&resumed, worker);
                    self.follow(&resumed, worker);
                    return None;
                }
                let busy = answer
                    .error
                    .and_then(rpc::message_of_error)
                    .is_some_and(|m| proto::error::is_writer_conflict(&m));
                let retry = retry.filter(|_| busy)?;
                // Another worker holds the thread: find it and send the resume there, once. When
                // two resumes raced, the winner holds the writer lock before its worker lists the
                // thread as loaded, so look again for a moment.
                // Boxed: the answer's future would carry this rare path's state on every round
                // trip otherwise (see `Leg::open`).
                let target = Box::pin(async {
                    let owner = self.find_other_owner(&thread, worker).await?;
                    self.leg_for(Target::Owner(owner), false).await.ok()
                })
                .await?;
                self.ctx
                    .metrics
                    .resume_retries
                    .with_label_values(&[&self.ctx.tenant.id])
                    .inc();
                self.in_flight.insert(
                    id.clone(),
                    InFlight {
                        worker: target,
                        since: f.since,
                        learn: Learn::Resume {
                            thread,
                            retry: None,
                        },
                        _slot: None,
                    },
                );
                if self.send_to_leg(target, retry) {
                    Some(Ok(()))
                } else {
                    self.in_flight.remove(id);
                    None
                }
            }
        }
    }

    /// The home leg, opened on the least-loaded worker if there is none.
    pub(super) async fn home_leg(&mut self) -> Result<WorkerId, Reason> {
        if let Some(home) = self.home.filter(|h| self.legs.contains_key(h)) {
            return Ok(home);
        }
        // No thread follows from it: not counted as a placement.
        let worker = self.acquired_leg(worker::Purpose::Connection).await?;
        self.home = Some(worker);
        Ok(worker)
    }

    /// Opens a leg to `handle`'s worker; once the client has sent its initialize, every new
    /// leg gets it replayed first (with the router's own id, whose answer is swallowed).
    pub(super) async fn open_leg(
        &mut self,
        handle: worker::WorkerHandle,
    ) -> Result<WorkerId, Reason> {
        let slots = self.ctx.admission.worker_slots(handle.id);
        // Not boxed again here: `Leg::open` boxes its handshake, and every path to this one is
        // already boxed where the round trip awaits it (`leg_for`'s callers, fan-out, re-home).
        let (mut leg, frames) = Leg::open(
            handle,
            self.ctx.max_message_bytes,
            self.leg_budget.clone(),
            slots,
            self.ctx
                .admission
                .held_buffer(&self.ctx.tenant.id, self.ctx.tenant_queue_bytes),
        )
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "cannot open leg");
            Reason::WorkerUnreachable
        })?;
        self.ctx
            .metrics
            .legs_opened
            .with_label_values(&[&self.ctx.tenant.id])
            .inc();
        let worker = leg.worker();
        if let Some(init) = self.init.as_ref().filter(|_| self.init_sent) {
            Self::replay_initialize(&mut leg, init);
            self.replayed.insert(worker);
        }
        self.legs.insert(worker, leg);
        self.new_legs
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(frames);
        Ok(worker)
    }

    /// Whether a frame from a leg in `replayed` is what app-server sends every newly
    /// initialized connection (counted and dropped: the client got its own after its
    /// initialize). The replayed initialize's answer keeps the window open; any other frame
    /// closes it, since app-server sends those notifications before anything else reaches the
    /// connection (it is marked ready for broadcasts only after them).
    pub(super) fn replay_echo(&mut self, worker: WorkerId, message: &Rpc<'_>) -> bool {
        match message {
            Rpc::Response { id } if *id == RequestId::Str(REPLAY_INIT_ID.into()) => false,
            Rpc::Notification { method, .. } if PER_CONNECTION.contains(&method.as_str()) => {
                self.ctx
                    .metrics
                    .replayed_notifications_dropped
                    .with_label_values(&[method.as_str()])
                    .inc();
                true
            }
            _ => {
                self.replayed.remove(&worker);
                false
            }
        }
    }

    /// The client's initialize as the session's legs send it: [`LEG_OPT_OUTS`] added to its
    /// `optOutNotificationMethods`, every other member as the client wrote it. `None` (sent
    /// as written, for the worker to answer as it would the client) when the frame, its params
    /// or its capabilities are not objects, or its opt-outs are neither a list nor null.
    /// `params` is the frame's, as the session already parsed it.
    pub(super) fn initialize_for_legs(text: &str, mut params: Value) -> Option<String> {
        type RawObject<'a> = std::collections::BTreeMap<Cow<'a, str>, &'a RawValue>;
        let mut frame: RawObject<'_> = serde_json::from_str(text).ok()?;
        let capabilities = params
            .as_object_mut()?
            .entry("capabilities")
            .or_insert(Value::Null);
        if capabilities.is_null() {
            *capabilities = Value::Object(Default::default());
        }
        let list = capabilities
            .as_object_mut()?
            .entry("optOutNotificationMethods")
            .or_insert(Value::Null);
        if list.is_null() {
            *list = Value::Array(Vec::new());
        }
        let list = list.as_array_mut()?;
        for method in LEG_OPT_OUTS {
            if !list.iter().any(|m| m == method) {
                list.push(Value::from(*method));
            }
        }
        let params = serde_json::value::to_raw_value(&params).ok()?;
        frame.insert(Cow::Borrowed("params"), &params);
        serde_json::to_string(&frame).ok()
    }

    pub(super) fn replay_initialize(leg: &mut Leg, init: &Init) {
        let params = match rpc::parse(&init.text) {
            Ok(Rpc::Request { params, .. }) => params,
            _ => None,
        };
        let replay = rpc::request(
            &RequestId::Str(REPLAY_INIT_ID.into()),
            Method::Initialize.as_str(),
            params,
        );
        leg.send(replay);
        if init.initialized {
            leg.send(Utf8Bytes::from_static(r#"{"method":"initialized"}"#));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::Session;

    /// As the session calls it: the frame's text, and its params parsed.
    fn leg_text(text: &str) -> Option<String> {
        let params = serde_json::from_str::<Value>(text)
            .map(|mut v| v["params"].take())
            .unwrap_or_default();
        Session::initialize_for_legs(text, params)
    }

    fn for_legs(frame: Value) -> Option<Value> {
        leg_text(&frame.to_string()).map(|t| serde_json::from_str(&t).unwrap())
    }

    #[test]
    fn legs_opt_out_of_status_changes_besides_what_the_client_opted_out_of() {
        let info = json!({ "name": "tui", "version": "1" });
        let opted = |v: Option<Value>| v.unwrap()["params"]["capabilities"].clone();
        // No capabilities, or null ones, or a null list: the list is made.
        for params in [
            json!({ "clientInfo": info }),
            json!({ "clientInfo": info, "capabilities": null }),
            json!({ "clientInfo": info, "capabilities": { "optOutNotificationMethods": null } }),
        ] {
            let frame = json!({ "id": "initialize", "method": "initialize", "params": params });
            assert_eq!(
                opted(for_legs(frame)),
                json!({ "optOutNotificationMethods": ["thread/status/changed"] })
            );
        }
        // The client's own members and opt-outs stay, the id exactly as written.
        let frame = r#"{"id":12345678901234567890,"method":"initialize","params":{"clientInfo":{"name":"x","version":"1"},"capabilities":{"experimentalApi":true,"optOutNotificationMethods":["item/agentMessage/delta"]}}}"#;
        let sent = leg_text(frame).unwrap();
        assert!(sent.contains(r#""id":12345678901234567890"#), "{sent}");
        let sent: Value = serde_json::from_str(&sent).unwrap();
        assert_eq!(
            sent["params"]["capabilities"],
            json!({ "experimentalApi": true,
                    "optOutNotificationMethods": ["item/agentMessage/delta", "thread/status/changed"] })
        );
        assert_eq!(
            sent["params"]["clientInfo"],
            json!({ "name": "x", "version": "1" })
        );
        // Already opted out: not listed twice.
        let frame = json!({ "id": 1, "method": "initialize", "params": { "clientInfo": info,
            "capabilities": { "optOutNotificationMethods": ["thread/status/changed"] } } });
        assert_eq!(
            opted(for_legs(frame)),
            json!({ "optOutNotificationMethods": ["thread/status/changed"] })
        );
        // What app-server would refuse is sent as written, for it to answer.
        for params in [
            json!(null),
            json!([1]),
            json!({ "clientInfo": info, "capabilities": 7 }),
            json!({ "clientInfo": info, "capabilities": { "optOutNotificationMethods": "thread/status/changed" } }),
        ] {
            let frame = json!({ "id": 1, "method": "initialize", "params": params });
            assert_eq!(for_legs(frame), None);
        }
        assert_eq!(for_legs(json!({ "id": 1, "method": "initialize" })), None);
        assert_eq!(leg_text("not json"), None);
    }
}
