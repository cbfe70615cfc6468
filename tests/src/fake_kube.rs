//! An in-process fake Kubernetes API server for the kubernetes nodes backend
//! (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md), on
//! loopback, plain HTTP, speaking the real wire format of what the backend uses: create, get,
//! delete, list and watch (`?watch=true`, JSON lines) of pods and persistentvolumeclaims, with
//! `resourceVersion`s, `409 AlreadyExists`, `404 NotFound`, a uid precondition on delete,
//! `410 Gone` for a watch from a compacted `resourceVersion`, and `403 Forbidden` for a claim
//! created while the storage quota is full (before the exists check, as a real one answers);
//! pod creates can be refused 403 (PodSecurity), 422 (invalid) or 429 (too many requests);
//! pods can stay Pending unschedulable or fail their image pull (ErrImagePull, ImagePullBackOff).
//!
//! Its "kubelet" runs each created pod as a real process: [`PodInfo`] (the pod's name, its own
//! loopback address 127.0.0.N, its container args, its volume claim) goes to the test's
//! [`Kubelet`], which returns the command and the admin address to probe; the pod is `Pending`
//! until the process runs, `Running` once it does, `Ready` while its `/readyz` answers 200,
//! `Succeeded` when it exits 0, `Failed` otherwise. Tests can evict or delete pods, fail API
//! requests with 500 and expire watches.
//!
//! As a cluster does: objects live per namespace (a list, watch, get or delete sees
//! its own namespace only); a delete is graceful (`deletionTimestamp`, the grace period, SIGTERM,
//! SIGKILL when it is over, the pod gone once its process is; `gracePeriodSeconds: 0` forces it)
//! and a Terminating pod keeps its name; a machine can be lost (SIGSTOP, Ready False, deletes
//! never confirmed); watches end at `timeoutSeconds` or the fake's cap, with a BOOKMARK when
//! asked for, and history can be compacted under open watches.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

mod https;
pub use https::{write_service_account, write_token, HttpsApi, SERVICE_ACCOUNT_DIR};

/// The namespace the test helpers ([`FakeKube::pod`], [`FakeKube::delete_pod`], …) mean: the
/// test cluster's ([`crate::kube_cluster`]).
pub const NAMESPACE: &str = "codex";

/// A created pod, for the kubelet.
#[derive(Debug, Clone)]
pub struct PodInfo {
    /// metadata.name
    pub name: String,
    /// metadata.namespace
    pub namespace: String,
    /// Its tenant label.
    pub tenant: String,
    /// Its address (each pod its own 127.0.0.N).
    pub ip: Ipv4Addr,
    /// The `node` container's args.
    pub args: Vec<String>,
    /// The `node` container's `env` (name, value), as a kubelet sets it.
    pub env: Vec<(String, String)>,
    /// The claim of its `home` volume.
    pub claim: String,
}

/// Runs a pod: the command to start, and the admin address whose `/readyz` makes it ready.
pub type Kubelet =
    Arc<dyn Fn(&PodInfo) -> anyhow::Result<(tokio::process::Command, SocketAddr)> + Send + Sync>;

type Body = BoxBody<Bytes, Infallible>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Pod,
    Pvc,
}

impl Kind {
    fn of(resource: &str) -> Option<Kind> {
        match resource {
            "pods" => Some(Kind::Pod),
            "persistentvolumeclaims" => Some(Kind::Pvc),
            _ => None,
        }
    }
    fn list_kind(self) -> &'static str {
        match self {
            Kind::Pod => "PodList",
            Kind::Pvc => "PersistentVolumeClaimList",
        }
    }
}

#[derive(Clone, Debug)]
struct WatchEvent {
    rv: u64,
    kind: Kind,
    ty: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(u8, String), Value>,
    log: Vec<WatchEvent>,
    /// Watches from a resourceVersion at or below this get 410 Gone.
    compacted: u64,
    next_ip: u8,
    pod_creates: usize,
    pvc_creates: usize,
    /// Deletes with `gracePeriodSeconds: 0` of a pod that existed.
    force_deletes: usize,
    /// Pod name → its process's controls (while the kubelet runs it).
    running: HashMap<String, PodCtl>,
    /// The processes of force-deleted pods on lost machines (killed when the fake stops).
    frozen: Vec<CancellationToken>,
    /// Pod name → a podIP to report instead of its own (a hostile test).
    ip_override: HashMap<String, Ipv4Addr>,
    fail_next: usize,
    /// Pods the kubelet does not start (their process "hangs" in Pending).
    hold: bool,
    /// The namespace's storage quota is used up: every claim create is 403 Forbidden, the
    /// existing claim's too (quota admission runs before the exists check, as a real API
    /// server's does).
    storage_quota_full: bool,
    /// The next this many pod creates are answered with this status (admission refusing them).
    pod_create_refusals: Option<(u16, usize)>,
    /// New pods cannot pull their image: ErrImagePull, then ImagePullBackOff, no process.
    pull_failures: bool,
    /// The API server is down: every request is answered 503 (its pods run on).
    outage: bool,
    /// Every watch ends after at most this long (an API server's request timeout).
    watch_cap: Option<Duration>,
    /// New watch requests wait (up to 10 s) while set.
    hold_watches: bool,
    /// Watches open now (streaming).
    open_watches: usize,
    /// The resourceVersion of the last BOOKMARK sent.
    last_bookmark: u64,
    /// New claims are Pending (not bound to a volume) until [`FakeKube::bind_claim`].
    claims_pending: bool,
    /// Pods waiting for their claim (a claim's full name → the pods and their uids).
    waiting_for_claim: Vec<(String, PodInfo, String)>,
}

