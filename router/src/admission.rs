//! Admission control: rate limits and caps that every frame passes before it costs a worker anything.
//!
//! One [`Admission`] is shared by all sessions. It holds two governor (GCRA) limiters per
//! tenant, for its request rate and its turn starts (each of the tenant's connections holds them
//! in its [`ConnectionGuard`], so a request is checked without a lookup), a limiter keyed by
//! source address for handshakes, a direct limiter per connection (inside its guard), counters for
//! connections and active turns, and a semaphore per worker that bounds the requests in flight
//! on it. Every refusal is a [`Rejection`] that knows its
//! scope, its reason and when to come back; the session turns it into a JSON-RPC `-32001`
//! (or, at the upgrade, HTTP 429/503 with `Retry-After`). See
//! docs/decisions/0007-admission-before-work.md.
//!
//! Locks are plain `std::sync` locks held for a few map operations and never across an await.
//!
//! Use, in this order:
//! 1. Listener, before TLS/upgrade work: [`Admission::check_handshake`] on the peer address;
//!    after authentication: [`Admission::open_connection`] for the tenant. Either refusal is
//!    answered with [`Rejection::http_status`] and `Retry-After: `[`Rejection::retry_after_secs`].
//!    The session keeps the [`ConnectionGuard`] for its whole life.
//! 2. Every client text frame, once parsed: [`ConnectionGuard::check_frame`]. A refused
//!    request gets [`Rejection::to_error_response`]; a refused notification or response
//!    closes the session with 1008 and [`FLOOD_CLOSE_REASON`].
//! 3. Every client request: [`Admission::check_request`] with the connection's guard (tenant
//!    rate; for `turn/start` the turn rate and active-turn cap), then the host-access policy,
//!    then routing.
//! 4. Before forwarding it to the chosen worker: [`Admission::try_worker_slot`] (or
//!    [`Admission::worker_slot`] from a task that may wait); keep the [`InFlightPermit`] with
//!    the in-flight entry until the worker answers or the leg is gone.
//! 5. Every response from a worker: [`Admission::rewrite_worker_overload`].
//! 6. `turn/started` / `turn/completed` (and `thread/closed`, worker exit) seen by anyone:
//!    [`Admission::turn_started`] / [`Admission::turn_ended`]; a worker exit also calls
//!    [`Admission::forget_worker`]. One [`Pruner`] from [`Admission::spawn_pruner`] lives as
//!    long as the server.

mod clock;
mod held_bytes;
mod leg_bytes;
mod queue_bytes;
mod rejection;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use worker::WorkerId;

pub use held_bytes::{HeldBuffer, ReadMeter, HELD_FREE};
pub use leg_bytes::{LegBudget, TenantLegBytes};

pub use clock::TokioClock;
pub use queue_bytes::QueueBytes;
pub use rejection::{
    bounded_refusal_body, bounded_refusal_header, bounded_retry_after, is_draining_answer,
    rewrite_worker_overload, Reason, Rejection, Scope, DRAINING_BODY, DRAINING_REFUSAL,
    OVERLOADED_MESSAGE, REFUSAL_HEADER,
};

/// A limiter keyed by `K`, on tokio's clock.
type KeyedLimiter<K> = RateLimiter<K, DefaultKeyedStateStore<K>, TokioClock, NoOpMiddleware<Nanos>>;
/// A limiter for one thing, on tokio's clock.
pub(crate) type DirectLimiter =
    RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Nanos>>;

/// The admission keys of `[limits]` (flattened there): every rate and cap admission enforces.
/// All have defaults.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Requests per second per tenant, summed over all its connections.
    pub tenant_rps: u32,
    /// Requests a tenant may send at once above its rate.
    pub tenant_burst: u32,
    /// Frames per second per connection (requests, notifications and responses).
    pub conn_fps: u32,
    /// Frames a connection may send at once above its rate (the TUI's start-up burst fits).
    pub conn_burst: u32,
    /// `turn/start` requests per minute per tenant.
    pub turn_start_per_min: u32,
    /// `turn/start` requests a tenant may send at once above its rate.
    pub turn_start_burst: u32,
    /// WebSocket upgrades per second per source address, before authentication.
    pub handshakes_per_sec_per_ip: u32,
    /// Upgrades a source address may attempt at once above its rate.
    pub handshake_burst: u32,
    /// Open client connections per tenant.
    pub max_connections_per_tenant: usize,
    /// Open client connections in total (sessions; connections still in their TLS or HTTP
    /// handshake are bounded separately by the listener).
    pub max_connections: usize,
    /// Turns running at once per tenant; a further `turn/start` is refused.
    pub max_active_turns_per_tenant: usize,
    /// Requests in flight per worker (app-server itself sheds at 128 queued).
    pub max_in_flight_per_worker: usize,
    /// Requests one client connection may have unanswered; a further one is refused.
    pub max_in_flight_per_connection: usize,
    /// How long a request may wait for a worker slot before it is refused.
    pub in_flight_wait_ms: u64,
    /// `retryAfterMs` suggested when a cap (not a rate) refuses.
    pub cap_retry_after_ms: u64,
    /// An active turn not seen to end within this time is forgotten (guards against a lost
    /// `turn/completed` pinning a tenant at its cap forever).
    pub active_turn_ttl_secs: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            tenant_rps: 200,
            tenant_burst: 1000,
            conn_fps: 100,
            conn_burst: 500,
            turn_start_per_min: 60,
            turn_start_burst: 20,
            handshakes_per_sec_per_ip: 10,
            handshake_burst: 50,
            max_connections_per_tenant: 256,
            max_connections: 10_000,
            max_active_turns_per_tenant: 32,
            max_in_flight_per_worker: 32,
            max_in_flight_per_connection: 4096,
            in_flight_wait_ms: 250,
            cap_retry_after_ms: 1000,
            active_turn_ttl_secs: 6 * 3600,
        }
    }
}

