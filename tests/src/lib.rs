//! End-to-end fixtures: a codex-fleet with real TLS, real `codex app-server` workers and the
//! offline mock model, and a wss JSON-RPC client that speaks the protocol as a real client does.
//!
//! The rooms (everything is re-exported here, so `testkit::X` reaches any of it):
//!
//! - [`fleet`]: the configuration builder, its files, a fleet in this process or as a child.
//! - [`client`]: the wss JSON-RPC client, the real `codex exec --remote`, HTTP and raw HTTPS.
//! - [`process`]: the binaries under test, pids, signals, memory, root-only tests.
//! - [`metrics`]: samples of `/metrics` and ready workers of `/readyz`.
//! - [`wait`]: the step a test waits for a message, polling a condition.
//! - [`split`]: edges in front of static nodes, and the link's PEM files.
//! - [`kube_cluster`], [`fake_kube`]: edges on the kubernetes backend against a fake API server.
//! - [`link`], [`pki`]: straight to a node's link port; a link CA of a test's own.
//! - [`tmux`]: the real Codex TUI in a tmux server of a test's own.

pub mod client;
pub mod contention;
pub mod fake_kube;
pub mod fleet;
pub mod kube_cluster;
pub mod link;
pub mod metrics;
pub mod pki;
pub mod process;
pub mod split;
pub mod tmux;
pub mod wait;

pub use client::{
    agent_text, bad_frames, client_tls, codex_exec_remote, http_get, https_raw, read_all,
    read_request_head, upgrade_request, Client, Unfinished, Upgrade,
};
pub use fleet::{
    init_tracing, pools_ready, read_addresses, ready_workers, Fleet, FleetBuilder, FleetFiles,
    FleetProcess, TenantSpec, FAST_FAULTS,
};
pub use metrics::{metric_at, metric_in, readyz_ready_workers};
pub use mock_model::{reply_text, MockModel, MOCK_USAGE};
pub use process::{
    codex_bin, fleet_bin, open_files, process_alive, processes_running, processes_under,
    root_or_explicit_skip, rss_kib, stop_process, until_open_files_at_most, workers_under,
    LoweredLimit, SKIP_ROOT_TESTS,
};
pub use split::{edge_config_text, free_port, node_config_text, write_link_pki, Node, Split};
pub use tmux::Tmux;
pub use wait::{wait_until, wait_until_async, STEP};