/// What the API server and the tests can do to a running pod's process.
#[derive(Clone, Default)]
struct PodCtl {
    /// SIGKILL (grace period over, force delete, eviction).
    kill: CancellationToken,
    /// SIGTERM (a graceful delete).
    term: CancellationToken,
    /// Its machine is lost: the process is SIGSTOPped, the kubelet reports nothing more and
    /// carries out no more deletes (the pod stays Terminating until force-deleted).
    lost: CancellationToken,
}

/// Objects are stored per namespace: `namespace/name`.
fn key(kind: Kind, full: &str) -> (u8, String) {
    (kind as u8, full.to_owned())
}

fn full(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

fn short_of(full: &str) -> &str {
    full.rsplit('/').next().unwrap_or(full)
}

struct Inner {
    store: Mutex<Store>,
    events: broadcast::Sender<WatchEvent>,
    /// Cancelled (and replaced) to end every open watch.
    watches: Mutex<CancellationToken>,
    kubelet: Kubelet,
    requests: Mutex<Vec<String>>,
    /// Events written (`events.k8s.io/v1`).
    events_log: Mutex<Vec<Value>>,
    /// Pod creates held until this many have arrived (see [`FakeKube::gather_pod_creates`]):
    /// (needed, arrived).
    gather: Mutex<Option<(usize, usize)>>,
    /// Wakes the held pod creates once they are gathered.
    gathered: tokio::sync::Notify,
    /// Wakes held watch requests.
    watches_released: tokio::sync::Notify,
}

/// The fake API server.
pub struct FakeKube {
    /// Its address (`http://ADDR`).
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    stop: CancellationToken,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.stop.cancel();
        let s = self.inner.store();
        for t in s.running.values() {
            t.kill.cancel();
        }
        for t in &s.frozen {
            t.cancel();
        }
    }
}

impl Inner {
    /// Ends every open watch (clients relist or resume from their last resourceVersion).
    fn end_watches(&self) {
        let mut w = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
        w.cancel();
        *w = CancellationToken::new();
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records an event at a new resourceVersion (stamped into the object).
    fn emit(&self, s: &mut Store, kind: Kind, ty: &'static str, mut object: Value) -> Value {
        s.rv += 1;
        object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        let ev = WatchEvent {
            rv: s.rv,
            kind,
            ty,
            object: object.clone(),
        };
        s.log.push(ev.clone());
        let _receivers = self.events.send(ev);
        object
    }

    /// Changes a pod's status (if it still exists with `uid`).
    fn set_status(&self, name: &str, uid: &str, f: impl FnOnce(&mut Value)) {
        let mut s = self.store();
        let Some(mut pod) = s.objects.get(&key(Kind::Pod, name)).cloned() else {
            return;
        };
        if pod["metadata"]["uid"] != uid {
            return;
        }
        f(&mut pod["status"]);
        if let Some(ip) = s.ip_override.get(name) {
            if pod["status"]["podIP"].is_string() {
                pod["status"]["podIP"] = json!(ip.to_string());
            }
        }
        let pod = self.emit(&mut s, Kind::Pod, "MODIFIED", pod);
        s.objects.insert(key(Kind::Pod, name), pod);
    }
}

fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    respond(code, &body)
}

fn respond(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    let decode = |s: &str| {
        let s = s.replace('+', " ");
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' && i + 2 < b.len() {
                if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                    out.push(v);
                    i += 3;
                    continue;
                }
            }
            out.push(b[i]);
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// `key`, `key=value`, `key!=value`, comma-separated (all must hold).
fn selects(selector: Option<&String>, object: &Value) -> bool {
    let Some(selector) = selector.filter(|s| !s.is_empty()) else {
        return true;
    };
    let labels = &object["metadata"]["labels"];
    selector.split(',').all(|term| {
        if let Some((k, v)) = term.split_once("!=") {
            labels[k] != v
        } else if let Some((k, v)) = term.split_once('=') {
            labels[k.trim_end_matches('=')] == v
        } else {
            labels.get(term).is_some()
        }
    })
}

