//! Session unit tests: server-request id mapping, property tests of the frame classifier and id
//! rewriting over pseudo-random input, and whole sessions in memory (paused time, fake worker
//! legs): bad frames, floods, approvals, and the order in which workers' frames reach the client.

use proto::arbitrary::{arbitrary_frame, Rng};
use proto::error::codes;
use proto::rpc::{self, Message as Rpc};
use serde_json::json;

use super::legs::LegEvent;
use super::server_requests::{Withdrawn, MAX_APPROVALS, MAX_SERVER_REQUESTS};
use super::*;

#[test]
fn server_request_ids_are_session_unique_and_mapped_back() {
    let mut s = ServerRequests::default();
    let w1 = WorkerId::new("t", 1, 1);
    let w2 = WorkerId::new("t", 2, 1);
    let a = s.insert(w1, RequestId::Int(0), None, None).unwrap();
    let b = s.insert(w2, RequestId::Int(0), None, None).unwrap();
    assert_ne!(a, b, "the same worker id on two workers must not collide");
    assert_eq!(
        s.insert(w1, RequestId::Int(0), None, None).unwrap(),
        a,
        "a replay keeps its id"
    );
    assert_eq!(s.resolved(w2, RequestId::Int(0)), Some((b, None)));
    assert_eq!(
        s.take(b),
        None,
        "a resolved request can no longer be answered"
    );
    assert_eq!(s.take(a), Some((w1, RequestId::Int(0), None)));
    assert_eq!(s.take(a), None, "only the first answer is forwarded");
}

#[test]
fn the_resolution_of_an_answered_request_carries_the_sessions_id() {
    let mut s = ServerRequests::default();
    let (w1, w2) = (WorkerId::new("t", 1, 1), WorkerId::new("t", 2, 1));
    let a = s.insert(w1, RequestId::Int(0), None, None).unwrap();
    let b = s.insert(w2, RequestId::Int(0), None, None).unwrap();
    assert_eq!(s.take(b), Some((w2, RequestId::Int(0), None)));
    // The worker reports the request resolved after the client's answer: in the session's ids.
    assert_eq!(s.resolved(w2, RequestId::Int(0)), Some((b, None)));
    assert_eq!(s.take(b), None);
    assert_eq!(s.take(a), Some((w1, RequestId::Int(0), None)));
}

#[test]
fn server_requests_stay_bounded() {
    let mut s = ServerRequests::default();
    let w = WorkerId::new("t", 1, 1);
    for n in 0..(MAX_SERVER_REQUESTS as i64 + 10) {
        s.insert(w, RequestId::Int(n), None, None).unwrap();
    }
    assert_eq!(s.by_session.len(), MAX_SERVER_REQUESTS);
    assert_eq!(s.by_worker.len(), MAX_SERVER_REQUESTS);
}

#[test]
fn a_closed_leg_s_requests_come_back_with_their_threads_to_be_resolved() {
    let mut s = ServerRequests::default();
    let (w1, w2) = (WorkerId::new("t", 1, 1), WorkerId::new("t", 2, 1));
    let a = s
        .insert(w1, RequestId::Int(0), Some("th-a".into()), None)
        .unwrap();
    let global = s.insert(w1, RequestId::Int(1), None, None).unwrap();
    let b = s
        .insert(w2, RequestId::Int(0), Some("th-b".into()), None)
        .unwrap();
    let forgotten: Vec<(i64, Option<String>)> = s
        .forget_worker(w1)
        .into_iter()
        .map(|w| (w.sid, w.thread))
        .collect();
    assert_eq!(
        forgotten,
        vec![(a, Some("th-a".to_owned())), (global, None)]
    );
    assert_eq!(s.by_session.len(), 1);
    assert_eq!(s.take(b), Some((w2, RequestId::Int(0), None)));
    assert_eq!(s.resolved(w2, RequestId::Int(0)), Some((b, None)));
    assert!(s.by_session.is_empty(), "a resolved request is forgotten");
}

#[test]
fn arbitrary_frames_never_panic_and_parsed_ids_map_back_exactly() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut parsed, mut refused) = (0, 0);
    for _ in 0..50_000 {
        let text = arbitrary_frame(&mut rng);
        let as_value: Option<serde_json::Value> = serde_json::from_str(&text).ok();
        // A worker's -32001 without data, and only that, gets the documented data; its id stays.
        // Only a well-formed response counts (a frame without an id is not one).
        let rewritten = crate::admission::rewrite_worker_overload(&text, Duration::from_millis(5));
        let overload = as_value.as_ref().is_some_and(|v| {
            v.is_object()
                && rpc::parse(&text).is_ok()
                && v["error"]["code"] == codes::OVERLOADED
                && v["error"]
                    .get("data")
                    .is_none_or(serde_json::Value::is_null)
        });
        assert_eq!(rewritten.is_some(), overload, "{text}");
        if let (Some(out), Some(v)) = (&rewritten, &as_value) {
            let out: serde_json::Value = serde_json::from_str(out).expect("JSON");
            assert_eq!(out["id"], v["id"], "{text}");
            assert_eq!(out["error"]["data"]["reason"], "workerOverloaded", "{text}");
        }
        // `params.requestId` is set on a frame with object params, and only there.
        let with_rid = rpc::with_params_request_id(&text, &RequestId::Int(1));
        if let Some(out) = &with_rid {
            // Raw, as the router passes values it does not read (e.g. `1e999`) through unparsed.
            type Raw = HashMap<String, Box<serde_json::value::RawValue>>;
            let out: Raw = serde_json::from_str(out).expect("a JSON object");
            let params: Raw = serde_json::from_str(out["params"].get()).expect("object params");
            assert_eq!(params["requestId"].get(), "1", "{text}");
        } else {
            assert!(
                !as_value.as_ref().is_some_and(|v| v["params"].is_object()),
                "{text}"
            );
        }
        // A turn event names the thread the frame itself names.
        if let Some(method) = as_value.as_ref().and_then(|v| v["method"].as_str()) {
            let params = as_value
                .as_ref()
                .and_then(|v| v.get("params"))
                .map(|p| serde_json::value::to_raw_value(p).expect("raw"));
            if let Some((_, thread)) = turns::event(method, params.as_deref()) {
                assert_eq!(
                    Some(thread.as_str()),
                    as_value
                        .as_ref()
                        .and_then(|v| v["params"]["threadId"].as_str()),
                    "{text}"
                );
            }
        }
        match rpc::parse(&text) {
            Err(e) => {
                refused += 1;
                assert!(e.code() == codes::PARSE_ERROR || e.code() == codes::INVALID_REQUEST);
            }
            Ok(msg) => {
                parsed += 1;
                let id = match msg {
                    Rpc::Request { id, .. } | Rpc::Response { id } => id,
                    Rpc::Notification { .. } => continue,
                };
                // Rewriting the id to a session id and back restores it exactly.
                let sid = RequestId::Int(rng.next_u64() as i64);
                let there = rpc::with_id(&text, &sid).unwrap_or_else(|| panic!("{text}"));
                let back = rpc::with_id(&there, &id).expect("an object");
                match (rpc::parse(&there), rpc::parse(&back)) {
                    (
                        Ok(Rpc::Request { id: a, .. } | Rpc::Response { id: a }),
                        Ok(Rpc::Request { id: b, .. } | Rpc::Response { id: b }),
                    ) => {
                        assert_eq!(a, sid, "{text}");
                        assert_eq!(b, id, "{text}");
                    }
                    other => panic!("{text}: {other:?}"),
                }
            }
        }
    }
    assert!(
        parsed > 1_000 && refused > 1_000,
        "{parsed} parsed, {refused} refused"
    );
}

