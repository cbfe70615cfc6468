//! The fake's kubelet: runs each created pod as a real process and reports its phase and
//! readiness as a kubelet does.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::{full, key, Inner, Kind, PodCtl, PodInfo};

/// Runs one pod: starts its process, reports Running, Ready from its `/readyz`, and how it
/// ended; carries out a graceful delete (SIGTERM, then SIGKILL at the end of the grace period,
/// then the pod goes) and a lost machine (SIGSTOP, and nothing more is reported or done).
pub(super) async fn kubelet(inner: Arc<Inner>, info: PodInfo, uid: String, ctl: PodCtl) {
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
