//! Fixtures shared by the real-binary tests: config, metrics, a protocol client, a model that hangs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures_util::{SinkExt, StreamExt};
use prometheus::Registry;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use tokio::time::{sleep, timeout, Duration, Instant};
use tokio_tungstenite::tungstenite::Message;
use worker::{
    LegStream, Pool, PoolConfig, PoolEvent, WorkerHandle, WorkerId, WorkerInfo, WorkerMetrics,
};

pub const WAIT: Duration = Duration::from_secs(10);

pub fn codex_bin() -> PathBuf {
    match std::env::var_os("CODEX_BIN") {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "CODEX_BIN is not set: these tests need the real codex binary (0.171.0), e.g. \
             CODEX_BIN=/tmp/codexnpm/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
        ),
    }
}

pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init()
        .ok();
}

/// A short temp dir under /tmp so socket paths stay short.
pub fn short_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("cf")
        .tempdir_in("/tmp")
        .unwrap()
}

pub fn config(dir: &Path, tenant: &str) -> PoolConfig {
    PoolConfig {
        tenant: tenant.into(),
        program: codex_bin(),
        args: vec!["app-server".into()],
        codex_home: dir.join("h"),
        cwd: dir.join("w"),
        socket_dir: dir.join("s"),
        thread_unload_delay_secs: 60,
        env: vec![
            ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()),
            ("HOME".into(), dir.join("w").display().to_string()),
        ],
        min_workers: 1,
        max_workers: 1,
        ready_timeout: Duration::from_secs(10),
        health_interval: Duration::from_millis(200),
        health_timeout: Duration::from_millis(500),
        restart_backoff_initial: Duration::from_millis(50),
        restart_backoff_max: Duration::from_millis(500),
        stop_grace: Duration::from_secs(2),
        ..PoolConfig::default()
    }
}

pub fn metrics() -> (Registry, WorkerMetrics) {
    let registry = Registry::new();
    let metrics = WorkerMetrics::register(&registry).unwrap();
    (registry, metrics)
}

/// Sum of a counter or gauge over the series carrying `label`.
pub fn metric(registry: &Registry, name: &str, label: (&str, &str)) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            m.get_label()
                .iter()
                .any(|l| l.name() == label.0 && l.value() == label.1)
        })
        .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
        .sum()
}

pub fn info(pool: &Pool, slot: u32) -> WorkerInfo {
    pool.workers().into_iter().find(|w| w.slot == slot).unwrap()
}

/// Polls `check` every 20 ms until it holds; panics with `what` after `WAIT`.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !check() {
        assert!(t0.elapsed() < WAIT, "timed out waiting for {what}");
        sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

pub async fn next_exit(events: &mut broadcast::Receiver<PoolEvent>, worker: WorkerId) -> String {
    loop {
        match events.recv().await.unwrap() {
            PoolEvent::WorkerExited {
                worker: w, status, ..
            } if w == worker => return status,
            _ => {}
        }
    }
}

/// A protocol client on one leg.
pub struct Client {
    ws: LegStream,
    next_id: u64,
}

impl Client {
    /// Connects and initializes as `name`.
    pub async fn connect(handle: &WorkerHandle, name: &str) -> Client {
        let ws = handle.connect(16 << 20).await.unwrap();
        let mut client = Client { ws, next_id: 1 };
        client
            .request(
                "initialize",
                json!({"clientInfo": {"name": name, "title": null, "version": "0.0.1"},
                       "capabilities": {"experimentalApi": true}}),
            )
            .await
            .unwrap();
        client
    }

    /// Sends a request and returns its result (or the error object), skipping other frames.
    pub async fn request(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = json!({"id": id, "method": method, "params": params});
        self.ws
            .send(Message::text(frame.to_string()))
            .await
            .unwrap();
        loop {
            let frame = timeout(WAIT, self.ws.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let Message::Text(text) = frame else { continue };
            let v: Value = serde_json::from_str(text.as_str()).unwrap();
            if v["id"] == id && v.get("method").is_none() {
                return match v.get("error") {
                    Some(e) => Err(e.clone()),
                    None => Ok(v["result"].clone()),
                };
            }
        }
    }

    /// Starts a thread (no model needed) and returns its id.
    pub async fn start_thread(&mut self) -> String {
        let result = self.request("thread/start", json!({})).await.unwrap();
        result["thread"]["id"].as_str().unwrap().to_owned()
    }

    /// Starts a turn on `thread`.
    pub async fn start_turn(&mut self, thread: &str) {
        self.request(
            "turn/start",
            json!({"threadId": thread, "input": [{"type": "text", "text": "hello"}]}),
        )
        .await
        .unwrap();
    }

    pub async fn close(mut self) {
        self.ws.close(None).await.ok();
    }
}

/// A model endpoint that accepts requests and never answers, so turns stay active until
/// [`HangModel::release`] drops the connections.
pub struct HangModel {
    pub port: u16,
    held: Arc<Mutex<Vec<TcpStream>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HangModel {
    pub async fn start() -> HangModel {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = Arc::new(Mutex::new(Vec::new()));
        let keep = held.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                keep.lock().unwrap().push(stream);
            }
        });
        HangModel { port, held, task }
    }

    /// `-c` overrides that point a worker at this model.
    pub fn overrides(&self) -> Vec<String> {
        let p = "model_providers.hang";
        vec![
            "model=\"mock-model\"".into(),
            "model_provider=\"hang\"".into(),
            "approval_policy=\"never\"".into(),
            "sandbox_mode=\"read-only\"".into(),
            format!("{p}.name=\"hang\""),
            format!("{p}.base_url=\"http://127.0.0.1:{}/v1\"", self.port),
            format!("{p}.wire_api=\"responses\""),
            format!("{p}.request_max_retries=0"),
            format!("{p}.stream_max_retries=0"),
        ]
    }

    /// Requests received so far (held open).
    pub fn held(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    /// Drops every held connection: the turns waiting on them fail.
    pub fn release(&self) {
        self.held.lock().unwrap().clear();
    }
}

impl Drop for HangModel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether a test that needs root should run: true as root; without root it panics (so the test
/// fails instead of passing unchecked) unless `CODEX_FLEET_SKIP_ROOT_TESTS=1` asks to skip it.
pub fn root_or_explicit_skip(what: &str) -> bool {
    const SKIP: &str = "CODEX_FLEET_SKIP_ROOT_TESTS";
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var(SKIP).as_deref() == Ok("1") {
        eprintln!("skipped ({SKIP}=1): {what} needs root");
        return false;
    }
    panic!(
        "{what} needs root and this run is not root: run the suite as root (e.g. `sudo -E bash \
         ops/test.sh`), or set {SKIP}=1 to skip the root-only tests knowingly"
    );
}
