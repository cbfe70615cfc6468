//! An in-process fake Kubernetes API server for the kubernetes nodes backend (issue 13), on
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

/// A created pod, for the kubelet.
#[derive(Debug, Clone)]
pub struct PodInfo {
    /// metadata.name
    pub name: String,
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
    /// Pod name → stops its process.
    running: HashMap<String, CancellationToken>,
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
}

fn key(kind: Kind, name: &str) -> (u8, String) {
    (kind as u8, name.to_owned())
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
            t.cancel();
        }
    }
}

impl Inner {
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

    /// A pod or claim, as the server has it.
    pub fn pod(&self, name: &str) -> Option<Value> {
        self.inner
            .store()
            .objects
            .get(&key(Kind::Pod, name))
            .cloned()
    }

    /// Whether a volume claim of this name exists.
    pub fn pvc_exists(&self, name: &str) -> bool {
        self.inner
            .store()
            .objects
            .contains_key(&key(Kind::Pvc, name))
    }

    /// Names of the pods that exist.
    pub fn pod_names(&self) -> Vec<String> {
        self.inner
            .store()
            .objects
            .keys()
            .filter(|(k, _)| *k == Kind::Pod as u8)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Successful pod creations so far.
    pub fn pod_creates(&self) -> usize {
        self.inner.store().pod_creates
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
        let mut w = self
            .inner
            .watches
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        w.cancel();
        *w = CancellationToken::new();
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
        self.inner.store().ip_override.insert(name.into(), ip);
    }

    /// Evicts a pod: its process is killed, it becomes Failed with reason Evicted.
    pub fn evict(&self, name: &str) {
        let stop = self.inner.store().running.remove(name);
        if let Some(pod) = self.pod(name) {
            let uid = pod["metadata"]["uid"].as_str().unwrap_or("").to_owned();
            self.inner.set_status(name, &uid, |st| {
                st["phase"] = json!("Failed");
                st["reason"] = json!("Evicted");
                st["conditions"] = json!([{ "type": "Ready", "status": "False" }]);
            });
        }
        if let Some(stop) = stop {
            stop.cancel();
        }
    }

    /// Deletes a pod as `kubectl delete pod` would (its process is killed).
    pub fn delete_pod(&self, name: &str) -> bool {
        delete(&self.inner, Kind::Pod, name, None).status() == StatusCode::OK
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
    let (kind, name) = match parts.as_slice() {
        ["api", "v1", "namespaces", _ns, resource] => (Kind::of(resource), None),
        ["api", "v1", "namespaces", _ns, resource, name] => (Kind::of(resource), Some(*name)),
        _ => return status(404, "NotFound", "no such path"),
    };
    let Some(kind) = kind else {
        return status(404, "NotFound", "no such resource");
    };
    let q = query(&req);
    match (req.method().clone(), name) {
        (Method::GET, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            watch(&inner, stop, kind, &q)
        }
        (Method::GET, None) => {
            let s = inner.store();
            let items: Vec<Value> = s
                .objects
                .iter()
                .filter(|((k, _), o)| *k == kind as u8 && selects(q.get("labelSelector"), o))
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
            None => status(404, "NotFound", &format!("{name} not found")),
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
            create(&inner, kind, object)
        }
        (Method::DELETE, Some(name)) => {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let uid = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v["preconditions"]["uid"].as_str().map(str::to_owned));
            delete(&inner, kind, name, uid)
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

fn create(inner: &Arc<Inner>, kind: Kind, mut object: Value) -> Response<Body> {
    let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
        return status(422, "Invalid", "metadata.name is required");
    };
    let mut s = inner.store();
    if kind == Kind::Pod {
        if let Some((code, n)) = s.pod_create_refusals.filter(|(_, n)| *n > 0) {
            s.pod_create_refusals = Some((code, n - 1));
            return refusal(code, &name);
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
                "persistentvolumeclaims \"{name}\" is forbidden: exceeded quota: storage, \
                 requested: requests.storage={size}, used: requests.storage=100Gi, limited: requests.storage=100Gi"
            ),
        );
    }
    if s.objects.contains_key(&key(kind, &name)) {
        return status(409, "AlreadyExists", &format!("{name} already exists"));
    }
    let uid = format!("uid-{}-{}", name, s.rv + 1);
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
            if s.hold {
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
                    name: name.clone(),
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
            object["status"] = json!({ "phase": "Bound" });
        }
    }
    let object = inner.emit(&mut s, kind, "ADDED", object);
    s.objects.insert(key(kind, &name), object.clone());
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
        let stop = CancellationToken::new();
        s.running.insert(name.clone(), stop.clone());
        drop(s);
        tokio::spawn(kubelet(inner.clone(), info, uid, stop));
    }
    respond(201, &object)
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

fn delete(inner: &Arc<Inner>, kind: Kind, name: &str, uid: Option<String>) -> Response<Body> {
    let mut s = inner.store();
    let Some(object) = s.objects.get(&key(kind, name)).cloned() else {
        return status(404, "NotFound", &format!("{name} not found"));
    };
    if let Some(uid) = uid {
        if object["metadata"]["uid"] != uid.as_str() {
            return status(409, "Conflict", "precondition failed: uid");
        }
    }
    s.objects.remove(&key(kind, name));
    if let Some(stop) = s.running.remove(name) {
        stop.cancel();
    }
    let object = inner.emit(&mut s, kind, "DELETED", object);
    respond(200, &object)
}

fn watch(
    inner: &Arc<Inner>,
    stop: CancellationToken,
    kind: Kind,
    q: &HashMap<String, String>,
) -> Response<Body> {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let selector = q.get("labelSelector").cloned();
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
    tokio::spawn(async move {
        if gone {
            let st = json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410,
            });
            let _sent = tx.send(line("ERROR", &st)).await;
            return;
        }
        for e in backlog {
            if tx.send(line(e.ty, &e.object)).await.is_err() {
                return;
            }
        }
        loop {
            tokio::select! {
                biased;
                () = ended.cancelled() => return,
                () = stop.cancelled() => return,
                e = live.recv() => match e {
                    Ok(e) if e.rv > last && e.kind == kind && selects(selector.as_ref(), &e.object) => {
                        if tx.send(line(e.ty, &e.object)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                },
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
/// ended.
async fn kubelet(inner: Arc<Inner>, info: PodInfo, uid: String, stop: CancellationToken) {
    let ip = info.ip.to_string();
    let started = (inner.kubelet)(&info).and_then(|(mut cmd, admin)| {
        cmd.kill_on_drop(true);
        Ok((cmd.spawn()?, admin))
    });
    let (mut child, admin) = match started {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(pod = %info.name, error = %e, "fake kubelet: cannot start the pod");
            inner.set_status(&info.name, &uid, |st| st["phase"] = json!("Failed"));
            return;
        }
    };
    inner.set_status(&info.name, &uid, |st| {
        st["phase"] = json!("Running");
        st["podIP"] = json!(ip);
    });
    let mut ready = false;
    let code = loop {
        tokio::select! {
            status = child.wait() => break status.ok().and_then(|s| s.code()),
            () = stop.cancelled() => {
                let _killed = child.kill().await;
                return;
            }
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                let now = matches!(crate::http_get(admin, "/readyz").await, Ok((200, _)));
                if now != ready {
                    ready = now;
                    inner.set_status(&info.name, &uid, |st| {
                        st["conditions"] = json!([
                            { "type": "PodScheduled", "status": "True" },
                            { "type": "Ready", "status": if now { "True" } else { "False" } },
                        ]);
                    });
                }
            }
        }
    };
    inner.store().running.remove(&info.name);
    inner.set_status(&info.name, &uid, |st| {
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
