//! One tenant measured while another makes a shared process do costly work: the harness of the
//! tests that pit a hog tenant against a calm one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::Client;

/// The cheap request the calm tenant measures itself with.
const CHEAP: &str = "thread/loaded/list";

/// The calm tenant's median round trip of a cheap request, before the hog starts: the
/// yardstick for its round trips meanwhile.
pub async fn quiet_median(calm: &mut Client) -> anyhow::Result<Duration> {
    let mut before = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        calm.request(CHEAP, json!({})).await?;
        before.push(t.elapsed());
    }
    before.sort();
    Ok(before[before.len() / 2])
}

/// What the calm tenant measured while every hog connection sent `request` (with id 1) at once.
pub struct Meanwhile {
    /// The calm tenant's round trips of a cheap request until every hog was answered, sorted.
    pub latencies: Vec<Duration>,
    /// Each hog's answer and how long after sending it came, quickest first.
    pub answers: Vec<(Value, Duration)>,
    /// The hogs that got no answer (their session ended, or the send failed), and why.
    pub failed: Vec<String>,
}

impl Meanwhile {
    /// The calm tenant's longest wait.
    pub fn longest(&self) -> Duration {
        self.latencies.last().copied().unwrap_or_default()
    }
}

/// Every hog connection sends `request` (with id 1) at once, so that a process doing the costly
/// work on its runtime threads would have every thread busy with it; `calm` makes round trips
/// until every hog is answered (or failed).
pub async fn while_hogs_send(
    calm: &mut Client,
    hogs: Vec<Client>,
    request: String,
) -> anyhow::Result<Meanwhile> {
    let request = Arc::new(request);
    let pending = Arc::new(AtomicUsize::new(hogs.len()));
    let mut sent = Vec::new();
    for mut hog in hogs {
        let (request, pending) = (request.clone(), pending.clone());
        sent.push(tokio::spawn(async move {
            let at = Instant::now();
            let answer = async {
                hog.send_text(&request).await?;
                hog.wait_for_within(|v| v["id"] == 1, Duration::from_secs(120))
                    .await
            }
            .await;
            // Answered or failed, the calm loop must end.
            pending.fetch_sub(1, Ordering::AcqRel);
            answer.map(|a| (a, at.elapsed()))
        }));
    }
    let mut latencies = Vec::new();
    while pending.load(Ordering::Acquire) > 0 {
        let t = Instant::now();
        calm.request(CHEAP, json!({})).await?;
        latencies.push(t.elapsed());
    }
    let (mut answers, mut failed) = (Vec::new(), Vec::new());
    for answer in sent {
        match answer.await? {
            Ok(answer) => answers.push(answer),
            Err(e) => failed.push(format!("{e:#}")),
        }
    }
    answers.sort_by_key(|(_, took)| *took);
    latencies.sort();
    Ok(Meanwhile {
        latencies,
        answers,
        failed,
    })
}

/// What parsing `frame` to route it takes in this build on this machine, as the router parses it
/// (the envelope, then a request's `threadId`): the median of 3.
pub fn one_parse(frame: &str) -> anyhow::Result<Duration> {
    let mut parses = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let parsed = proto::rpc::parse(frame)?;
        let proto::rpc::Message::Request { params, .. } = parsed else {
            anyhow::bail!("not a request");
        };
        anyhow::ensure!(proto::rpc::thread_id(params).is_some(), "no threadId");
        parses.push(t.elapsed());
    }
    parses.sort();
    Ok(parses[1])
}

/// A `turn/start` for a made-up thread whose params hold 8 MiB of zeros in an array: small
/// values are the slowest JSON to parse per byte.
pub fn large_frame() -> String {
    format!(
        r#"{{"id":1,"method":"turn/start","params":{{"threadId":"thr_hog","input":[],"zeros":[{}0]}}}}"#,
        "0,".repeat(4 << 20)
    )
}