#[test]
fn any_id_survives_the_round_trip_through_the_router() {
    let mut rng = Rng(0xfeed_0000_0000_0007);
    for _ in 0..20_000 {
        let id = rng.id();
        let sid = RequestId::Int(rng.next_u64() as i64);
        let request = rpc::request(&id, "item/tool/call", None);
        let to_client = rpc::with_id(&request, &sid).expect("object");
        let Ok(Rpc::Request { id: seen, .. }) = rpc::parse(&to_client) else {
            panic!("{to_client}")
        };
        assert_eq!(seen, sid);
        let answer = format!(
            r#"{{"id":{},"result":{{}}}}"#,
            serde_json::to_string(&sid).unwrap()
        );
        let to_worker = rpc::with_id(&answer, &id).expect("object");
        let Ok(Rpc::Response { id: back }) = rpc::parse(&to_worker) else {
            panic!("{to_worker}")
        };
        assert_eq!(back, id, "{to_worker}");
        // A worker's -32001 for this id keeps the id when its data is filled in.
        let overload = rpc::error_response(Some(&id), codes::OVERLOADED, "x", None);
        let rewritten =
            crate::admission::rewrite_worker_overload(&overload, Duration::from_millis(3))
                .expect("rewritten");
        let Ok(Rpc::Response { id: kept }) = rpc::parse(&rewritten) else {
            panic!("{rewritten}")
        };
        assert_eq!(kept, id);
    }
}

#[test]
fn server_request_ids_match_a_model_under_random_operations() {
    let mut rng = Rng(0x0dd_ba11_0000_0042);
    let workers = [
        WorkerId::new("t", 1, 1),
        WorkerId::new("t", 2, 1),
        WorkerId::new("t", 1, 2),
    ];
    let mut s = ServerRequests::default();
    // The model: session id -> (worker, original id, answered), for requests not yet resolved.
    let mut model: HashMap<i64, (WorkerId, RequestId, bool)> = HashMap::new();
    let mut issued: HashSet<i64> = HashSet::new();
    for _ in 0..50_000 {
        let w = *rng.pick(&workers);
        match rng.below(5) {
            0 | 1 => {
                let id = RequestId::Int(rng.below(64) as i64);
                let sid = s.insert(w, id.clone(), None, None).unwrap();
                match model.iter().find(|(_, v)| (v.0, &v.1) == (w, &id)) {
                    Some((known, _)) => assert_eq!(*known, sid, "a replay keeps its id"),
                    None => {
                        assert!(issued.insert(sid), "session ids are never reused");
                        model.insert(sid, (w, id, false));
                    }
                }
            }
            2 => {
                let sid = if model.is_empty() || rng.below(4) == 0 {
                    rng.next_u64() as i64
                } else {
                    let keys: Vec<i64> = model.keys().copied().collect();
                    *rng.pick(&keys)
                };
                let expect = model.get_mut(&sid).filter(|v| !v.2).map(|v| {
                    v.2 = true;
                    (v.0, v.1.clone(), None)
                });
                assert_eq!(s.take(sid), expect, "answer to {sid}");
            }
            3 => {
                let id = RequestId::Int(rng.below(64) as i64);
                let expect = model
                    .iter()
                    .find(|(_, v)| (v.0, &v.1) == (w, &id))
                    .map(|(k, _)| *k);
                assert_eq!(s.resolved(w, id), expect.map(|k| (k, None)));
                if let Some(k) = expect {
                    model.remove(&k);
                }
            }
            _ if rng.below(50) == 0 => {
                s.forget_worker(w);
                model.retain(|_, v| v.0 != w);
            }
            _ => {}
        }
        assert_eq!(s.by_session.len(), model.len());
        assert_eq!(s.by_worker.len(), model.len());
    }
}

/// `serve` over in-memory streams with paused time: the inbound pipeline's defined answers for
/// a client that never reaches a worker, without a socket or a worker process (the tenant's pool
/// has `min_workers = 0` and nothing here asks it for one).
pub(super) mod in_memory {
    use super::*;
    use serde_json::Value;
    use tokio::sync::mpsc as chan;

    pub(crate) struct Harness {
        to_session: chan::UnboundedSender<Result<Message, WsError>>,
        pub(crate) from_session: chan::UnboundedReceiver<Message>,
        pub(crate) session: tokio::task::JoinHandle<End>,
        /// Flushes of the client's sink that followed at least one frame.
        pub(crate) flushes: Arc<std::sync::atomic::AtomicUsize>,
        pub(crate) tenant: Arc<Tenant>,
        _dir: Arc<tempfile::TempDir>,
    }

