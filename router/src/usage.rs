//! Who uses the fleet, and how much (docs/decisions/0010-observability-is-part-of-the-contract.md):
//! turns started and completed by final status, their duration, the model tokens each tenant
//! spends, and approvals asked and answered.
//!
//! Sessions see these events on their legs, and several sessions may follow one thread, so
//! every event is counted once per tenant: a small bounded memory of what was counted
//! ([`Counted`], one per tenant) decides. Tokens come from `thread/tokenUsage/updated`'s `last`
//! field, counted only for a turn this process saw start and only once per (turn, running
//! total): app-server restates the last usage to a connection that resumes or forks a thread,
//! and those restatements are not new spending.

use std::borrow::Cow;
use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::{Mutex, OnceLock, PoisonError};

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use worker::WorkerId;

use proto::event::Event;
use proto::rpc::RequestId;
use proto::Method;

/// Events remembered per kind and tenant (oldest forgotten first).
const REMEMBERED: usize = 4096;

/// Final statuses of `turn/completed`, the `status` label (anything else is `other`).
pub const TURN_STATUSES: [&str; 4] = ["completed", "interrupted", "failed", "other"];
/// Token kinds, the `kind` label.
pub const TOKEN_KINDS: [&str; 4] = ["input", "cached_input", "output", "reasoning_output"];
/// Approval decisions, the `decision` label (anything else is `other`).
pub const DECISIONS: [&str; 6] = [
    "accept",
    "acceptForSession",
    "acceptWithExecpolicyAmendment",
    "decline",
    "cancel",
    "other",
];

/// Server requests that ask the user to approve something.
const APPROVALS: [&str; 5] = [
    "item/commandExecution/requestApproval",
    "item/fileChange/requestApproval",
    "item/permissions/requestApproval",
    "applyPatchApproval",
    "execCommandApproval",
];

/// The usage metrics (all labelled by tenant; other labels are closed lists).
#[derive(Clone)]
pub struct UsageMetrics {
    turns_started: IntCounterVec,
    turns_completed: IntCounterVec,
    turn_seconds: HistogramVec,
    tokens: IntCounterVec,
    approvals_requested: IntCounterVec,
    approvals_answered: IntCounterVec,
}

impl UsageMetrics {
    /// Creates and registers the metrics.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = UsageMetrics {
            turns_started: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_turns_started_total",
                    "Turns started, per tenant.",
                ),
                &["tenant"],
            )?,
            turns_completed: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_turns_completed_total",
                    "Turns ended, per tenant, by final status.",
                ),
                &["tenant", "status"],
            )?,
            turn_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "codex_fleet_turn_duration_seconds",
                    "Turn duration (turn/started to turn/completed), per tenant.",
                )
                .buckets(vec![
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                ]),
                &["tenant"],
            )?,
            tokens: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_model_tokens_total",
                    "Model tokens spent, per tenant, by kind.",
                ),
                &["tenant", "kind"],
            )?,
            approvals_requested: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_approvals_requested_total",
                    "Approval requests workers sent, per tenant.",
                ),
                &["tenant"],
            )?,
            approvals_answered: IntCounterVec::new(
                Opts::new(
                    "codex_fleet_approvals_answered_total",
                    "Approval requests answered by a client, per tenant, by decision.",
                ),
                &["tenant", "decision"],
            )?,
        };
        registry.register(Box::new(m.turns_started.clone()))?;
        registry.register(Box::new(m.turns_completed.clone()))?;
        registry.register(Box::new(m.turn_seconds.clone()))?;
        registry.register(Box::new(m.tokens.clone()))?;
        registry.register(Box::new(m.approvals_requested.clone()))?;
        registry.register(Box::new(m.approvals_answered.clone()))?;
        Ok(m)
    }

    /// Every series of `tenant` at zero.
    pub fn init_tenant(&self, tenant: &str) {
        self.turns_started.with_label_values(&[tenant]);
        self.turn_seconds.with_label_values(&[tenant]);
        self.approvals_requested.with_label_values(&[tenant]);
        for s in TURN_STATUSES {
            self.turns_completed.with_label_values(&[tenant, s]);
        }
        for k in TOKEN_KINDS {
            self.tokens.with_label_values(&[tenant, k]);
        }
        for d in DECISIONS {
            self.approvals_answered.with_label_values(&[tenant, d]);
        }
    }
}

