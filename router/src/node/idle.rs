//! `codex-fleet node --exit-when-idle`: a tenant pod's node ends itself once it has had no
//! session, no running turn and no loaded thread for `workers.worker_idle_secs`, so its pod
//! completes and the edges delete it (the volume stays for the next session).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::admission::Admission;
use crate::tenants::TenantRegistry;

/// How often idleness is looked at.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// Whether nothing runs: no session of any tenant, no running turn, no loaded thread.
pub fn is_idle(tenants: &TenantRegistry, admission: &Admission) -> bool {
    let current = tenants.current();
    let idle = current.iter().all(|t| {
        admission.connections(&t.id).0 == 0
            && t.pool.active_turns() == 0
            && t.pool
                .loaded_threads()
                .iter()
                .all(|(_, threads)| threads.is_empty())
    });
    idle
}

/// Resolves once the node has been idle for `idle`, without interruption.
pub async fn until_idle(tenants: Arc<TenantRegistry>, admission: Arc<Admission>, idle: Duration) {
    let mut since: Option<Instant> = None;
    loop {
        if is_idle(&tenants, &admission) {
            let at = *since.get_or_insert_with(Instant::now);
            if at.elapsed() >= idle {
                tracing::info!(
                    idle_secs = idle.as_secs(),
                    "idle: no session, turn or loaded thread; exiting"
                );
                return;
            }
        } else {
            since = None;
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}