/// A configuration admission cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("limits: {key} must be at least 1")]
pub struct AdmissionConfigError {
    /// The offending key.
    pub key: &'static str,
}

impl AdmissionConfig {
    /// Checks that every rate, burst and cap is at least 1.
    pub fn validate(&self) -> Result<(), AdmissionConfigError> {
        let rates = [
            ("tenant_rps", self.tenant_rps),
            ("tenant_burst", self.tenant_burst),
            ("conn_fps", self.conn_fps),
            ("conn_burst", self.conn_burst),
            ("turn_start_per_min", self.turn_start_per_min),
            ("turn_start_burst", self.turn_start_burst),
            ("handshakes_per_sec_per_ip", self.handshakes_per_sec_per_ip),
            ("handshake_burst", self.handshake_burst),
        ];
        let caps = [
            (
                "max_connections_per_tenant",
                self.max_connections_per_tenant,
            ),
            ("max_connections", self.max_connections),
            (
                "max_active_turns_per_tenant",
                self.max_active_turns_per_tenant,
            ),
            ("max_in_flight_per_worker", self.max_in_flight_per_worker),
            (
                "max_in_flight_per_connection",
                self.max_in_flight_per_connection,
            ),
        ];
        let zero_rate = rates.iter().find(|(_, v)| *v == 0).map(|(k, _)| *k);
        let zero_cap = caps.iter().find(|(_, v)| *v == 0).map(|(k, _)| *k);
        match zero_rate.or(zero_cap) {
            Some(key) => Err(AdmissionConfigError { key }),
            None => Ok(()),
        }
    }

    /// The bounded wait for a worker slot.
    pub fn in_flight_wait(&self) -> Duration {
        Duration::from_millis(self.in_flight_wait_ms)
    }

    fn cap_retry_after(&self) -> Duration {
        Duration::from_millis(self.cap_retry_after_ms)
    }