/// A bounded set that forgets its oldest members.
struct Recent<T: Eq + Hash + Clone> {
    order: VecDeque<T>,
    set: HashSet<T>,
}

impl<T: Eq + Hash + Clone> Default for Recent<T> {
    fn default() -> Self {
        Recent {
            order: VecDeque::new(),
            set: HashSet::new(),
        }
    }
}

impl<T: Eq + Hash + Clone> Recent<T> {
    /// Adds `item`; false when it was already there.
    fn insert(&mut self, item: T) -> bool {
        if !self.set.insert(item.clone()) {
            return false;
        }
        self.order.push_back(item);
        if self.order.len() > REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    fn contains(&self, item: &T) -> bool {
        self.set.contains(item)
    }
}

/// What one tenant has counted already, and its series.
#[derive(Default)]
pub struct Counted {
    inner: Mutex<Inner>,
    /// The keys turn ids are remembered by (random per tenant and process).
    keys: RandomState,
    /// The tenant's series, looked up once: a lookup hashes the labels under the vector's lock.
    series: OnceLock<Series>,
}

/// Turns are remembered by a keyed 64-bit digest of their id, not the id: 8 bytes instead of a
/// string held twice, which bounds what a tenant's busy history costs. A new id whose digest
/// equals one of the 4,096 remembered (odds 2^-52 per id) would leave that turn uncounted.
#[derive(Default)]
struct Inner {
    started: Recent<u64>,
    completed: Recent<u64>,
    /// (turn, running total) pairs.
    usage: Recent<u64>,
    approvals: Recent<(WorkerId, RequestId)>,
    answered: Recent<(WorkerId, RequestId)>,
}

/// One tenant's children of the usage metrics.
struct Series {
    turns_started: IntCounter,
    /// In the order of [`TURN_STATUSES`].
    turns_completed: [IntCounter; TURN_STATUSES.len()],
    turn_seconds: Histogram,
    /// In the order of [`TOKEN_KINDS`].
    tokens: [IntCounter; TOKEN_KINDS.len()],
    approvals_requested: IntCounter,
    /// In the order of [`DECISIONS`].
    approvals_answered: [IntCounter; DECISIONS.len()],
}

impl Series {
    fn new(m: &UsageMetrics, tenant: &str) -> Self {
        Series {
            turns_started: m.turns_started.with_label_values(&[tenant]),
            turns_completed: TURN_STATUSES
                .map(|status| m.turns_completed.with_label_values(&[tenant, status])),
            turn_seconds: m.turn_seconds.with_label_values(&[tenant]),
            tokens: TOKEN_KINDS.map(|kind| m.tokens.with_label_values(&[tenant, kind])),
            approvals_requested: m.approvals_requested.with_label_values(&[tenant]),
            approvals_answered: DECISIONS
                .map(|decision| m.approvals_answered.with_label_values(&[tenant, decision])),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct UsageParams<'a> {
    #[serde(borrow)]
    turn_id: Cow<'a, str>,
    token_usage: TokenUsage,
}

#[derive(Deserialize)]
struct TokenUsage {
    total: Tokens,
    last: Tokens,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Tokens {
    #[serde(default)]
    total_tokens: u64,
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    cached_input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    reasoning_output_tokens: u64,
}

/// The position of `name` in `list`, or of its last entry (`other`).
fn index_of(list: &[&str], name: &str) -> usize {
    list.iter()
        .position(|known| *known == name)
        .unwrap_or(list.len() - 1)
}

impl Counted {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn series(&self, metrics: &UsageMetrics, tenant: &str) -> &Series {
        self.series.get_or_init(|| Series::new(metrics, tenant))
    }

    /// A notification a session received from a worker: counts turns and tokens once. `event` is
    /// the lifecycle or turn event the session parsed from it, if any.
    pub fn notification(
        &self,
        metrics: &UsageMetrics,
        tenant: &str,
        method: &Method<'_>,
        params: Option<&RawValue>,
        event: Option<&Event<'_>>,
    ) {
        match event {
            Some(Event::TurnStarted { turn, .. }) => {
                let Some(id) = &turn.id else { return };
                if self.lock().started.insert(self.keys.hash_one(id)) {
                    self.series(metrics, tenant).turns_started.inc();
                }
            }
            Some(Event::TurnCompleted { turn, .. }) => {
                let Some(id) = &turn.id else { return };
                if !self.lock().completed.insert(self.keys.hash_one(id)) {
                    return;
                }
                let series = self.series(metrics, tenant);
                let status = turn.status.as_deref().unwrap_or("other");
                series.turns_completed[index_of(&TURN_STATUSES, status)].inc();
                if let Some(ms) = turn.duration_ms {
                    series.turn_seconds.observe(ms as f64 / 1000.0);
                }
            }
            _ if matches!(method, Method::Other(name) if name == "thread/tokenUsage/updated") => {
                let Some(p) =
                    params.and_then(|p| serde_json::from_str::<UsageParams<'_>>(p.get()).ok())
                else {
                    return;
                };
                let turn = self.keys.hash_one(&p.turn_id);
                let spent = self
                    .keys
                    .hash_one((&p.turn_id, p.token_usage.total.total_tokens));
                {
                    let mut inner = self.lock();
                    // A turn this process did not see start is history being restated.
                    if !inner.started.contains(&turn) || !inner.usage.insert(spent) {
                        return;
                    }
                }
                let last = &p.token_usage.last;
                let tokens = &self.series(metrics, tenant).tokens;
                for (counter, n) in tokens.iter().zip([
                    last.input_tokens,
                    last.cached_input_tokens,
                    last.output_tokens,
                    last.reasoning_output_tokens,
                ]) {
                    counter.inc_by(n);
                }
            }
            _ => {}
        }
    }

    /// A server request a session received from `worker`: counts approval requests once.
    pub fn server_request(
        &self,
        metrics: &UsageMetrics,
        tenant: &str,
        worker: WorkerId,
        id: &RequestId,
        method: &Method<'_>,
    ) {
        if APPROVALS.contains(&method.as_str())
            && self.lock().approvals.insert((worker, id.clone()))
        {
            self.series(metrics, tenant).approvals_requested.inc();
        }
    }

    /// A client's answer to `worker`'s request `id` (first answer per request only): counts the
    /// decision of an approval.
    pub fn answer(
        &self,
        metrics: &UsageMetrics,
        tenant: &str,
        worker: WorkerId,
        id: &RequestId,
        result: Option<&RawValue>,
    ) {
        {
            let mut inner = self.lock();
            let key = (worker, id.clone());
            if !inner.approvals.contains(&key) || !inner.answered.insert(key) {
                return;
            }
        }
        let decision = result.map_or("other", decision_of);
        self.series(metrics, tenant).approvals_answered[index_of(&DECISIONS, decision)].inc();
    }
}

/// The decision of an approval answer: `{"decision": "accept"}` or `{"decision": {"acceptWith…":
/// …}}`, as a closed label value.
fn decision_of(result: &RawValue) -> &'static str {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(result.get()) else {
        return "other";
    };
    let name = match &v["decision"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(m) => m.keys().next().cloned().unwrap_or_default(),
        _ => String::new(),
    };
    DECISIONS
        .iter()
        .find(|d| **d == name)
        .copied()
        .unwrap_or("other")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).expect("json")
    }

