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
use http_body_util::combinators::BoxBody;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

mod https;
mod kubelet;
mod server;
mod watch;

pub use https::{write_service_account, write_token, HttpsApi, SERVICE_ACCOUNT_DIR};
use server::{delete, handle, schedule_waiting};

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
    /// Pod creates wait while this is true (see [`FakeKube::hold_pod_creates`]).
    creates_held: tokio::sync::watch::Sender<bool>,
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
    /// Ends every open watch (clients relist or resume from their last resourceVersion), as an
    /// API server's restart does.
    pub fn end_watches(&self) {
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
            creates_held: tokio::sync::watch::Sender::new(false),
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

    /// How often an Event of `reason` about object `name` was said: kube's recorder writes a
    /// repeat as a patch of the first one's `series`, so this sums each such Event's series
    /// count (1 for one without a series).
    pub fn event_occurrences(&self, name: &str, reason: &str) -> u64 {
        self.inner
            .events_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|e| e["regarding"]["name"] == name && e["reason"] == reason)
            .map(|e| e["series"]["count"].as_u64().unwrap_or(1))
            .sum()
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

    /// Ends every open watch (clients relist or resume from their last resourceVersion), as an
    /// API server's restart does.
    pub fn end_watches(&self) {
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

    /// Pod creates that arrive wait, unanswered, while `hold` is true (they arrive: they are in
    /// [`FakeKube::requests`]); `false` lets them through, in arrival order. A test holds the
    /// first create until every session it opened is waiting for the pod.
    pub fn hold_pod_creates(&self, hold: bool) {
        self.inner.creates_held.send_replace(hold);
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
    /// `terminationGracePeriodSeconds` (see `delete`).
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
