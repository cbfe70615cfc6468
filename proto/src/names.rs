//! Naming rules: tenant ids and worker socket paths, defined once.
//!
//! Two tenant-id rules exist on purpose: the configuration file is strict (ids become Unix user
//! names under the per-tenant uid scheme), the worker pool accepts any id that is safe as a metric
//! label and a file name.

/// Socket paths must be shorter than this (sun_path is 108 bytes with its NUL; keep a margin).
pub const MAX_SOCKET_PATH: usize = 100;

/// Longest tenant id the configuration accepts.
pub const MAX_CONFIG_TENANT_ID: usize = 32;
/// Longest tenant id a worker pool accepts.
pub const MAX_POOL_TENANT_ID: usize = 64;

/// A tenant id in the configuration: 1–32 of `[a-z0-9_-]`.
pub fn valid_config_tenant_id(id: &str) -> bool {
    (1..=MAX_CONFIG_TENANT_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A tenant id of a worker pool (a metric label and part of file names): 1–64 of
/// `[A-Za-z0-9_-]`.
pub fn valid_pool_tenant_id(id: &str) -> bool {
    (1..=MAX_POOL_TENANT_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Whether a socket path of `len` bytes is short enough to connect to.
pub fn socket_path_fits(len: usize) -> bool {
    len < MAX_SOCKET_PATH
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids() {
        assert!(valid_config_tenant_id("acme-1_x"));
        assert!(!valid_config_tenant_id("Acme"));
        assert!(!valid_config_tenant_id(""));
        assert!(!valid_config_tenant_id(&"a".repeat(33)));
        assert!(valid_config_tenant_id(&"a".repeat(32)));
        assert!(valid_pool_tenant_id("Acme-1"));
        assert!(valid_pool_tenant_id(&"a".repeat(64)));
        assert!(!valid_pool_tenant_id(&"a".repeat(65)));
        assert!(!valid_pool_tenant_id("a/b"));
        assert!(!valid_pool_tenant_id("a.b"));
    }

    #[test]
    fn socket_paths() {
        assert!(socket_path_fits(MAX_SOCKET_PATH - 1));
        assert!(!socket_path_fits(MAX_SOCKET_PATH));
    }
}
