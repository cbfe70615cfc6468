//! Requests a tenant's pool answers as one app-server by asking every worker that holds threads
//! and merging the answers (docs/decisions/0013-parse-once-one-method-table.md):
//! `thread/loaded/list` is the union of the workers' loaded threads, sorted and paginated as one
//! process sorts and paginates its own; `thread/list` is the home worker's page (every worker reads
//! the one CODEX_HOME, so order and cursors agree), with each thread as the worker that has it
//! loaded reports it (its live status and environments).
//!
//! The request is admitted once, as a single-leg request to the home leg (its worker slot and
//! in-flight entry); the copies to the other workers carry the router's own id. The answer waits
//! for every worker for at most [`FANOUT_WAIT`]: a worker that fails to answer in time, or whose
//! leg closes or cannot be opened, is left out of the merge and counted.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::time::Instant;
use worker::WorkerId;

use super::Target;
use super::{End, Session};
use proto::error::codes;
use proto::rpc::RequestId;
use proto::Method;

use crate::admission::{Reason, Scope};

/// Prefix of the ids the router gives the copies of a fanned-out request.
pub(super) const ID_PREFIX: &str = "codex-fleet:fanout:";
/// How long a fanned-out request waits for the slowest worker before answering without it.
const FANOUT_WAIT: Duration = Duration::from_secs(10);

/// A method whose answer is merged from every worker of the tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Merge {
    /// `thread/loaded/list`.
    LoadedList,
    /// `thread/list`.
    List,
}

impl Merge {
    /// Every merged method, so each metric series exists from the start.
    pub(crate) const ALL: [Merge; 2] = [Merge::LoadedList, Merge::List];

    /// The merge a method needs, if it is merged.
    pub(super) fn of(method: &Method<'_>) -> Option<Merge> {
        match method {
            Method::ThreadLoadedList => Some(Merge::LoadedList),
            Method::ThreadList => Some(Merge::List),
            _ => None,
        }
    }

    /// The `method` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Merge::LoadedList => "thread/loaded/list",
            Merge::List => "thread/list",
        }
    }
}

/// Why a worker's answer is missing from a merged answer: the `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missing {
    /// No answer within [`FANOUT_WAIT`].
    Timeout,
    /// The leg closed before the answer.
    LegClosed,
    /// No leg could be opened, or the request could not be sent on it.
    Unreachable,
    /// The worker (not the home worker) answered app-server's own `-32001`: it is busy, which
    /// says nothing about the request.
    Overloaded,
}

impl Missing {
    /// Every reason.
    pub(crate) const ALL: [Missing; 4] = [
        Missing::Timeout,
        Missing::LegClosed,
        Missing::Unreachable,
        Missing::Overloaded,
    ];

    /// The `reason` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Missing::Timeout => "timeout",
            Missing::LegClosed => "leg_closed",
            Missing::Unreachable => "unreachable",
            Missing::Overloaded => "overloaded",
        }
    }
}

/// One fanned-out request waiting for its workers.
struct FanOut {
    client_id: RequestId,
    merge: Merge,
    /// The client's `limit` of a `thread/loaded/list` (the workers are asked for everything).
    limit: Option<u64>,
    home: WorkerId,
    waiting: HashSet<WorkerId>,
    answers: Vec<(WorkerId, Value)>,
    deadline: Instant,
}

/// A session's fanned-out requests.
#[derive(Default)]
pub(super) struct FanOuts {
    next: u64,
    open: HashMap<u64, FanOut>,
}

impl FanOuts {
    /// When the oldest open fan-out stops waiting.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.open.values().map(|f| f.deadline).min()
    }
}

/// Sleeps until `deadline`; pending forever without one.
pub(super) async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The request each worker gets, with the router's `id`; for `thread/loaded/list` a valid
/// client `limit` (or none) becomes "everything" and is returned, to be applied to the union.
/// Params of any other shape go as they came, so the workers reject them in their own words.
pub(crate) fn worker_request(merge: Merge, request: &Value, id: &str) -> (Value, Option<u64>) {
    let mut req = request.clone();
    req["id"] = Value::String(id.to_owned());
    let mut limit = None;
    if merge == Merge::LoadedList {
        if let Some(params) = req.get_mut("params").and_then(Value::as_object_mut) {
            let valid = match params.get("limit") {
                None | Some(Value::Null) => true,
                Some(v) => v.as_u64().is_some_and(|n| u32::try_from(n).is_ok()),
            };
            if valid {
                limit = params.get("limit").and_then(Value::as_u64);
                params.insert("limit".into(), Value::from(u32::MAX));
            }
        }
    }
    (req, limit)
}

