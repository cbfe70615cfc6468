//! Tenants at run time: each configured tenant with its worker pool and its token digests.

use std::sync::Arc;
use std::time::Duration;

use proto::event::{Event, Notice, Turn};
use proto::Method;
use tokio::sync::{broadcast, Notify, Semaphore};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Utf8Bytes;
use worker::metrics::{ExitReason, WorkerMetrics};
use worker::{FleetCap, Pool, PoolEvent, WorkerId, WorkerUser};

use crate::admission::TurnMark;
use crate::config::Config;
use crate::credentials::Credentials;
use crate::policy::{HostAccessPolicy, TenantRoots};
use rehome::{Cause, Moves, Rehome, Subscribers};

mod build;
mod program;
pub mod rehome;
pub mod uids;

pub use build::{
    check_worker_programs, per_tenant_uid, shared_uid_warning, REMOTE_CONTROL_DISABLED,
};
use build::{fingerprint, pool_config, pool_sizes, tenant_roots};
pub use program::resolve_program;

/// Relayed broadcasts buffered per tenant; a session that falls this far behind has missed some and
/// is closed ([`crate::end::End::RelayLagged`]). tokio allocates every slot up front, so this is a
/// fixed cost per tenant.
pub(crate) const RELAY_CAPACITY: usize = 512;

/// One tenant: its id, its pool of workers and the table of which worker owns each thread.
pub struct Tenant {
    /// The configured id.
    pub id: String,
    /// Its workers.
    pub pool: Arc<Pool>,
    /// What its clients may do on the host (docs/decisions/0011-containment-by-the-os-first.md,
    /// defence in depth).
    pub policy: HostAccessPolicy,
    /// Where its clients may point host-access methods.
    pub roots: TenantRoots,
    /// The one costly step of the tenant's requests that may run off the runtime at a time: a
    /// policy check too costly to run inline ([`HostAccessPolicy::check_inline`]), or the parse
    /// of a frame over a MiB. A tenant's costly steps wait for each other, not for a thread of
    /// every tenant's.
    pub costly_work: Arc<Semaphore>,
    /// How many of its host-access denials get an audit record of their own.
    pub denial_records: crate::audit::denials::DenialRecords,
    /// How many sessions are subscribed to each thread (decides re-home or close when a worker
    /// ends).
    pub subscribers: Arc<Subscribers>,
    /// Threads being re-homed now: what the moves themselves make workers say about them is
    /// held back.
    pub moves: Moves,
    /// Turns, tokens and approvals already counted (each once, however many sessions see it).
    pub counted: crate::usage::Counted,
    /// The settings a reload cannot change in place (see [`fingerprint`]).
    settings: String,
    relay: broadcast::Sender<Relayed>,
    reconcile: Arc<Notify>,
    events: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// A broadcast about one of the tenant's threads, seen on a worker's control leg.
#[derive(Clone, Debug)]
pub struct Relayed {
    /// The worker it came from.
    pub worker: WorkerId,
    /// The notification as sent to clients: one allocation, shared by every session that
    /// forwards it.
    pub text: Utf8Bytes,
    /// Its method, which a client may have opted out of (`optOutNotificationMethods`).
    pub method: Arc<str>,
    /// Sent to every session, legs or not (the router's own news, e.g. a worker's death).
    pub to_all: bool,
    /// The thread whose turn this notification starts or ends, if it does (read once here, so
    /// no session parses the text again).
    pub turn: Option<Arc<TurnMark>>,
    /// An order about a thread of a worker that ended (no text to forward): each session acts
    /// on it for itself.
    pub rehome: Option<Arc<Rehome>>,
    /// For `thread/status/changed` and `thread/goal/cleared`: the thread, and whether this is
    /// what a move makes the new worker say (a restated idle, a cleared goal). Read once here,
    /// so a session holds back a move's echoes without parsing the text again.
    pub status_of: Option<(Arc<str>, bool)>,
}

impl Tenant {
    fn new(
        id: String,
        pool: Arc<Pool>,
        policy: HostAccessPolicy,
        roots: TenantRoots,
        settings: String,
    ) -> Arc<Tenant> {
        let (relay, _) = broadcast::channel(RELAY_CAPACITY);
        let tenant = Arc::new(Tenant {
            id,
            pool,
            policy,
            roots,
            costly_work: Arc::new(Semaphore::new(1)),
            denial_records: crate::audit::denials::DenialRecords::new(),
            settings,
            subscribers: Arc::default(),
            moves: Moves::default(),
            counted: crate::usage::Counted::default(),
            relay,
            reconcile: Arc::new(Notify::new()),
            events: std::sync::Mutex::new(None),
        });
        let task = tokio::spawn(watch_pool(
            Arc::downgrade(&tenant),
            tenant.pool.subscribe(),
            tenant.reconcile.clone(),
        ));
        *tenant
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(task);
        tenant
    }

