//! Supervisor of codex app-server worker processes: spawn, place, watch, restart, drain, stop idle.

pub mod control;
pub mod error;
pub mod fleet;
pub mod id;
pub mod identity;
pub mod interrupt;
pub mod leg;
pub mod lifecycle;
pub(crate) mod load;
pub mod metrics;
pub mod restart;
pub mod supervisor;
mod sweep;
pub mod usage;
pub mod worker;

pub use error::{ConfigError, ControlError, LegError, PoolError, StartError};
pub use fleet::FleetCap;
pub use id::WorkerId;
pub use identity::{Rlimits, WorkerUser};
pub use leg::{connect, LegStream};
pub use metrics::WorkerMetrics;
pub use supervisor::{Pool, PoolConfig, PoolEvent, Sizes, WorkerHandle, WorkerInfo, WorkerState};
pub use worker::ExitReport;
