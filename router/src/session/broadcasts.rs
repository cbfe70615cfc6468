//! The tenant's relay: broadcasts from workers' control legs reach every session once. A session
//! forwards one unless its own live leg to that worker delivers it, holds back what a thread's
//! move makes the new worker say, and takes only turn ends from it for the turn count.

use tokio::sync::broadcast;

use super::{End, Session};
use crate::tenants::Relayed;

/// The next relayed broadcast; pending forever once the relay is closed.
pub(super) async fn recv_relay(
    relay: &mut Option<broadcast::Receiver<Relayed>>,
) -> Option<Relayed> {
    let Some(rx) = relay.as_mut() else {
        return std::future::pending().await;
    };
    match rx.recv().await {
        Ok(r) => Some(r),
        Err(broadcast::error::RecvError::Lagged(n)) => {
            tracing::warn!(missed = n, "session lagged behind the tenant's broadcasts");
            None
        }
        Err(broadcast::error::RecvError::Closed) => {
            *relay = None;
            std::future::pending().await
        }
    }
}

// === impl Session ===

impl Session {
    /// A broadcast from a worker's control leg: forwarded unless this session's own live leg
    /// to that worker delivers it (so each broadcast arrives once).
    pub(super) async fn on_relayed(&mut self, relayed: Option<Relayed>) -> Result<(), End> {
        let Some(r) = relayed else { return Ok(()) };
        // Only the end of a turn is taken from the relay: it lags the legs, and a late relayed
        // "active" after the leg's turn/completed would count a finished turn as running.
        if let Some(thread) = &r.turn_ended {
            self.ctx.admission.turn_ended(self.tenant(), thread);
        }
        if let Some(order) = &r.rehome {
            return self.on_rehome(order).await;
        }
        if self.init.as_ref().is_none_or(|i| !i.answered) || self.holds_back_relayed(&r) {
            return Ok(());
        }
        if r.to_all || !self.live.contains(&r.worker) {
            return self.to_client(r.text);
        }
        Ok(())
    }
}