/// Merges the workers' responses (the home worker's first): the first error if any worker
/// refused (they all parse the same params), else the merged `result`.
pub(crate) fn merge(merge: Merge, answers: &[Value], limit: Option<u64>) -> Result<Value, Value> {
    if let Some(error) = answers.iter().find_map(|a| a.get("error")) {
        return Err(error.clone());
    }
    let results: Vec<&Value> = answers.iter().filter_map(|a| a.get("result")).collect();
    let Some(base) = results.first() else {
        return Err(Value::Null);
    };
    Ok(match merge {
        Merge::LoadedList => merge_loaded(&results, limit),
        Merge::List => merge_list(base, &results[1..]),
    })
}

/// `thread/loaded/list` over the union, as app-server pages its own list: ids sorted, the
/// cursor already applied by each worker (every id after it), at most `limit` (at least one)
/// ids, and `nextCursor` the last id given when more follow.
fn merge_loaded(results: &[&Value], limit: Option<u64>) -> Value {
    let ids: BTreeSet<&str> = results
        .iter()
        .filter_map(|r| r["data"].as_array())
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let total = ids.len();
    let take = limit
        .map_or(total, |l| usize::try_from(l).unwrap_or(usize::MAX))
        .max(1);
    let page: Vec<Value> = ids.into_iter().take(take).map(Value::from).collect();
    let next = if take < total {
        page.last().cloned().unwrap_or(Value::Null)
    } else {
        Value::Null
    };
    let mut out = results[0].as_object().cloned().unwrap_or_else(Map::new);
    out.insert("data".into(), Value::Array(page));
    out.insert("nextCursor".into(), next);
    Value::Object(out)
}

/// Whether a `thread/list` entry is loaded in the process that listed it.
fn loaded(entry: &Value) -> bool {
    entry["status"]["type"]
        .as_str()
        .is_some_and(|t| t != "notLoaded")
}

/// `thread/list`: the home page, each entry replaced by another worker's entry for the same
/// thread where that worker has it loaded and the home worker does not.
fn merge_list(base: &Value, others: &[&Value]) -> Value {
    let mut out = base.clone();
    let Some(data) = out.get_mut("data").and_then(Value::as_array_mut) else {
        return out;
    };
    for entry in data.iter_mut().filter(|e| !loaded(e)) {
        let live = others
            .iter()
            .filter_map(|r| r["data"].as_array())
            .flatten()
            .find(|e| e["id"] == entry["id"] && loaded(e));
        if let Some(live) = live {
            *entry = live.clone();
        }
    }
    out
}

/// The response to the client.
fn response(id: &RequestId, merged: Result<Value, Value>) -> String {
    let mut m = Map::new();
    m.insert("id".into(), serde_json::to_value(id).unwrap_or(Value::Null));
    match merged {
        Ok(result) => m.insert("result".into(), result),
        Err(error) => m.insert("error".into(), error),
    };
    Value::Object(m).to_string()
}

// === impl Session: fan-out ===

impl Session {
    /// Sends an admitted request (in flight on `home`) to every live worker of the tenant that
    /// has threads loaded or a leg of this session, opening legs where the session has none. A
    /// worker with no threads loaded has nothing to add (none listed, every status `notLoaded`),
    /// and a leg to it would keep it from idling out. With no such worker besides the home
    /// worker, the request goes as it came.
    pub(super) async fn fan_out(
        &mut self,
        id: &RequestId,
        home: WorkerId,
        merge: Merge,
        text: &str,
    ) -> Result<(), End> {
        let pool = self.ctx.tenant.pool.clone();
        let holding: HashSet<WorkerId> = pool
            .loaded_threads()
            .into_iter()
            .filter(|(_, threads)| !threads.is_empty())
            .map(|(w, _)| w)
            .collect();
        let others: Vec<WorkerId> = pool
            .workers()
            .into_iter()
            .filter(|w| {
                w.loaded_threads > 0
                    || w.active_turns > 0
                    || holding.contains(&w.id)
                    || self.legs.contains_key(&w.id)
            })
            .map(|w| w.id)
            .filter(|w| *w != home && pool.get(*w).is_some())
            .collect();
        let request = serde_json::from_str::<Value>(text).ok();
        let (Some(request), false) = (request, others.is_empty()) else {
            if self.send_to_leg(home, text.to_owned()) {
                return Ok(());
            }
            self.in_flight.remove(id);
            return self.worker_gone_reply(id);
        };
        let seq = self.fanouts.next;
        self.fanouts.next += 1;
        let (copy, limit) = worker_request(merge, &request, &format!("{ID_PREFIX}{seq}"));
        let copy = copy.to_string();
        let mut waiting = HashSet::new();
        for worker in std::iter::once(home).chain(others) {
            let leg = match worker == home {
                true => Ok(home),
                false => self.leg_for(Target::Owner(worker), false).await,
            };
            if leg == Ok(worker) && self.send_to_leg(worker, copy.clone()) {
                waiting.insert(worker);
            } else {
                self.count_missing(merge, Missing::Unreachable);
            }
        }
        if !waiting.contains(&home) {
            // The home leg is the request's own: without it the request is answered as a
            // single-leg request to a vanished worker would be.
            self.in_flight.remove(id);
            return self.worker_gone_reply(id);
        }
        self.fanouts.open.insert(
            seq,
            FanOut {
                client_id: id.clone(),
                merge,
                limit,
                home,
                waiting,
                answers: Vec::new(),
                deadline: Instant::now() + FANOUT_WAIT,
            },
        );
        Ok(())
    }

