//! Router metrics: one struct, registered on the registry `main` creates; labels are bounded.

use prometheus::{
    CounterVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Metric names, written once.
pub mod names {
    /// Client connections accepted at TCP level.
    pub const CONNECTIONS_ACCEPTED: &str = "codex_fleet_connections_accepted_total";
    /// Failed `accept`s, by listener.
    pub const ACCEPT_ERRORS: &str = "codex_fleet_accept_errors_total";
    /// Upgrades refused, by reason.
    pub const UPGRADES_REFUSED: &str = "codex_fleet_upgrades_refused_total";
    /// Open client sessions, by tenant.
    pub const SESSIONS: &str = "codex_fleet_sessions";
    /// Client frames received, by tenant.
    pub const CLIENT_FRAMES: &str = "codex_fleet_client_frames_total";
    /// Client frames refused, by reason.
    pub const CLIENT_ERRORS: &str = "codex_fleet_client_errors_total";
    /// Sessions closed, by reason.
    pub const SESSIONS_CLOSED: &str = "codex_fleet_sessions_closed_total";
    /// Legs opened to workers, by tenant.
    pub const LEGS_OPENED: &str = "codex_fleet_legs_opened_total";
    /// See [`super::RouterMetrics::resume_retries`].
    pub const RESUME_RETRIES: &str = "codex_fleet_resume_retries_total";
    /// Client request round trips through a worker, by tenant.
    pub const REQUEST_SECONDS: &str = "codex_fleet_request_duration_seconds";
    /// TLS handshake plus upgrade duration.
    pub const HANDSHAKE_SECONDS: &str = "codex_fleet_handshake_duration_seconds";
    /// 1 while draining.
    pub const DRAINING: &str = "codex_fleet_draining";
    /// Admission refusals, by scope and reason.
    pub const ADMISSION_REJECTIONS: &str = "codex_fleet_admission_rejections_total";
    /// Streaming deltas not sent to a client whose queue was above its soft mark.
    pub const DELTAS_DROPPED: &str = "codex_fleet_client_deltas_dropped_total";
    /// Per-connection notifications that followed a replayed initialize, not sent on, by method.
    pub const REPLAYED_NOTIFICATIONS_DROPPED: &str =
        "codex_fleet_replayed_notifications_dropped_total";
    /// See [`super::RouterMetrics::thread_rehomes`].
    pub const THREAD_REHOMES: &str = "codex_fleet_thread_rehomes_total";
    /// See [`super::RouterMetrics::rehome_seconds`].
    pub const REHOME_SECONDS: &str = "codex_fleet_thread_rehome_duration_seconds";
    /// See [`super::RouterMetrics::tenant_rejections`].
    pub const TENANT_REJECTIONS: &str = "codex_fleet_tenant_rejections_total";
    /// See [`super::RouterMetrics::limits`].
    pub const LIMITS: &str = "codex_fleet_limit";
    /// See [`super::RouterMetrics::tenant_limits`].
    pub const TENANT_LIMITS: &str = "codex_fleet_tenant_limit";
    /// Workers' answers left out of a merged (fanned-out) answer, by method and reason.
    pub const FANOUT_MISSING: &str = "codex_fleet_fanout_missing_answers_total";
    /// See [`super::RouterMetrics::costly_steps`].
    pub const COSTLY_STEPS: &str = "codex_fleet_costly_steps_total";
    /// See [`super::RouterMetrics::costly_wait_seconds`].
    pub const COSTLY_WAIT_SECONDS: &str = "codex_fleet_costly_wait_seconds_total";
    /// See [`super::RouterMetrics::costly_waiting`].
    pub const COSTLY_WAITING: &str = "codex_fleet_costly_waiting";
}

/// The router's metrics.
#[derive(Clone)]
pub struct RouterMetrics {
    /// See [`names::CONNECTIONS_ACCEPTED`].
    pub connections_accepted: prometheus::IntCounter,
    /// See [`names::ACCEPT_ERRORS`]; label `listener` (`client`, `admin`).
    pub accept_errors: IntCounterVec,
    /// See [`names::UPGRADES_REFUSED`]; label `reason`.
    pub upgrades_refused: IntCounterVec,
    /// See [`names::SESSIONS`]; label `tenant`.
    pub sessions: IntGaugeVec,
    /// See [`names::CLIENT_FRAMES`]; label `tenant`.
    pub client_frames: IntCounterVec,
    /// See [`names::CLIENT_ERRORS`]; label `reason`.
    pub client_errors: IntCounterVec,
    /// See [`names::SESSIONS_CLOSED`]; label `reason`.
    pub sessions_closed: IntCounterVec,
    /// See [`names::LEGS_OPENED`]; label `tenant`.
    pub legs_opened: IntCounterVec,
    /// `thread/resume`s that a worker refused because another worker of the tenant holds the
    /// thread ("already has an active writer"), then sent to that owner once, per tenant. A
    /// steady rate means the routing table keeps missing where threads live.
    pub resume_retries: IntCounterVec,
    /// See [`names::REQUEST_SECONDS`]; label `tenant`.
    pub request_seconds: HistogramVec,
    /// See [`names::HANDSHAKE_SECONDS`].
    pub handshake_seconds: Histogram,
    /// See [`names::DRAINING`].
    pub draining: IntGauge,
    /// See [`names::ADMISSION_REJECTIONS`]; labels `scope`, `reason` (both closed enums).
    pub admission_rejections: IntCounterVec,
    /// See [`names::DELTAS_DROPPED`].
    pub deltas_dropped: prometheus::IntCounter,
    /// See [`names::REPLAYED_NOTIFICATIONS_DROPPED`]; label `method` (a closed list).
    pub replayed_notifications_dropped: IntCounterVec,
    /// Threads of a worker that ended, per subscribed session, by tenant, `cause` (crash, hang,
    /// retired) and `outcome` (`rehomed`; `no_worker` or `resume_failed`, when the session got
    /// `thread/closed` instead).
    pub thread_rehomes: IntCounterVec,
    /// From the tenant learning that a worker ended to a subscribed session's thread being
    /// served again on another worker, by tenant.
    pub rehome_seconds: HistogramVec,
    /// See [`names::FANOUT_MISSING`]; labels `method` (the merged methods), `reason` (closed enum).
    pub fanout_missing: IntCounterVec,
    /// See [`names::COSTLY_STEPS`]: a tenant's requests' costly steps run off the runtime
    /// threads, by `tenant` and `step` ([`CostlyStep`]). Each waits for its tenant's turn and the
    /// process's.
    pub costly_steps: IntCounterVec,
    /// See [`names::COSTLY_WAIT_SECONDS`]: seconds a tenant's sessions waited for their costly
    /// steps' turn, by `tenant`, each wait counted when it ends (its step's turn came, or the
    /// session ended); a session reads nothing from its client meanwhile.
    pub costly_wait_seconds: CounterVec,
    /// See [`names::COSTLY_WAITING`]: a tenant's sessions waiting for a costly step's turn now,
    /// by `tenant`.
    pub costly_waiting: IntGaugeVec,
    /// The configured fleet-wide limits, by `limit` (a closed list: see [`FLEET_LIMITS`]), so a
    /// panel divides use by limit without copying configuration into the dashboard.
    pub limits: IntGaugeVec,
    /// The configured per-tenant limits, by `tenant` and `limit` (`max_workers`, `min_workers`).
    pub tenant_limits: IntGaugeVec,
    /// A tenant's requests refused by admission, by `tenant` and `reason` (both bounded): who is
    /// refused, and why.
    pub tenant_rejections: IntCounterVec,
    /// Turns, tokens and approvals per tenant ([`crate::usage`]).
    pub usage: crate::usage::UsageMetrics,
}

/// The `reason` values of `codex_fleet_upgrades_refused_total` (listener, edge and node),
/// besides authentication's ([`crate::auth::AuthError::ALL`]).
pub const UPGRADE_REFUSALS: [&str; 15] = [
    "auth_missing",
    "auth_malformed",
    "auth_invalid",
    "path",
    "not_websocket",
    "draining",
    "handshake_rate",
    "connection_cap",
    "tls",
    "handshake_timeout",
    "node_refused",
    "node_unavailable",
    "edge_descriptors",
    "tenant_not_here",
    "link_header",
];

/// Whether `reason` is a `codex_fleet_upgrades_refused_total` label registered at zero.
pub fn is_upgrade_refusal(reason: &str) -> bool {
    UPGRADE_REFUSALS.contains(&reason)
        || crate::auth::AuthError::ALL
            .iter()
            .any(|e| e.reason() == reason)
}

/// A request's step too costly for a runtime thread: the `step` of
/// `codex_fleet_costly_steps_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostlyStep {
    /// A host-access check too costly to run inline.
    Check,
    /// The parse of a frame over a MiB.
    Parse,
}

