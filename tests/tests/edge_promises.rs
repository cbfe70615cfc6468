//! Promises docs/architecture.md makes of edges and nodes that hold only if the edge passes the
//! node's answers on unchanged: a node's refusal at its connection caps reaches the client as the
//! same HTTP answer `serve` gives (status, `Retry-After`, body), the caps are exact however many
//! edges the sessions come through, and the same size limits and close codes (1009 too big, 1008
//! for a flood or protocol errors) hold through both hops. Each answer through an edge is compared
//! with what `serve` with the same `[limits]` answers. Real processes on loopback, real TLS on both
//! hops, real workers.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use router::admission::FLOOD_CLOSE_REASON;
use serde_json::json;
use testkit::{
    fleet_bin, https_raw, metric_at, wait_until_async, Client, FleetBuilder, FleetProcess, Split,
    Upgrade,
};

/// `cap_retry_after_ms = 2001`: with up to 25 % jitter the wait is 2001–2502 ms, so
/// `Retry-After` (whole seconds, rounded up) is 3 on every refusal, and two answers compare.
const CAPS: &str = "max_connections_per_tenant = 2\nmax_connections = 3\ncap_retry_after_ms = 2001";

/// A refused upgrade as the client received it: the status line, the headers that are not
/// per-response (`date` goes) and the body with the jittered milliseconds replaced by `<ms>`
/// (checked to lie in 2001..=2502 first).
#[derive(Debug, PartialEq, Eq)]
struct Answer {
    status: String,
    headers: BTreeMap<String, String>,
    body: String,
}