    /// Broadcasts about the tenant's threads from workers' control legs.
    pub fn subscribe(&self) -> broadcast::Receiver<Relayed> {
        self.relay.subscribe()
    }

    /// Relays `r` to the tenant's sessions as a control leg's broadcast would be.
    #[cfg(test)]
    pub(crate) fn relay(&self, r: Relayed) {
        let _receivers = self.relay.send(r);
    }

    /// Asks for a reconciliation with every worker soon (after a leg or worker loss).
    pub fn reconcile_soon(&self) {
        self.reconcile.notify_one();
    }

    /// Reconciles now: asks every ready worker for its loaded threads (the pool's record of
    /// where threads live is reset from the answers).
    pub async fn reconcile_now(&self) {
        self.pool.reconcile().await;
    }

    /// The worker that owns `thread`: the pool keeps the one record of it, from the lifecycle
    /// broadcasts its control legs receive and, level-triggered, their `thread/loaded/list`
    /// answers (a missed event or a lost entry heals within one health period); sessions add
    /// what answers to `thread/start`, `thread/fork` and `thread/resume` say, which can arrive
    /// before the broadcast ([`Pool::learn`]).
    pub fn find_owner(&self, thread: &str) -> Option<WorkerId> {
        self.pool.owner(thread)
    }

    fn on_pool_event(self: &Arc<Self>, ev: PoolEvent) {
        match ev {
            PoolEvent::Notification { worker, notice } => self.on_notification(worker, &notice),
            PoolEvent::WorkerExited {
                worker,
                reason,
                threads,
                ..
            } => self.on_worker_exited(worker, reason, &threads),
            _ => {}
        }
    }

    fn on_notification(&self, worker: WorkerId, notice: &Notice) {
        if !notice.method.is_thread_scoped() {
            return; // process-wide news reaches sessions through their own legs
        }
        let status_of = match (&notice.method, &notice.event, &notice.thread) {
            (_, Some(Event::ThreadStatusChanged { status, .. }), Some(thread)) => Some((
                thread.clone(),
                rehome::is_move_echo(notice.method.as_str(), Some(status)),
            )),
            (Method::Other(name), _, Some(thread)) if name == "thread/goal/cleared" => {
                Some((thread.clone(), true))
            }
            _ => None,
        };
        let turn = match (notice.event.as_ref().and_then(Event::turn), &notice.thread) {
            (Some(turn), Some(thread)) => {
                Some(TurnMark::new(thread.clone(), turn == Turn::Started))
            }
            _ => None,
        };
        let _receivers = self.relay.send(Relayed {
            worker,
            text: notice.text.clone(),
            method: Arc::from(notice.method.as_str()),
            to_all: false,
            turn,
            rehome: None,
            status_of,
        });
    }

    /// A worker ended. Each of its threads that sessions are subscribed to is re-homed: the
    /// tenant picks a ready worker for it once and orders every session to resume it there
    /// (`session/rehome.rs`). The others close, as they would in app-server: `systemError` after a
    /// failure, `notLoaded` after a retirement, then `thread/closed`. When codex-fleet itself
    /// stops the worker, nothing moves.
    fn on_worker_exited(
        self: &Arc<Self>,
        worker: WorkerId,
        reason: ExitReason,
        threads: &[(String, bool)],
    ) {
        let cause = Cause::of(reason);
        let status = match cause {
            Some(Cause::Retired) => "notLoaded",
            _ => "systemError",
        };
        let mut orphans = Vec::new();
        for (thread, active) in threads.iter().cloned() {
            match cause {
                Some(cause) if self.subscribers.count(&thread) > 0 => {
                    self.moves.begin(&thread, self.subscribers.count(&thread));
                    orphans.push((thread, cause, active));
                }
                _ => self.broadcast_closed(worker, &thread, status),
            }
        }
        if orphans.is_empty() {
            return;
        }
        let since = tokio::time::Instant::now();
        let tenant = self.clone();
        tokio::spawn(async move {
            // Handles held until every thread is placed, so placement spreads them.
            let mut held = Vec::new();
            for (thread, cause, was_active) in orphans {
                let to = match tenant.pool.acquire().await {
                    Ok(handle) => {
                        tenant.pool.learn(&thread, handle.id);
                        let id = handle.id;
                        held.push(handle);
                        Some(id)
                    }
                    Err(e) => {
                        tracing::warn!(tenant = %tenant.id, %thread, %worker, cause = cause.as_str(), error = %e,
                            "no worker can take the thread of a worker that ended; closing it");
                        None
                    }
                };
                let thread: Arc<str> = Arc::from(thread.as_str());
                let _receivers = tenant.relay.send(Relayed {
                    worker,
                    text: Utf8Bytes::from_static(""),
                    method: Arc::from(""),
                    to_all: true,
                    turn: Some(TurnMark::ended(thread.clone())),
                    status_of: None,
                    rehome: Some(Arc::new(Rehome {
                        thread,
                        from: worker,
                        to,
                        cause,
                        since,
                        was_active,
                    })),
                });
            }
        });
    }