    /// The client's side of the session: frames go to a channel, and each flush that follows
    /// frames is counted (a flush is a TLS record and a system call on a real socket).
    struct Recording {
        tx: chan::UnboundedSender<Message>,
        unflushed: bool,
        flushes: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Sink<Message> for Recording {
        type Error = WsError;

        fn poll_ready(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            Poll::Ready(Ok(()))
        }

        fn start_send(mut self: Pin<&mut Self>, msg: Message) -> Result<(), WsError> {
            self.tx.send(msg).map_err(|_| WsError::ConnectionClosed)?;
            self.unflushed = true;
            Ok(())
        }

        fn poll_flush(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Result<(), WsError>> {
            if std::mem::take(&mut self.unflushed) {
                self.flushes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), WsError>> {
            self.poll_flush(cx)
        }
    }

    async fn start(limits: &str) -> Harness {
        start_with(limits, "", Vec::new()).await
    }

    /// [`start_as`], for a client that has not initialized yet.
    pub(crate) async fn start_with(
        limits: &str,
        more: &str,
        legs: Vec<legs::LegFrames>,
    ) -> Harness {
        start_as(limits, more, legs, false).await
    }

    /// A session whose legs are `legs` (frames a test writes as if from workers), with `more`
    /// config after `[limits]`; `initialized`: as if its client's `initialize` had been answered.
    pub(crate) async fn start_as(
        limits: &str,
        more: &str,
        legs: Vec<legs::LegFrames>,
        initialized: bool,
    ) -> Harness {
        Process::new(limits, more, "").session("acme", legs, initialized)
    }

    /// What every session of one router process shares: its tenants (`acme`, then `tenants`),
    /// admission, metrics and audit log.
    pub(crate) struct Process {
        cfg: crate::config::Config,
        tenants: crate::tenants::Tenants,
        admission: Arc<Admission>,
        metrics: RouterMetrics,
        audit: crate::audit::Audit,
        dir: Arc<tempfile::TempDir>,
    }

    impl Process {
        pub(crate) fn new(limits: &str, more: &str, tenants: &str) -> Process {
            let dir = tempfile::tempdir().unwrap();
            let more = more.replace("{dir}", &dir.path().display().to_string());
            let toml = crate::config::tests::minimal(&format!(
                "command = [\"/bin/true\"]\n[limits]\n{limits}\n{more}\n"
            ))
            .replace("/var/lib/codex-fleet", &dir.path().display().to_string())
                + "min_workers = 0\n"
                + tenants;
            let cfg = crate::config::Config::parse(&toml).unwrap();
            let registry = prometheus::Registry::new();
            let worker_metrics = worker::metrics::WorkerMetrics::register(&registry).unwrap();
            Process {
                tenants: crate::tenants::Tenants::build(&cfg, &worker_metrics).unwrap(),
                admission: Admission::new(cfg.limits.admission.clone()).unwrap(),
                metrics: RouterMetrics::register(&registry).unwrap(),
                audit: crate::audit::Audit::start(&cfg.audit, &registry).unwrap(),
                cfg,
                dir: Arc::new(dir),
            }
        }

        /// [`start_as`], for a client of `tenant`.
        pub(crate) fn session(
            &self,
            tenant: &str,
            legs: Vec<legs::LegFrames>,
            initialized: bool,
        ) -> Harness {
            self.run(self.unstarted(tenant), legs, initialized)
        }

        /// Runs `session` (from [`Process::unstarted`]) as [`Process::session`] would.
        pub(crate) fn run(
            &self,
            mut session: Session,
            legs: Vec<legs::LegFrames>,
            initialized: bool,
        ) -> Harness {
            session.new_legs.lock().unwrap().extend(legs);
            if initialized {
                session.init = Some(Init {
                    id: RequestId::Int(0),
                    text: r#"{"id":0,"method":"initialize","params":{}}"#.into(),
                    answered: true,
                    initialized: true,
                    opt_out: HashSet::new(),
                });
            }
            let (to_session, stream) = chan::unbounded_channel();
            let (tx, from_session) = chan::unbounded_channel();
            let stream = Box::pin(futures_util::stream::unfold(stream, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            }));
            let flushes = Arc::default();
            let sink = Recording {
                tx,
                unflushed: false,
                flushes: Arc::clone(&flushes),
            };
            let tenant = session.ctx.tenant.clone();
            let session = tokio::spawn(run(session, sink, stream));
            Harness {
                to_session,
                from_session,
                session,
                flushes,
                tenant,
                _dir: self.dir.clone(),
            }
        }
    }

    impl Process {
        /// A session of `tenant` with no client and no legs yet, not running.
        pub(crate) fn unstarted(&self, tenant: &str) -> Session {
            let cfg = &self.cfg;
            let guard = self.admission.open_connection(tenant).unwrap();
            let ctx = SessionCtx {
                tenant: self.tenants.get(tenant).unwrap().clone(),
                metrics: self.metrics.clone(),
                max_message_bytes: cfg.limits.max_message_bytes,
                client_queue: cfg.limits.client_queue,
                client_queue_bytes: cfg.limits.client_queue_bytes,
                tenant_queue_bytes: cfg.limits.tenant_queue_bytes,
                admission: self.admission.clone(),
                shutdown: CancellationToken::new(),
                lease: crate::credentials::Lease::unbounded(),
                subject: "test".into(),
                audit: self.audit.clone(),
                client_read: self
                    .admission
                    .read_meter(tenant, cfg.limits.tenant_queue_bytes),
            };
            Session::new(ctx, guard)
        }
    }

    impl Harness {
        pub(crate) fn dir(&self) -> &std::path::Path {
            self._dir.path()
        }

        pub(crate) fn send(&self, msg: Message) {
            self.to_session.send(Ok(msg)).unwrap();
        }

        /// The next frame the session sends, as JSON (a close frame as `{"close": code}`).
        pub(crate) async fn next(&mut self) -> Value {
            let msg = tokio::time::timeout(Duration::from_secs(5), self.from_session.recv())
                .await
                .expect("an answer")
                .expect("the session is still writing");
            match msg {
                Message::Text(t) => serde_json::from_str(t.as_str()).unwrap(),
                Message::Close(f) => json!({ "close": f.map(|f| u16::from(f.code)) }),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn bad_frames_get_their_defined_answers_and_a_run_of_them_ends_the_session() {
        let mut h = start("").await;
        h.send(Message::text("{not json"));
        assert_eq!(h.next().await["error"]["code"], codes::PARSE_ERROR);
        h.send(Message::binary(vec![1u8, 2, 3]));
        let binary = h.next().await;
        assert_eq!(binary["error"]["code"], codes::INVALID_REQUEST, "{binary}");
        h.send(Message::text(
            r#"{"id":7,"method":"thread/list","params":{}}"#,
        ));
        let early = h.next().await;
        assert_eq!(early["id"], 7);
        assert_eq!(early["error"]["message"], "Not initialized", "{early}");
        // A notification before initialize is ignored, as app-server ignores it.
        h.send(Message::text(r#"{"method":"initialized"}"#));
        h.send(Message::text(r#"[1,2]"#));
        assert_eq!(
            h.next().await["error"]["code"],
            codes::INVALID_REQUEST,
            "a batch is refused (and nothing came for the notification before it)"
        );
        // MAX_PROTOCOL_ERRORS in a row: the session ends with 1002.
        for _ in 0..MAX_PROTOCOL_ERRORS {
            h.send(Message::text("nope"));
        }
        let mut last = Value::Null;
        for _ in 0..MAX_PROTOCOL_ERRORS {
            last = h.next().await;
            if last.get("close").is_some() {
                break;
            }
        }
        assert!(last.get("close").is_some(), "closed: {last}");
        assert_eq!(h.session.await.unwrap(), End::ProtocolErrors);
    }

    /// Lets the session task handle what was sent (one thread, paused time).
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    /// A session waiting for its costly step's turn (another costly step of its tenant holds
    /// it) reads nothing from its client, yet still ends when its credential is revoked, and the
    /// request it waited with is never answered or forwarded; a step that never ran is not
    /// counted, its wait is. When the turn comes, the step runs and is counted with its wait.
    /// Both costly steps: the parse of a frame over a MiB, a host-access check too costly to run
    /// inline.
    #[tokio::test(start_paused = true)]
    async fn a_session_waiting_for_a_costly_step_still_ends_with_its_credential() {
        let p = Process::new("", "", "");
        let large = json!({
            "id": 1, "method": "thread/list",
            "params": { "cursor": "x".repeat(crate::offload::LARGE_FRAME_BYTES + 1) },
        });
        let paths: Vec<Value> = (0..1000)
            .map(|i| json!({ "type": "localImage", "path": format!("a/b/c/{i}.png") }))
            .collect();
        let costly = json!({
            "id": 1, "method": "turn/start",
            "params": { "threadId": "t", "input": paths },
        });
        let steps = |step: &str| {
            p.metrics
                .costly_steps
                .with_label_values(&["acme", step])
                .get()
        };
        let waited = || {
            p.metrics
                .costly_wait_seconds
                .with_label_values(&["acme"])
                .get()
        };
        let waiting = || p.metrics.costly_waiting.with_label_values(&["acme"]).get();
        for (step, frame) in [("parse", &large), ("check", &costly)] {
            let tenant = p.tenants.get("acme").unwrap().clone();
            let held = tenant.costly_work.clone().try_acquire_owned().unwrap();
            let mut session = p.unstarted("acme");
            let lease = crate::credentials::Lease::unbounded();
            session.ctx.lease = lease.clone();
            let mut h = p.run(session, Vec::new(), false);
            h.send(Message::text(frame.to_string()));
            tokio::time::sleep(Duration::from_secs(3)).await;
            assert!(h.from_session.try_recv().is_err(), "{step}: answered");
            assert!(!h.session.is_finished(), "{step}");
            assert_eq!(waiting(), 1, "{step}");
            let before = waited();
            lease.revoke();
            let closed = h.next().await;
            assert!(closed.get("close").is_some(), "{step}: {closed}");
            assert_eq!(h.session.await.unwrap(), End::CredentialRevoked, "{step}");
            assert_eq!(steps(step), 0, "{step}");
            assert_eq!(waiting(), 0, "{step}");
            assert!(waited() - before >= 3.0, "{step}: {}", waited() - before);

            // The turn comes after 2 s: the step runs, and its request gets its answer (before
            // `initialize`, app-server's "Not initialized").
            let before = waited();
            let mut h = p.session("acme", Vec::new(), false);
            h.send(Message::text(frame.to_string()));
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(h.from_session.try_recv().is_err(), "{step}: answered");
            drop(held);
            let answer = h.next().await;
            assert_eq!(answer["id"], 1, "{step}: {answer}");
            assert_eq!(steps(step), 1, "{step}");
            assert!(
                waited() - before >= 2.0,
                "{step}: waited {}",
                waited() - before
            );
        }
    }

    /// A frame over a MiB is parsed in place, where nothing interrupts it: a credential revoked
    /// while it is parsed (a 16 MiB frame: most of a second in a debug build) still ends the
    /// session before the request goes anywhere. Real time, two threads: the revocation comes
    /// from the test as soon as the step is counted, which is just before the parse starts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_credential_revoked_while_a_large_frame_is_parsed_ends_the_session_before_it_goes_on()
    {
        let p = Process::new("", "", "");
        let large = json!({
            "id": 1, "method": "thread/list",
            "params": { "cursor": "x".repeat(16 << 20) },
        });
        let mut session = p.unstarted("acme");
        let lease = crate::credentials::Lease::unbounded();
        session.ctx.lease = lease.clone();
        let tenant = p.tenants.get("acme").unwrap().clone();
        let held = tenant.costly_work.clone().try_acquire_owned().unwrap();
        let mut h = p.run(session, Vec::new(), false);
        h.send(Message::text(large.to_string()));
        let waiting = || p.metrics.costly_waiting.with_label_values(&["acme"]).get();
        let parses = || {
            p.metrics
                .costly_steps
                .with_label_values(&["acme", "parse"])
                .get()
        };
        // Looks yield to the runtime (a blocked worker thread could hold the session task).
        async fn until(done: &dyn Fn() -> bool) -> bool {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !done() && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            done()
        }
        assert!(
            until(&|| waiting() == 1).await,
            "the session never waited for its turn"
        );
        // The turn comes: the step is counted, and the parse starts.
        drop(held);
        assert!(until(&|| parses() == 1).await, "the parse never started");
        lease.revoke();
        let mut frames = Vec::new();
        loop {
            let frame = h.next().await;
            let closed = frame.get("close").is_some();
            frames.push(frame);
            if closed {
                break;
            }
        }
        assert_eq!(frames.len(), 1, "answered after the revocation: {frames:?}");
        assert_eq!(h.session.await.unwrap(), End::CredentialRevoked);
    }

    /// A status change of thread `th-{n}`, relayed to the tenant's sessions as from a worker
    /// they have no leg to.
    fn relay_status(h: &Harness, n: usize) {
        relay_status_of(h, WorkerId::new("acme", 9, 1), &format!("th-{n}"));
    }

    /// A status change of `thread`, relayed to `h`'s tenant's sessions as from `worker`.
    fn relay_status_of(h: &Harness, worker: WorkerId, thread: &str) {
        let text = json!({
            "method": "thread/status/changed",
            "params": { "threadId": thread, "status": { "type": "idle" } },
        });
        h.tenant.relay(crate::tenants::Relayed {
            worker,
            text: text.to_string().into(),
            method: Arc::from("thread/status/changed"),
            to_all: false,
            turn: None,
            rehome: None,
            status_of: None,
        });
    }

    /// A session whose leg to a worker is live gets that worker's status changes from the relay
    /// (its legs opt out of them: `LEG_OPT_OUTS`) and the worker's other broadcasts from the leg
    /// only; the relayed start and end of a turn count once for the tenant, however many of its
    /// sessions see them.
    #[tokio::test(start_paused = true)]
    async fn a_live_leg_s_status_changes_come_from_the_relay_and_count_its_turns_once() {
        let p = Process::new("", "", "");
        let w = WorkerId::new("acme", 1, 1);
        let mut clients: Vec<Harness> = (0..2)
            .map(|_| {
                let mut s = p.unstarted("acme");
                s.live.insert(w);
                p.run(s, Vec::new(), true)
            })
            .collect();
        let relay = |clients: &[Harness], method: &str, status: &str, started: Option<bool>| {
            let text = json!({ "method": method,
                "params": { "threadId": "th", "status": { "type": status }, "thread": { "id": "th" } } });
            clients[0].tenant.relay(crate::tenants::Relayed {
                worker: w,
                text: text.to_string().into(),
                method: Arc::from(method),
                to_all: false,
                turn: started.map(|s| crate::admission::TurnMark::new(Arc::from("th"), s)),
                rehome: None,
                status_of: None,
            });
        };
        settle().await;
        relay(&clients, "thread/status/changed", "active", Some(true));
        for c in &mut clients {
            assert_eq!(c.next().await["params"]["status"]["type"], "active");
        }
        assert_eq!(p.admission.active_turns("acme"), 1, "the turn counts once");
        // Not a status change: the live leg delivers it, so the relay's copy is not forwarded.
        relay(&clients, "thread/started", "idle", None);
        relay(&clients, "thread/status/changed", "idle", Some(false));
        for c in &mut clients {
            assert_eq!(c.next().await["params"]["status"]["type"], "idle");
        }
        assert_eq!(p.admission.active_turns("acme"), 0, "and ends once");
        settle().await;
        for c in &mut clients {
            assert!(c.from_session.try_recv().is_err(), "nothing more");
        }
    }

    /// A follower whose copy of `turn/started` the dying worker never wrote (app-server writes
    /// to each connection from its own queue; a SIGKILL drops what is unwritten) has no turn to
    /// end, but the thread was active: it is told the thread is idle before anything else of
    /// the move, as a session that does not follow the thread is. A thread that was idle gets
    /// no such word.
    #[tokio::test(start_paused = true)]
    async fn a_follower_that_never_got_the_running_turn_is_told_its_thread_is_idle() {
        let p = Process::new("", "", "");
        let from = WorkerId::new("acme", 1, 1);
        for was_active in [true, false] {
            let mut s = p.unstarted("acme");
            s.live.insert(from);
            s.follow("th", from);
            let mut h = p.run(s, Vec::new(), true);
            settle().await;
            h.tenant.relay(crate::tenants::Relayed {
                worker: from,
                text: "".into(),
                method: Arc::from(""),
                to_all: true,
                turn: None,
                status_of: None,
                rehome: Some(Arc::new(crate::tenants::rehome::Rehome {
                    thread: Arc::from("th"),
                    from,
                    // Not in the pool: the resume cannot be sent, and the thread closes.
                    to: Some(WorkerId::new("acme", 2, 1)),
                    cause: crate::tenants::rehome::Cause::Crash,
                    since: tokio::time::Instant::now(),
                    was_active,
                })),
            });
            let mut seen = Vec::new();
            loop {
                let frame = h.next().await;
                assert_eq!(frame["params"]["threadId"], "th", "{frame}");
                let closed = frame["method"] == "thread/closed";
                seen.push(match frame["params"]["status"]["type"].as_str() {
                    Some(status) => status.to_owned(),
                    None => frame["method"].as_str().unwrap_or_default().to_owned(),
                });
                if closed {
                    break;
                }
            }
            let want: &[&str] = if was_active {
                &["idle", "systemError", "thread/closed"]
            } else {
                &["systemError", "thread/closed"]
            };
            assert_eq!(seen, want, "was active: {was_active}");
        }
    }

    /// A session further behind its tenant's broadcasts than the relay holds has lost some (a
    /// status change, or a followed thread's move): it is closed with a reason, as app-server
    /// closes a connection whose outbound queue filled, rather than go on with a wrong picture.
    #[tokio::test(start_paused = true)]
    async fn a_session_that_fell_behind_the_relay_is_closed_not_left_wrong() {
        let mut h = start_as("", "", Vec::new(), true).await;
        settle().await;
        relay_status(&h, 0);
        assert_eq!(h.next().await["params"]["threadId"], "th-0", "keeping up");
        // More than the relay holds, before the session runs again.
        for n in 1..=crate::tenants::RELAY_CAPACITY + 1 {
            relay_status(&h, n);
        }
        assert_eq!(h.next().await, json!({ "close": 1008 }));
        assert_eq!(h.session.await.unwrap(), End::RelayLagged);
        // Before its initialize is answered a session forwards nothing, so it has lost nothing.
        let mut h = start_as("", "", Vec::new(), false).await;
        settle().await;
        for n in 0..=crate::tenants::RELAY_CAPACITY {
            relay_status(&h, n);
        }
        settle().await;
        h.send(Message::text(
            r#"{"id":1,"method":"thread/list","params":{}}"#,
        ));
        assert_eq!(h.next().await["error"]["message"], "Not initialized");
        assert!(!h.session.is_finished());
    }

    /// A tenant's relay is its own: a tenant flooding it past what it holds (as a hostile tenant's
    /// workers could) closes its own lagging session, while a session of another tenant of the
    /// same process, its broadcasts relayed in between, gets exactly its own, in order, and goes
    /// on answering.
    #[tokio::test(start_paused = true)]
    async fn one_tenant_flooding_its_relay_closes_only_its_own_lagging_session() {
        let other = format!(
            "[[tenants]]\nid = \"other\"\ntoken_sha256 = [\"{}\"]\nmin_workers = 0\n",
            crate::config::tests::DIGEST.replace('a', "b")
        );
        let process = Process::new("", "", &other);
        let mut a = process.session("acme", Vec::new(), true);
        let mut b = process.session("other", Vec::new(), true);
        settle().await; // both subscribe to their tenant's relay
        let (wa, wb) = (WorkerId::new("acme", 9, 1), WorkerId::new("other", 9, 1));
        // More than the relay holds, before either session runs again; the other tenant's
        // broadcasts go in between.
        let mut sent = Vec::new();
        for n in 1..=crate::tenants::RELAY_CAPACITY + 1 {
            relay_status_of(&a, wa, &format!("acme-{n}"));
            if n % 128 == 0 {
                sent.push(format!("other-{n}"));
                relay_status_of(&b, wb, &format!("other-{n}"));
            }
        }
        assert_eq!(a.next().await, json!({ "close": 1008 }));
        assert_eq!(a.session.await.unwrap(), End::RelayLagged);
        for thread in &sent {
            let v = b.next().await;
            assert_eq!(v["params"]["threadId"], *thread, "{v}");
        }
        settle().await;
        assert!(b.from_session.try_recv().is_err(), "none of acme's");
        assert!(!b.session.is_finished());
        relay_status_of(&b, wb, "other-after");
        assert_eq!(b.next().await["params"]["threadId"], "other-after");
        b.send(Message::text("{not json"));
        assert_eq!(b.next().await["error"]["code"], codes::PARSE_ERROR);
        assert!(!b.session.is_finished());
    }

    /// Broadcasts relayed together reach the client in one flush, in order (a big tenant's
    /// sessions each get many status changes at once: one TLS record and one system call for
    /// them, not one each), and a burst is bounded.
    #[tokio::test(start_paused = true)]
    async fn broadcasts_relayed_together_reach_the_client_in_one_flush_in_order() {
        let mut h = start_as("", "", Vec::new(), true).await;
        for (sent, want_flushes) in [(10, 1), (2 * RELAY_BURST + 1, 3)] {
            settle().await; // the session waits on its client, its legs and the relay
            let before = h.flushes.load(std::sync::atomic::Ordering::Relaxed);
            for n in 0..sent {
                relay_status(&h, n);
            }
            for n in 0..sent {
                let v = h.next().await;
                assert_eq!(v["params"]["threadId"], format!("th-{n}"), "{v}");
            }
            settle().await;
            assert!(h.from_session.try_recv().is_err(), "each once");
            assert_eq!(
                h.flushes.load(std::sync::atomic::Ordering::Relaxed) - before,
                want_flushes,
                "{sent} relayed broadcasts"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_frame_flood_is_closed_and_the_rate_refills_with_time() {
        let mut h = start("conn_fps = 10\nconn_burst = 5").await;
        // Five frames of burst (notifications before initialize: ignored, but counted).
        for _ in 0..5 {
            h.send(Message::text(r#"{"method":"x/ping"}"#));
        }
        settle().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        // A second later the bucket is full again: five more are fine.
        for _ in 0..5 {
            h.send(Message::text(r#"{"method":"x/ping"}"#));
        }
        settle().await;
        assert!(
            h.from_session.try_recv().is_err(),
            "within the rate nothing is refused and nothing closes"
        );
        for _ in 0..10 {
            h.send(Message::text(r#"{"method":"x/ping"}"#));
        }
        let closed = h.next().await;
        assert!(closed.get("close").is_some(), "{closed}");
        assert_eq!(h.session.await.unwrap(), End::Flooded);
    }

    /// A future is moved whole at the await that builds it, and a session's task holds its own
    /// for the session's life. A rare path awaited inline (a leg's handshake, a fan-out) once made
    /// each future on a round trip's path 3.5–4.3 KB: a `memcpy` of 3.3 KB per answer, about 270
    /// of the data lines a cold round trip fetched, and 3 KiB on every idle connection
    /// (BENCHMARKS.md, "Futures moved whole"). Those paths are boxed where they are awaited; this
    /// keeps them so. The bounds leave room for growth, not for another inline handshake.
    #[tokio::test]
    async fn the_futures_on_a_round_trip_s_path_stay_small() {
        use std::mem::size_of_val;
        const PER_FRAME: usize = 2048;
        const SESSION_TASK: usize = 6 * 1024;
        let process = Process::new("", "", "");
        let mut session = process.unstarted("acme");
        let mut legs = legs::LegSet::default();
        let mut relay = Relay::new(session.ctx.tenant.subscribe());
        let mut relayed = Gate::new();
        let worker = WorkerId::new("acme", 0, 1);
        // Each future is built and dropped in its own statement: it borrows the session.
        let client_frame = size_of_val(&session.on_client_frame(None));
        let closed = LegEvent::Closed(worker, String::new());
        let leg_events = size_of_val(&session.on_leg_events(closed, &mut legs));
        let answer = Utf8Bytes::from_static("{}");
        let worker_frame = size_of_val(&session.on_worker_frame(worker, &answer));
        let relayed_burst = size_of_val(&session.on_relayed_burst(None, &mut relayed, &mut relay));
        let per_frame = [
            ("on_client_frame", client_frame),
            ("on_leg_events", leg_events),
            ("on_worker_frame", worker_frame),
            ("on_relayed_burst", relayed_burst),
        ];
        let (tx, _rx) = chan::unbounded_channel();
        let sink = Recording {
            tx,
            unflushed: false,
            flushes: Arc::default(),
        };
        let stream = futures_util::stream::pending::<Result<Message, WsError>>();
        let task = size_of_val(&run(session, sink, stream));
        eprintln!("measured: {per_frame:?}, the session's task {task} bytes");
        for (name, size) in per_frame {
            assert!(size <= PER_FRAME, "{name}'s future is {size} bytes");
        }
        assert!(task <= SESSION_TASK, "the session's task is {task} bytes");
    }
}

/// Approvals are forgotten when they are resolved, when their turn ends and when
/// their worker is lost, so no decision goes unaudited however many prompts came before; at the
/// bound of live prompts the session ends rather than forget one.
mod approvals {
    use super::in_memory::{start_with, Harness};
    use super::*;
    use serde_json::Value;
    use tokio::sync::mpsc as chan;

    /// A fake worker: what the test writes is what the session reads from that worker's leg.
    pub(super) struct FakeWorker {
        id: WorkerId,
        tx: chan::UnboundedSender<LegEvent>,
    }

    pub(super) fn fake_worker(n: u32) -> (FakeWorker, legs::LegFrames) {
        let (tx, rx) = chan::unbounded_channel();
        let frames = Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|e| (e, rx))
        }));
        let id = WorkerId::new("acme", n, 1);
        (FakeWorker { id, tx }, frames)
    }

    impl FakeWorker {
        pub(super) fn send(&self, v: Value) {
            let text = v.to_string();
            self.tx.send(LegEvent::Frame(self.id, text.into())).unwrap();
        }

        pub(super) fn approval(&self, id: i64, thread: &str) {
            self.send(json!({
                "id": id,
                "method": "item/commandExecution/requestApproval",
                "params": {
                    "threadId": thread, "turnId": "turn-1", "itemId": format!("call-{id}"),
                    "command": format!("touch /tmp/x{id}"), "cwd": "/w", "reason": "r",
                },
            }));
        }

        fn resolved(&self, id: i64, thread: &str) {
            self.send(json!({
                "method": "serverRequest/resolved",
                "params": { "threadId": thread, "requestId": id },
            }));
        }
    }

    /// The audit log's events once it holds at least `want` of `event` (the writer is a thread;
    /// the session task runs between looks).
    async fn audit_events(path: &std::path::Path, event: &str, want: usize) -> Vec<Value> {
        for _ in 0..400 {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let all: Vec<Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if all.iter().filter(|e| e["event"] == event).count() >= want {
                return all;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("fewer than {want} {event} in the audit log");
    }

    fn count(events: &[Value], event: &str, why: Option<&str>) -> usize {
        events
            .iter()
            .filter(|e| e["event"] == event && why.is_none_or(|w| e["why"] == w))
            .count()
    }

    const AUDIT: &str = "[audit]\npath = \"{dir}/audit.log\"\nqueue = 1000000";

    /// A tenant denied at a rate its admission allows gets a burst of `access.denied` records,
    /// then a tenth of a second each; the denials in between are counted by the session denied,
    /// into its own next record (never a colleague's) or, when it ends first, a record of their
    /// own; and every denial is still answered.
    #[tokio::test(start_paused = true)]
    async fn a_tenants_denials_are_recorded_at_a_bounded_rate_and_none_goes_uncounted() {
        use super::in_memory::Process;
        use crate::audit::denials::BURST;
        let p = Process::new(
            "conn_fps = 100000\nconn_burst = 100000\ntenant_rps = 100000\ntenant_burst = 100000\nturn_start_per_min = 100000\nturn_start_burst = 100000",
            AUDIT,
            "",
        );
        let as_subject = |subject: &str| {
            let mut s = p.unstarted("acme");
            s.ctx.subject = subject.into();
            p.run(s, Vec::new(), false)
        };
        let mut flooder = as_subject("flooder");
        let mut colleague = as_subject("colleague");
        let log = flooder.dir().join("audit.log");
        /// Sends `ids.len()` requests the policy denies.
        fn deny(h: &mut Harness, ids: std::ops::Range<u32>) -> usize {
            let n = ids.len();
            for id in ids {
                h.send(Message::text(
                    json!({
                        "id": id, "method": "turn/start",
                        "params": { "threadId": "t", "input": [{ "type": "localImage", "path": "/etc/passwd" }] },
                    })
                    .to_string(),
                ));
            }
            n
        }
        /// The next `n` answers are denials.
        async fn answered(h: &mut Harness, n: usize) {
            for _ in 0..n {
                let answer = h.next().await;
                assert_eq!(answer["error"]["code"], -32003, "{answer}");
            }
        }
        let flood = 3 * BURST.get();
        let n = deny(&mut flooder, 0..flood + 50);
        answered(&mut flooder, n).await;
        let events = audit_events(&log, "access.denied", BURST.get() as usize).await;
        assert_eq!(count(&events, "access.denied", None), BURST.get() as usize);
        assert!(events.iter().all(|e| e.get("suppressed").is_none()));
        /// A tenth of a second on (one record's allowance), one denial of `h`'s: the record
        /// it gets, the `nth` after the burst.
        async fn next_record(h: &mut Harness, log: &std::path::Path, nth: usize) -> Value {
            tokio::time::advance(Duration::from_millis(100)).await;
            deny(h, 0..1);
            answered(h, 1).await;
            let events = audit_events(log, "access.denied", BURST.get() as usize + nth).await;
            events
                .into_iter()
                .rfind(|e| e["event"] == "access.denied")
                .unwrap()
        }
        // The next record is the colleague's: it carries none of the flooder's count.
        let last = next_record(&mut colleague, &log, 1).await;
        assert_eq!(last["subject"], "colleague", "{last}");
        assert!(last.get("suppressed").is_none(), "{last}");
        // The flooder's next record carries its own.
        let last = next_record(&mut flooder, &log, 2).await;
        assert_eq!(last["subject"], "flooder", "{last}");
        assert_eq!(last["suppressed"], 2 * BURST.get() + 50, "{last}");
        assert_eq!(last["tenant"], "acme", "{last}");
        // Denials that no later record carries are written when the session ends.
        let n = deny(&mut flooder, 0..7);
        answered(&mut flooder, n).await;
        flooder.send(Message::Close(None));
        assert_eq!(flooder.session.await.unwrap(), End::ClientGone);
        let events = audit_events(&log, "access.denied.suppressed", 1).await;
        let flushed = events
            .iter()
            .find(|e| e["event"] == "access.denied.suppressed")
            .unwrap();
        assert_eq!(flushed["count"], 7, "{flushed}");
        assert_eq!(flushed["subject"], "flooder", "{flushed}");
        assert_eq!(
            count(&events, "access.denied", None),
            BURST.get() as usize + 2
        );
    }

    /// The session's next text frame; the approvals of this test come one at a time.
    async fn next_request_id(h: &mut Harness) -> i64 {
        let v = h.next().await;
        v["id"]
            .as_i64()
            .unwrap_or_else(|| panic!("a server request: {v}"))
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_after_thousands_of_prompts_resolved_otherwise_is_still_audited() {
        let (w1, leg1) = fake_worker(1);
        let (w2, leg2) = fake_worker(2);
        let mut h = start_with(
            "conn_fps = 100000\nconn_burst = 100000",
            AUDIT,
            vec![leg1, leg2],
        )
        .await;
        let log = h.dir().join("audit.log");
        let rounds = MAX_APPROVALS as i64 + 100;
        // Resolved by another subscriber (or aborted): serverRequest/resolved.
        for n in 0..rounds {
            w1.approval(n, "th-1");
            let sid = next_request_id(&mut h).await;
            w1.resolved(n, "th-1");
            let resolved = h.next().await;
            assert_eq!(resolved["params"]["requestId"], sid, "{resolved}");
        }
        // Aborted by the end of their turn, without a resolution the session saw.
        for n in rounds..2 * rounds {
            w1.approval(n, "th-2");
            next_request_id(&mut h).await;
            if n % (MAX_APPROVALS as i64 / 2) == 0 {
                w1.send(json!({"method": "turn/completed", "params": {"threadId": "th-2", "turn": {"id": "turn-1"}}}));
                h.next().await;
            }
        }
        w1.send(json!({"method": "turn/completed", "params": {"threadId": "th-2", "turn": {"id": "turn-1"}}}));
        h.next().await;
        // Lost with their worker.
        for n in 0..(MAX_APPROVALS as i64 - 1) {
            w2.approval(n, "th-3");
            next_request_id(&mut h).await;
        }
        w2.tx
            .send(LegEvent::Closed(w2.id, "worker exited".into()))
            .unwrap();
        for _ in 0..(MAX_APPROVALS - 1) {
            let v = h.next().await;
            assert_eq!(v["method"], "serverRequest/resolved", "{v}");
        }
        // One more prompt, answered: its decision is audited.
        w1.approval(1_000_000, "th-4");
        let sid = next_request_id(&mut h).await;
        h.send(Message::text(
            json!({"id": sid, "result": {"decision": "accept"}}).to_string(),
        ));
        let events = audit_events(&log, "approval.answered", 1).await;
        let answered: Vec<&Value> = events
            .iter()
            .filter(|e| e["event"] == "approval.answered")
            .collect();
        assert_eq!(answered.len(), 1, "the answered approval is audited");
        assert_eq!(answered[0]["decision"], "accept");
        assert_eq!(answered[0]["command"], "touch /tmp/x1000000");
        assert_eq!(answered[0]["thread"], "th-4");
        let requested = count(&events, "approval.requested", None);
        assert_eq!(requested as i64, 2 * rounds + MAX_APPROVALS as i64);
        assert_eq!(
            count(&events, "approval.withdrawn", Some("resolved")) as i64,
            rounds
        );
        assert_eq!(
            count(&events, "approval.withdrawn", Some("turn_ended")) as i64,
            rounds
        );
        assert_eq!(
            count(&events, "approval.withdrawn", Some("worker_lost")),
            MAX_APPROVALS - 1
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_live_prompts_ends_the_session_rather_than_forget_one() {
        let (w1, leg1) = fake_worker(1);
        let mut h = start_with("conn_fps = 100000\nconn_burst = 100000", AUDIT, vec![leg1]).await;
        let log = h.dir().join("audit.log");
        for n in 0..MAX_APPROVALS as i64 {
            w1.approval(n, "th-1");
            next_request_id(&mut h).await;
        }
        // Other server requests are no approvals and do not count.
        w1.send(json!({"id": 5000, "method": "item/tool/call", "params": {"threadId": "th-1"}}));
        next_request_id(&mut h).await;
        w1.approval(MAX_APPROVALS as i64, "th-1");
        let closed = h.next().await;
        assert_eq!(closed["close"], 1008, "{closed}");
        assert_eq!(h.session.await.unwrap(), End::TooManyPrompts);
        let events = audit_events(&log, "approval.withdrawn", 1).await;
        assert_eq!(
            count(&events, "approval.requested", None),
            MAX_APPROVALS + 1
        );
        assert_eq!(
            count(&events, "approval.withdrawn", Some("too_many_pending")),
            1
        );
    }

    #[test]
    fn the_table_withdraws_a_thread_s_prompts_at_its_turn_end_and_keeps_unanswered_approvals() {
        let mut s = ServerRequests::default();
        let (w1, w2) = (WorkerId::new("t", 1, 1), WorkerId::new("t", 2, 1));
        let asked = || Some(json!({"method": "item/commandExecution/requestApproval"}));
        let a = s
            .insert(w1, RequestId::Int(0), Some("th".into()), asked())
            .unwrap();
        let other_worker = s
            .insert(w2, RequestId::Int(0), Some("th".into()), asked())
            .unwrap();
        let other_thread = s
            .insert(w1, RequestId::Int(1), Some("th-2".into()), None)
            .unwrap();
        assert_eq!(
            s.turn_ended(w1, "th"),
            vec![Withdrawn {
                sid: a,
                thread: Some("th".into()),
                approval: asked()
            }]
        );
        assert_eq!(s.approvals(), 1);
        assert_eq!(
            s.take(a),
            None,
            "no answer to a withdrawn prompt is forwarded"
        );
        assert_eq!(
            s.resolved(w1, RequestId::Int(0)),
            Some((a, None)),
            "a resolution after the turn's end still carries the session's id"
        );
        assert!(s.take(other_worker).is_some_and(|t| t.2.is_some()));
        assert_eq!(s.approvals(), 0, "an answered approval no longer counts");
        assert_eq!(
            s.resolved(w1, RequestId::Int(1)),
            Some((other_thread, None))
        );
        // Full of other requests: answered or withdrawn ones make room first, then the oldest
        // that is no unanswered approval.
        let mut s = ServerRequests::default();
        let first = s.insert(w1, RequestId::Int(-1), None, asked()).unwrap();
        let live = s.insert(w1, RequestId::Int(-2), None, None).unwrap();
        let answered = s.insert(w1, RequestId::Int(-3), None, None).unwrap();
        s.take(answered);
        for n in 0..(MAX_SERVER_REQUESTS as i64 - 3) {
            s.insert(w1, RequestId::Int(n), None, None).unwrap();
        }
        assert_eq!(s.by_session.len(), MAX_SERVER_REQUESTS);
        s.insert(w1, RequestId::Int(100_000), None, None).unwrap();
        assert!(
            !s.by_session.contains_key(&answered),
            "the answered one made room"
        );
        assert!(s.by_session.contains_key(&live));
        s.insert(w1, RequestId::Int(100_001), None, None).unwrap();
        assert!(
            !s.by_session.contains_key(&live),
            "then the oldest live non-approval"
        );
        assert!(s.by_session.contains_key(&first), "the approval stays");
        assert_eq!(s.by_session.len(), MAX_SERVER_REQUESTS);
        assert_eq!(s.approvals(), 1);
    }
}

/// What workers send reaches the client in each worker's order, once each, however the session
/// batches its writes: a property any rework of the hot path or of the modules must keep.
mod order {
    use super::approvals::fake_worker;
    use super::in_memory::start_with;
    use super::*;
    use serde_json::Value;

    const OPEN: &str = "conn_fps = 100000\nconn_burst = 100000";

    fn completed(thread: &str, item: &str) -> Value {
        json!({
            "method": "item/completed",
            "params": { "threadId": thread, "turnId": "turn-1", "item": { "id": item } },
        })
    }

    #[tokio::test(start_paused = true)]
    async fn each_worker_s_frames_reach_the_client_in_its_order_exactly_once() {
        let (w1, leg1) = fake_worker(1);
        let (w2, leg2) = fake_worker(2);
        let mut h = start_with(OPEN, "", vec![leg1, leg2]).await;
        const N: usize = 600;
        for n in 0..N {
            w1.send(completed("th-1", &format!("{n}")));
            w2.send(completed("th-2", &format!("{n}")));
        }
        let mut got: HashMap<String, Vec<usize>> = HashMap::new();
        for _ in 0..2 * N {
            let v = h.next().await;
            let thread = v["params"]["threadId"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let item = v["params"]["item"]["id"]
                .as_str()
                .and_then(|s| s.parse().ok());
            got.entry(thread)
                .or_default()
                .push(item.unwrap_or(usize::MAX));
        }
        let want: Vec<usize> = (0..N).collect();
        assert_eq!(
            got.get("th-1"),
            Some(&want),
            "worker 1's frames in order, once each"
        );
        assert_eq!(
            got.get("th-2"),
            Some(&want),
            "worker 2's frames in order, once each"
        );
        assert!(h.from_session.try_recv().is_err(), "nothing more");
    }

    /// A server request is rewritten to the session's id on its way, and keeps its place among
    /// the notifications around it.
    #[tokio::test(start_paused = true)]
    async fn a_rewritten_server_request_keeps_its_place_among_notifications() {
        let (w1, leg1) = fake_worker(1);
        let mut h = start_with(OPEN, "", vec![leg1]).await;
        w1.send(completed("th-1", "before"));
        w1.approval(41, "th-1");
        w1.send(completed("th-1", "after"));
        assert_eq!(h.next().await["params"]["item"]["id"], "before");
        let asked = h.next().await;
        assert_eq!(
            asked["method"], "item/commandExecution/requestApproval",
            "{asked}"
        );
        assert!(asked["id"].is_i64(), "{asked}");
        assert_ne!(
            asked["id"], 41,
            "the worker's id is not the session's: {asked}"
        );
        assert_eq!(h.next().await["params"]["item"]["id"], "after");
    }
}
