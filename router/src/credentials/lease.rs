//! How a session ends with its credential: a [`Lease`] that ends at the JWT's expiry, or when a
//! reload revokes the token, the key or the tenant that admitted it.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

use tokio_util::sync::CancellationToken;

/// Why a session's credential ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialEnd {
    /// The JWT's `exp` (plus the grace) passed.
    Expired,
    /// A reload removed the token, the key or the tenant.
    Revoked,
}

/// Ends a session with the credential that admitted it.
#[derive(Debug, Clone)]
pub struct Lease {
    pub(super) credential: CancellationToken,
    pub(super) tenant: CancellationToken,
    pub(super) deadline: Option<tokio::time::Instant>,
}

impl Lease {
    /// A lease that never ends (sessions a node admits: the edge holds their lease).
    pub fn unbounded() -> Lease {
        Lease {
            credential: CancellationToken::new(),
            tenant: CancellationToken::new(),
            deadline: None,
        }
    }

    /// A lease whose credential was revoked already (tests).
    #[cfg(test)]
    pub(crate) fn revoked() -> Lease {
        let lease = Lease::unbounded();
        lease.revoke();
        lease
    }

    /// Revokes the credential, as a reload that removed it does (tests).
    #[cfg(test)]
    pub(crate) fn revoke(&self) {
        self.credential.cancel();
    }

    /// Whether the credential has ended already, without waiting (the edge checks it before a
    /// session's held messages leave for its node).
    pub fn ended_now(&self) -> Option<CredentialEnd> {
        if self.credential.is_cancelled() || self.tenant.is_cancelled() {
            Some(CredentialEnd::Revoked)
        } else if self
            .deadline
            .is_some_and(|d| tokio::time::Instant::now() >= d)
        {
            Some(CredentialEnd::Expired)
        } else {
            None
        }
    }

    /// Resolves when the credential ends.
    pub async fn ended(&self) -> CredentialEnd {
        let expiry = async {
            match self.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = self.credential.cancelled() => CredentialEnd::Revoked,
            () = self.tenant.cancelled() => CredentialEnd::Revoked,
            () = expiry => CredentialEnd::Expired,
        }
    }
}

/// One cancellation token per live credential and per tenant, shared by every configuration
/// built after the first, so a reload can end exactly the sessions whose credential it removed.
#[derive(Debug, Default)]
pub(super) struct Leases {
    tokens: Mutex<HashMap<String, CancellationToken>>,
}

impl Leases {
    pub(super) fn token(&self, key: &str) -> CancellationToken {
        self.tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    /// Cancels and forgets every token whose key is not in `keep`; returns how many.
    pub(super) fn retain(&self, keep: &HashSet<String>) -> usize {
        let mut tokens = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        let before = tokens.len();
        tokens.retain(|k, t| {
            let live = keep.contains(k);
            if !live {
                t.cancel();
            }
            live
        });
        before - tokens.len()
    }
}
