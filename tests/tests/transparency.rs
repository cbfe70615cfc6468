//! A tenant's pool answers as one app-server: what a client sees through codex-fleet is compared
//! with what the same client gets on a direct connection to one of the tenant's real workers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use e2e::{ready_workers, wait_until, Fleet, FleetBuilder, STEP};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// A client on a worker's own socket, as the router's legs connect (WebSocket over the Unix
/// socket): the reference a fleet client is compared with.
struct Direct {
    ws: WebSocketStream<UnixStream>,
    next_id: i64,
}

impl Direct {
    async fn connect(socket: &Path) -> anyhow::Result<Direct> {
        let stream = UnixStream::connect(socket)
            .await
            .with_context(|| format!("connecting to {}", socket.display()))?;
        let (ws, _) = tokio_tungstenite::client_async("ws://localhost/", stream).await?;
        Ok(Direct { ws, next_id: 1 })
    }

    async fn send(&mut self, v: &Value) -> anyhow::Result<()> {
        self.ws.send(Message::text(v.to_string())).await?;
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<Value> {
        loop {
            match tokio::time::timeout(STEP, self.ws.next())
                .await
                .context("timed out waiting for the worker")?
            {
                Some(Ok(Message::Text(t))) => return Ok(serde_json::from_str(&t)?),
                Some(Ok(Message::Close(c))) => bail!("worker closed: {c:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("read error: {e}"),
                None => bail!("worker connection ended"),
            }
        }
    }

    /// Sends a request; returns its response and every other message that came before it.
    async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<(Value, Vec<Value>)> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        self.until_answer(&json!(id)).await
    }

    /// Sends a raw request frame with id `id`; returns its response.
    async fn call_raw(&mut self, frame: &Value) -> anyhow::Result<Value> {
        self.send(frame).await?;
        Ok(self.until_answer(&frame["id"]).await?.0)
    }

    /// Sends a raw request frame; returns its response and every other message before it.
    async fn until_answer_after(&mut self, frame: &Value) -> anyhow::Result<(Value, Vec<Value>)> {
        self.send(frame).await?;
        self.until_answer(&frame["id"]).await
    }

    async fn until_answer(&mut self, id: &Value) -> anyhow::Result<(Value, Vec<Value>)> {
        let mut before = Vec::new();
        loop {
            let v = self.recv().await?;
            if v["id"] == *id && v.get("method").is_none() {
                return Ok((v, before));
            }
            before.push(v);
        }
    }
}

/// The initialize `e2e::Client::initialize` sends.
fn initialize_frame() -> Value {
    json!({
        "id": "initialize",
        "method": "initialize",
        "params": {
            "clientInfo": { "name": "e2e-client", "title": null, "version": "0.0.1" },
            "capabilities": { "experimentalApi": true }
        }
    })
}

fn worker_socket(fleet: &Fleet, tenant: &str, n: usize) -> PathBuf {
    fleet
        .files
        .dir
        .path()
        .join(format!("s/sockets/{tenant}/{n}.sock"))
}

/// A direct connection to one worker, initialized: the notifications it got for its initialize
/// (everything before the answer to the next request), counted by method.
async fn direct_per_connection(socket: &Path) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut d = Direct::connect(socket).await?;
    let (init, mut msgs) = d.until_answer_after(&initialize_frame()).await?;
    anyhow::ensure!(init.get("result").is_some(), "direct initialize: {init}");
    d.send(&json!({ "method": "initialized" })).await?;
    let (_, more) = d.call("thread/loaded/list", json!({})).await?;
    msgs.extend(more);
    let mut counts = BTreeMap::new();
    for m in msgs {
        let method = m["method"].as_str().context("a notification")?.to_owned();
        *counts.entry(method).or_insert(0) += 1;
    }
    Ok(counts)
}

