//! Watches: JSON lines of `ADDED`, `MODIFIED`, `DELETED` (and `BOOKMARK` when asked for) from
//! a `resourceVersion`, `410 Gone` for a compacted one, ended at `timeoutSeconds` or the fake's
//! cap.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::server::selects;
use super::{Body, Inner, Kind, WatchEvent};

/// Counts an open watch while it lives.
pub(super) struct OpenWatch(Arc<Inner>);

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.store().open_watches -= 1;
    }
}

/// Holds a watch request while [`super::FakeKube::hold_watches`] is set (at most 10 s).
pub(super) async fn hold_watch(inner: &Inner) {
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
pub(super) fn watch(
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