    fn metrics() -> (Registry, UsageMetrics) {
        let r = Registry::new();
        let m = UsageMetrics::register(&r).expect("register");
        m.init_tenant("t");
        (r, m)
    }

    /// Metrics with tenants `t` and `u`, and what each has counted.
    fn two_tenants() -> (Registry, UsageMetrics, Counted, Counted) {
        let (r, m) = metrics();
        m.init_tenant("u");
        (r, m, Counted::default(), Counted::default())
    }

    /// `tenant`'s session saw the notification `method` with `params`.
    fn notify(m: &UsageMetrics, c: &Counted, tenant: &str, method: Method<'_>, params: &RawValue) {
        let event = Event::parse(&method, Some(params));
        c.notification(m, tenant, &method, Some(params), event.as_ref());
    }

    fn usage(turn: &str, total: u64, last_in: u64) -> Box<RawValue> {
        raw(&format!(
            r#"{{"threadId":"th","turnId":"{turn}","tokenUsage":{{"total":{{"totalTokens":{total}}},"last":{{"totalTokens":{last_in},"inputTokens":{last_in},"cachedInputTokens":1,"outputTokens":2,"reasoningOutputTokens":3}}}}}}"#
        ))
    }

    #[test]
    fn a_turn_and_its_tokens_count_once_however_many_sessions_see_them() {
        let (_r, m) = metrics();
        let c = Counted::default();
        let started = raw(r#"{"threadId":"th","turn":{"id":"u1"}}"#);
        let done =
            raw(r#"{"threadId":"th","turn":{"id":"u1","status":"interrupted","durationMs":2500}}"#);
        let other = Method::Other("thread/tokenUsage/updated".into());
        let notify = |method: &Method<'_>, params: &RawValue| {
            let event = Event::parse(method, Some(params));
            c.notification(&m, "t", method, Some(params), event.as_ref());
        };
        for _session in 0..2 {
            notify(&Method::TurnStarted, &started);
            notify(&other, &usage("u1", 110, 100));
            notify(&other, &usage("u1", 220, 110));
            notify(&Method::TurnCompleted, &done);
        }
        // A replay (resume, fork) restates the last usage: not counted again.
        notify(&other, &usage("u1", 220, 110));
        // Usage of a turn this process never saw start is history.
        notify(&other, &usage("old", 999, 999));
        assert_eq!(m.turns_started.with_label_values(&["t"]).get(), 1);
        assert_eq!(
            m.turns_completed
                .with_label_values(&["t", "interrupted"])
                .get(),
            1
        );
        assert_eq!(
            m.turn_seconds.with_label_values(&["t"]).get_sample_count(),
            1
        );
        assert_eq!(
            m.turn_seconds.with_label_values(&["t"]).get_sample_sum(),
            2.5
        );
        assert_eq!(m.tokens.with_label_values(&["t", "input"]).get(), 210);
        assert_eq!(m.tokens.with_label_values(&["t", "cached_input"]).get(), 2);
        assert_eq!(m.tokens.with_label_values(&["t", "output"]).get(), 4);
        assert_eq!(
            m.tokens.with_label_values(&["t", "reasoning_output"]).get(),
            6
        );
    }

    #[test]
    fn another_tenant_with_the_same_turn_id_counts_its_own_and_odd_turns_are_other() {
        let (_r, m, mine, theirs) = two_tenants();
        let count = |c: &Counted, tenant: &str, method: Method<'_>, params: &str| {
            notify(&m, c, tenant, method, &raw(params));
        };
        // A tenant that copies another's turn id (or guesses it) cannot stop that turn counting.
        for (c, tenant) in [(&mine, "t"), (&theirs, "u")] {
            count(
                c,
                tenant,
                Method::TurnStarted,
                r#"{"threadId":"a","turn":{"id":"same"}}"#,
            );
            count(
                c,
                tenant,
                Method::TurnCompleted,
                r#"{"threadId":"a","turn":{"id":"same","status":"weird"}}"#,
            );
        }
        // No id: nothing to count once, so nothing is counted.
        count(
            &mine,
            "t",
            Method::TurnStarted,
            r#"{"threadId":"a","turn":{}}"#,
        );
        for tenant in ["t", "u"] {
            assert_eq!(m.turns_started.with_label_values(&[tenant]).get(), 1);
            assert_eq!(
                m.turns_completed
                    .with_label_values(&[tenant, "other"])
                    .get(),
                1
            );
        }
    }