    /// Tells every session that `thread` is gone (it went `status`, then closed).
    fn broadcast_closed(&self, worker: WorkerId, thread: &str, status: &str) {
        let ended: Arc<str> = Arc::from(thread);
        for frame in rehome::thread_closed_frames(thread, status) {
            let _receivers = self.relay.send(Relayed {
                worker,
                text: Utf8Bytes::from(frame.text),
                method: Arc::from(frame.method.as_str()),
                to_all: true,
                turn: Some(TurnMark::ended(ended.clone())),
                rehome: None,
                status_of: None,
            });
        }
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        if let Some(task) = self
            .events
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// The tenants in force; a reload swaps in a new set while sessions keep the tenant they have.
pub struct TenantRegistry {
    current: std::sync::RwLock<Arc<Tenants>>,
}

impl TenantRegistry {
    /// Starts with `tenants`.
    pub fn new(tenants: Tenants) -> TenantRegistry {
        TenantRegistry {
            current: std::sync::RwLock::new(Arc::new(tenants)),
        }
    }

    /// The tenants in force now.
    pub fn current(&self) -> Arc<Tenants> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Puts `tenants` in force, and ends the sessions whose credential or tenant it no longer
    /// has; returns the previous set.
    pub fn replace(&self, tenants: Arc<Tenants>) -> Arc<Tenants> {
        let previous = {
            let mut cur = self
                .current
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            std::mem::replace(&mut *cur, tenants.clone())
        };
        tenants.credentials.commit();
        previous
    }
}

/// Every tenant, and the credentials that name them.
pub struct Tenants {
    list: Vec<Arc<Tenant>>,
    credentials: Credentials,
    fleet: FleetCap,
    /// The tenants' uids this instance claims on the host (kept across reloads).
    uid_claims: crate::tenants::uids::UidClaims,
}

/// The outcome of [`Tenants::rebuild`].
pub struct Rebuilt {
    /// The new set.
    pub tenants: Tenants,
    /// Tenants no longer configured: their pools stop once their sessions end.
    pub removed: Vec<Arc<Tenant>>,
    /// Ids of retired tenants configured again: the new set holds their running pools.
    pub adopted: Vec<String>,
    /// Changes that were not applied (they need a restart).
    pub warnings: Vec<String>,
}

impl Tenants {
    /// Builds each tenant's pool (min_workers start in the background), its host-access policy
    /// and roots, and — when codex-fleet runs as root — its Unix identity.
    pub fn build(cfg: &Config, metrics: &WorkerMetrics) -> anyhow::Result<Tenants> {
        Ok(Tenants::rebuild(cfg, metrics, None, &[])?.tenants)
    }

    /// Builds the tenants `cfg` names, reusing from `old` every tenant (its running pool, thread
    /// table and sessions) whose worker settings are unchanged; only its pool sizes are updated in
    /// place. A tenant whose worker settings changed keeps its running workers and settings (a
    /// warning says a restart applies them). A `retired` tenant (removed earlier, its pool still
    /// serving open sessions) that `cfg` names again is adopted the same way: a second pool would
    /// collide with the running one (same socket paths and worker ids) and be quarantined.
    /// Nothing of `old` is touched when this fails.
    pub fn rebuild(
        cfg: &Config,
        metrics: &WorkerMetrics,
        old: Option<&Tenants>,
        retired: &[Arc<Tenant>],
    ) -> anyhow::Result<Rebuilt> {
        check_worker_programs(cfg)?;
        let mut warnings = Vec::new();
        let fleet = match old {
            Some(old) => {
                if old.fleet.max() != cfg.workers.max_workers {
                    warnings.push(format!(
                        "workers.max_workers changed ({} -> {}); it applies after a restart",
                        old.fleet.max(),
                        cfg.workers.max_workers
                    ));
                }
                old.fleet.clone()
            }
            None => FleetCap::new(cfg.workers.max_workers),
        };
        let per_tenant_uid = per_tenant_uid(cfg);
        let uid_claims = old.map_or_else(crate::tenants::uids::UidClaims::host, |o| {
            o.uid_claims.clone()
        });
        let uids = if per_tenant_uid && !cfg.tenants.is_empty() {
            let wait = match old {
                None => crate::tenants::uids::START_CLAIM_WAIT,
                Some(_) => std::time::Duration::ZERO,
            };
            crate::tenants::uids::tenant_uids(cfg, &uid_claims, wait)?
        } else {
            Default::default()
        };
        if old.is_none() {
            crate::tenants::uids::warn_about_foreign_processes(&uids);
        }
        let mut list = Vec::with_capacity(cfg.tenants.len());
        let credentials = Credentials::build(
            cfg.tenants.iter().map(crate::config::Tenant::credentials),
            cfg.jwt_auth(),
            old.map(|o| &o.credentials),
        )?;
        let mut resizes = Vec::new();
        let mut adopted = Vec::new();
        for t in &cfg.tenants {
            let settings = fingerprint(cfg, t);
            let running = old
                .and_then(|o| o.iter().find(|e| e.id == t.id))
                .or_else(|| {
                    let back = retired.iter().find(|e| e.id == t.id)?;
                    adopted.push(t.id.clone());
                    Some(back)
                });
            if let Some(existing) = running {
                if existing.settings != settings {
                    warnings.push(format!(
                        "tenant {:?}: worker settings changed; the running ones stay until a restart",
                        t.id
                    ));
                }
                resizes.push((existing.clone(), pool_sizes(cfg, t)));
                list.push(existing.clone());
                continue;
            }
            let program = resolve_program(&cfg.worker_command(t)[0])?;
            let user = uids.get(&t.id).map(|&(uid, gid)| WorkerUser { uid, gid });
            let policy = t
                .policy
                .resolve(!per_tenant_uid)
                .map_err(|e| anyhow::anyhow!("tenant {:?}: {e}", t.id))?;
            let mut pool_cfg = pool_config(cfg, t, &program, &fleet, user);
            if !policy.allows_remote_control() {
                pool_cfg.env.push((
                    REMOTE_CONTROL_DISABLED.0.into(),
                    REMOTE_CONTROL_DISABLED.1.into(),
                ));
            }
            pool_cfg
                .validate()
                .map_err(|e| anyhow::anyhow!("tenant {:?}: {e}", t.id))?;
            let roots = tenant_roots(cfg, t)?;
            let pool = Pool::new(pool_cfg, metrics.clone());
            list.push(Tenant::new(t.id.clone(), pool, policy, roots, settings));
        }
        // Resizing changes running pools: only once everything else succeeded.
        for (tenant, sizes) in resizes {
            if tenant.pool.sizes() != sizes {
                tenant
                    .pool
                    .resize(sizes)
                    .map_err(|e| anyhow::anyhow!("tenant {:?}: {e}", tenant.id))?;
            }
        }
        let removed = old
            .map(|o| {
                o.iter()
                    .filter(|e| !cfg.tenants.iter().any(|t| t.id == e.id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        Ok(Rebuilt {
            tenants: Tenants {
                list,
                credentials,
                fleet,
                uid_claims,
            },
            removed,
            adopted,
            warnings,
        })
    }

    /// Running turns across every tenant.
    pub fn active_turns(&self) -> usize {
        self.list.iter().map(|t| t.pool.active_turns()).sum()
    }

    /// The credentials that authenticate clients as these tenants.
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// The tenant named `id`.
    pub fn get(&self, id: &str) -> Option<&Arc<Tenant>> {
        self.list.iter().find(|t| t.id == id)
    }

    /// All tenants.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.list.iter()
    }

    /// Stops every tenant's workers: SIGTERM, then SIGKILL after `grace`.
    pub async fn shutdown(&self, grace: Duration) {
        let all = self.list.iter().map(|t| t.pool.shutdown(grace));
        futures_util::future::join_all(all).await;
    }
}

/// Follows the pool's events for as long as the tenant exists (it holds no strong reference
/// while waiting, so dropping the tenant ends it).
async fn watch_pool(
    tenant: std::sync::Weak<Tenant>,
    mut events: broadcast::Receiver<PoolEvent>,
    reconcile: Arc<Notify>,
) {
    loop {
        tokio::select! {
            ev = events.recv() => {
                let Some(t) = tenant.upgrade() else { return };
                match ev {
                    Ok(ev) => t.on_pool_event(ev),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(tenant = %t.id, missed = n, "pool events lagged; reconciling");
                        t.reconcile_now().await;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
            () = reconcile.notified() => {
                let Some(t) = tenant.upgrade() else { return };
                t.reconcile_now().await;
            }
        }
    }
}