impl FakeKube {
    /// Starts it on 127.0.0.1 with `kubelet` running the pods.
    pub async fn start(kubelet: Kubelet) -> anyhow::Result<FakeKube> {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = tcp.local_addr()?;
        let (events, _) = broadcast::channel(1024);
        let inner = Arc::new(Inner {
            store: Mutex::new(Store {
                next_ip: 10,
                ..Store::default()
            }),
            events,
            watches: Mutex::new(CancellationToken::new()),
            kubelet,
            requests: Mutex::new(Vec::new()),
            events_log: Mutex::new(Vec::new()),
            gather: Mutex::new(None),
            gathered: tokio::sync::Notify::new(),
            watches_released: tokio::sync::Notify::new(),
        });
        let stop = CancellationToken::new();
        let (inner2, stop2) = (inner.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (conn, _) = tokio::select! {
                    r = tcp.accept() => match r { Ok(c) => c, Err(_) => continue },
                    () = stop2.cancelled() => return,
                };
                let inner = inner2.clone();
                let stop = stop2.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let inner = inner.clone();
                        let stop = stop.clone();
                        async move { Ok::<_, Infallible>(handle(inner, stop, req).await) }
                    });
                    let _served = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(conn), svc)
                        .await;
                });
            }
        });
        Ok(FakeKube { addr, inner, stop })
    }

    /// `http://ADDR`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A pod of [`NAMESPACE`], as the server has it.
    pub fn pod(&self, name: &str) -> Option<Value> {
        self.pod_in(NAMESPACE, name)
    }

    /// A pod of `namespace`, as the server has it.
    pub fn pod_in(&self, namespace: &str, name: &str) -> Option<Value> {
        self.inner
            .store()
            .objects
            .get(&key(Kind::Pod, &full(namespace, name)))
            .cloned()
    }

    /// Whether a volume claim of this name exists.
    pub fn pvc_exists(&self, name: &str) -> bool {
        self.inner
            .store()
            .objects
            .contains_key(&key(Kind::Pvc, &full(NAMESPACE, name)))
    }

    /// Names of the pods of [`NAMESPACE`] that exist.
    pub fn pod_names(&self) -> Vec<String> {
        let prefix = full(NAMESPACE, "");
        self.inner
            .store()
            .objects
            .keys()
            .filter(|(k, _)| *k == Kind::Pod as u8)
            .filter_map(|(_, n)| n.strip_prefix(&prefix).map(str::to_owned))
            .collect()
    }

    /// Successful pod creations so far.
    pub fn pod_creates(&self) -> usize {
        self.inner.store().pod_creates
    }

    /// Force deletes (`gracePeriodSeconds: 0`) of a pod so far.
    pub fn force_deletes(&self) -> usize {
        self.inner.store().force_deletes
    }

    /// Successful claim creations so far.
    pub fn pvc_creates(&self) -> usize {
        self.inner.store().pvc_creates
    }

    /// Every request so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.inner
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The Events written so far about object `name`: (type, reason, note).
    pub fn events_about(&self, name: &str) -> Vec<(String, String, String)> {
        let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
        self.inner
            .events_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|e| e["regarding"]["name"] == name)
            .map(|e| (s(&e["type"]), s(&e["reason"]), s(&e["note"])))
            .collect()
    }

    /// The next `n` API requests are answered 500.
    pub fn fail_next(&self, n: usize) {
        self.inner.store().fail_next = n;
    }

    /// Ends every open watch and forgets the history: a watch resumed from any earlier
    /// resourceVersion gets 410 Gone and must list again.
    pub fn expire_watches(&self) {
        {
            let mut s = self.inner.store();
            s.compacted = s.rv;
            // Lists from now on are newer than anything forgotten.
            s.rv += 1;
        }
        self.end_watches();
    }

    /// Ends every open watch (clients relist or resume from their last resourceVersion).
    fn end_watches(&self) {
        self.inner.end_watches();
    }

    /// New claims are created Pending (no volume bound yet) while set; their pods stay Pending
    /// and unschedulable until [`FakeKube::bind_claim`].
    pub fn claims_pending(&self, pending: bool) {
        self.inner.store().claims_pending = pending;
    }

    /// Binds claim `name` of [`NAMESPACE`] (its volume is provisioned): the pods waiting for it
    /// are scheduled and started. False when there is no such claim.
    pub fn bind_claim(&self, name: &str) -> bool {
        let claim = full(NAMESPACE, name);
        let mut s = self.inner.store();
        let Some(mut pvc) = s.objects.get(&key(Kind::Pvc, &claim)).cloned() else {
            return false;
        };
        if pvc["status"]["phase"] != "Bound" {
            pvc["status"]["phase"] = json!("Bound");
            let pvc = self.inner.emit(&mut s, Kind::Pvc, "MODIFIED", pvc);
            s.objects.insert(key(Kind::Pvc, &claim), pvc);
        }
        schedule_waiting(&self.inner, &mut s, &claim);
        true
    }

    /// Caps every watch from now on at `cap` (as an API server's request timeout does; the
    /// client's own `timeoutSeconds` is honoured too) and ends the open ones.
    pub fn cap_watches(&self, cap: Duration) {
        self.inner.store().watch_cap = Some(cap);
        self.end_watches();
    }

    /// New watch requests wait while held (at most 10 s), so changes can fall between two
    /// watches.
    pub fn hold_watches(&self, hold: bool) {
        self.inner.store().hold_watches = hold;
        if !hold {
            self.inner.watches_released.notify_waiters();
        }
    }

    /// Watches streaming now.
    pub fn open_watches(&self) -> usize {
        self.inner.store().open_watches
    }

    /// The resourceVersion of the last BOOKMARK event sent (0: none).
    pub fn last_bookmark(&self) -> u64 {
        self.inner.store().last_bookmark
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.inner.store().rv
    }

    /// Compacts the history as etcd does, without ending any watch: a watch (or a resumed one)
    /// from before the current resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        let mut s = self.inner.store();
        s.compacted = s.rv.saturating_sub(1);
    }

    /// New pods stay Pending and unschedulable, with no process, while held (a full cluster).
    pub fn hold_pods(&self, hold: bool) {
        self.inner.store().hold = hold;
    }

    /// The namespace's storage quota is (or is no longer) used up: creating any claim, an
    /// existing one included, is answered 403 Forbidden.
    pub fn storage_quota_full(&self, full: bool) {
        self.inner.store().storage_quota_full = full;
    }

    /// The next `n` pod creates are held until all `n` have arrived (at most 10 s), then served
    /// in arrival order: racing creators of one pod all reach the API server, as they do when
    /// neither has seen the other's pod yet, and all but the first get `409 AlreadyExists`.
    pub fn gather_pod_creates(&self, n: usize) {
        *self
            .inner
            .gather
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((n, 0));
    }

    /// The next `n` pod creates are refused with `code`, as admission or validation would:
    /// 403 (PodSecurity), 422 (invalid), 429 (too many requests), others as 500s are.
    pub fn refuse_pod_creates(&self, code: u16, n: usize) {
        self.inner.store().pod_create_refusals = Some((code, n));
    }

    /// The API server goes down (every request 503, open watches end) or comes back; the pods
    /// and their processes run on, as a control-plane outage leaves them.
    pub fn outage(&self, down: bool) {
        self.inner.store().outage = down;
        if down {
            self.end_watches();
        }
    }

    /// New pods cannot pull their image (or, with false, can again): they stay Pending with
    /// ErrImagePull, then ImagePullBackOff, as a kubelet reports a missing image.
    pub fn fail_image_pulls(&self, fail: bool) {
        self.inner.store().pull_failures = fail;
    }

    /// Report `ip` as the podIP of pod `name` (a lying or confused kubelet).
    pub fn override_ip(&self, name: &str, ip: Ipv4Addr) {
        self.inner
            .store()
            .ip_override
            .insert(full(NAMESPACE, name), ip);
    }

    /// Evicts a pod: its process is killed, it becomes Failed with reason Evicted.
    pub fn evict(&self, name: &str) {
        let stop = self.inner.store().running.remove(&full(NAMESPACE, name));
        if let Some(pod) = self.pod(name) {
            let uid = pod["metadata"]["uid"].as_str().unwrap_or("").to_owned();
            self.inner.set_status(&full(NAMESPACE, name), &uid, |st| {
                st["phase"] = json!("Failed");
                st["reason"] = json!("Evicted");
                st["conditions"] = json!([{ "type": "Ready", "status": "False" }]);
            });
        }
        if let Some(stop) = stop {
            stop.kill.cancel();
        }
    }

    /// Deletes a pod as `kubectl delete pod` does: gracefully, with the pod's own
    /// `terminationGracePeriodSeconds` (see [`delete`]).
    pub fn delete_pod(&self, name: &str) -> bool {
        delete(&self.inner, Kind::Pod, &full(NAMESPACE, name), None, None).status()
            == StatusCode::OK
    }

    /// Deletes a pod with this grace period (`kubectl delete --grace-period=N`; 0 with
    /// `--force` removes it at once, whatever its machine does).
    pub fn delete_pod_with_grace(&self, name: &str, grace: u64) -> bool {
        delete(
            &self.inner,
            Kind::Pod,
            &full(NAMESPACE, name),
            None,
            Some(grace),
        )
        .status()
            == StatusCode::OK
    }

    /// The pod's machine is lost (powered off, partitioned): its process is frozen (SIGSTOP:
    /// its connections stay open and answer nothing, as to a machine that is gone), its kubelet
    /// reports nothing more, and the node lifecycle controller marks it not Ready (`Ready`
    /// False, as `MarkPodsNotReady` does; the Node's own Ready is what goes Unknown). A delete
    /// then leaves it Terminating for good (no kubelet confirms it) until it is force-deleted.
    pub fn lose_machine(&self, name: &str) -> bool {
        let Some(ctl) = self
            .inner
            .store()
            .running
            .get(&full(NAMESPACE, name))
            .cloned()
        else {
            return false;
        };
        ctl.lost.cancel();
        true
    }

    /// Whether the pod's process has been signalled SIGTERM (a graceful delete reached it).
    pub fn terminated(&self, name: &str) -> bool {
        self.inner
            .store()
            .running
            .get(&full(NAMESPACE, name))
            .is_some_and(|c| c.term.is_cancelled())
    }
}