/// Issue 15 item 1: a session whose threads live on both workers of its tenant gets the notifications
/// app-server sends each newly initialized connection exactly as often as a direct client does:
/// once, after its own initialize; those after the router's replayed initialize are dropped and
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_leg_repeats_no_per_connection_notification() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await,
        "two workers should start"
    );
    let direct = direct_per_connection(&worker_socket(&fleet, "acme", 0)).await?;
    eprintln!("direct connection, after initialize: {direct:?}");
    anyhow::ensure!(
        !direct.is_empty(),
        "a direct connection gets per-connection notifications after initialize"
    );

    let mut c = fleet.client("acme").await?;
    let table = &fleet.tenant("acme").table;
    let mut owners = std::collections::HashSet::new();
    let mut threads = Vec::new();
    for _ in 0..8 {
        let t = c.start_thread().await?;
        owners.insert(table.owner(&t).context("thread placed")?);
        threads.push(t);
        if owners.len() == 2 {
            break;
        }
    }
    assert_eq!(
        owners.len(),
        2,
        "the session's threads should use both workers"
    );
    // One more answer from each thread's worker: anything sent after a leg's initialize has
    // arrived by then.
    for t in &threads {
        c.request("thread/read", json!({ "threadId": t })).await?;
    }
    while let Ok(v) = c.recv_wire(Duration::from_millis(500)).await {
        c.backlog.push_back(v);
    }
    for (method, n) in &direct {
        let got = c
            .backlog
            .iter()
            .filter(|m| m["method"] == method.as_str() && m.get("id").is_none())
            .count();
        assert_eq!(
            got, *n,
            "{method}: the fleet client got it {got} times, a direct client {n}"
        );
        let dropped = fleet
            .metric(
                "codex_fleet_replayed_notifications_dropped_total",
                &[("method", method)],
            )
            .await?;
        assert_eq!(
            dropped, *n as f64,
            "{method}: the second leg's copies should be counted as dropped"
        );
    }
    fleet.stop().await
}

/// Issue 15 item 4: malformed requests are invalid requests (`-32600`, as app-server answers them), not
/// host-access refusals; a real refusal is still `-32003`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_not_refused() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 1)
        .await,
        "the worker should start"
    );
    let mut d = Direct::connect(&worker_socket(&fleet, "acme", 0)).await?;
    d.until_answer_after(&initialize_frame()).await?;
    let mut c = fleet.client("acme").await?;
    let thread = "00000000-0000-0000-0000-000000000000";
    let shapes = [
        json!({"id": 11, "method": "turn/start", "params": {"threadId": thread, "input": 42}}),
        json!({"id": 12, "method": "turn/start", "params": "hello"}),
        json!({"id": 13, "method": "turn/start", "params": 7}),
        json!({"id": 14, "method": "thread/start", "params": {"cwd": 5}}),
        json!({"id": 15, "method": "turn/start", "params": {"threadId": thread, "input": [], "sandboxPolicy": "x"}}),
        json!({"id": 16, "method": "thread/start", "params": {"config": 3}}),
    ];
    for frame in &shapes {
        let want = d.call_raw(frame).await?;
        c.send(frame).await?;
        let id = frame["id"].clone();
        let got = c.wait_for(|v| v["id"] == id).await?;
        eprintln!("{frame}\n  direct: {want}\n  fleet:  {got}");
        assert_eq!(
            want["error"]["code"], -32600,
            "app-server calls {frame} invalid"
        );
        assert_eq!(got["error"]["code"], -32600, "{frame}: {got}");
        // Word for word what app-server answers.
        assert_eq!(got["error"], want["error"], "{frame}");
    }
    // A well-formed request the policy refuses is still a host-access denial, and so are
    // positional params, which the policy cannot check.
    let refused = c.call("thread/start", json!({ "cwd": "/etc" })).await?;
    assert_eq!(refused["error"]["code"], -32003, "{refused}");
    let positional = c.call("thread/start", json!(["/etc"])).await?;
    assert_eq!(positional["error"]["code"], -32003, "{positional}");
    fleet.stop().await
}

/// A tenant of two workers with `per_worker` threads on each, every thread with one finished
/// turn (so it is on disk and `thread/list` shows it): the client, and each thread's worker slot.
async fn threads_on_two_workers(
    fleet: &Fleet,
    per_worker: usize,
) -> anyhow::Result<(e2e::Client, Vec<(String, u32)>)> {
    let mut c = fleet.client("acme").await?;
    let table = &fleet.tenant("acme").table;
    let mut threads: Vec<(String, u32)> = Vec::new();
    for i in 0..per_worker * 6 {
        let count = |slot: u32| threads.iter().filter(|(_, s)| *s == slot).count();
        if count(0) >= per_worker && count(1) >= per_worker {
            break;
        }
        let t = c.start_thread().await?;
        c.start_turn(&t, &format!("placed {i}")).await?;
        c.until_turn_completed(&t).await?;
        let slot = table.owner(&t).context("thread placed")?.slot();
        threads.push((t, slot));
    }
    for slot in [0, 1] {
        let n = threads.iter().filter(|(_, s)| *s == slot).count();
        anyhow::ensure!(
            n >= per_worker,
            "worker {slot} got {n} threads: {threads:?}"
        );
    }
    Ok((c, threads))
}