    fn quotas(&self) -> Result<Quotas, AdmissionConfigError> {
        self.validate()?;
        let nz = |key: &'static str, v: u32| NonZeroU32::new(v).ok_or(AdmissionConfigError { key });
        Ok(Quotas {
            tenant: Quota::per_second(nz("tenant_rps", self.tenant_rps)?)
                .allow_burst(nz("tenant_burst", self.tenant_burst)?),
            conn: Quota::per_second(nz("conn_fps", self.conn_fps)?)
                .allow_burst(nz("conn_burst", self.conn_burst)?),
            turn_start: Quota::per_minute(nz("turn_start_per_min", self.turn_start_per_min)?)
                .allow_burst(nz("turn_start_burst", self.turn_start_burst)?),
            handshake: Quota::per_second(nz(
                "handshakes_per_sec_per_ip",
                self.handshakes_per_sec_per_ip,
            )?)
            .allow_burst(nz("handshake_burst", self.handshake_burst)?),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Quotas {
    tenant: Quota,
    conn: Quota,
    turn_start: Quota,
    handshake: Quota,
}

/// The limiters of one configuration; replaced as a whole on reload when a quota changes.
struct Limiters {
    quotas: Quotas,
    tenant: Mutex<TenantRates>,
    handshake: KeyedLimiter<IpAddr>,
}

impl Limiters {
    fn new(quotas: Quotas) -> Limiters {
        Limiters {
            quotas,
            tenant: Mutex::default(),
            handshake: keyed(quotas.handshake),
        }
    }

    fn keys(&self) -> usize {
        lock(&self.tenant).by_name.len() + self.handshake.len()
    }

    /// Replaced by a reload: every rate it made is retired, and it makes no more.
    fn retire(&self) {
        let mut rates = lock(&self.tenant);
        rates.retired = true;
        for rate in rates.by_name.values() {
            rate.retired.store(true, Ordering::Release);
        }
    }

    /// Drops the rates no connection holds that are back at a full burst, requests and turn
    /// starts alike: a fresh one is the same, so a tenant gains nothing by reconnecting after
    /// this.
    fn prune_tenant_rates(&self) {
        let full = |q: Quota| q.replenish_interval() * q.burst_size().get();
        let (refill, turns_refill) = (full(self.quotas.tenant), full(self.quotas.turn_start));
        let mut rates = lock(&self.tenant);
        rates.by_name.retain(|_, rate| {
            Arc::strong_count(rate) > 1
                || rate.since(&rate.released) < refill
                || rate.since(&rate.turn_started) < turns_refill
        });
        rates.by_name.shrink_to_fit();
    }
}

/// The tenants' request rates of one [`Limiters`].
#[derive(Default)]
struct TenantRates {
    by_name: HashMap<String, Arc<TenantRate>>,
    /// Its limiters were replaced by a reload: rates are looked up in the new ones.
    retired: bool,
}

/// One tenant's request and turn-start rates, each summed over its connections. Each of them
/// holds it in its [`ConnectionGuard`], so a request (or a turn's start) checks it directly: no
/// lookup by name, no shared map's lock, nothing allocated.
struct TenantRate {
    limiter: DirectLimiter,
    /// `turn/start`s (`limits.turn_start_per_min`).
    turns: DirectLimiter,
    /// When it last admitted a `turn/start` ([`TenantRate::note`]): until its burst is back
    /// from then, it is kept.
    turn_started: AtomicU64,
    /// A reload replaced it (its quota changed): the holders look the tenant's new one up.
    retired: AtomicBool,
    /// When a connection last let go of it ([`TenantRate::note`]). Kept while it may not be back
    /// at a full burst, held or not, so closing every connection and opening one does not reset
    /// the tenant's rate.
    released: AtomicU64,
}

impl TenantRate {
    /// Notes in `when` that it happened now: nanoseconds on `turns`' clock plus one (0: never).
    /// An atomic, not a lock, as every admitted turn start and closed connection writes one.
    fn note(&self, when: &AtomicU64) {
        let now = self.turns.clock().now().as_u64();
        when.fetch_max(now.saturating_add(1), Ordering::Relaxed);
    }

    /// How long ago what `when` notes last happened ([`Duration::MAX`]: never).
    fn since(&self, when: &AtomicU64) -> Duration {
        match when.load(Ordering::Relaxed) {
            0 => Duration::MAX,
            at => {
                let now = self.turns.clock().now().as_u64();
                Duration::from_nanos(now.saturating_sub(at - 1))
            }
        }
    }
}

fn keyed<K: std::hash::Hash + Eq + Clone>(quota: Quota) -> KeyedLimiter<K> {
    RateLimiter::new(quota, DefaultKeyedStateStore::default(), TokioClock::new())
}

/// The maps every turn's start and end look up under the counts' lock, hashed with foldhash
/// (randomly seeded) rather than SipHash. Their keys are configured tenant names and a tenant's
/// running threads, which `limits.max_active_turns_per_tenant` caps, so colliding keys cannot
/// make a lookup slow beyond that cap.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Connections and active turns of one tenant.
#[derive(Debug, Default)]
struct TenantState {
    conns: usize,
    /// Threads with a running turn, and when it was seen to start.
    turns: FastMap<String, Instant>,
}

#[derive(Debug, Default)]
struct Counts {
    total_conns: usize,
    tenants: FastMap<String, TenantState>,
}

impl Counts {
    fn turn_started(&mut self, tenant: &str, thread_id: &str) {
        // Every session that sees the broadcast reports it: names are copied only when new.
        if !self.tenants.contains_key(tenant) {
            self.tenants
                .insert(tenant.to_owned(), TenantState::default());
        }
        let Some(state) = self.tenants.get_mut(tenant) else {
            return;
        };
        if !state.turns.contains_key(thread_id) {
            state.turns.insert(thread_id.to_owned(), Instant::now());
        }
    }

    fn turn_ended(&mut self, tenant: &str, thread_id: &str) {
        if let Some(state) = self.tenants.get_mut(tenant) {
            state.turns.remove(thread_id);
            if state.conns == 0 && state.turns.is_empty() {
                self.tenants.remove(tenant);
            }
        }
    }
}

/// A thread's turn starting or ending, relayed to every session of the tenant and counted
/// against the tenant's active turns once ([`Admission::turn_marked`]): the count is the
/// tenant's, and one call under admission's lock (shared by every tenant) does what one per
/// session did, hundreds of times a turn in a big tenant.
#[derive(Debug)]
pub struct TurnMark {
    thread: Arc<str>,
    started: bool,
    taken: AtomicBool,
}

impl TurnMark {
    /// `thread`'s turn started (or ended).
    pub fn new(thread: Arc<str>, started: bool) -> Arc<TurnMark> {
        Arc::new(TurnMark {
            thread,
            started,
            taken: AtomicBool::new(false),
        })
    }

    /// The end of `thread`'s turn.
    pub fn ended(thread: Arc<str>) -> Arc<TurnMark> {
        TurnMark::new(thread, false)
    }
}

/// Admission state shared by every session; see the module docs.
pub struct Admission {
    cfg: RwLock<Arc<AdmissionConfig>>,
    limiters: RwLock<Arc<Limiters>>,
    counts: Mutex<Counts>,
    workers: Mutex<HashMap<WorkerId, Arc<Semaphore>>>,
    /// Bumped when a reload's new in-flight cap drops every worker's slots: slots a leg kept
    /// from before ([`WorkerSlots`]) are looked up afresh.
    slots_generation: AtomicU64,
    /// Bytes queued towards each tenant's clients (keyed by configured tenants only).
    queued: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    /// Per tenant: bytes on its sessions' legs towards its workers.
    leg_bytes: Mutex<HashMap<String, Arc<TenantLegBytes>>>,
    /// Per tenant: its sockets' read buffers grown by large frames ([`HeldBuffer`]).
    held: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    /// Requests' costly steps running off the runtime at once, all tenants together
    /// ([`Admission::costly_work`]).
    costly_work: Arc<Semaphore>,
}

/// How many costly steps run off the runtime at once ([`Admission::costly_work`]): half the
/// cores, at least one.
fn costly_parallelism() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cores / 2).max(1)
}

/// Locks a mutex; a panic elsewhere while holding it leaves plain counters, still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T: Clone>(l: &RwLock<T>) -> T {
    l.read().unwrap_or_else(PoisonError::into_inner).clone()
}

fn write<T>(l: &RwLock<T>, v: T) {
    *l.write().unwrap_or_else(PoisonError::into_inner) = v;
}

/// The limiter key of a source address: IPv6 clients are grouped by /64, the smallest block
/// a single subscriber usually holds, so rotating addresses within it does not evade the limit.
fn ip_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

// === impl Admission ===

impl Admission {
    /// Builds admission from a validated configuration.
    pub fn new(cfg: AdmissionConfig) -> Result<Arc<Admission>, AdmissionConfigError> {
        let quotas = cfg.quotas()?;
        Ok(Arc::new(Admission {
            cfg: RwLock::new(Arc::new(cfg)),
            limiters: RwLock::new(Arc::new(Limiters::new(quotas))),
            counts: Mutex::new(Counts::default()),
            workers: Mutex::new(HashMap::new()),
            slots_generation: AtomicU64::new(0),
            queued: Mutex::new(HashMap::new()),
            leg_bytes: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            costly_work: Arc::new(Semaphore::new(costly_parallelism())),
        }))
    }

