//! Supervisor of codex app-server worker processes: spawn, place, watch, restart, drain, stop idle.

pub mod control;
pub mod descriptors;
pub mod error;
pub mod fleet;
pub mod id;
pub mod interrupt;
pub mod leg;
pub mod lifecycle;
pub(crate) mod load;
pub mod metrics;
pub mod process;
pub mod restart;
pub mod run_as;
pub mod supervisor;
mod sweep;
pub mod usage;

pub use error::{ConfigError, ControlError, LegError, PoolError, StartError};
pub use fleet::FleetCap;
pub use id::WorkerId;
pub use leg::{connect, LegStream};
pub use metrics::WorkerMetrics;
pub use process::exec::{exec_if_shim, spawn_through};
pub use process::ExitReport;
pub use run_as::{Rlimits, WorkerUser};
pub use supervisor::{
    Pool, PoolConfig, PoolEvent, Purpose, Sizes, WorkerHandle, WorkerInfo, WorkerState,
};