/// Sends a WebSocket upgrade with `token` to `addr` over TLS and reads the answer to its end.
async fn raw_upgrade(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    token: &str,
) -> anyhow::Result<Answer> {
    let text = https_raw(addr, ca, &testkit::upgrade_request("/", token)).await?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP answer: {text:?}"))?;
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default().to_owned();
    let mut headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .filter(|(k, _)| k != "date")
        .collect();
    // "… ; retry after 2212 ms": the jitter differs per answer.
    let (body, body_ms) = match body.rsplit_once("retry after ") {
        Some((before, after)) => {
            let (ms, rest) = after
                .split_once(" ms")
                .with_context(|| format!("body {body:?}"))?;
            let ms: u64 = ms.parse().with_context(|| format!("body {body:?}"))?;
            anyhow::ensure!((2001..=2502).contains(&ms), "retry after {ms} ms: {body:?}");
            (format!("{before}retry after <ms> ms{rest}"), Some(ms))
        }
        None => (body.to_owned(), None),
    };
    // The machine-readable refusal says what the body says, to the millisecond.
    if let Some(refusal) = headers.get_mut("codex-fleet-refusal") {
        let (before, ms) = refusal
            .rsplit_once("retry-after-ms=")
            .with_context(|| format!("refusal header {refusal:?}"))?;
        anyhow::ensure!(
            ms.parse::<u64>().ok() == body_ms,
            "header {refusal:?}, body {body:?}"
        );
        *refusal = format!("{before}retry-after-ms=<ms>");
    }
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// Opens a session of `token` at `url`, or fails with the refusal.
async fn open(url: &str, ca: &std::path::Path, token: &str) -> anyhow::Result<Client> {
    match Client::try_connect(url, ca, Some(token)).await? {
        Upgrade::Open(c) => Ok(*c),
        Upgrade::Refused { status, body, .. } => anyhow::bail!("refused: {status} {body}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_s_caps_answer_through_two_edges_as_serve_answers_and_stay_exact(
) -> anyhow::Result<()> {
    // `serve` with the caps: two sessions of acme, a third refused (scope tenant); one of beta,
    // a second refused (scope fleet).
    let files = FleetBuilder::new()
        .tenant("acme")
        .tenant("beta")
        .limits_toml(CAPS)
        .prepare()
        .await?;
    let serve = FleetProcess::spawn(&files).await?;
    let (acme, beta) = (files.token("acme"), files.token("beta"));
    let _held = [
        open(&serve.url(), &files.ca, &acme).await?,
        open(&serve.url(), &files.ca, &acme).await?,
    ];
    let serve_tenant = raw_upgrade(serve.addr, &files.ca, &acme).await?;
    let _beta = open(&serve.url(), &files.ca, &beta).await?;
    let serve_fleet = raw_upgrade(serve.addr, &files.ca, &beta).await?;
    drop(serve);
    assert!(
        serve_tenant.status.contains(" 503 ") && serve_tenant.body.contains("scope tenant"),
        "{serve_tenant:?}"
    );
    assert!(
        serve_fleet.status.contains(" 503 ") && serve_fleet.body.contains("scope fleet"),
        "{serve_fleet:?}"
    );
    assert_eq!(
        serve_tenant.headers.get("retry-after").map(String::as_str),
        Some("3")
    );
    assert_eq!(
        serve_tenant
            .headers
            .get("codex-fleet-refusal")
            .map(String::as_str),
        Some("overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=<ms>")
    );

    // Two edges in front of one node, every process with the same file (as deployed): each
    // edge alone is under the caps, the node holding both tenants is at them.
    let s = Split::start(&[("acme", "n1"), ("beta", "n1")], 2, CAPS).await?;
    let (acme, beta) = (s.token("acme"), s.token("beta"));
    let (e0, e1) = (&s.edges[0], &s.edges[1]);
    let mut held = vec![
        open(&e0.url(), &s.files.ca, &acme).await?,
        open(&e1.url(), &s.files.ca, &acme).await?,
    ];
    // The third session of acme, through either edge (each holds one): the node refuses it.
    let tenant_via_e0 = raw_upgrade(e0.addr, &s.files.ca, &acme).await?;
    let tenant_via_e1 = raw_upgrade(e1.addr, &s.files.ca, &acme).await?;
    // beta's first session fills the node; its second is refused for the node as a whole.
    held.push(open(&e1.url(), &s.files.ca, &beta).await?);
    let fleet_via_e0 = raw_upgrade(e0.addr, &s.files.ca, &beta).await?;
    assert_eq!(tenant_via_e0, serve_tenant, "the tenant cap through edge 0");
    assert_eq!(tenant_via_e1, serve_tenant, "the tenant cap through edge 1");
    assert_eq!(fleet_via_e0, serve_fleet, "the fleet cap through edge 0");
    // Refused by the node, exactly once per refusal; never by an edge's own cap.
    let n1 = s.nodes[0].process.as_ref().context("n1")?;
    let capped = [("reason", "connection_cap")];
    assert_eq!(
        metric_at(n1.admin, "codex_fleet_upgrades_refused_total", &capped).await?,
        3.0
    );
    for e in [e0, e1] {
        assert_eq!(
            metric_at(e.admin, "codex_fleet_upgrades_refused_total", &capped).await?,
            0.0,
            "an edge refused on its own count"
        );
    }
    // The node's slot comes back when a session through the other edge ends.
    held.remove(0).close().await;
    let back = wait_until_async(Duration::from_secs(10), || async {
        matches!(
            Client::try_connect(&e1.url(), &s.files.ca, Some(&acme)).await,
            Ok(Upgrade::Open(_))
        )
    })
    .await;
    assert!(back, "a closed session's slot never came back on the node");
    Ok(())
}

/// `limits` with `key = value` set (the line replaced, or added to `[limits]`).
fn with_limit(text: &str, key: &str, value: &str) -> String {
    let prefix = format!("{key} = ");
    let mut found = false;
    let mut lines: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with(&prefix) {
                found = true;
                format!("{prefix}{value}")
            } else {
                l.to_owned()
            }
        })
        .collect();
    if !found {
        let at = lines
            .iter()
            .position(|l| l == "[limits]")
            .expect("[limits]");
        lines.insert(at + 1, format!("{prefix}{value}"));
    }
    lines.join("\n") + "\n"
}

const MAX: usize = 65_536;
const LIMITS: &str = "max_message_bytes = 65536\nconn_fps = 50\nconn_burst = 100";

/// A request of exactly `len` bytes.
fn request_of(id: i64, len: usize) -> String {
    let bare =
        json!({ "id": id, "method": "thread/loaded/list", "params": {}, "pad": "" }).to_string();
    let pad = "x".repeat(len - bare.len());
    let text =
        json!({ "id": id, "method": "thread/loaded/list", "params": {}, "pad": pad }).to_string();
    assert_eq!(text.len(), len);
    text
}

/// What one target did with: a request of exactly the limit (answered), one byte more (close),
/// a flood of notifications (close), 33 frames of bad JSON (close). Each close as (code, reason).
#[derive(Debug, PartialEq, Eq)]
struct Closes {
    too_big: Option<(u16, String)>,
    flood: Option<(u16, String)>,
    bad_json: Option<(u16, String)>,
}

async fn closes(url: &str, ca: &std::path::Path, token: &str) -> anyhow::Result<Closes> {
    let session = || async {
        let mut c = Client::connect(url, ca, Some(token)).await?;
        c.initialize("limits").await?;
        anyhow::Ok(c)
    };
    let mut c = session().await?;
    c.send_text(&request_of(7, MAX)).await?;
    let answer = c.wait_for(|v| v["id"] == 7).await?;
    anyhow::ensure!(
        answer.get("result").is_some() || answer.get("error").is_some(),
        "{answer}"
    );
    c.send_text(&request_of(8, MAX + 1)).await?;
    let too_big = c.recv_close_frame(Duration::from_secs(10)).await?;

    let mut c = session().await?;
    for _ in 0..400 {
        if c.send(&json!({ "method": "x/flood" })).await.is_err() {
            break;
        }
    }
    let flood = c.recv_close_frame(Duration::from_secs(10)).await?;

    let mut c = session().await?;
    for _ in 0..33 {
        if c.send_text("{not json").await.is_err() {
            break;
        }
    }
    let bad_json = c.recv_close_frame(Duration::from_secs(10)).await?;
    Ok(Closes {
        too_big,
        flood,
        bad_json,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limits_and_close_codes_hold_through_both_hops_as_from_serve() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant("acme")
        .limits_toml(LIMITS)
        .prepare()
        .await?;
    let serve = FleetProcess::spawn(&files).await?;
    let from_serve = closes(&serve.url(), &files.ca, &files.token("acme")).await?;
    drop(serve);
    eprintln!("measured: serve closes {from_serve:?}");
    assert_eq!(from_serve.too_big.as_ref().map(|c| c.0), Some(1009));
    assert_eq!(
        from_serve.flood,
        Some((1008, FLOOD_CLOSE_REASON.to_owned()))
    );
    assert_eq!(from_serve.bad_json.as_ref().map(|c| c.0), Some(1008));

    // Edge 0 and the node share the file: the edge's own bounds close first, as serve's.
    let s = Split::start(&[("acme", "n1")], 1, LIMITS).await?;
    let through_edge = closes(&s.edges[0].url(), &s.files.ca, &s.token("acme")).await?;
    assert_eq!(through_edge, from_serve, "an edge with serve's limits");
    let n1 = s.nodes[0].process.as_ref().context("n1")?;
    let node_closed = |reason: &'static str| async move {
        metric_at(
            n1.admin,
            "codex_fleet_sessions_closed_total",
            &[("reason", reason)],
        )
        .await
    };
    let reasons = ["too_big", "flooded", "protocol_errors"];
    let mut before = Vec::new();
    for reason in reasons {
        before.push(node_closed(reason).await?);
    }
    // An edge with loose limits: what closes is the node, and its close passes through.
    let mut text = std::fs::read_to_string(s.files.dir.path().join("edge0.toml"))?;
    for (k, v) in [
        ("max_message_bytes", "1048576"),
        ("conn_fps", "100000"),
        ("conn_burst", "100000"),
    ] {
        text = with_limit(&text, k, v);
    }
    let path = s.files.dir.path().join("loose.toml");
    std::fs::write(&path, text)?;
    let loose = FleetProcess::spawn_role(&fleet_bin(), "serve", &path, |_| {}).await?;
    let through_node = closes(&loose.url(), &s.files.ca, &s.token("acme")).await?;
    assert_eq!(
        through_node, from_serve,
        "the node's closes through a loose edge"
    );
    for (reason, before) in reasons.into_iter().zip(before) {
        wait_until_async(Duration::from_secs(5), || async {
            node_closed(reason).await.is_ok_and(|n| n > before)
        })
        .await;
        let n = node_closed(reason).await? - before;
        assert_eq!(n, 1.0, "the node closed the session ({reason})");
        assert_eq!(
            metric_at(
                loose.admin,
                "codex_fleet_sessions_closed_total",
                &[("reason", reason)]
            )
            .await?,
            0.0,
            "the loose edge closed a session itself ({reason})"
        );
    }
    Ok(())
}