async fn handle(
    inner: Arc<Inner>,
    stop: CancellationToken,
    req: Request<Incoming>,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    inner
        .requests
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(format!("{} {}", req.method(), req.uri()));
    {
        let mut s = inner.store();
        if s.outage {
            return status(503, "ServiceUnavailable", "the API server is down");
        }
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return status(500, "InternalError", "injected failure");
        }
    }
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    if let ["apis", "events.k8s.io", "v1", "namespaces", _ns, "events", rest @ ..] =
        parts.as_slice()
    {
        return event(&inner, req.method().clone(), rest.first().copied(), req).await;
    }
    let (ns, kind, name) = match parts.as_slice() {
        ["api", "v1", "namespaces", ns, resource] => (ns.to_string(), Kind::of(resource), None),
        ["api", "v1", "namespaces", ns, resource, name] => {
            (ns.to_string(), Kind::of(resource), Some(full(ns, name)))
        }
        _ => return status(404, "NotFound", "no such path"),
    };
    let name = name.as_deref();
    let Some(kind) = kind else {
        return status(404, "NotFound", "no such resource");
    };
    let q = query(&req);
    match (req.method().clone(), name) {
        (Method::GET, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            hold_watch(&inner).await;
            watch(&inner, stop, kind, &ns, &q)
        }
        (Method::GET, None) => {
            let s = inner.store();
            let prefix = full(&ns, "");
            let items: Vec<Value> = s
                .objects
                .iter()
                .filter(|((k, n), o)| {
                    *k == kind as u8 && n.starts_with(&prefix) && selects(q.get("labelSelector"), o)
                })
                .map(|(_, o)| o.clone())
                .collect();
            respond(
                200,
                &json!({
                    "kind": kind.list_kind(), "apiVersion": "v1",
                    "metadata": { "resourceVersion": s.rv.to_string() },
                    "items": items,
                }),
            )
        }
        (Method::GET, Some(name)) => match inner.store().objects.get(&key(kind, name)) {
            Some(o) => respond(200, o),
            None => status(404, "NotFound", &format!("{} not found", short_of(name))),
        },
        (Method::POST, None) => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => return status(400, "BadRequest", "no body"),
            };
            let Ok(object) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "not JSON");
            };
            if kind == Kind::Pod {
                gather(&inner).await;
            }
            create(&inner, kind, &ns, object)
        }
        (Method::DELETE, Some(name)) => {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let options = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
            let uid = options["preconditions"]["uid"].as_str().map(str::to_owned);
            let grace = options["gracePeriodSeconds"]
                .as_u64()
                .or_else(|| q.get("gracePeriodSeconds").and_then(|g| g.parse().ok()));
            delete(&inner, kind, name, uid, grace)
        }
        _ => status(405, "MethodNotAllowed", "method not allowed"),
    }
}

