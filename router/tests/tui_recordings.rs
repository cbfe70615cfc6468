//! The real TUI must work through the host-access policy unchanged: every request of the
//! recorded TUI sessions (shared/reference/recordings) passes the default per-tenant-uid policy
//! once its paths are the tenant's own.

use std::path::PathBuf;

use router::policy::{Decision, HostAccessPolicy, TenantRoots};
use serde_json::Value;

fn recordings() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/recordings");
    assert!(
        dir.is_dir(),
        "{} is missing: the shared/ folder must sit beside the project root",
        dir.display()
    );
    dir
}

#[test]
fn recorded_tui_requests_pass_the_default_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let workspace = tmp.path().join("workspaces/acme");
    let home = tmp.path().join("tenants/acme");
    std::fs::create_dir_all(&workspace).unwrap();
    std::fs::create_dir_all(&home).unwrap();
    let roots = TenantRoots::new(std::slice::from_ref(&workspace), &home).unwrap();
    let policy = HostAccessPolicy::defaults(false);
    let mut checked = 0;
    for entry in std::fs::read_dir(recordings()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "jsonl") {
            continue;
        }
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let line = line
                .replace("/home/dev/project", &workspace.display().to_string())
                .replace("/home/dev/.codex", &home.display().to_string());
            let rec: Value = serde_json::from_str(&line).unwrap();
            if rec["dir"] != "C->S" || rec["msg"]["method"].is_null() || rec["msg"]["id"].is_null()
            {
                continue;
            }
            let method = rec["msg"]["method"].as_str().unwrap();
            let params = rec["msg"]
                .get("params")
                .map(|p| serde_json::value::RawValue::from_string(p.to_string()).unwrap());
            let decision = policy.check(method, params.as_deref(), &roots);
            if let Decision::Deny(d) = decision {
                panic!(
                    "{}: the TUI's {method} would be refused: {}\n{}",
                    path.display(),
                    d.message(),
                    rec["msg"]["params"]
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked > 50,
        "only {checked} requests found in the recordings"
    );
}