    /// The process's turns at a request's costly step (a host-access check too costly to run
    /// inline, the parse of a frame over a MiB), which runs off the runtime: half the cores at
    /// once, all tenants together, at least one.
    pub fn costly_work(&self) -> Arc<Semaphore> {
        self.costly_work.clone()
    }

    /// Applies a reloaded configuration. Counters (connections, active turns, permits held)
    /// carry over; limiters whose quota changed start afresh (a full burst for everyone);
    /// open connections keep the frame rate they were opened with; a new in-flight cap
    /// applies to workers as they next get a slot (permits held on the old bound drain out).
    pub fn reconfigure(&self, cfg: AdmissionConfig) -> Result<(), AdmissionConfigError> {
        let quotas = cfg.quotas()?;
        let old = self.config();
        let limiters = read(&self.limiters);
        if limiters.quotas != quotas {
            // The new ones first: a rate looked up from here on is looked up in them.
            write(&self.limiters, Arc::new(Limiters::new(quotas)));
            limiters.retire();
        }
        let new_cap = old.max_in_flight_per_worker != cfg.max_in_flight_per_worker;
        write(&self.cfg, Arc::new(cfg));
        if new_cap {
            // After the new cap is in force: slots made from here on are made with it (the
            // cap is read under this same lock, see `worker_semaphore`).
            let mut workers = lock(&self.workers);
            workers.clear();
            self.slots_generation.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<AdmissionConfig> {
        read(&self.cfg)
    }

    /// Pre-authentication: may this source address attempt another upgrade?
    pub fn check_handshake(&self, ip: IpAddr) -> Result<(), Rejection> {
        let limiters = read(&self.limiters);
        limiters
            .handshake
            .check_key(&ip_key(ip))
            .map_err(|not_until| {
                Rejection::rate(
                    Scope::Connection,
                    Reason::HandshakeRateLimited,
                    not_until.wait_time_from(limiters.handshake.clock().now()),
                )
            })
    }

    /// After authentication: admits one more connection of `tenant` under the per-tenant and
    /// total caps. The guard gives the slot back when dropped and carries the connection's
    /// frame limiter.
    pub fn open_connection(self: &Arc<Self>, tenant: &str) -> Result<ConnectionGuard, Rejection> {
        let cfg = self.config();
        {
            let mut counts = lock(&self.counts);
            if counts.total_conns >= cfg.max_connections {
                return Err(Rejection::cap(
                    Scope::Fleet,
                    Reason::TooManyConnections,
                    cfg.cap_retry_after(),
                ));
            }
            let state = counts.tenants.entry(tenant.to_owned()).or_default();
            if state.conns >= cfg.max_connections_per_tenant {
                return Err(Rejection::cap(
                    Scope::Tenant,
                    Reason::TooManyConnections,
                    cfg.cap_retry_after(),
                ));
            }
            state.conns += 1;
            counts.total_conns += 1;
        }
        let quota = read(&self.limiters).quotas.conn;
        Ok(ConnectionGuard {
            admission: Arc::downgrade(self),
            tenant: tenant.to_owned(),
            frames: RateLimiter::direct_with_clock(quota, TokioClock::new()),
            rate: self.tenant_rate(tenant),
        })
    }

    /// `tenant`'s request rate in the limiters in force, made on first use.
    fn tenant_rate(&self, tenant: &str) -> Arc<TenantRate> {
        loop {
            let limiters = read(&self.limiters);
            let mut rates = lock(&limiters.tenant);
            if rates.retired {
                continue; // a reload replaced them since the read: the new ones are in force
            }
            if let Some(rate) = rates.by_name.get(tenant) {
                return rate.clone();
            }
            let rate = Arc::new(TenantRate {
                limiter: RateLimiter::direct_with_clock(limiters.quotas.tenant, TokioClock::new()),
                turns: RateLimiter::direct_with_clock(
                    limiters.quotas.turn_start,
                    TokioClock::new(),
                ),
                turn_started: AtomicU64::new(0),
                retired: AtomicBool::new(false),
                released: AtomicU64::new(0),
            });
            rates.by_name.insert(tenant.to_owned(), rate.clone());
            return rate;
        }
    }

    /// Admits one client request on `conn`: its tenant's request rate, and for a request that
    /// starts a turn ([`starts_a_turn`]) also the tenant's turn rate and active-turn cap. A
    /// `turn/start` naming a thread that already runs a turn steers it and is not counted as a
    /// new turn.
    pub fn check_request(
        &self,
        conn: &mut ConnectionGuard,
        method: &str,
        thread_id: Option<&str>,
    ) -> Result<(), Rejection> {
        if conn.rate.retired.load(Ordering::Acquire) {
            conn.rate = self.tenant_rate(&conn.tenant);
        }
        let limiter = &conn.rate.limiter;
        limiter.check().map_err(|not_until| {
            Rejection::rate(
                Scope::Tenant,
                Reason::TenantRateLimited,
                not_until.wait_time_from(limiter.clock().now()),
            )
        })?;
        if !starts_a_turn(method) {
            return Ok(());
        }
        // Only a `turn/start` on a thread running a turn steers it; the others start turns
        // of their own (a review, a compaction) whatever the thread runs.
        let steers = method == "turn/start";
        self.check_turn_start(conn, thread_id.filter(|_| steers))
    }

    /// A turn's own admission: the tenant's active-turn cap (unless it steers the turn `steered`
    /// runs), then its turn rate.
    fn check_turn_start(
        &self,
        conn: &ConnectionGuard,
        steered: Option<&str>,
    ) -> Result<(), Rejection> {
        let cfg = self.config();
        {
            let counts = lock(&self.counts);
            let turns = counts.tenants.get(conn.tenant.as_str()).map(|t| &t.turns);
            let steering = steered.is_some_and(|t| turns.is_some_and(|ts| ts.contains_key(t)));
            if steering {
                return Ok(());
            }
            if turns.map_or(0, FastMap::len) >= cfg.max_active_turns_per_tenant {
                return Err(Rejection::cap(
                    Scope::Tenant,
                    Reason::ActiveTurnLimit,
                    cfg.cap_retry_after(),
                ));
            }
        }
        let limiter = &conn.rate.turns;
        limiter.check().map_err(|not_until| {
            Rejection::rate(
                Scope::Tenant,
                Reason::TurnRateLimited,
                not_until.wait_time_from(limiter.clock().now()),
            )
        })?;
        conn.rate.note(&conn.rate.turn_started);
        Ok(())
    }

    /// Records that `thread_id` of `tenant` runs a turn (`turn/started`). Idempotent, so every
    /// session that sees the broadcast may report it.
    pub fn turn_started(&self, tenant: &str, thread_id: &str) {
        lock(&self.counts).turn_started(tenant, thread_id);
    }

    /// Records that the turn on `thread_id` ended (`turn/completed`, or the thread closed or
    /// its worker died). Idempotent.
    pub fn turn_ended(&self, tenant: &str, thread_id: &str) {
        lock(&self.counts).turn_ended(tenant, thread_id);
    }

    /// Records a relayed turn start or end, once for the tenant however many of its sessions
    /// report it. Taken and applied under the counts' lock, so a session that finds a start
    /// taken reports the end after it was applied, in the relay's order; a session that finds
    /// it taken does not take the lock at all.
    pub fn turn_marked(&self, tenant: &str, mark: &TurnMark) {
        if mark.taken.load(Ordering::Acquire) {
            return;
        }
        let mut counts = lock(&self.counts);
        if mark.taken.swap(true, Ordering::AcqRel) {
            return;
        }
        match mark.started {
            true => counts.turn_started(tenant, &mark.thread),
            false => counts.turn_ended(tenant, &mark.thread),
        }
    }

    /// Corrects the tenant's tracked turns towards `running`, the workers' own count (their
    /// control legs see every thread, also when no session of the tenant saw a turn end).
    /// Only turns seen to start more than `settled` ago are dropped, oldest first, because the
    /// workers' count trails what sessions see on their own legs by a moment.
    pub fn reconcile_turns(&self, tenant: &str, running: usize, settled: Duration) {
        let mut counts = lock(&self.counts);
        let Some(state) = counts.tenants.get_mut(tenant) else {
            return;
        };
        if state.turns.len() <= running {
            return;
        }
        let mut stale: Vec<(String, Instant)> = state
            .turns
            .iter()
            .filter(|(_, since)| since.elapsed() > settled)
            .map(|(t, since)| (t.clone(), *since))
            .collect();
        stale.sort_by_key(|(_, since)| *since);
        let excess = state.turns.len() - running;
        for (thread, _) in stale.into_iter().take(excess) {
            state.turns.remove(&thread);
        }
    }

    /// Turns `tenant` is known to be running.
    /// Turns sessions saw start within `within` and not end, over every tenant: the freshest
    /// view of turns the workers' own counts may not show yet.
    pub fn turns_started_within(&self, within: Duration) -> usize {
        let now = Instant::now();
        lock(&self.counts)
            .tenants
            .values()
            .flat_map(|t| t.turns.values())
            .filter(|at| now.saturating_duration_since(**at) < within)
            .count()
    }

    pub fn active_turns(&self, tenant: &str) -> usize {
        lock(&self.counts)
            .tenants
            .get(tenant)
            .map_or(0, |t| t.turns.len())
    }

    /// The account of one session's queue towards its client, bounded in bytes per session
    /// and against the tenant's total over all its sessions.
    pub fn client_queue_bytes(
        &self,
        tenant: &str,
        session_bound: usize,
        tenant_bound: usize,
    ) -> Arc<QueueBytes> {
        let total = lock(&self.queued)
            .entry(tenant.to_owned())
            .or_default()
            .clone();
        QueueBytes::new(total, session_bound, tenant_bound)
    }

    /// The byte budget of one session's legs towards the workers, bounded per session and
    /// against the tenant's total.
    pub fn leg_budget(&self, tenant: &str, session_bound: usize, tenant_bound: usize) -> LegBudget {
        let up = lock(&self.leg_bytes)
            .entry(tenant.to_owned())
            .or_insert_with(|| Arc::new(TenantLegBytes::new(tenant_bound)))
            .clone();
        LegBudget::new(session_bound, up)
    }

    /// One socket's read buffer, counted against `tenant`'s sockets' total up to `bound`.
    pub fn held_buffer(&self, tenant: &str, bound: usize) -> HeldBuffer {
        let total = lock(&self.held)
            .entry(tenant.to_owned())
            .or_default()
            .clone();
        HeldBuffer::new(total, bound)
    }

    /// A client socket's read buffer, counted against `tenant`'s sockets' total up to `bound`
    /// as its bytes arrive ([`ReadMeter`]).
    pub fn read_meter(&self, tenant: &str, bound: usize) -> Arc<ReadMeter> {
        Arc::new(ReadMeter::new(self.held_buffer(tenant, bound)))
    }

    /// What `tenant`'s sockets' read buffers hold beyond [`HELD_FREE`] each.
    pub fn held_bytes(&self, tenant: &str) -> usize {
        lock(&self.held)
            .get(tenant)
            .map_or(0, |t| t.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Bytes `tenant`'s sessions hold towards its workers (on an edge: towards its node), over
    /// all its sessions.
    pub fn leg_bytes(&self, tenant: &str) -> usize {
        lock(&self.leg_bytes).get(tenant).map_or(0, |t| t.used())
    }

    /// Bytes queued towards `tenant`'s clients, over all its sessions.
    pub fn queued_bytes(&self, tenant: &str) -> usize {
        lock(&self.queued)
            .get(tenant)
            .map_or(0, |t| t.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Open connections of `tenant` and in total.
    pub fn connections(&self, tenant: &str) -> (usize, usize) {
        let counts = lock(&self.counts);
        let of_tenant = counts.tenants.get(tenant).map_or(0, |t| t.conns);
        (of_tenant, counts.total_conns)
    }

    /// A slot on `worker` without waiting; hold the permit until the worker answers.
    pub fn try_worker_slot(&self, worker: WorkerId) -> Result<InFlightPermit, Rejection> {
        self.try_slot(&mut self.worker_slots(worker))
    }

    /// `worker`'s in-flight slots, for a leg to keep: a request then takes one
    /// ([`Admission::try_slot`]) without looking the worker up under the table's lock.
    pub fn worker_slots(&self, worker: WorkerId) -> WorkerSlots {
        // Read first: slots looked up before a reload's bump are then refreshed on first use.
        let generation = self.slots_generation.load(Ordering::Acquire);
        WorkerSlots {
            worker,
            semaphore: self.worker_semaphore(worker),
            generation,
        }
    }

    /// [`Admission::try_worker_slot`] on slots already looked up (looked up again if a reload
    /// changed the cap since, so the new cap applies as it does to every other request).
    pub fn try_slot(&self, slots: &mut WorkerSlots) -> Result<InFlightPermit, Rejection> {
        if slots.generation != self.slots_generation.load(Ordering::Acquire) {
            *slots = self.worker_slots(slots.worker);
        }
        slots
            .semaphore
            .clone()
            .try_acquire_owned()
            .map(|permit| InFlightPermit { _permit: permit })
            .map_err(|_| self.worker_busy())
    }

    /// A slot on `worker`, waiting at most `in_flight_wait_ms` for one to free up.
    pub async fn worker_slot(&self, worker: WorkerId) -> Result<InFlightPermit, Rejection> {
        let sem = self.worker_semaphore(worker);
        let wait = self.config().in_flight_wait();
        match tokio::time::timeout(wait, sem.acquire_owned()).await {
            Ok(Ok(permit)) => Ok(InFlightPermit { _permit: permit }),
            // Timed out, or the semaphore was closed (never done today): the worker is busy.
            Ok(Err(_)) | Err(_) => Err(self.worker_busy()),
        }
    }

    /// Gives a worker's own `-32001` the router's `data` shape (scope `worker`, reason
    /// `workerOverloaded`, `retryAfterMs` from `in_flight_wait_ms`); `None` leaves `text` as is.
    pub fn rewrite_worker_overload(&self, text: &str) -> Option<String> {
        rewrite_worker_overload(text, self.config().in_flight_wait())
    }

    /// Forgets a worker that exited; its outstanding permits stay valid until dropped.
    pub fn forget_worker(&self, worker: WorkerId) {
        lock(&self.workers).remove(&worker);
    }

    fn worker_semaphore(&self, worker: WorkerId) -> Arc<Semaphore> {
        let mut workers = lock(&self.workers);
        let cap = self.config().max_in_flight_per_worker;
        workers
            .entry(worker)
            .or_insert_with(|| Arc::new(Semaphore::new(cap)))
            .clone()
    }

    fn worker_busy(&self) -> Rejection {
        Rejection::cap(
            Scope::Worker,
            Reason::WorkerBusy,
            self.config().in_flight_wait(),
        )
    }

    /// Drops per-key state that no longer matters: limiter keys back at full burst, idle
    /// worker semaphores, active turns older than the TTL, and the byte accounts of tenants no
    /// session holds any more (a tenant a reload removed, or one gone quiet on this edge).
    pub fn prune(&self) {
        // Under each map's lock, as a session takes its account: one taken now is held
        // (counted), and one pruned is made afresh, at zero, for the next session.
        lock(&self.queued).retain(|_, t| Arc::strong_count(t) > 1);
        lock(&self.leg_bytes).retain(|_, t| Arc::strong_count(t) > 1);
        lock(&self.held).retain(|_, t| Arc::strong_count(t) > 1);
        let limiters = read(&self.limiters);
        limiters.prune_tenant_rates();
        limiters.handshake.retain_recent();
        limiters.handshake.shrink_to_fit();
        let cfg = self.config();
        lock(&self.workers).retain(|_, sem| {
            Arc::strong_count(sem) > 1 || sem.available_permits() < cfg.max_in_flight_per_worker
        });
        let ttl = Duration::from_secs(cfg.active_turn_ttl_secs);
        let mut counts = lock(&self.counts);
        for state in counts.tenants.values_mut() {
            state.turns.retain(|_, since| since.elapsed() < ttl);
        }
        counts
            .tenants
            .retain(|_, t| t.conns > 0 || !t.turns.is_empty());
        counts.tenants.shrink_to_fit();
    }

    /// Keys the limiters hold (tenants' request and turn rates, source addresses).
    pub fn limiter_keys(&self) -> usize {
        read(&self.limiters).keys()
    }

    /// Starts a task that calls [`Admission::prune`] every `every`; it stops when the returned
    /// [`Pruner`] is dropped or the admission is gone.
    pub fn spawn_pruner(self: &Arc<Self>, every: Duration) -> Pruner {
        let weak: Weak<Admission> = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(admission) => admission.prune(),
                    None => break,
                }
            }
        });
        Pruner { task }
    }

    fn close_connection(&self, tenant: &str) {
        let mut counts = lock(&self.counts);
        counts.total_conns = counts.total_conns.saturating_sub(1);
        if let Some(state) = counts.tenants.get_mut(tenant) {
            state.conns = state.conns.saturating_sub(1);
            if state.conns == 0 && state.turns.is_empty() {
                counts.tenants.remove(tenant);
            }
        }
    }
}

/// Whether a request of `method` starts a turn on the thread it names, and so counts against the
/// turn rate and the active-turn cap: `turn/start`, and the requests app-server answers with a
/// turn of their own (measured on 0.171: `review/start` answers with the review's turn
/// `inProgress`; `thread/goal/set` sets a goal that runs turns by itself) or runs as one by the
/// protocol (`thread/compact/start`, `thread/shellCommand`, `thread/queue/start`, which starts
/// the queued turns).
pub fn starts_a_turn(method: &str) -> bool {
    STARTS_A_TURN.contains(&method)
}

/// [`starts_a_turn`]'s methods.
const STARTS_A_TURN: [&str; 6] = [
    "turn/start",
    "review/start",
    "thread/compact/start",
    "thread/shellCommand",
    "thread/goal/set",
    "thread/queue/start",
];

/// One admitted client connection: holds its tenant's connection slot until dropped and
/// limits the connection's frame rate.
pub struct ConnectionGuard {
    admission: Weak<Admission>,
    tenant: String,
    frames: DirectLimiter,
    /// The tenant's request rate, shared with its other connections.
    rate: Arc<TenantRate>,
}

impl ConnectionGuard {
    /// Admits one frame of this connection. A refused request gets `-32001`; a refused
    /// notification or response closes the connection (1008, [`FLOOD_CLOSE_REASON`]), because
    /// those cannot be answered and must not be dropped silently.
    pub fn check_frame(&self) -> Result<(), Rejection> {
        self.frames.check().map_err(|not_until| {
            Rejection::rate(
                Scope::Connection,
                Reason::ConnectionRateLimited,
                not_until.wait_time_from(self.frames.clock().now()),
            )
        })
    }

    /// The tenant this connection counts against.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.rate.note(&self.rate.released);
        if let Some(admission) = self.admission.upgrade() {
            admission.close_connection(&self.tenant);
        }
    }
}

/// Close reason for a connection whose notifications or responses exceed its frame rate.
pub const FLOOD_CLOSE_REASON: &str = "frame rate limit exceeded";

/// A worker's in-flight slots (`max_in_flight_per_worker`), shared by every session's leg to
/// it. While a leg holds them they are not pruned, so its requests and the rest take the same
/// slots.
#[derive(Clone, Debug)]
pub struct WorkerSlots {
    worker: WorkerId,
    semaphore: Arc<Semaphore>,
    /// [`Admission`]'s `slots_generation` when looked up.
    generation: u64,
}

/// A request in flight on a worker; the slot frees when this is dropped (keep it with the
/// request until the worker answers, or the leg or worker is gone).
#[derive(Debug)]
pub struct InFlightPermit {
    _permit: OwnedSemaphorePermit,
}

/// The owned background pruning task; dropping it stops the task.
#[derive(Debug)]
pub struct Pruner {
    task: JoinHandle<()>,
}

impl Drop for Pruner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests;