/// `events.k8s.io/v1` Events: created (POST) and, for a repeated one, patched (a merge patch
/// of its series), as kube's event recorder writes them.
async fn event(
    inner: &Arc<Inner>,
    method: Method,
    name: Option<&str>,
    req: Request<Incoming>,
) -> Response<Body> {
    let Ok(body) = req.into_body().collect().await.map(|b| b.to_bytes()) else {
        return status(400, "BadRequest", "no body");
    };
    let Ok(ev) = serde_json::from_slice::<Value>(&body) else {
        return status(400, "BadRequest", "not JSON");
    };
    let mut events = inner
        .events_log
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    match (method, name) {
        (Method::POST, None) => {
            events.push(ev.clone());
            respond(201, &ev)
        }
        (Method::PATCH, Some(name)) => {
            match events.iter_mut().find(|e| e["metadata"]["name"] == name) {
                Some(e) => {
                    e["series"] = ev["series"].clone();
                    respond(200, e)
                }
                None => status(404, "NotFound", &format!("{name} not found")),
            }
        }
        _ => status(405, "MethodNotAllowed", "method not allowed"),
    }
}

/// Holds a pod create while [`FakeKube::gather_pod_creates`] waits for more of them.
async fn gather(inner: &Inner) {
    let woken = inner.gathered.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    let complete = {
        let mut g = inner.gather.lock().unwrap_or_else(PoisonError::into_inner);
        match g.as_mut() {
            None => return,
            Some((needed, arrived)) => {
                *arrived += 1;
                let complete = *arrived >= *needed;
                if complete {
                    *g = None;
                }
                complete
            }
        }
    };
    if complete {
        inner.gathered.notify_waiters();
    } else {
        let _in_time = tokio::time::timeout(Duration::from_secs(10), woken).await;
    }
}

