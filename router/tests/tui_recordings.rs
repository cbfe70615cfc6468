//! The real TUI must work through the host-access policy unchanged: every request of the
//! recorded TUI sessions passes the default per-tenant-uid policy once its paths are the
//! tenant's own. `data/tui-client-requests.jsonl` holds the client→server requests of the
//! recordings made for docs/app-server-facts.md §6 (codex 0.171.0, ws and wss), so the suite does
//! not depend on that folder.

use std::path::PathBuf;

use router::policy::{Decision, HostAccessPolicy, TenantRoots};
use serde_json::Value;

#[test]
fn recorded_tui_requests_pass_the_default_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let workspace = tmp.path().join("workspaces/acme");
    let home = tmp.path().join("tenants/acme");
    std::fs::create_dir_all(&workspace).unwrap();
    std::fs::create_dir_all(&home).unwrap();
    let roots = TenantRoots::new(std::slice::from_ref(&workspace), &home).unwrap();
    let policy = HostAccessPolicy::defaults(false);
    let data =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tui-client-requests.jsonl");
    let mut checked = 0;
    for line in std::fs::read_to_string(&data).unwrap().lines() {
        let line = line
            .replace("/home/dev/project", &workspace.display().to_string())
            .replace("/home/dev/.codex", &home.display().to_string());
        let rec: Value = serde_json::from_str(&line).unwrap();
        let method = rec["msg"]["method"].as_str().unwrap();
        let params = rec["msg"]
            .get("params")
            .map(|p| serde_json::value::RawValue::from_string(p.to_string()).unwrap());
        if let Decision::Deny(d) = policy.check(method, params.as_deref(), &roots) {
            panic!(
                "{}: the TUI's {method} would be refused: {}\n{}",
                rec["recording"],
                d.message(),
                rec["msg"]["params"]
            );
        }
        checked += 1;
    }
    assert!(
        checked > 100,
        "only {checked} requests in {}",
        data.display()
    );
}