    /// A worker's answer to a fanned-out copy (`None` if `id` is not the router's fan-out id).
    pub(super) fn fanout_answer(
        &mut self,
        worker: WorkerId,
        id: &RequestId,
        text: &str,
    ) -> Option<Result<(), End>> {
        let RequestId::Str(s) = id else { return None };
        let seq: u64 = s.strip_prefix(ID_PREFIX)?.parse().ok()?;
        let Some(f) = self.fanouts.open.get_mut(&seq) else {
            return Some(Ok(())); // late: answered without this worker
        };
        if f.waiting.remove(&worker) {
            let answer: Value = serde_json::from_str(text).unwrap_or(Value::Null);
            if worker != f.home && answer["error"]["code"] == codes::OVERLOADED {
                let merge = f.merge;
                self.count_missing(merge, Missing::Overloaded);
            } else {
                f.answers.push((worker, answer));
            }
        }
        let Some(f) = self.fanouts.open.get(&seq) else {
            return Some(Ok(()));
        };
        if f.waiting.is_empty() {
            return Some(self.finish_fanout(seq));
        }
        Some(Ok(()))
    }

    /// A leg closed: the fan-outs waiting on it stop waiting for it.
    pub(super) fn fanout_leg_closed(&mut self, worker: WorkerId) -> Result<(), End> {
        let done: Vec<u64> = self
            .fanouts
            .open
            .iter_mut()
            .filter_map(|(seq, f)| f.waiting.remove(&worker).then_some((*seq, f)))
            .map(|(seq, f)| {
                self.ctx
                    .metrics
                    .fanout_missing
                    .with_label_values(&[f.merge.as_str(), Missing::LegClosed.as_str()])
                    .inc();
                (seq, f.waiting.is_empty())
            })
            .filter_map(|(seq, empty)| empty.then_some(seq))
            .collect();
        for seq in done {
            self.finish_fanout(seq)?;
        }
        Ok(())
    }

    /// Fan-outs past their deadline answer with what they have.
    pub(super) fn fanouts_expired(&mut self) -> Result<(), End> {
        let now = Instant::now();
        let expired: Vec<u64> = self
            .fanouts
            .open
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in expired {
            if let Some(f) = self.fanouts.open.get(&seq) {
                for worker in &f.waiting {
                    tracing::warn!(%worker, method = f.merge.as_str(), "worker did not answer a fanned-out request in time; answering without it");
                }
                let (merge, late) = (f.merge, f.waiting.len());
                for _ in 0..late {
                    self.count_missing(merge, Missing::Timeout);
                }
            }
            self.finish_fanout(seq)?;
        }
        Ok(())
    }

    fn count_missing(&self, merge: Merge, why: Missing) {
        self.ctx
            .metrics
            .fanout_missing
            .with_label_values(&[merge.as_str(), why.as_str()])
            .inc();
    }