impl CostlyStep {
    /// Every step, so each series exists (at zero) from the start.
    pub const ALL: [CostlyStep; 2] = [CostlyStep::Check, CostlyStep::Parse];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CostlyStep::Check => "check",
            CostlyStep::Parse => "parse",
        }
    }
}

/// The `limit` values of `codex_fleet_limit`.
pub const FLEET_LIMITS: [&str; 7] = [
    "max_workers",
    "max_connections",
    "max_connections_per_tenant",
    "max_active_turns_per_tenant",
    "tenant_rps",
    "turn_start_per_min",
    "max_worker_rss_bytes",
];

/// Why a client frame was refused or dropped: the `reason` of
/// `codex_fleet_client_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientError {
    /// A binary frame (the protocol is text).
    BinaryFrame,
    /// A message over the size limit.
    TooBig,
    /// Not JSON, or not a JSON-RPC message.
    InvalidMessage,
    /// Refused by the tenant's host-access policy.
    HostAccessDenied,
    /// A request id still in flight on this connection.
    DuplicateId,
    /// The router's own reserved request id.
    ReservedId,
    /// A request before `initialize`.
    NotInitialized,
    /// No worker could take the request.
    NoWorker,
    /// A response to a server request that was never sent or is already answered.
    UnknownResponse,
    /// The worker holding the request exited.
    WorkerExited,
}

