//! The default of every `[listen]`, `[admin]`, `[workers]`, `[drain]`, `[limits]` and `[[tenants]]`
//! key that has one (the components' own sections keep their defaults beside them); the table in
//! docs/configuration.md is tested against them (`config/tests.rs`).

use std::net::SocketAddr;

pub fn close_on_expiry() -> bool {
    true
}
pub fn handshake_timeout_secs() -> u64 {
    10
}
/// An absent `[workers]` table: every default, and no `state_dir` (only an edge may omit it).
pub fn workers() -> super::Workers {
    toml::from_str("state_dir = \"\"").expect("every other [workers] key has a default")
}
pub fn admin_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}
pub fn command() -> Vec<String> {
    vec!["codex".into(), "app-server".into()]
}
pub fn idle_secs() -> u64 {
    1800
}
pub fn ready_timeout_secs() -> u64 {
    20
}
pub fn health_interval_secs() -> u64 {
    10
}
pub fn health_timeout_secs() -> u64 {
    5
}
pub fn stop_grace_secs() -> u64 {
    10
}
pub fn restart_backoff_initial_ms() -> u64 {
    250
}
pub fn restart_backoff_max_ms() -> u64 {
    30_000
}
pub fn max_message_bytes() -> usize {
    32 << 20
}
pub fn client_queue() -> usize {
    8192
}
pub fn client_queue_bytes() -> usize {
    64 << 20
}
pub fn tenant_queue_bytes() -> usize {
    256 << 20
}
pub fn max_workers() -> usize {
    4
}
pub fn uid_range() -> [u32; 2] {
    [200_000, 300_000]
}
pub fn yes() -> bool {
    true
}
pub fn rlimit_nofile() -> Option<u64> {
    Some(65_536)
}
pub fn max_processes() -> u64 {
    4096
}
pub fn nice() -> u8 {
    super::DEFAULT_WORKER_NICE
}
pub fn load_mark() -> usize {
    4
}
pub fn max_workers_total() -> usize {
    64
}
pub fn drain_settle_secs() -> u64 {
    5
}
pub fn drain_timeout_secs() -> u64 {
    300
}
