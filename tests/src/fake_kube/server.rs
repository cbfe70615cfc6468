//! The fake API server's answers: every request is routed by verb and resource, a create runs
//! the admission a real API server runs (quota, PodSecurity, the claim's binding) before its
//! exists check, a delete is graceful unless told otherwise, and events are recorded.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::kubelet::kubelet;
use super::watch::{hold_watch, watch};
use super::{full, key, short_of, Body, Inner, Kind, PodCtl, PodInfo, Store};

pub(super) fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    respond(code, &body)
}

pub(super) fn respond(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

pub(super) fn query(req: &Request<Incoming>) -> HashMap<String, String> {
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
pub(super) fn selects(selector: Option<&String>, object: &Value) -> bool {
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

pub(super) async fn handle(
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
                let mut held = inner.creates_held.subscribe();
                if held.wait_for(|held| !*held).await.is_err() {
                    return status(503, "ServiceUnavailable", "the fake is stopping");
                }
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
pub(super) async fn event(
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

/// Holds a pod create while [`super::FakeKube::gather_pod_creates`] waits for more of them.
pub(super) async fn gather(inner: &Inner) {
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

pub(super) fn create(
    inner: &Arc<Inner>,
    kind: Kind,
    ns: &str,
    mut object: Value,
) -> Response<Body> {
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
pub(super) fn schedule_waiting(inner: &Arc<Inner>, s: &mut Store, claim: &str) {
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
pub(super) fn refusal(code: u16, name: &str) -> Response<Body> {
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
pub(super) fn delete(
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
pub(super) fn rfc3339(t: std::time::SystemTime) -> String {
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