impl ClientError {
    /// Every reason, so each series exists (at zero) from the start.
    pub const ALL: [ClientError; 10] = [
        ClientError::BinaryFrame,
        ClientError::TooBig,
        ClientError::InvalidMessage,
        ClientError::HostAccessDenied,
        ClientError::DuplicateId,
        ClientError::ReservedId,
        ClientError::NotInitialized,
        ClientError::NoWorker,
        ClientError::UnknownResponse,
        ClientError::WorkerExited,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientError::BinaryFrame => "binary_frame",
            ClientError::TooBig => "too_big",
            ClientError::InvalidMessage => "invalid_message",
            ClientError::HostAccessDenied => "host_access_denied",
            ClientError::DuplicateId => "duplicate_id",
            ClientError::ReservedId => "reserved_id",
            ClientError::NotInitialized => "not_initialized",
            ClientError::NoWorker => "no_worker",
            ClientError::UnknownResponse => "unknown_response",
            ClientError::WorkerExited => "worker_exited",
        }
    }
}

impl RouterMetrics {
    /// Creates `tenant`'s counters whose labels are all known, at zero.
    pub fn init_tenant(&self, tenant: &str) {
        self.resume_retries.with_label_values(&[tenant]);
        for cause in crate::tenants::rehome::Cause::ALL {
            for outcome in crate::tenants::rehome::Outcome::ALL {
                self.thread_rehomes
                    .with_label_values(&[tenant, cause.as_str(), outcome.as_str()]);
            }
        }
        self.rehome_seconds.with_label_values(&[tenant]);
        for step in CostlyStep::ALL {
            self.costly_steps
                .with_label_values(&[tenant, step.as_str()]);
        }
        self.costly_wait_seconds.with_label_values(&[tenant]);
        self.costly_waiting.with_label_values(&[tenant]);
        self.usage.init_tenant(tenant);
        for reason in crate::admission::Reason::ALL {
            self.tenant_rejections
                .with_label_values(&[tenant, reason.as_str()]);
        }
    }

