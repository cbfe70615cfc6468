//! Which worker a frame, a leg or a metric is about: [`WorkerId`] (tenant, slot, start count),
//! and who a worker process is on its socket ([`Peer`]); leaves every other module may name.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Mutex, PoisonError};

/// Identifies one worker process: tenant, slot and the slot's start count. Displays as `acme#0.g3`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId {
    tenant: &'static str,
    slot: u32,
    generation: u32,
}

// === impl WorkerId ===

impl WorkerId {
    /// An id from its parts (the pool makes them; tests and simulators may too).
    pub fn new(tenant: &'static str, slot: u32, generation: u32) -> Self {
        Self {
            tenant,
            slot,
            generation,
        }
    }

    /// The tenant the worker belongs to.
    pub fn tenant(&self) -> &'static str {
        self.tenant
    }

    /// The slot within the tenant's pool (0-based).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// How many processes this slot has started, this one included (0: none yet).
    pub fn generation(&self) -> u32 {
        self.generation
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}.g{}", self.tenant, self.slot, self.generation)
    }
}

/// Interns a configured tenant id so [`WorkerId`] can be `Copy`. Tenant ids come from configuration,
/// so the set stays small.
pub(crate) fn intern_tenant(tenant: &str) -> &'static str {
    static INTERNED: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let mut set = INTERNED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&known) = set.get(tenant) {
        return known;
    }
    let leaked: &'static str = Box::leak(tenant.to_owned().into_boxed_str());
    set.insert(leaked);
    leaked
}

/// Who must be listening on a worker's socket: the worker process itself, under its uid.
///
/// The socket path lives in a folder the tenant's uid owns, so a tenant can point it anywhere
/// (another tenant's worker, a listener of its own). Every connection checks the listener's
/// credentials (`SO_PEERCRED`, taken by the kernel when the listener was created) before a single
/// byte is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// The worker's process id (it listens itself; app-server does not fork a listener).
    pub pid: u32,
    /// The uid the worker runs as.
    pub uid: u32,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} uid {}", self.pid, self.uid)
    }
}
