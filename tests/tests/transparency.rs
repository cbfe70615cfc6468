//! A tenant's pool answers as one app-server: what a client sees through codex-fleet is compared
//! with what the same client gets on a direct connection to one of the tenant's real workers.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use testkit::{ready_workers, wait_until, Fleet, FleetBuilder, STEP};
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
        Ok(serde_json::from_str(&self.recv_text().await?)?)
    }

    /// The next text frame, as the worker wrote it.
    async fn recv_text(&mut self) -> anyhow::Result<String> {
        loop {
            match tokio::time::timeout(STEP, self.ws.next())
                .await
                .context("timed out waiting for the worker")?
            {
                Some(Ok(Message::Text(t))) => return Ok(t.as_str().to_owned()),
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

/// The initialize `testkit::Client::initialize` sends.
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

/// A session whose threads live on both workers of its tenant gets the notifications
/// app-server sends each newly initialized connection exactly as often as a direct client does:
/// once, after its own initialize; those after the router's replayed initialize are dropped and
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_leg_repeats_no_per_connection_notification() -> anyhow::Result<()> {
    let fleet = acme(FleetBuilder::new(), 2).await?;
    let direct = direct_per_connection(&worker_socket(&fleet, "acme", 0)).await?;
    eprintln!("direct connection, after initialize: {direct:?}");
    anyhow::ensure!(
        !direct.is_empty(),
        "a direct connection gets per-connection notifications after initialize"
    );

    let mut c = fleet.client("acme").await?;
    let tenant = fleet.tenant("acme");
    let mut owners = std::collections::HashSet::new();
    let mut threads = Vec::new();
    for _ in 0..8 {
        let t = c.start_thread().await?;
        owners.insert(tenant.find_owner(&t).context("thread placed")?);
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

/// The real worker writes its answers as the router reads them by their head
/// (`proto::rpc::result_head`: `{"id":…,"result":…}`, compact), so a `thread/read` answer is
/// relayed without its result being scanned; and what the head reads is what the full parse
/// reads. Were app-server to change the shape, answers would still be read (the full parse),
/// only slower: this test is what notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_answers_are_read_by_their_head() -> anyhow::Result<()> {
    use proto::rpc::{result_head, thread_of_result, Frame, Message as Rpc};
    let fleet = acme(FleetBuilder::new(), 1).await?;
    let mut d = Direct::connect(&worker_socket(&fleet, "acme", 0)).await?;
    let mut answers = Vec::new();
    let mut thread = None;
    let requests = [
        initialize_frame(),
        json!({ "id": 2, "method": "thread/start", "params": {} }),
        json!({ "id": "read", "method": "thread/read", "params": { "threadId": "" } }),
    ];
    for (n, mut request) in requests.into_iter().enumerate() {
        if let Some(t) = &thread {
            request["params"]["threadId"] = json!(t);
        }
        d.send(&request).await?;
        let text = loop {
            let text = d.recv_text().await?;
            let v: Value = serde_json::from_str(&text)?;
            if v["id"] == request["id"] && v.get("method").is_none() {
                break text;
            }
        };
        let (id, result) =
            result_head(&text).with_context(|| format!("not read by its head: {text}"))?;
        let full = Frame::parse(&text)?;
        anyhow::ensure!(
            matches!(&full.message, Rpc::Response { id: parsed } if *parsed == id),
            "{text}"
        );
        anyhow::ensure!(full.result.map(|r| r.get()) == Some(result), "{text}");
        if n == 0 {
            d.send(&json!({ "method": "initialized" })).await?;
        }
        if n == 1 {
            thread = Some(thread_of_result(result).with_context(|| format!("no thread: {text}"))?);
        }
        answers.push(text);
    }
    eprintln!("answers read by their head: {answers:?}");
    fleet.stop().await
}

/// Malformed requests are invalid requests (`-32600`, as app-server answers them), not
/// host-access refusals; a real refusal is still `-32003`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_not_refused() -> anyhow::Result<()> {
    let fleet = acme(FleetBuilder::new(), 1).await?;
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

/// A method app-server does not know gets app-server's own answer (`-32600`,
/// its message word for word), before `initialize` as after, and never reaches a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_methods_get_app_servers_own_answer_and_reach_no_worker() -> anyhow::Result<()> {
    let fleet = acme(FleetBuilder::new(), 1).await?;
    let mut d = Direct::connect(&worker_socket(&fleet, "acme", 0)).await?;
    let frames = [
        json!({"id": 21, "method": "thread/notAMethodYet", "params": {}}),
        json!({"id": 22, "method": "no/such/method"}),
        json!({"id": "x", "method": "a\"b\u{1}c`d\u{e9}", "params": {"threadId": "t"}}),
    ];
    let compare = |want: &Value, got: &Value, frame: &Value| {
        assert_eq!(want["error"]["code"], -32600, "app-server: {want}");
        let message = want["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("unknown variant"), "{want}");
        // Byte for byte: the error object as both sides serialize it.
        assert_eq!(
            got["error"].to_string(),
            want["error"].to_string(),
            "{frame}"
        );
        assert_eq!(got["id"], frame["id"]);
    };
    let mut early = fleet.connect("acme").await?;
    for frame in &frames {
        let want = d.call_raw(frame).await?;
        early.send(frame).await?;
        let id = frame["id"].clone();
        let got = early.wait_for(|v| v["id"] == id).await?;
        compare(&want, &got, frame);
    }
    d.until_answer_after(&initialize_frame()).await?;
    let mut c = fleet.client("acme").await?;
    let answered_by_workers = || {
        fleet.metric(
            "codex_fleet_request_duration_seconds_count",
            &[("tenant", "acme")],
        )
    };
    let before = answered_by_workers().await?;
    for frame in &frames {
        let want = d.call_raw(frame).await?;
        c.send(frame).await?;
        let id = frame["id"].clone();
        let got = c.wait_for(|v| v["id"] == id).await?;
        compare(&want, &got, frame);
    }
    assert_eq!(
        answered_by_workers().await?,
        before,
        "no worker answered an unknown method"
    );
    // The count does move for a request a worker answers.
    c.request("account/read", json!({})).await?;
    assert!(answered_by_workers().await? > before);
    fleet.stop().await
}

/// A tenant of two workers with `per_worker` threads on each, every thread with one finished
/// turn (so it is on disk and `thread/list` shows it): the client, and each thread's worker slot.
async fn threads_on_two_workers(
    fleet: &Fleet,
    per_worker: usize,
) -> anyhow::Result<(testkit::Client, Vec<(String, u32)>)> {
    let mut c = fleet.client("acme").await?;
    let tenant = fleet.tenant("acme");
    let mut threads: Vec<(String, u32)> = Vec::new();
    for i in 0..per_worker * 6 {
        let count = |slot: u32| threads.iter().filter(|(_, s)| *s == slot).count();
        if count(0) >= per_worker && count(1) >= per_worker {
            break;
        }
        let t = c.start_thread().await?;
        c.start_turn(&t, &format!("placed {i}")).await?;
        c.until_turn_completed(&t).await?;
        let slot = tenant.find_owner(&t).context("thread placed")?.slot();
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

/// A fleet with tenant `acme` of exactly `workers` workers, all ready.
async fn acme(builder: FleetBuilder, workers: usize) -> anyhow::Result<Fleet> {
    let fleet = builder
        .tenant_pool("acme", workers, workers)
        .start()
        .await?;
    anyhow::ensure!(
        wait_until(Duration::from_secs(30), || ready_workers(&fleet, "acme")
            == workers)
        .await,
        "{workers} workers should start"
    );
    Ok(fleet)
}

async fn two_worker_fleet() -> anyhow::Result<Fleet> {
    acme(FleetBuilder::new(), 2).await
}

/// `thread/loaded/list` lists the threads loaded on every worker of the tenant,
/// sorted and paginated as one app-server pages its own (ids in order, `limit` ids a page,
/// `nextCursor` the page's last id while more follow), and a bad cursor gets app-server's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loaded_threads_are_listed_across_the_pool() -> anyhow::Result<()> {
    let fleet = two_worker_fleet().await?;
    // With no threads anywhere, only the home worker is asked: a leg to a worker with nothing
    // to add would keep it from idling out.
    let mut idle = fleet.client("acme").await?;
    let none = idle.request("thread/loaded/list", json!({})).await?;
    assert_eq!(none, json!({ "data": [], "nextCursor": null }));
    let legs = [("tenant", "acme")];
    assert_eq!(
        fleet.metric("codex_fleet_legs_opened_total", &legs).await?,
        1.0
    );
    idle.close().await;
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
    // The ids codex-fleet gives the copies are its own: a client cannot use them.
    let reserved =
        json!({ "id": "codex-fleet:fanout:0", "method": "thread/loaded/list", "params": {} });
    c.send(&reserved).await?;
    let refused = c.wait_for(|v| v["id"] == "codex-fleet:fanout:0").await?;
    assert_eq!(refused["error"]["code"], -32600, "{refused}");
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

/// `thread/list` through codex-fleet reports each thread as the worker holding it
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
    // The stopped worker must not be killed as hung while the test looks.
    let hold =
        FleetBuilder::new().workers_toml("health_interval_secs = 120\nhealth_timeout_secs = 120");
    let fleet = acme(hold, 2).await?;
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
    let tenant = fleet.tenant("acme");
    let mut on_home = Vec::new();
    for _ in 0..12 {
        let t = c.start_thread().await?;
        let slot = tenant.find_owner(&t).context("placed")?.slot();
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

// === The transparency scenario (docs/decisions/0013-parse-once-one-method-table.md) ===

/// One client connection of the scenario: straight to a worker's socket, or through codex-fleet.
enum Wire {
    Direct(Box<Direct>),
    Fleet(Box<testkit::Client>),
}

/// How long a step waits for more after its last expected message: notifications that follow
/// a step's answer (status changes after a turn) belong to it, not to the next step. At least
/// this; longer on a machine whose worker answers slowly today (see [`measure_settle`]).
const SETTLE: Duration = Duration::from_millis(250);

/// The quiet window every run of this process uses, once measured.
static SETTLE_WINDOW: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

fn settle() -> Duration {
    SETTLE_WINDOW.get().copied().unwrap_or(SETTLE)
}

/// Measures, once per process, how slowly the worker at `socket` answers now (the slowest of ten
/// requests before `initialize`, which app-server refuses without touching any state), and sets
/// the quiet window to twenty times that, never less than [`SETTLE`]: notifications that trail a
/// step come later on a slower machine, and must not slide into the next step.
async fn measure_settle(socket: &Path) -> anyhow::Result<()> {
    if SETTLE_WINDOW.get().is_some() {
        return Ok(());
    }
    let mut d = Direct::connect(socket).await?;
    let mut slowest = Duration::ZERO;
    for id in 0..10 {
        let t = tokio::time::Instant::now();
        d.call_raw(&json!({ "id": format!("settle-{id}"), "method": "thread/loaded/list" }))
            .await?;
        slowest = slowest.max(t.elapsed());
    }
    let window = SETTLE.max(slowest * 20);
    eprintln!("measured: slowest worker round trip {slowest:?}; quiet window {window:?}");
    let _set = SETTLE_WINDOW.set(window);
    Ok(())
}

impl Wire {
    async fn send(&mut self, v: &Value) -> anyhow::Result<()> {
        match self {
            Wire::Direct(d) => d.send(v).await,
            Wire::Fleet(c) => c.send(v).await,
        }
    }

    async fn recv(&mut self, within: Duration) -> anyhow::Result<Value> {
        match self {
            Wire::Direct(d) => Ok(tokio::time::timeout(within, d.recv()).await??),
            Wire::Fleet(c) => c.recv_wire(within).await,
        }
    }

    /// Reads until `done` holds for a message (answering server requests with `answer`), then
    /// until the wire has been quiet for [`settle`]; returns everything read, in order.
    async fn until(
        &mut self,
        mut done: impl FnMut(&Value) -> bool,
        mut answer: impl FnMut(&Value) -> Option<Value>,
    ) -> anyhow::Result<Vec<Value>> {
        let mut seen = Vec::new();
        loop {
            let v = self.recv(STEP).await?;
            if v.get("method").is_some() && v.get("id").is_some() {
                if let Some(result) = answer(&v) {
                    self.send(&json!({ "id": v["id"], "result": result }))
                        .await?;
                }
            }
            let finished = done(&v);
            seen.push(v);
            if finished {
                break;
            }
        }
        while let Ok(v) = self.recv(settle()).await {
            seen.push(v);
        }
        Ok(seen)
    }
}

/// A scenario run: its wire, the next request id, and the transcript so far (one entry a step).
struct Run {
    wire: Wire,
    next_id: i64,
    steps: Vec<(String, Vec<Value>)>,
    /// The threads of the run, by scenario name.
    threads: BTreeMap<&'static str, String>,
}

fn no_answer(_: &Value) -> Option<Value> {
    None
}

/// Whether a message is `turn/completed` for `thread`.
fn completed(thread: &str) -> impl FnMut(&Value) -> bool + '_ {
    move |v| v["method"] == "turn/completed" && v["params"]["threadId"] == thread
}

impl Run {
    fn thread(&self, name: &str) -> String {
        self.threads.get(name).cloned().unwrap_or_default()
    }

    fn record(&mut self, name: impl Into<String>, msgs: Vec<Value>) -> Vec<Value> {
        self.steps.push((name.into(), msgs.clone()));
        msgs
    }

    /// A request and everything up to its answer (and the settle after it).
    async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.wire
            .send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        let msgs = self
            .wire
            .until(|v| v["id"] == id && v.get("method").is_none(), no_answer)
            .await?;
        let answer = msgs
            .iter()
            .find(|v| v["id"] == id && v.get("method").is_none())
            .cloned()
            .unwrap_or_default();
        self.record(format!("{method} {params}"), msgs);
        Ok(answer)
    }

    /// `thread/start` with `params`; remembers the thread as `name`.
    async fn start(&mut self, name: &'static str, params: Value) -> anyhow::Result<()> {
        let r = self.call("thread/start", params).await?;
        let id = r["result"]["thread"]["id"].as_str().context("thread id")?;
        self.threads.insert(name, id.to_owned());
        Ok(())
    }

    /// Sends `turn/start` on `thread` with one text input; returns its id.
    async fn start_turn(&mut self, thread: &str, text: &str) -> anyhow::Result<i64> {
        let id = self.next_id;
        self.next_id += 1;
        self.wire
            .send(&json!({ "id": id, "method": "turn/start", "params": {
                "threadId": thread,
                "input": [{ "type": "text", "text": text, "text_elements": [] }] } }))
            .await?;
        Ok(id)
    }

    /// A turn from `turn/start` to its `turn/completed`, approvals answered with `decision`.
    async fn turn(&mut self, name: &str, text: &str, decision: Option<&str>) -> anyhow::Result<()> {
        let thread = self.thread(name);
        self.start_turn(&thread, text).await?;
        let msgs = self
            .wire
            .until(completed(&thread), |_| {
                decision.map(|d| json!({ "decision": d }))
            })
            .await?;
        self.record(format!("turn on {name}: {text} ({decision:?})"), msgs);
        Ok(())
    }

    /// A turn interrupted (`turn/interrupt`) or steered (`turn/steer`) once it has started.
    async fn turn_then(&mut self, name: &str, text: &str, then: &str) -> anyhow::Result<()> {
        let thread = self.thread(name);
        let id = self.start_turn(&thread, text).await?;
        self.next_id += 1;
        let mut msgs = self
            .wire
            .until(|v| v["method"] == "turn/started", no_answer)
            .await?;
        let turn = msgs
            .iter()
            .find(|v| v["id"] == id)
            .and_then(|v| v["result"]["turn"]["id"].as_str())
            .context("turn id")?
            .to_owned();
        let params = match then {
            "turn/interrupt" => json!({ "threadId": thread, "turnId": turn }),
            _ => json!({ "threadId": thread, "expectedTurnId": turn,
                "input": [{ "type": "text", "text": "steered", "text_elements": [] }] }),
        };
        self.wire
            .send(&json!({ "id": id + 1, "method": then, "params": params }))
            .await?;
        msgs.extend(self.wire.until(completed(&thread), no_answer).await?);
        self.record(format!("{then} on {name}: {text}"), msgs);
        Ok(())
    }
}

/// Prefix of the names of the second connection's steps.
const SECOND: &str = "second session: ";

/// The scenario, the same for every run: ~50 steps of what a client does. `workspace` is the
/// tenant's workspace (a cwd the policy allows), `second` a second connection of the tenant.
async fn scenario(
    mut run: Run,
    second: impl std::future::Future<Output = anyhow::Result<Run>>,
    workspace: &Path,
) -> anyhow::Result<Vec<(String, Vec<Value>)>> {
    let init = initialize_frame();
    run.wire.send(&init).await?;
    let msgs = run
        .wire
        .until(|v| v["id"] == "initialize", no_answer)
        .await?;
    run.record("initialize", msgs);
    run.wire.send(&json!({ "method": "initialized" })).await?;
    let ws = workspace.display().to_string();
    run.call("thread/loaded/list", json!({})).await?;
    run.call("thread/list", json!({})).await?;
    run.call("model/list", json!({})).await?;
    run.call("collaborationMode/list", json!({})).await?;
    run.start("a", json!({})).await?;
    run.start("b", json!({ "cwd": ws })).await?;
    run.start("c", json!({ "approvalPolicy": "never" })).await?;
    run.turn("a", "hello one", None).await?;
    run.turn("b", "hello two", None).await?;
    run.turn("c", "hello three", None).await?;
    run.call("thread/loaded/list", json!({})).await?;
    let page = run
        .call("thread/loaded/list", json!({ "limit": 1 }))
        .await?;
    let cursor = page["result"]["nextCursor"].clone();
    run.call(
        "thread/loaded/list",
        json!({ "limit": 1, "cursor": cursor }),
    )
    .await?;
    run.call("thread/list", json!({})).await?;
    let page = run.call("thread/list", json!({ "limit": 2 })).await?;
    let cursor = page["result"]["nextCursor"].clone();
    run.call("thread/list", json!({ "limit": 2, "cursor": cursor }))
        .await?;
    run.call("thread/list", json!({ "sortKey": "updated_at" }))
        .await?;
    let (a, b, c) = (run.thread("a"), run.thread("b"), run.thread("c"));
    run.call(
        "thread/read",
        json!({ "threadId": a, "includeTurns": true }),
    )
    .await?;
    run.call("thread/name/set", json!({ "threadId": a, "name": "first" }))
        .await?;
    run.call("thread/read", json!({ "threadId": a })).await?;
    run.turn("a", "please RUNSHELL", Some("accept")).await?;
    run.turn("b", "please RUNSHELL", Some("decline")).await?;
    run.turn("a", "please RUNSHELL", Some("cancel")).await?;
    run.turn_then("b", "SLOW3 interrupt me", "turn/interrupt")
        .await?;
    run.turn_then("c", "SLOW2 steer me", "turn/steer").await?;
    let fork = run.call("thread/fork", json!({ "threadId": a })).await?;
    let d = fork["result"]["thread"]["id"]
        .as_str()
        .context("fork id")?
        .to_owned();
    run.threads.insert("d", d.clone());
    run.turn("d", "after the fork", None).await?;
    run.call(
        "thread/read",
        json!({ "threadId": d, "includeTurns": true }),
    )
    .await?;
    run.call("thread/turns/list", json!({ "threadId": a }))
        .await?;
    run.call("thread/loaded/list", json!({})).await?;
    run.call("thread/archive", json!({ "threadId": c })).await?;
    run.call("thread/list", json!({})).await?;
    run.call("thread/list", json!({ "archived": true })).await?;
    run.call("thread/unarchive", json!({ "threadId": c }))
        .await?;
    run.call("thread/unsubscribe", json!({ "threadId": b }))
        .await?;
    run.call("thread/loaded/list", json!({})).await?;
    run.call("thread/resume", json!({ "threadId": b })).await?;
    run.turn("b", "after the resume", None).await?;
    run.call("thread/list", json!({ "limit": 10 })).await?;
    // A second connection (opened now: app-server drops connections that stay uninitialized)
    // takes part in thread a and answers its approval.
    let mut second = second.await?;
    second.wire.send(&init).await?;
    second
        .wire
        .until(|v| v["id"] == "initialize", no_answer)
        .await?;
    second
        .wire
        .send(&json!({ "method": "initialized" }))
        .await?;
    second
        .call("thread/resume", json!({ "threadId": a }))
        .await?;
    run.start_turn(&a, "shared RUNSHELL").await?;
    // Through the end of the turn: what follows the answer (the command's output, the model's
    // reply) belongs to this step however long the command takes, so no quiet window decides
    // where the step ends.
    let asked = second
        .wire
        .until(completed(&a), |_| Some(json!({ "decision": "accept" })))
        .await?;
    second.record("second session answers the approval", asked);
    let msgs = run.wire.until(completed(&a), no_answer).await?;
    run.record("turn on a, approved by the second session", msgs);
    // Errors, in app-server's words.
    let unknown = "00000000-0000-7000-8000-000000000000";
    run.call("thread/read", json!({ "threadId": unknown }))
        .await?;
    run.call("thread/resume", json!({ "threadId": unknown }))
        .await?;
    run.call("turn/start", json!({ "threadId": a, "input": 42 }))
        .await?;
    run.call("thread/loaded/list", json!({ "cursor": "not-a-thread" }))
        .await?;
    run.call("thread/read", json!({ "threadId": "not-a-uuid" }))
        .await?;
    run.call(
        "thread/name/set",
        json!({ "threadId": d, "name": "the fork" }),
    )
    .await?;
    run.call(
        "thread/list",
        json!({ "limit": 3, "sortKey": "updated_at" }),
    )
    .await?;
    run.call("thread/loaded/list", json!({ "limit": 2 }))
        .await?;
    let _ = (b, c);
    let mut steps = run.steps;
    steps.extend(
        second
            .steps
            .into_iter()
            .map(|(name, msgs)| (format!("{SECOND}{name}"), msgs)),
    );
    Ok(steps)
}

/// Replaces what differs between runs without meaning: ids (in order of first appearance),
/// timestamps and durations, opaque cursors, the run's temporary directory and the mock model's
/// port.
struct Normalizer {
    ids: HashMap<String, String>,
    dir: String,
}

impl Normalizer {
    fn id(&mut self, s: &str) -> String {
        let n = self.ids.len();
        self.ids
            .entry(s.to_owned())
            .or_insert_with(|| format!("<id{n}>"))
            .clone()
    }

    fn string(&mut self, key: &str, s: &str) -> Value {
        let is_id = key == "id" || key.ends_with("Id") || key.ends_with("Ids") || key == "data";
        if key.ends_with("ursor") {
            return json!("<cursor>");
        }
        let uuid = regex_uuid(s);
        if is_id || uuid.is_some() {
            if let Some(u) = uuid.filter(|u| u.len() != s.len()) {
                let placeholder = self.id(&u);
                return self.string("", &s.replace(&u, &placeholder));
            }
            return json!(self.id(s));
        }
        let mut out = s.replace(&self.dir, "<dir>");
        // Rollout file names and paths carry the time they were made.
        out = mask_digits_after(&out, "rollout-");
        out = mask_digits_after(&out, "/sessions/");
        out = mask_digits_after(&out, "127.0.0.1:");
        json!(out)
    }

    fn value(&mut self, key: &str, v: &Value) -> Value {
        match v {
            Value::String(s) => self.string(key, s),
            Value::Number(_)
                if key.ends_with("At")
                    || key.ends_with("Ms")
                    || key.ends_with("Seconds")
                    || key.contains("time")
                    || key.contains("Time")
                    || key == "duration" =>
            {
                json!("<n>")
            }
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(key, x)).collect()),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| {
                        // Maps keyed by thread id (`readStates`).
                        let name = match regex_uuid(k) {
                            Some(_) => self.string("id", k).as_str().unwrap_or_default().to_owned(),
                            None => k.clone(),
                        };
                        (name, self.value(k, x))
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

/// The first UUID in `s`, if any.
fn regex_uuid(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let shape = |w: &[u8]| {
        w.len() == 36
            && w.iter().enumerate().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => *c == b'-',
                _ => c.is_ascii_hexdigit(),
            })
    };
    (0..b.len().saturating_sub(35))
        .find(|i| shape(&b[*i..*i + 36]))
        .map(|i| s[i..i + 36].to_owned())
}

/// `s` with the digits after each `marker` (up to the next `/` or `.`) masked.
fn mask_digits_after(s: &str, marker: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(marker) {
        out.push_str(&rest[..i + marker.len()]);
        rest = &rest[i + marker.len()..];
        let end = rest.find(['/', '.']).unwrap_or(rest.len());
        out.extend(
            rest[..end]
                .chars()
                .map(|c| if c.is_ascii_digit() { '#' } else { c }),
        );
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A step's messages, normalized, in three parts:
/// - `ordered`: answers and server requests, in the order they came;
/// - `threads`: per thread (by its normalized id), every message about it — notifications,
///   answers whose result names it, server requests — in the order they came, duplicates kept,
///   and beside it the thread's status changes in their own order. One thread lives on one
///   worker, so one app-server's order within a thread, and against its answers, must survive
///   the pool (docs/architecture.md, "One app-server per tenant");
/// - `unthreaded`: notifications that name no thread, as a sorted list: two workers send them
///   in an order no single process reproduces.
fn normalize(msgs: &[Value], n: &mut Normalizer, conn: &str) -> Value {
    let mut ordered = Vec::new();
    let mut threads: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let mut unthreaded = Vec::new();
    for m in msgs {
        let mut v = n.value("", m);
        // Server-request ids are the server's to choose and a client only echoes them: app-server
        // counts them per process (across its connections), codex-fleet per session (two workers
        // would collide). Compared per connection by first appearance, like every other id.
        if m.get("method").is_some() && m.get("id").is_some() {
            v["id"] = json!(n.id(&format!("{conn} server request {}", m["id"])));
        }
        if m["method"] == "serverRequest/resolved" {
            v["params"]["requestId"] = json!(n.id(&format!(
                "{conn} server request {}",
                m["params"]["requestId"]
            )));
        }
        let thread = [
            &v["params"]["threadId"],
            &v["params"]["thread"]["id"],
            &v["result"]["thread"]["id"],
        ]
        .into_iter()
        .find_map(|t| t.as_str())
        .map(str::to_owned);
        match thread {
            // app-server reports a thread's status from a task of its own: its changes interleave
            // with a turn's items in an order that varies run to run on one app-server (seen
            // direct against direct), so the two streams are compared each in its own order.
            Some(t) if m["method"] == "thread/status/changed" => {
                let stream = threads.entry(format!("{t} status")).or_default();
                // app-server's `thread/archive` of a loaded thread says `notLoaded` once or twice,
                // run to run on one app-server (its shutdown of the thread and the archive's own
                // teardown each take it out of the status watch, racing): seen direct against
                // direct, two runs saying it twice and two runs once. A repeat of `notLoaded`
                // tells a client nothing, so it is compared once.
                let repeat = m["params"]["status"]["type"] == "notLoaded"
                    && stream
                        .last()
                        .is_some_and(|l| l["params"]["status"] == v["params"]["status"]);
                if !repeat {
                    stream.push(v.clone());
                }
            }
            Some(t) => threads.entry(t).or_default().push(v.clone()),
            None if m.get("id").is_none() => unthreaded.push(v.to_string()),
            None => {}
        }
        if m.get("id").is_some() {
            ordered.push(v);
        }
    }
    unthreaded.sort();
    json!({ "ordered": ordered, "threads": threads, "unthreaded": unthreaded })
}

/// A repeated `notLoaded` (app-server's archive says it once or twice) is compared once; any
/// other repeated status, or a `notLoaded` after another status, still counts.
#[test]
fn only_a_repeated_not_loaded_is_compared_once() {
    let status = |s: &str| {
        json!({ "method": "thread/status/changed",
            "params": { "threadId": "t", "status": { "type": s } } })
    };
    let step = |msgs: &[Value]| {
        let mut n = Normalizer {
            ids: HashMap::new(),
            dir: "/nowhere".into(),
        };
        normalize(msgs, &mut n, "first")
    };
    let gone = status("notLoaded");
    let idle = status("idle");
    let once = |v: &Value| step(std::slice::from_ref(v));
    assert_eq!(once(&gone), step(&[gone.clone(), gone.clone()]));
    assert_ne!(once(&idle), step(&[idle.clone(), idle.clone()]));
    assert_ne!(once(&gone), step(&[idle.clone(), gone.clone()]));
    assert_ne!(
        step(&[gone.clone(), gone.clone()]),
        step(&[gone.clone(), idle, gone])
    );
}

/// Each message of a step and how often it came (for the duplicates a pool could add).
fn counts(step: &Value) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    let all = step["threads"]
        .as_object()
        .into_iter()
        .flat_map(|t| t.values())
        .filter_map(Value::as_array)
        .flatten()
        .map(Value::to_string)
        .chain(
            step["unthreaded"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned)),
        );
    for m in all {
        *out.entry(m).or_default() += 1;
    }
    out
}

fn normalize_run(steps: &[(String, Vec<Value>)], dir: &Path) -> Vec<(String, Value)> {
    let mut n = Normalizer {
        ids: HashMap::new(),
        dir: dir.display().to_string(),
    };
    steps
        .iter()
        .map(|(name, msgs)| {
            let conn = if name.starts_with(SECOND) {
                "second"
            } else {
                "first"
            };
            (name.clone(), normalize(msgs, &mut n, conn))
        })
        .collect()
}

/// Runs the scenario straight against the only worker of a fresh tenant.
async fn direct_run() -> anyhow::Result<Vec<(String, Value)>> {
    let fleet = acme(FleetBuilder::new(), 1).await?;
    let socket = worker_socket(&fleet, "acme", 0);
    measure_settle(&socket).await?;
    let wire = |d: Direct| Run {
        wire: Wire::Direct(Box::new(d)),
        next_id: 1,
        steps: Vec::new(),
        threads: BTreeMap::new(),
    };
    let first = wire(Direct::connect(&socket).await?);
    let second = async { Ok(wire(Direct::connect(&socket).await?)) };
    let steps = scenario(first, second, &fleet.workspace("acme")).await?;
    let out = normalize_run(&steps, fleet.files.dir.path());
    fleet.stop().await?;
    Ok(out)
}

/// Runs the scenario through codex-fleet, against a tenant of two workers; returns the steps and
/// how many workers the scenario's threads ended up on.
async fn fleet_run() -> anyhow::Result<(Vec<(String, Value)>, usize)> {
    let fleet = two_worker_fleet().await?;
    let wire = |c: testkit::Client| Run {
        wire: Wire::Fleet(Box::new(c)),
        next_id: 1,
        steps: Vec::new(),
        threads: BTreeMap::new(),
    };
    let first = wire(fleet.connect("acme").await?);
    let second = async { Ok(wire(fleet.connect("acme").await?)) };
    let steps = scenario(first, second, &fleet.workspace("acme")).await?;
    let tenant = fleet.tenant("acme");
    let owners: std::collections::HashSet<_> = steps
        .iter()
        .flat_map(|(_, msgs)| msgs)
        .filter_map(|m| m["result"]["thread"]["id"].as_str())
        .filter_map(|t| tenant.find_owner(t))
        .collect();
    let out = normalize_run(&steps, fleet.files.dir.path());
    fleet.stop().await?;
    Ok((out, owners.len()))
}

/// Prints where two values differ.
fn diff(at: &str, want: &Value, got: &Value) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for k in w.keys().chain(g.keys().filter(|k| !w.contains_key(*k))) {
                let (wk, gk) = (w.get(k), g.get(k));
                diff(
                    &format!("{at}.{k}"),
                    wk.unwrap_or(&Value::Null),
                    gk.unwrap_or(&Value::Null),
                );
            }
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => {
            for (i, (w, g)) in w.iter().zip(g).enumerate() {
                diff(&format!("{at}[{i}]"), w, g);
            }
        }
        (w, g) if w != g => {
            let cut = |v: &Value| v.to_string().chars().take(600).collect::<String>();
            eprintln!("  at {at}\n    want: {}\n    got:  {}", cut(w), cut(g));
        }
        _ => {}
    }
}

/// Compares a run with the runs it may equal, step by step: a step is the same when it equals the
/// step of any of `want` (app-server itself varies some steps run to run: the set of its orders,
/// not a sorted list). Prints the differing steps, each message that came more often than in any
/// of `want` (a duplicate), and returns (steps the same, duplicates).
fn compare(what: &str, want: &[&[(String, Value)]], got: &[(String, Value)]) -> (usize, usize) {
    let mut same = 0;
    let mut duplicates = 0;
    for (i, (name, g)) in got.iter().enumerate() {
        let variants: Vec<&Value> = want
            .iter()
            .filter_map(|w| w.get(i))
            .map(|(_, w)| w)
            .collect();
        if variants.contains(&g) {
            same += 1;
            continue;
        }
        eprintln!("{what}: step {i} differs: {name}");
        if let Some(w) = variants.first() {
            diff("", w, g);
        }
        let most: BTreeMap<String, usize> =
            variants
                .iter()
                .map(|w| counts(w))
                .fold(BTreeMap::new(), |mut acc, c| {
                    for (m, k) in c {
                        let e = acc.entry(m).or_insert(0);
                        *e = (*e).max(k);
                    }
                    acc
                });
        for (m, k) in counts(g) {
            let allowed = most.get(&m).copied().unwrap_or(0);
            if allowed > 0 && k > allowed {
                duplicates += k - allowed;
                let cut: String = m.chars().take(300).collect();
                eprintln!("  duplicate: {k} times (app-server: {allowed}): {cut}");
            }
        }
    }
    let all = want
        .iter()
        .map(|w| w.len())
        .chain([got.len()])
        .max()
        .unwrap_or(0);
    eprintln!("{what}: {same}/{all} identical, {duplicates} duplicates");
    (same, duplicates)
}

/// The scenario run straight against one worker, twice, is the same (after normalizing ids,
/// timestamps and paths) but for a step or two app-server itself varies; through codex-fleet
/// against a tenant of two workers, with the threads on both, every step is one of app-server's:
/// within each thread the same messages in the same order, answers included, and nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scenario_through_the_pool_is_the_scenario_against_one_app_server() -> anyhow::Result<()>
{
    let started = tokio::time::Instant::now();
    let direct = direct_run().await?;
    let again = direct_run().await?;
    let (fleet, workers) = fleet_run().await?;
    eprintln!("three runs in {:?}", started.elapsed());
    // Steps app-server itself varies are compared against both of its runs.
    let (stable, _) = compare("direct vs direct", &[&direct], &again);
    let (same, duplicates) = compare("fleet vs direct", &[&direct, &again], &fleet);
    assert_eq!(
        workers, 2,
        "the scenario's threads should live on both workers"
    );
    assert!(direct.len() >= 50, "{} steps", direct.len());
    assert!(
        direct.len() - stable <= 2,
        "direct against direct varies in {} steps: the scenario is not a stable reference",
        direct.len() - stable
    );
    assert_eq!(
        duplicates, 0,
        "codex-fleet delivered a message more often than app-server"
    );
    assert_eq!(
        (same, fleet.len()),
        (direct.len(), direct.len()),
        "through codex-fleet every step must be one app-server's: per thread the same order of \
         notifications and answers, no duplicates"
    );
    Ok(())
}