    /// Puts a configuration in force on the metrics: every tenant's series at zero
    /// ([`Self::init_tenant`]) and the configured limits ([`FLEET_LIMITS`]).
    pub fn init_config(&self, cfg: &crate::config::Config) {
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let usize_gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let a = &cfg.limits.admission;
        for (limit, value) in [
            ("max_workers", usize_gauge(cfg.workers.max_workers)),
            ("max_connections", usize_gauge(a.max_connections)),
            (
                "max_connections_per_tenant",
                usize_gauge(a.max_connections_per_tenant),
            ),
            (
                "max_active_turns_per_tenant",
                usize_gauge(a.max_active_turns_per_tenant),
            ),
            ("tenant_rps", i64::from(a.tenant_rps)),
            ("turn_start_per_min", i64::from(a.turn_start_per_min)),
            // 0: no memory guard.
            (
                "max_worker_rss_bytes",
                gauge(cfg.workers.max_worker_rss_bytes.unwrap_or(0)),
            ),
        ] {
            debug_assert!(FLEET_LIMITS.contains(&limit));
            self.limits.with_label_values(&[limit]).set(value);
        }
        self.tenant_limits.reset();
        for t in &cfg.tenants {
            self.init_tenant(&t.id);
            self.tenant_limits
                .with_label_values(&[&t.id, "max_workers"])
                .set(usize_gauge(t.max_workers));
            self.tenant_limits
                .with_label_values(&[&t.id, "min_workers"])
                .set(usize_gauge(t.min_workers));
        }
    }

