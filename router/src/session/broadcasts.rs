//! The tenant's relay: broadcasts from workers' control legs reach every session once. A session
//! forwards one unless its own live leg to that worker delivers it, holds back what a thread's
//! move makes the new worker say, and takes only turn ends from it for the turn count.

use std::task::{ready, Context, Poll};

use tokio::sync::broadcast::{self, error::RecvError, Receiver};
use tokio_util::sync::ReusableBoxFuture;

use super::{End, Session, LEG_OPT_OUTS, RELAY_BURST};
use crate::gate::Gate;
use crate::tenants::Relayed;

/// One receive from the relay, holding the receiver until it is done.
type Receiving = ReusableBoxFuture<'static, (Result<Relayed, RecvError>, Receiver<Relayed>)>;

/// The tenant's relay as a session reads it: one receive kept across the session loop's
/// turns. A receive made afresh on every turn would lock the tenant's channel twice per turn
/// (to wait, and to stop waiting when another branch of the loop won), with every session of
/// the tenant taking that same lock.
pub(super) struct Relay {
    /// None once the relay is closed.
    receiving: Option<Receiving>,
}

async fn receive(mut rx: Receiver<Relayed>) -> (Result<Relayed, RecvError>, Receiver<Relayed>) {
    let r = rx.recv().await;
    (r, rx)
}

impl Relay {
    pub(super) fn new(rx: Receiver<Relayed>) -> Relay {
        Relay {
            receiving: Some(ReusableBoxFuture::new(receive(rx))),
        }
    }

    /// The next relayed broadcast (`None` after a lag, which is logged); pending forever once
    /// the relay is closed. Cancel-safe: the receive goes on in the relay, not in this future.
    /// (The session loop polls [`Relay::poll_recv`] behind its gate.)
    #[cfg(test)]
    pub(super) fn recv(&mut self) -> impl std::future::Future<Output = Option<Relayed>> + '_ {
        std::future::poll_fn(|cx| self.poll_recv(cx))
    }

    /// [`Relay::recv`], polled.
    pub(super) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Relayed>> {
        let Some(receiving) = self.receiving.as_mut() else {
            return Poll::Pending;
        };
        let (result, rx) = ready!(receiving.poll(cx));
        match result {
            Ok(r) => {
                receiving.set(receive(rx));
                Poll::Ready(Some(r))
            }
            Err(broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!(
                    missed = n,
                    "session fell behind the tenant's broadcasts; closing it"
                );
                receiving.set(receive(rx));
                Poll::Ready(None)
            }
            Err(broadcast::error::RecvError::Closed) => {
                self.receiving = None;
                Poll::Pending
            }
        }
    }
}

// === impl Session ===

impl Session {
    /// A relayed broadcast, and then whatever else the relay holds now (up to [`RELAY_BURST`]),
    /// so that it goes to the client in one write: a big tenant's sessions each get many status
    /// changes at once. `relayed` is the gate the session loop polls the relay behind.
    pub(super) async fn on_relayed_burst(
        &mut self,
        first: Option<Relayed>,
        relayed: &mut Gate,
        relay: &mut Relay,
    ) -> Result<(), End> {
        self.on_relayed(first).await?;
        for _ in 1..RELAY_BURST {
            let ready =
                std::future::poll_fn(|cx| Poll::Ready(relayed.poll(cx, |cx| relay.poll_recv(cx))))
                    .await;
            match ready {
                Poll::Ready(r) => self.on_relayed(r).await?,
                Poll::Pending => break,
            }
        }
        Ok(())
    }

    /// A broadcast from a worker's control leg: forwarded unless this session's own live leg
    /// to that worker delivers it (so each broadcast arrives once). Legs opt out of
    /// [`LEG_OPT_OUTS`], so those always come from here.
    ///
    /// `None`: the session fell behind the relay and missed broadcasts. Once its client is
    /// initialized that ends the session ([`End::RelayLagged`]); before, it would have dropped
    /// them all anyway.
    pub(super) async fn on_relayed(&mut self, relayed: Option<Relayed>) -> Result<(), End> {
        let Some(r) = relayed else {
            return match &self.init {
                Some(init) if init.answered => Err(End::RelayLagged),
                _ => Ok(()),
            };
        };
        // Counted once for the tenant, in the control leg's order: a relayed "active" that
        // comes after the leg's turn/completed is followed by its relayed idle. (Legs do not
        // get status changes, so a turn driven on a thread no session follows counts here.)
        if let Some(mark) = &r.turn {
            self.ctx.admission.turn_marked(self.tenant(), mark);
        }
        if let Some(order) = &r.rehome {
            // Boxed: rare, and every relayed broadcast's future would carry it otherwise.
            return Box::pin(self.on_rehome(order)).await;
        }
        if self.init.as_ref().is_none_or(|i| !i.answered) || self.holds_back_relayed(&r) {
            return Ok(());
        }
        let leg_has_it = self.live.contains(&r.worker) && !LEG_OPT_OUTS.contains(&&*r.method);
        if (r.to_all || !leg_has_it) && !self.opted_out(&r.method) {
            return self.to_client(r.text);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use worker::WorkerId;

    fn relayed(text: &str) -> Relayed {
        Relayed {
            worker: WorkerId::new("t", 0, 1),
            text: text.into(),
            method: std::sync::Arc::from("thread/status/changed"),
            to_all: false,
            turn: None,
            rehome: None,
            status_of: None,
        }
    }

    #[tokio::test]
    async fn a_relay_keeps_its_receive_when_the_loop_takes_another_branch() {
        let (tx, rx) = broadcast::channel(4);
        let mut relay = Relay::new(rx);
        // The session loop polls the relay, another branch wins, the receive is dropped...
        assert!(relay.recv().now_or_never().is_none());
        assert!(relay.recv().now_or_never().is_none());
        // ...and nothing sent meanwhile is lost, in order.
        tx.send(relayed("one")).unwrap();
        tx.send(relayed("two")).unwrap();
        assert_eq!(relay.recv().await.unwrap().text.as_str(), "one");
        assert_eq!(relay.recv().await.unwrap().text.as_str(), "two");
    }

    #[tokio::test]
    async fn a_lagging_relay_says_none_once_and_goes_on_and_a_closed_one_is_pending() {
        let (tx, rx) = broadcast::channel(2);
        let mut relay = Relay::new(rx);
        for n in 0..5 {
            tx.send(relayed(&n.to_string())).unwrap();
        }
        assert!(relay.recv().await.is_none(), "a lag is reported as none");
        assert_eq!(relay.recv().await.unwrap().text.as_str(), "3");
        assert_eq!(relay.recv().await.unwrap().text.as_str(), "4");
        drop(tx);
        let closed = tokio::time::timeout(std::time::Duration::from_millis(50), relay.recv());
        assert!(closed.await.is_err(), "a closed relay stays pending");
    }
}