    /// Answers the client from the answers in; nothing if the request was answered already
    /// (its home leg closed).
    fn finish_fanout(&mut self, seq: u64) -> Result<(), End> {
        let Some(mut f) = self.fanouts.open.remove(&seq) else {
            return Ok(());
        };
        let Some(flight) = self.in_flight.remove(&f.client_id) else {
            return Ok(());
        };
        self.ctx
            .metrics
            .request_seconds
            .with_label_values(&[&self.ctx.tenant.id])
            .observe(flight.since.elapsed().as_secs_f64());
        // The home worker's answer first: it is the base of the merge.
        let home = f.home;
        f.answers.sort_by_key(|(w, _)| *w != home);
        let answers: Vec<Value> = f.answers.into_iter().map(|(_, a)| a).collect();
        match merge(f.merge, &answers, f.limit) {
            Err(Value::Null) => self.worker_gone_reply(&f.client_id),
            Err(e) if e["code"] == codes::OVERLOADED => {
                // The home worker is busy: answered as on a single leg, with codex-fleet's `data`.
                let text = response(&f.client_id, Err(e));
                let text = self
                    .ctx
                    .admission
                    .rewrite_worker_overload(&text)
                    .unwrap_or(text);
                self.ctx
                    .metrics
                    .admission_rejections
                    .with_label_values(&[Scope::Worker.as_str(), Reason::WorkerOverloaded.as_str()])
                    .inc();
                self.to_client(text)
            }
            merged => self.to_client(response(&f.client_id, merged)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ok(result: Value) -> Value {
        json!({ "id": "x", "result": result })
    }

    fn loaded_page(answers: &[Value], limit: Option<u64>) -> Value {
        merge(Merge::LoadedList, answers, limit).expect("a result")
    }

    #[test]
    fn loaded_list_is_the_sorted_union_paged_as_one_process_pages() {
        let a = ok(json!({ "data": ["c", "a", "e"], "nextCursor": null }));
        let b = ok(json!({ "data": ["d", "b"], "nextCursor": null }));
        let all = loaded_page(&[a.clone(), b.clone()], None);
        assert_eq!(
            all,
            json!({ "data": ["a", "b", "c", "d", "e"], "nextCursor": null })
        );
        let first = loaded_page(&[a.clone(), b.clone()], Some(2));
        assert_eq!(first, json!({ "data": ["a", "b"], "nextCursor": "b" }));
        // A limit of 0 is one, as app-server clamps it.
        let one = loaded_page(&[a.clone(), b.clone()], Some(0));
        assert_eq!(one, json!({ "data": ["a"], "nextCursor": "a" }));
        // The last page ends pagination.
        let exact = loaded_page(&[a, b], Some(5));
        assert_eq!(exact["nextCursor"], Value::Null);
        // Nothing loaded anywhere.
        let none = loaded_page(&[ok(json!({ "data": [], "nextCursor": null }))], Some(3));
        assert_eq!(none, json!({ "data": [], "nextCursor": null }));
    }

    #[test]
    fn a_refusal_from_any_worker_is_the_answer() {
        let error = json!({ "code": -32600, "message": "invalid cursor: x" });
        let answers = [
            ok(json!({ "data": [], "nextCursor": null })),
            json!({ "id": "x", "error": error }),
        ];
        assert_eq!(merge(Merge::LoadedList, &answers, None), Err(error.clone()));
        assert_eq!(merge(Merge::List, &answers, None), Err(error));
        assert_eq!(merge(Merge::List, &[], None), Err(Value::Null));
    }

    #[test]
    fn the_workers_are_asked_for_everything_and_the_limit_is_kept() {
        let req = json!({ "id": 7, "method": "thread/loaded/list", "params": { "limit": 2, "cursor": "c" } });
        let (copy, limit) = worker_request(Merge::LoadedList, &req, "codex-fleet:fanout:3");
        assert_eq!(limit, Some(2));
        assert_eq!(
            copy,
            json!({ "id": "codex-fleet:fanout:3", "method": "thread/loaded/list",
                "params": { "limit": u32::MAX, "cursor": "c" } })
        );
        // A limit app-server would refuse stays, so every worker refuses it in its own words.
        let bad = json!({ "id": 7, "method": "thread/loaded/list", "params": { "limit": "x" } });
        let (copy, limit) = worker_request(Merge::LoadedList, &bad, "f");
        assert_eq!(
            (copy["params"].clone(), limit),
            (json!({ "limit": "x" }), None)
        );
        // thread/list goes as it came, under the router's id.
        let list = json!({ "id": 7, "method": "thread/list", "params": { "limit": 2 } });
        let (copy, limit) = worker_request(Merge::List, &list, "f");
        assert_eq!(
            (copy["params"].clone(), copy["id"].clone(), limit),
            (json!({ "limit": 2 }), json!("f"), None)
        );
    }

    #[test]
    fn thread_list_takes_each_thread_from_the_worker_that_has_it_loaded() {
        let not_loaded =
            |id: &str| json!({ "id": id, "status": { "type": "notLoaded" }, "environments": null });
        let idle = |id: &str| json!({ "id": id, "status": { "type": "idle" }, "environments": [{ "id": "local" }] });
        let home = ok(
            json!({ "data": [idle("a"), not_loaded("b"), not_loaded("c")],
            "nextCursor": "n", "backwardsCursor": "p" }),
        );
        let other = ok(
            json!({ "data": [not_loaded("a"), idle("b"), not_loaded("c")],
            "nextCursor": "n", "backwardsCursor": "p" }),
        );
        let merged = merge(Merge::List, &[home, other], None).expect("a result");
        assert_eq!(
            merged,
            json!({ "data": [idle("a"), idle("b"), not_loaded("c")],
                "nextCursor": "n", "backwardsCursor": "p" })
        );
    }
}