fn create(inner: &Arc<Inner>, kind: Kind, ns: &str, mut object: Value) -> Response<Body> {
    let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
        return status(422, "Invalid", "metadata.name is required");
    };
    match object["metadata"]["namespace"].as_str() {
        Some(other) if other != ns => return status(
            400,
            "BadRequest",
            "the namespace of the provided object does not match the namespace sent on the request",
        ),
        _ => object["metadata"]["namespace"] = json!(ns),
    }
    let short = name;
    let name = full(ns, &short);
    let mut s = inner.store();
    if kind == Kind::Pod {
        if let Some((code, n)) = s.pod_create_refusals.filter(|(_, n)| *n > 0) {
            s.pod_create_refusals = Some((code, n - 1));
            return refusal(code, &short);
        }
    }
    if kind == Kind::Pvc && s.storage_quota_full {
        let size = object["spec"]["resources"]["requests"]["storage"]
            .as_str()
            .unwrap_or("0")
            .to_owned();
        return status(
            403,
            "Forbidden",
            &format!(
                "persistentvolumeclaims \"{short}\" is forbidden: exceeded quota: storage, \
                 requested: requests.storage={size}, used: requests.storage=100Gi, limited: requests.storage=100Gi"
            ),
        );
    }
    if s.objects.contains_key(&key(kind, &name)) {
        return status(409, "AlreadyExists", &format!("{short} already exists"));
    }
    let uid = format!("uid-{}-{}", short, s.rv + 1);
    object["metadata"]["uid"] = json!(uid);
    object["metadata"]["creationTimestamp"] = json!("2026-12-01T00:00:00Z");
    let mut info = None;
    let mut pull_backoff = None;
    match kind {
        Kind::Pod => {
            s.pod_creates += 1;
            s.next_ip = s.next_ip.wrapping_add(1).max(10);
            let ip = Ipv4Addr::new(127, 0, 0, s.next_ip);
            object["status"] = json!({ "phase": "Pending", "conditions": [
                { "type": "PodScheduled", "status": "True" },
                { "type": "Ready", "status": "False" },
            ]});
            let c = &object["spec"]["containers"][0];
            let args: Vec<String> = c["args"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            let env: Vec<(String, String)> = c["env"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|e| {
                            Some((
                                e["name"].as_str()?.to_owned(),
                                e["value"].as_str()?.to_owned(),
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default();
            let claim = object["spec"]["volumes"]
                .as_array()
                .and_then(|vs| vs.iter().find(|v| v["name"] == "home"))
                .and_then(|v| v["persistentVolumeClaim"]["claimName"].as_str())
                .unwrap_or("")
                .to_owned();
            let tenant = object["metadata"]["labels"]["codex-fleet.io/tenant"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            let claim_full = full(ns, &claim);
            let unbound = if claim.is_empty() {
                None
            } else {
                match s.objects.get(&key(Kind::Pvc, &claim_full)) {
                    None => Some(format!(
                        "0/3 nodes are available: persistentvolumeclaim \"{claim}\" not found. \
                         preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
                    )),
                    Some(c) if c["status"]["phase"] != "Bound" => Some(format!(
                        "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims \
                         (\"{claim}\"). preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
                    )),
                    Some(_) => None,
                }
            };
            if let Some(message) = unbound {
                // The scheduler places no pod whose claim is missing or unbound.
                object["status"]["conditions"][0] = json!({
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": message,
                });
                let pod = PodInfo {
                    name: short.clone(),
                    namespace: ns.to_owned(),
                    tenant,
                    ip,
                    args,
                    env,
                    claim,
                };
                s.waiting_for_claim.push((claim_full, pod, uid.clone()));
            } else if s.hold {
                object["status"]["conditions"][0] = json!({
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient cpu.",
                });
            } else if s.pull_failures {
                let image = object["spec"]["containers"][0]["image"].clone();
                object["status"]["containerStatuses"] = json!([{
                    "name": "node", "image": image, "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": { "waiting": { "reason": "ErrImagePull",
                        "message": format!("failed to pull and unpack image {image}: not found") } },
                }]);
                pull_backoff = Some((name.clone(), uid.clone(), image));
            } else {
                info = Some(PodInfo {
                    name: short.clone(),
                    namespace: ns.to_owned(),
                    tenant,
                    ip,
                    args,
                    env,
                    claim,
                });
            }
        }
        Kind::Pvc => {
            s.pvc_creates += 1;
            let phase = if s.claims_pending { "Pending" } else { "Bound" };
            object["status"] = json!({ "phase": phase });
        }
    }
    let object = inner.emit(&mut s, kind, "ADDED", object);
    s.objects.insert(key(kind, &name), object.clone());
    if kind == Kind::Pvc && object["status"]["phase"] == "Bound" {
        schedule_waiting(inner, &mut s, &name);
    }
    if let Some((name, uid, image)) = pull_backoff {
        // The kubelet retries the pull, fails again and backs off.
        let inner = inner.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            inner.set_status(&name, &uid, |st| {
                st["containerStatuses"][0]["state"]["waiting"] = json!({
                    "reason": "ImagePullBackOff",
                    "message": format!("Back-off pulling image {image}"),
                });
            });
        });
    }
    if let Some(info) = info {
        let ctl = PodCtl::default();
        s.running.insert(name.clone(), ctl.clone());
        drop(s);
        tokio::spawn(kubelet(inner.clone(), info, uid, ctl));
    }
    respond(201, &object)
}

/// Schedules the pods that waited for claim `claim` (full name), now Bound: PodScheduled, and
/// their kubelet starts them.
fn schedule_waiting(inner: &Arc<Inner>, s: &mut Store, claim: &str) {
    let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut s.waiting_for_claim)
        .into_iter()
        .partition(|(c, _, _)| c == claim);
    s.waiting_for_claim = later;
    for (_, info, uid) in now {
        let name = full(&info.namespace, &info.name);
        let Some(mut pod) = s.objects.get(&key(Kind::Pod, &name)).cloned() else {
            continue;
        };
        if pod["metadata"]["uid"] != uid.as_str() || !pod["metadata"]["deletionTimestamp"].is_null()
        {
            continue;
        }
        pod["status"]["conditions"] = json!([
            { "type": "PodScheduled", "status": "True" },
            { "type": "Ready", "status": "False" },
        ]);
        let pod = inner.emit(s, Kind::Pod, "MODIFIED", pod);
        s.objects.insert(key(Kind::Pod, &name), pod);
        let ctl = PodCtl::default();
        s.running.insert(name, ctl.clone());
        tokio::spawn(kubelet(inner.clone(), info, uid, ctl));
    }
}

/// A pod create refused as a real API server refuses one, by status: 403 (PodSecurity
/// admission), 422 (validation), 429 (priority and fairness), 500 and others (an error).
fn refusal(code: u16, name: &str) -> Response<Body> {
    match code {
        403 => status(
            403,
            "Forbidden",
            &format!(
                "pods \"{name}\" is forbidden: violates PodSecurity \"restricted:latest\": \
                 allowPrivilegeEscalation != false (container \"node\" must set \
                 securityContext.allowPrivilegeEscalation=false)"
            ),
        ),
        422 => status(
            422,
            "Invalid",
            &format!(
                "Pod \"{name}\" is invalid: spec.containers[0].resources.requests: Invalid value: \
                 \"8\": must be less than or equal to cpu limit of 4"
            ),
        ),
        429 => {
            let mut r = status(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.",
            );
            r.headers_mut()
                .insert("retry-after", hyper::header::HeaderValue::from_static("1"));
            r
        }
        code => status(code, "InternalError", "injected failure"),
    }
}

/// A delete as a real API server does it. A claim, a pod never started (Pending, no process)
/// or one whose process has ended goes at once (DELETED). A running pod is deleted gracefully:
/// `deletionTimestamp` (now + the grace period) and `deletionGracePeriodSeconds` are set
/// (MODIFIED), its process gets SIGTERM, and the pod goes (DELETED) when the process exits, or
/// when the grace period ends and the kubelet has SIGKILLed it. The grace period: the request's
/// `gracePeriodSeconds`, else the pod's `spec.terminationGracePeriodSeconds`, else 30; 0 is a
/// force delete (at once, whatever the kubelet does). A pod Terminating keeps its name (a create
/// of it gets 409); a pod on a lost machine stays Terminating until force-deleted.
fn delete(
    inner: &Arc<Inner>,
    kind: Kind,
    name: &str,
    uid: Option<String>,
    grace: Option<u64>,
) -> Response<Body> {
    let mut s = inner.store();
    let Some(mut object) = s.objects.get(&key(kind, name)).cloned() else {
        return status(404, "NotFound", &format!("{} not found", short_of(name)));
    };
    if let Some(uid) = uid {
        if object["metadata"]["uid"] != uid.as_str() {
            return status(409, "Conflict", "precondition failed: uid");
        }
    }
    let grace = grace
        .or_else(|| object["spec"]["terminationGracePeriodSeconds"].as_u64())
        .unwrap_or(30);
    if kind == Kind::Pod && grace == 0 {
        s.force_deletes += 1;
    }
    let ctl = if kind == Kind::Pod {
        s.running.get(name).cloned()
    } else {
        None
    };
    match ctl {
        Some(ctl) if grace > 0 => {
            if object["metadata"]["deletionTimestamp"].is_null() {
                object["metadata"]["deletionTimestamp"] = json!(rfc3339(
                    std::time::SystemTime::now() + Duration::from_secs(grace)
                ));
                object["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
                object = inner.emit(&mut s, kind, "MODIFIED", object);
                s.objects.insert(key(kind, name), object.clone());
                drop(s);
                ctl.term.cancel();
                tokio::spawn(async move {
                    tokio::select! {
                        // A lost machine's kubelet carries out nothing.
                        () = tokio::time::sleep(Duration::from_secs(grace)) => {
                            if !ctl.lost.is_cancelled() {
                                ctl.kill.cancel();
                            }
                        }
                        () = ctl.kill.cancelled() => {}
                    }
                });
            }
            respond(200, &object)
        }
        ctl => {
            s.objects.remove(&key(kind, name));
            if let Some(ctl) = ctl {
                s.running.remove(name);
                // A lost machine's process is out of reach: it stays frozen (until the fake
                // stops), its connections open, as on a machine that is gone.
                if ctl.lost.is_cancelled() {
                    s.frozen.push(ctl.kill);
                } else {
                    ctl.kill.cancel();
                }
            }
            let object = inner.emit(&mut s, kind, "DELETED", object);
            respond(200, &object)
        }
    }
}

/// `2026-12-01T14:05:09Z`, as the API server writes times.
fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Counts an open watch while it lives.
struct OpenWatch(Arc<Inner>);

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.store().open_watches -= 1;
    }
}

/// Holds a watch request while [`FakeKube::hold_watches`] is set (at most 10 s).
async fn hold_watch(inner: &Inner) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let released = inner.watches_released.notified();
        tokio::pin!(released);
        released.as_mut().enable();
        if !inner.store().hold_watches {
            return;
        }
        if tokio::time::timeout_at(deadline, released).await.is_err() {
            return;
        }
    }
}