    /// A tenant that floods its workers' usage with made-up turns: its memory of them stays
    /// within the bound, and another tenant's turn that started before the flood and ends after
    /// it is counted once, its tokens too (its memory is its own, not evicted by the flood).
    #[test]
    fn a_tenant_flooding_turn_ids_stays_bounded_and_another_tenants_turn_still_counts_once() {
        let (_r, m, flood, quiet) = two_tenants();
        let count = |c: &Counted, tenant: &str, method: Method<'_>, params: &RawValue| {
            notify(&m, c, tenant, method, params);
        };
        let usage_method = || Method::Other("thread/tokenUsage/updated".into());
        let started = raw(r#"{"threadId":"b","turn":{"id":"b1"}}"#);
        count(&quiet, "u", Method::TurnStarted, &started);
        let turns = 3 * REMEMBERED;
        for n in 0..turns {
            let id = format!("flood-{n}");
            let params = raw(&format!(r#"{{"threadId":"a","turn":{{"id":"{id}"}}}}"#));
            count(&flood, "t", Method::TurnStarted, &params);
            count(&flood, "t", usage_method(), &usage(&id, 10, 10));
            let params = raw(&format!(
                r#"{{"threadId":"a","turn":{{"id":"{id}","status":"completed"}}}}"#
            ));
            count(&flood, "t", Method::TurnCompleted, &params);
        }
        {
            let inner = flood.lock();
            for (kind, len) in [
                ("started", inner.started.order.len()),
                ("completed", inner.completed.order.len()),
                ("usage", inner.usage.order.len()),
            ] {
                assert_eq!(len, REMEMBERED, "{kind}");
            }
            assert_eq!(inner.started.set.len(), REMEMBERED);
        }
        // The quiet tenant's turn, seen again by a second session, then its usage and its end.
        count(&quiet, "u", Method::TurnStarted, &started);
        count(&quiet, "u", usage_method(), &usage("b1", 50, 40));
        let done = raw(r#"{"threadId":"b","turn":{"id":"b1","status":"completed"}}"#);
        count(&quiet, "u", Method::TurnCompleted, &done);
        count(&quiet, "u", Method::TurnCompleted, &done);
        assert_eq!(m.turns_started.with_label_values(&["u"]).get(), 1);
        assert_eq!(
            m.turns_completed
                .with_label_values(&["u", "completed"])
                .get(),
            1
        );
        assert_eq!(m.tokens.with_label_values(&["u", "input"]).get(), 40);
        // The flood counted what it sent, once each.
        let sent = u64::try_from(turns).unwrap();
        assert_eq!(m.turns_started.with_label_values(&["t"]).get(), sent);
        assert_eq!(m.tokens.with_label_values(&["t", "input"]).get(), 10 * sent);
    }

    #[test]
    fn approvals_count_once_per_request_and_answer_with_a_closed_decision() {
        let (_r, m) = metrics();
        let c = Counted::default();
        let w = WorkerId::new("t", 0, 1);
        let ask = Method::parse("item/commandExecution/requestApproval");
        for _session in 0..2 {
            c.server_request(&m, "t", w, &RequestId::Int(0), &ask);
        }
        c.server_request(
            &m,
            "t",
            w,
            &RequestId::Int(1),
            &Method::parse("item/tool/requestUserInput"),
        );
        c.answer(
            &m,
            "t",
            w,
            &RequestId::Int(0),
            Some(&raw(r#"{"decision":{"acceptWithExecpolicyAmendment":{}}}"#)),
        );
        c.answer(
            &m,
            "t",
            w,
            &RequestId::Int(0),
            Some(&raw(r#"{"decision":"decline"}"#)),
        );
        c.answer(
            &m,
            "t",
            w,
            &RequestId::Int(1),
            Some(&raw(r#"{"answers":{}}"#)),
        );
        assert_eq!(m.approvals_requested.with_label_values(&["t"]).get(), 1);
        let answered = |d: &str| m.approvals_answered.with_label_values(&["t", d]).get();
        assert_eq!(answered("acceptWithExecpolicyAmendment"), 1);
        assert_eq!(answered("decline"), 0, "only the first answer counts");
        assert_eq!(answered("other"), 0, "user input is not an approval");
        assert_eq!(decision_of(&raw(r#"{"decision":"sure"}"#)), "other");
    }
}