    /// Creates and registers every router metric.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = RouterMetrics {
            connections_accepted: prometheus::IntCounter::new(
                names::CONNECTIONS_ACCEPTED,
                "Client TCP connections accepted.",
            )?,
            accept_errors: IntCounterVec::new(
                Opts::new(
                    names::ACCEPT_ERRORS,
                    "Deferred or failed accepts (out of file descriptors: on the client port, \
                     of those below the reserve), by listener; the connection waits in the \
                     listen queue.",
                ),
                &["listener"],
            )?,
            upgrades_refused: IntCounterVec::new(
                Opts::new(
                    names::UPGRADES_REFUSED,
                    "Client upgrades refused, by reason.",
                ),
                &["reason"],
            )?,
            sessions: IntGaugeVec::new(
                Opts::new(names::SESSIONS, "Open client sessions."),
                &["tenant"],
            )?,
            client_frames: IntCounterVec::new(
                Opts::new(names::CLIENT_FRAMES, "Frames received from clients."),
                &["tenant"],
            )?,
            client_errors: IntCounterVec::new(
                Opts::new(
                    names::CLIENT_ERRORS,
                    "Client frames answered with an error or dropped, by reason.",
                ),
                &["reason"],
            )?,
            sessions_closed: IntCounterVec::new(
                Opts::new(names::SESSIONS_CLOSED, "Client sessions closed, by reason."),
                &["reason"],
            )?,
            resume_retries: IntCounterVec::new(
                Opts::new(
                    names::RESUME_RETRIES,
                    "thread/resume retried on the thread's owner after a writer conflict.",
                ),
                &["tenant"],
            )?,
            legs_opened: IntCounterVec::new(
                Opts::new(names::LEGS_OPENED, "Session legs opened to workers."),
                &["tenant"],
            )?,
            request_seconds: HistogramVec::new(
                HistogramOpts::new(
                    names::REQUEST_SECONDS,
                    "Client request to worker response, as seen by the router.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0,
                ]),
                &["tenant"],
            )?,
            handshake_seconds: Histogram::with_opts(
                HistogramOpts::new(names::HANDSHAKE_SECONDS, "TLS handshake and upgrade.").buckets(
                    vec![0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
                ),
            )?,
            draining: IntGauge::new(names::DRAINING, "1 while codex-fleet drains for shutdown.")?,
            admission_rejections: IntCounterVec::new(
                Opts::new(
                    names::ADMISSION_REJECTIONS,
                    "Connections, frames and requests refused by admission control.",
                ),
                &["scope", "reason"],
            )?,
            deltas_dropped: prometheus::IntCounter::new(
                names::DELTAS_DROPPED,
                "Streaming deltas not sent to clients that fell behind (item/completed still is).",
            )?,
            replayed_notifications_dropped: IntCounterVec::new(
                Opts::new(
                    names::REPLAYED_NOTIFICATIONS_DROPPED,
                    "Per-connection notifications after a replayed initialize, not sent to the \
                     client (it had them after its own initialize).",
                ),
                &["method"],
            )?,
            thread_rehomes: IntCounterVec::new(
                Opts::new(
                    names::THREAD_REHOMES,
                    "Threads of workers that ended, per subscribed session: re-homed on another \
                     worker, or closed (no worker, resume failed).",
                ),
                &["tenant", "cause", "outcome"],
            )?,
            rehome_seconds: HistogramVec::new(
                HistogramOpts::new(
                    names::REHOME_SECONDS,
                    "A worker's end to its thread being served again on another worker.",
                )
                .buckets(vec![
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                ]),
                &["tenant"],
            )?,
            fanout_missing: IntCounterVec::new(
                Opts::new(
                    names::FANOUT_MISSING,
                    "Workers' answers left out of a merged answer (timed out, leg closed, \
                     unreachable): the client got the other workers' merge.",
                ),
                &["method", "reason"],
            )?,
            costly_steps: IntCounterVec::new(
                Opts::new(
                    names::COSTLY_STEPS,
                    "A tenant's requests' costly steps run off the runtime threads, one at a \
                     time per tenant: host-access checks too costly to run inline (check), \
                     parses of frames over a MiB (parse).",
                ),
                &["tenant", "step"],
            )?,
            costly_wait_seconds: CounterVec::new(
                Opts::new(
                    names::COSTLY_WAIT_SECONDS,
                    "Seconds a tenant's sessions waited for their costly steps' turn (the \
                     tenant's, then the process's), counted as each wait ends; the session read \
                     nothing from its client meanwhile.",
                ),
                &["tenant"],
            )?,
            costly_waiting: IntGaugeVec::new(
                Opts::new(
                    names::COSTLY_WAITING,
                    "A tenant's sessions waiting for a costly step's turn now.",
                ),
                &["tenant"],
            )?,
            limits: IntGaugeVec::new(
                Opts::new(names::LIMITS, "A configured fleet-wide limit, by name."),
                &["limit"],
            )?,
            usage: crate::usage::UsageMetrics::register(registry)?,
            tenant_rejections: IntCounterVec::new(
                Opts::new(
                    names::TENANT_REJECTIONS,
                    "A tenant's requests refused by admission control, by reason.",
                ),
                &["tenant", "reason"],
            )?,
            tenant_limits: IntGaugeVec::new(
                Opts::new(
                    names::TENANT_LIMITS,
                    "A configured per-tenant limit, by name.",
                ),
                &["tenant", "limit"],
            )?,
        };
        registry.register(Box::new(m.connections_accepted.clone()))?;
        registry.register(Box::new(m.accept_errors.clone()))?;
        for listener in ["client", "admin"] {
            m.accept_errors.with_label_values(&[listener]);
        }
        registry.register(Box::new(m.limits.clone()))?;
        registry.register(Box::new(m.tenant_limits.clone()))?;
        registry.register(Box::new(m.tenant_rejections.clone()))?;
        registry.register(Box::new(m.upgrades_refused.clone()))?;
        registry.register(Box::new(m.sessions.clone()))?;
        registry.register(Box::new(m.client_frames.clone()))?;
        registry.register(Box::new(m.client_errors.clone()))?;
        registry.register(Box::new(m.sessions_closed.clone()))?;
        registry.register(Box::new(m.legs_opened.clone()))?;
        registry.register(Box::new(m.resume_retries.clone()))?;
        registry.register(Box::new(m.request_seconds.clone()))?;
        registry.register(Box::new(m.handshake_seconds.clone()))?;
        registry.register(Box::new(m.draining.clone()))?;
        registry.register(Box::new(m.admission_rejections.clone()))?;
        registry.register(Box::new(m.deltas_dropped.clone()))?;
        registry.register(Box::new(m.replayed_notifications_dropped.clone()))?;
        registry.register(Box::new(m.thread_rehomes.clone()))?;
        registry.register(Box::new(m.rehome_seconds.clone()))?;
        registry.register(Box::new(m.fanout_missing.clone()))?;
        registry.register(Box::new(m.costly_steps.clone()))?;
        registry.register(Box::new(m.costly_wait_seconds.clone()))?;
        registry.register(Box::new(m.costly_waiting.clone()))?;
        // Series whose labels are all known exist from the start, at zero: dashboards and
        // alerts then see 0, not "no data", before the first event (the session's own labels:
        // `session::metrics::init_series`).
        for reason in ClientError::ALL {
            m.client_errors.with_label_values(&[reason.as_str()]);
        }
        for reason in UPGRADE_REFUSALS {
            m.upgrades_refused.with_label_values(&[reason]);
        }
        for refusal in crate::auth::AuthError::ALL {
            m.upgrades_refused.with_label_values(&[refusal.reason()]);
        }
        for reason in crate::admission::Reason::ALL {
            for scope in refusal_scopes(reason) {
                m.admission_rejections
                    .with_label_values(&[scope.as_str(), reason.as_str()]);
            }
        }
        Ok(m)
    }

    /// Counts one admission refusal of one of `tenant`'s requests.
    pub fn rejected_for(&self, tenant: &str, r: &crate::admission::Rejection) {
        self.rejected(r);
        self.tenant_rejections
            .with_label_values(&[tenant, r.reason.as_str()])
            .inc();
    }

    /// Counts one admission refusal.
    pub fn rejected(&self, r: &crate::admission::Rejection) {
        self.admission_rejections
            .with_label_values(&[r.scope.as_str(), r.reason.as_str()])
            .inc();
    }
}

