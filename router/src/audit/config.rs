//! `[audit]`: the audit log's own section of the configuration.

use std::path::PathBuf;

use serde::Deserialize;

/// `[audit]`: where the audit log goes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// A file (appended, rotated past `max_file_bytes`: `<path>.1` the newest of `keep_files`)
    /// or `-` for stdout; unset: no audit log.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Events queued towards the sink; beyond it events are dropped and counted.
    #[serde(default = "defaults::audit_queue")]
    pub queue: usize,
    /// Size at which the file is rotated.
    #[serde(default = "defaults::audit_max_file_bytes")]
    pub max_file_bytes: u64,
    /// Rotated files kept (`<path>.1` … `<path>.N`, the oldest dropped at the next rotation).
    #[serde(default = "defaults::audit_keep_files")]
    pub keep_files: u32,
}

/// Most rotated audit files kept.
pub const MAX_KEEP_FILES: u32 = 1000;

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            path: None,
            queue: defaults::audit_queue(),
            max_file_bytes: defaults::audit_max_file_bytes(),
            keep_files: defaults::audit_keep_files(),
        }
    }
}

mod defaults {
    pub(super) fn audit_queue() -> usize {
        4096
    }
    pub(super) fn audit_max_file_bytes() -> u64 {
        104_857_600
    }
    pub(super) fn audit_keep_files() -> u32 {
        1
    }
}