/// A watch: the history after `resourceVersion` (410 Gone when compacted), then live events,
/// until `timeoutSeconds` or the fake's cap; with `allowWatchBookmarks=true`, a BOOKMARK of the
/// last resourceVersion it has gone through ends it, as a real API server's does.
fn watch(
    inner: &Arc<Inner>,
    stop: CancellationToken,
    kind: Kind,
    ns: &str,
    q: &HashMap<String, String>,
) -> Response<Body> {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let selector = q.get("labelSelector").cloned();
    // Only this namespace's objects, selected by the labels.
    let ns = ns.to_owned();
    let selects = move |sel: Option<&String>, o: &Value| {
        o["metadata"]["namespace"] == ns.as_str() && selects(sel, o)
    };
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map(Duration::from_secs);
    let timeout = match (timeout, inner.store().watch_cap) {
        (Some(t), Some(c)) => Some(t.min(c)),
        (t, c) => t.or(c),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let line = |ty: &str, object: &Value| {
        Bytes::from(format!("{}\n", json!({ "type": ty, "object": object })))
    };
    // Subscribe before reading the history, so nothing falls between the two.
    let mut live = inner.events.subscribe();
    let (backlog, gone, last) = {
        let s = inner.store();
        if from <= s.compacted && s.compacted > 0 || from > s.rv {
            (Vec::new(), true, s.rv)
        } else {
            let backlog: Vec<WatchEvent> = s
                .log
                .iter()
                .filter(|e| e.rv > from && e.kind == kind && selects(selector.as_ref(), &e.object))
                .cloned()
                .collect();
            (backlog, false, s.rv)
        }
    };
    let ended = inner
        .watches
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let inner = inner.clone();
    tokio::spawn(async move {
        if gone {
            let st = json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410,
            });
            let _sent = tx.send(line("ERROR", &st)).await;
            return;
        }
        inner.store().open_watches += 1;
        let _open = OpenWatch(inner.clone());
        // The last resourceVersion this watch has gone through (sent or not selected).
        let mut seen = last;
        for e in backlog {
            if tx.send(line(e.ty, &e.object)).await.is_err() {
                return;
            }
        }
        let ends = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(86_400)));
        tokio::pin!(ends);
        loop {
            tokio::select! {
                biased;
                () = ended.cancelled() => return,
                () = stop.cancelled() => return,
                e = live.recv() => match e {
                    Ok(e) if e.rv > last => {
                        seen = seen.max(e.rv);
                        if e.kind == kind && selects(selector.as_ref(), &e.object)
                            && tx.send(line(e.ty, &e.object)).await.is_err()
                        {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                },
                () = &mut ends => {
                    // What has happened up to now goes first.
                    while let Ok(e) = live.try_recv() {
                        if e.rv > last {
                            seen = seen.max(e.rv);
                            if e.kind == kind && selects(selector.as_ref(), &e.object)
                                && tx.send(line(e.ty, &e.object)).await.is_err()
                            {
                                return;
                            }
                        }
                    }
                    if bookmarks {
                        let kind_name = match kind { Kind::Pod => "Pod", Kind::Pvc => "PersistentVolumeClaim" };
                        let mark = json!({ "kind": kind_name, "apiVersion": "v1",
                            "metadata": { "resourceVersion": seen.to_string() } });
                        if tx.send(line("BOOKMARK", &mark)).await.is_ok() {
                            let mut s = inner.store();
                            s.last_bookmark = s.last_bookmark.max(seen);
                        }
                    }
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

/// Runs one pod: starts its process, reports Running, Ready from its `/readyz`, and how it
/// ended; carries out a graceful delete (SIGTERM, then SIGKILL at the end of the grace period,
/// then the pod goes) and a lost machine (SIGSTOP, and nothing more is reported or done).
async fn kubelet(inner: Arc<Inner>, info: PodInfo, uid: String, ctl: PodCtl) {
    let ip = info.ip.to_string();
    let name = full(&info.namespace, &info.name);
    let started = (inner.kubelet)(&info).and_then(|(mut cmd, admin)| {
        cmd.kill_on_drop(true);
        Ok((cmd.spawn()?, admin))
    });
    let (mut child, admin) = match started {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(pod = %info.name, error = %e, "fake kubelet: cannot start the pod");
            inner.store().running.remove(&name);
            inner.set_status(&name, &uid, |st| st["phase"] = json!("Failed"));
            return;
        }
    };
    let signal = |child: &tokio::process::Child, sig: nix::sys::signal::Signal| {
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            let _sent = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
        }
    };
    inner.set_status(&name, &uid, |st| {
        st["phase"] = json!("Running");
        st["podIP"] = json!(ip);
    });
    let mut ready = false;
    let mut termed = false;
    let code = loop {
        tokio::select! {
            status = child.wait() => break status.ok().and_then(|s| s.code()),
            () = ctl.lost.cancelled() => {
                signal(&child, nix::sys::signal::Signal::SIGSTOP);
                // The node lifecycle controller's MarkPodsNotReady.
                inner.set_status(&name, &uid, |st| {
                    st["conditions"] = json!([
                        { "type": "PodScheduled", "status": "True" },
                        { "type": "Ready", "status": "False" },
                    ]);
                });
                // The machine is gone: only the end of the fake ends the process.
                ctl.kill.cancelled().await;
                let _killed = child.kill().await;
                return;
            }
            () = ctl.kill.cancelled() => {
                let _killed = child.kill().await;
                if termed {
                    break None;
                }
                return;
            }
            () = ctl.term.cancelled(), if !termed => {
                termed = true;
                signal(&child, nix::sys::signal::Signal::SIGTERM);
            }
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                let now = matches!(crate::http_get(admin, "/readyz").await, Ok((200, _)));
                if now != ready {
                    ready = now;
                    inner.set_status(&name, &uid, |st| {
                        st["conditions"] = json!([
                            { "type": "PodScheduled", "status": "True" },
                            { "type": "Ready", "status": if now { "True" } else { "False" } },
                        ]);
                    });
                }
            }
        }
    };
    let mut s = inner.store();
    s.running.remove(&name);
    // Deleted while it ran: it goes now that its process has ended.
    if let Some(pod) = s.objects.get(&key(Kind::Pod, &name)).cloned() {
        if pod["metadata"]["uid"] == uid.as_str() && !pod["metadata"]["deletionTimestamp"].is_null()
        {
            s.objects.remove(&key(Kind::Pod, &name));
            inner.emit(&mut s, Kind::Pod, "DELETED", pod);
            return;
        }
    }
    drop(s);
    inner.set_status(&name, &uid, |st| {
        st["phase"] = json!(if code == Some(0) {
            "Succeeded"
        } else {
            "Failed"
        });
        st["conditions"] = json!([
            { "type": "PodScheduled", "status": "True" },
            { "type": "Ready", "status": "False" },
        ]);
    });
}