/// The scopes an admission refusal of `reason` is counted under, so each pair a dashboard shows
/// exists from the start.
fn refusal_scopes(reason: crate::admission::Reason) -> &'static [crate::admission::Scope] {
    use crate::admission::{Reason, Scope};
    match reason {
        Reason::HandshakeRateLimited
        | Reason::ConnectionRateLimited
        | Reason::TooManyRequestsInFlight => &[Scope::Connection],
        Reason::TenantRateLimited | Reason::TurnRateLimited | Reason::ActiveTurnLimit => {
            &[Scope::Tenant]
        }
        Reason::TooManyConnections => &[Scope::Tenant, Scope::Fleet],
        Reason::FleetWorkerLimit => &[Scope::Fleet],
        Reason::WorkerBusy
        | Reason::WorkerOverloaded
        | Reason::NoWorkerAvailable
        | Reason::WorkerUnreachable
        | Reason::NodeUnavailable
        | Reason::NodeStarting
        | Reason::NodeStartFailed => &[Scope::Worker],
        // A newer node's refusal keeps its scope when this edge knows it.
        Reason::NodeOverloaded => &Scope::ALL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusals panel reads 0, not "no data", before the first refusal.
    #[test]
    fn admission_refusals_exist_at_zero_before_the_first() {
        let registry = Registry::new();
        RouterMetrics::register(&registry).unwrap();
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        for (scope, reason) in [
            ("connection", "handshakeRateLimited"),
            ("connection", "connectionRateLimited"),
            ("connection", "tooManyRequestsInFlight"),
            ("tenant", "tenantRateLimited"),
            ("tenant", "turnRateLimited"),
            ("tenant", "activeTurnLimit"),
            ("tenant", "tooManyConnections"),
            ("fleet", "tooManyConnections"),
            ("fleet", "fleetWorkerLimit"),
            ("worker", "workerBusy"),
            ("worker", "workerOverloaded"),
            ("worker", "noWorkerAvailable"),
            ("worker", "workerUnreachable"),
            ("worker", "nodeUnavailable"),
            ("worker", "nodeStarting"),
            ("worker", "nodeStartFailed"),
            ("worker", "nodeOverloaded"),
            ("tenant", "nodeOverloaded"),
            ("connection", "nodeOverloaded"),
            ("fleet", "nodeOverloaded"),
        ] {
            let series = format!(
                "{}{{reason=\"{reason}\",scope=\"{scope}\"}} 0",
                names::ADMISSION_REJECTIONS
            );
            assert!(
                text.lines().any(|l| l == series),
                "{series} missing:\n{text}"
            );
        }
    }
}