async fn two_worker_fleet() -> anyhow::Result<Fleet> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .start()
        .await?;
    anyhow::ensure!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await,
        "two workers should start"
    );
    Ok(fleet)
}

/// Issue 15 item 2: `thread/loaded/list` lists the threads loaded on every worker of the tenant,
/// sorted and paginated as one app-server pages its own (ids in order, `limit` ids a page,
/// `nextCursor` the page's last id while more follow), and a bad cursor gets app-server's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loaded_threads_are_listed_across_the_pool() -> anyhow::Result<()> {
    let fleet = two_worker_fleet().await?;
    let (mut c, threads) = threads_on_two_workers(&fleet, 2).await?;
    let mut all: Vec<String> = threads.iter().map(|(t, _)| t.clone()).collect();
    all.sort();
    let whole = c.request("thread/loaded/list", json!({})).await?;
    assert_eq!(whole, json!({ "data": all, "nextCursor": null }));
    let mut pages = Vec::new();
    let mut cursor = Value::Null;
    loop {
        let page = c
            .request(
                "thread/loaded/list",
                json!({ "limit": 2, "cursor": cursor }),
            )
            .await?;
        pages.push(page.clone());
        cursor = page["nextCursor"].clone();
        if cursor.is_null() || pages.len() > all.len() {
            break;
        }
    }
    let want: Vec<Value> = all
        .chunks(2)
        .enumerate()
        .map(|(i, chunk)| {
            let last = (i + 1) * 2 < all.len();
            json!({ "data": chunk, "nextCursor": if last { json!(chunk[1]) } else { Value::Null } })
        })
        .collect();
    assert_eq!(pages, want, "pages of 2 over {all:?}");
    // A cursor between ids starts after it, as app-server's binary search does.
    let mid = c
        .request(
            "thread/loaded/list",
            json!({ "cursor": all[1], "limit": 0 }),
        )
        .await?;
    assert_eq!(mid, json!({ "data": [all[2]], "nextCursor": all[2] }));
    // app-server's own refusal of a cursor that is not a thread id, word for word.
    let mut d = Direct::connect(&worker_socket(&fleet, "acme", 0)).await?;
    d.until_answer_after(&initialize_frame()).await?;
    let bad = json!({ "cursor": "not-a-thread" });
    let (want, _) = d.call("thread/loaded/list", bad.clone()).await?;
    let got = c.call("thread/loaded/list", bad).await?;
    assert!(want.get("error").is_some(), "{want}");
    assert_eq!(got["error"], want["error"]);
    fleet.stop().await
}

/// Issue 15 item 3: `thread/list` through codex-fleet reports each thread as the worker holding it
/// does (its live status and environments), in the order and with the cursors one app-server
/// gives over the tenant's one CODEX_HOME.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thread_list_reports_each_thread_from_its_worker() -> anyhow::Result<()> {
    let fleet = two_worker_fleet().await?;
    let (mut c, threads) = threads_on_two_workers(&fleet, 2).await?;
    let mut direct = Vec::new();
    for slot in [0, 1] {
        let mut d = Direct::connect(&worker_socket(&fleet, "acme", slot)).await?;
        d.until_answer_after(&initialize_frame()).await?;
        direct.push(d);
    }
    for params in [
        json!({}),
        json!({ "limit": 3 }),
        json!({ "limit": 2, "sortKey": "updated_at" }),
    ] {
        let got = c.request("thread/list", params.clone()).await?;
        let mut per_worker = Vec::new();
        for d in &mut direct {
            let (r, _) = d.call("thread/list", params.clone()).await?;
            per_worker.push(r["result"].clone());
        }
        let ids = |v: &Value| -> Vec<Value> {
            v["data"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| e["id"].clone())
                .collect()
        };
        assert_eq!(
            ids(&got),
            ids(&per_worker[0]),
            "{params}: the order of one CODEX_HOME"
        );
        assert_eq!(got["nextCursor"], per_worker[0]["nextCursor"], "{params}");
        assert_eq!(
            got["backwardsCursor"], per_worker[0]["backwardsCursor"],
            "{params}"
        );
        let listed = got["data"].as_array().context("data")?;
        assert!(!listed.is_empty(), "{params}: {got}");
        for entry in listed {
            let id = entry["id"].as_str().context("id")?;
            let (_, slot) = threads
                .iter()
                .find(|(t, _)| t == id)
                .context("our thread")?;
            let holder = per_worker[*slot as usize]["data"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["id"] == id)
                .context("listed by its worker")?;
            assert_ne!(holder["status"]["type"], "notLoaded", "{holder}");
            assert_eq!(
                entry, holder,
                "{params}: {id} as its worker ({slot}) reports it"
            );
        }
    }
    fleet.stop().await
}

