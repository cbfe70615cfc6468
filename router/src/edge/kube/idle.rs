//! What an edge asks a tenant pod's node before it replaces the pod at its next idle moment:
//! whether the node is idle by the node's own rule ([`crate::node::idle::is_idle`]), read from
//! its admin endpoint.

use std::time::Duration;

/// The most of a node's `/metrics` or `/readyz` the edge reads.
const ADMIN_BODY_MAX: usize = 4 << 20;

/// What an edge asks a tenant pod's node (docs/decisions/0017-settings-travel-with-the-tenant.md: a
/// pod of an older template is replaced at its next idle moment): whether it is idle by
/// [`crate::node::idle::is_idle`]'s rule, as its admin endpoint shows it to anyone who may scrape it. No session
/// (`codex_fleet_sessions`, every edge's links counted) from `/metrics`, no running turn and no
/// loaded thread from `/readyz`. An answer that cannot be read is an error: the caller keeps the
/// pod.
pub async fn node_is_idle(admin: std::net::SocketAddr, within: Duration) -> anyhow::Result<bool> {
    let look = async {
        // /readyz first: a node with a session has a loaded thread, mostly, and then its
        // (larger) /metrics need not be read.
        let readyz = admin_get(admin, "/readyz").await?;
        if !workers_idle(&readyz)? {
            return Ok(false);
        }
        let metrics = admin_get(admin, "/metrics").await?;
        idle_from_admin(&metrics, &readyz)
    };
    tokio::time::timeout(within, look)
        .await
        .map_err(|_| anyhow::anyhow!("no answer from {admin} within {within:?}"))?
}

/// [`crate::node::idle::is_idle`]'s rule over a node's `/metrics` text and `/readyz` JSON.
pub fn idle_from_admin(metrics: &str, readyz: &str) -> anyhow::Result<bool> {
    let mut seen_sessions = false;
    let mut sessions = 0.0;
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(crate::metrics::names::SESSIONS) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue; // another metric with this prefix
        }
        let value: f64 = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("an unreadable {line:?}"))?;
        seen_sessions = true;
        sessions += value;
    }
    let workers_idle = workers_idle(readyz)?;
    if !seen_sessions {
        anyhow::bail!("/metrics has no {}", crate::metrics::names::SESSIONS);
    }
    Ok(workers_idle && sessions == 0.0)
}

/// Whether a node's `/readyz` shows no running turn and no loaded thread.
fn workers_idle(readyz: &str) -> anyhow::Result<bool> {
    let r: serde_json::Value =
        serde_json::from_str(readyz).map_err(|e| anyhow::anyhow!("/readyz is not JSON: {e}"))?;
    let tenants = r["tenants"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("/readyz has no tenants"))?;
    let mut busy = false;
    for t in tenants {
        for w in t["workers"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let count = |k: &str| {
                w[k].as_u64()
                    .ok_or_else(|| anyhow::anyhow!("a worker without {k}"))
            };
            busy |= count("activeTurns")? > 0 || count("loadedThreads")? > 0;
        }
    }
    Ok(!busy)
}

async fn admin_get(addr: std::net::SocketAddr, path: &str) -> anyhow::Result<String> {
    use http_body_util::{BodyExt, Empty, Limited};
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
    let conn = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(conn));
    let req = http::Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .body(Empty::<hyper::body::Bytes>::new())?;
    let resp = sender.send_request(req).await?;
    let body = Limited::new(resp.into_body(), ADMIN_BODY_MAX)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
        .to_bytes();
    drop(conn);
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[cfg(test)]
mod tests {
    use super::idle_from_admin;

    const READY_IDLE: &str =
        r#"{"tenants":[{"id":"acme","workers":[{"activeTurns":0,"loadedThreads":0}]}]}"#;

    #[test]
    fn a_node_is_idle_only_without_sessions_turns_and_loaded_threads() {
        let m = |n: u32| {
            format!("# TYPE codex_fleet_sessions gauge\ncodex_fleet_sessions{{tenant=\"acme\"}} {n}\ncodex_fleet_sessions_closed_total{{tenant=\"acme\"}} 7\n")
        };
        assert!(idle_from_admin(&m(0), READY_IDLE).expect("readable"));
        assert!(!idle_from_admin(&m(1), READY_IDLE).expect("readable"));
        let turning = READY_IDLE.replace("\"activeTurns\":0", "\"activeTurns\":1");
        assert!(!idle_from_admin(&m(0), &turning).expect("readable"));
        let loaded = READY_IDLE.replace("\"loadedThreads\":0", "\"loadedThreads\":2");
        assert!(!idle_from_admin(&m(0), &loaded).expect("readable"));
        // What cannot be read is never taken for idle.
        for (metrics, readyz) in [
            (m(0), "not json".to_owned()),
            (
                m(0),
                r#"{"tenants":[{"id":"acme","workers":[{}]}]}"#.to_owned(),
            ),
            (String::new(), READY_IDLE.to_owned()),
            (
                "codex_fleet_sessions{tenant=\"acme\"} many".to_owned(),
                READY_IDLE.to_owned(),
            ),
        ] {
            assert!(
                idle_from_admin(&metrics, &readyz).is_err(),
                "{metrics} {readyz}"
            );
        }
    }
}