/// A merged request does not wait for a worker that stopped answering: after the bounded wait the
/// client gets the other workers' merge, and the missing answer is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merged_answer_does_not_wait_for_a_stuck_worker() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        // The stopped worker must not be killed as hung while the test looks.
        .workers_toml("health_interval_secs = 120\nhealth_timeout_secs = 120")
        .start()
        .await?;
    assert!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == 2)
        .await,
        "two workers should start"
    );
    let pool = fleet.tenant("acme").pool.clone();
    let handles = |slot: u32| {
        pool.workers()
            .iter()
            .find(|w| w.slot == slot)
            .map_or(0, |w| w.handles)
    };
    let before = [handles(0), handles(1)];
    let mut c = fleet.client("acme").await?;
    c.request("thread/loaded/list", json!({})).await?;
    // The session's first leg (its home) holds a handle on its worker.
    let home = (0..2u32)
        .find(|s| handles(*s) > before[*s as usize])
        .context("a home leg")?;
    let other = 1 - home;
    let table = &fleet.tenant("acme").table;
    let mut on_home = Vec::new();
    for _ in 0..12 {
        let t = c.start_thread().await?;
        let slot = table.owner(&t).context("placed")?.slot();
        if slot == home {
            on_home.push(t);
        } else if !on_home.is_empty() {
            break;
        }
    }
    let stuck = pool
        .workers()
        .iter()
        .find(|w| w.slot == other)
        .and_then(|w| w.pid)
        .context("the other worker's pid")?;
    let stuck = nix::unistd::Pid::from_raw(i32::try_from(stuck)?);
    // The worker runs in its own process group (its launcher and app-server).
    nix::sys::signal::killpg(stuck, nix::sys::signal::Signal::SIGSTOP)?;
    // Stopping is asynchronous: wait until every thread of the worker shows as stopped.
    let stopped = || {
        std::fs::read_dir(format!("/proc/{stuck}/task")).is_ok_and(|tasks| {
            tasks.filter_map(Result::ok).all(|t| {
                std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                    stat.rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with('T'))
                })
            })
        })
    };
    assert!(
        wait_until(Duration::from_secs(10), stopped).await,
        "the worker should stop"
    );
    let asked = tokio::time::Instant::now();
    let got = tokio::time::timeout(
        Duration::from_secs(25),
        c.request("thread/loaded/list", json!({})),
    )
    .await;
    let waited = asked.elapsed();
    nix::sys::signal::killpg(stuck, nix::sys::signal::Signal::SIGCONT)?;
    let got = got.context("the merged answer waited for the stopped worker")??;
    eprintln!("answered without the stopped worker after {waited:?}: {got}");
    on_home.sort();
    assert_eq!(got, json!({ "data": on_home, "nextCursor": null }));
    let missing = fleet
        .metric(
            "codex_fleet_fanout_missing_answers_total",
            &[("method", "thread/loaded/list"), ("reason", "timeout")],
        )
        .await?;
    assert_eq!(missing, 1.0);
    // The late answer is dropped, and the worker counts again once it runs.
    let all = c.request("thread/loaded/list", json!({})).await?;
    assert!(
        all["data"]
            .as_array()
            .is_some_and(|d| d.len() > on_home.len()),
        "{all}"
    );
    fleet.stop().await
}
