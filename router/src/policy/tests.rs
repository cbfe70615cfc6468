use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tempfile::TempDir;

use super::*;

/// `<tmp>/state/{workspaces,tenants}/{acme,beta}` plus a key outside every tenant.
struct Fixture {
    _tmp: TempDir,
    root: PathBuf,
    roots: TenantRoots,
}

impl Fixture {
    fn new() -> Fixture {
        let tmp = TempDir::new().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        for d in [
            "state/workspaces/acme/src",
            "state/workspaces/beta",
            "state/tenants/acme/sessions/2026/11/30",
            "state/tenants/beta/sessions",
            "secret",
        ] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        for f in [
            "state/workspaces/acme/src/main.rs",
            "state/workspaces/beta/code.rs",
            "state/tenants/acme/auth.json",
            "state/tenants/acme/config.toml",
            "state/tenants/acme/sessions/2026/11/30/rollout-x.jsonl",
            "state/tenants/beta/auth.json",
            "state/tenants/beta/sessions/rollout-b.jsonl",
            "secret/tls.key",
        ] {
            fs::write(root.join(f), "x").unwrap();
        }
        let roots = TenantRoots::new(
            &[root.join("state/workspaces/acme")],
            &root.join("state/tenants/acme"),
        )
        .unwrap();
        Fixture {
            _tmp: tmp,
            root,
            roots,
        }
    }

    fn p(&self, rel: &str) -> String {
        self.root.join(rel).to_string_lossy().into_owned()
    }

    fn ws(&self, rel: &str) -> String {
        self.p(&format!("state/workspaces/acme/{rel}"))
    }
}

fn raw(v: &Value) -> Box<RawValue> {
    RawValue::from_string(v.to_string()).unwrap()
}

fn decide(policy: &HostAccessPolicy, method: &str, params: Value, roots: &TenantRoots) -> Decision {
    policy.check(method, Some(&raw(&params)), roots)
}

fn root_policy() -> HostAccessPolicy {
    HostAccessPolicy::defaults(false)
}

#[track_caller]
fn assert_denied(d: &Decision, class: Class, needle: &str) {
    match d {
        Decision::Deny(denial) => {
            assert_eq!(denial.class, class, "{denial:?}");
            assert!(denial.message().contains(needle), "{}", denial.message());
        }
        other => panic!("expected a denial, got {other:?}"),
    }
}

#[test]
fn fs_paths_inside_the_workspace_are_allowed() {
    let f = Fixture::new();
    let p = root_policy();
    for path in [
        f.ws("src/main.rs"),
        f.ws("src"),
        f.ws("."),
        f.ws("src/../src/main.rs"),
    ] {
        assert_eq!(
            decide(&p, "fs/readFile", json!({ "path": path }), &f.roots),
            Decision::Allow,
            "{path}"
        );
    }
    // A file (and directories) that do not exist yet, in an allowed directory.
    for path in [f.ws("src/new.rs"), f.ws("new/deeper/file.txt")] {
        assert_eq!(
            decide(
                &p,
                "fs/writeFile",
                json!({ "path": path, "dataBase64": "" }),
                &f.roots
            ),
            Decision::Allow,
            "{path}"
        );
    }
    assert_eq!(
        decide(
            &p,
            "fs/copy",
            json!({ "sourcePath": f.ws("src/main.rs"), "destinationPath": f.ws("copy.rs") }),
            &f.roots
        ),
        Decision::Allow
    );
    assert_eq!(
        decide(&p, "fs/unwatch", json!({ "watchId": "w" }), &f.roots),
        Decision::Allow
    );
}

#[test]
fn fs_escapes_are_denied() {
    let f = Fixture::new();
    let p = root_policy();
    let escapes = [
        f.ws("../beta/code.rs"), // .. into another tenant's workspace
        f.ws("src/../../../tenants/beta/auth.json"), // .. into another tenant's home
        f.p("state/workspaces/beta/code.rs"), // another tenant's workspace
        f.p("state/tenants/acme/auth.json"), // the tenant's own CODEX_HOME
        f.p("state/tenants/acme/config.toml"),
        f.p("secret/tls.key"), // codex-fleet's key
        "/etc/passwd".to_owned(),
        f.ws("nope/../../beta/x"), // .. inside the part that does not exist
        "../beta/code.rs".to_owned(), // relative, from the workspace
        String::new(),
    ];
    for path in escapes {
        assert_denied(
            &decide(&p, "fs/readFile", json!({ "path": path }), &f.roots),
            Class::Fs,
            "`path`",
        );
    }
    // Either end of a copy.
    assert_denied(
        &decide(
            &p,
            "fs/copy",
            json!({ "sourcePath": f.p("secret/tls.key"), "destinationPath": f.ws("k") }),
            &f.roots,
        ),
        Class::Fs,
        "`sourcePath`",
    );
}

#[test]
fn symlink_escapes_are_denied() {
    let f = Fixture::new();
    let p = root_policy();
    symlink(f.p("state/tenants/beta"), f.ws("beta-home")).unwrap();
    symlink(f.p("secret/tls.key"), f.ws("key")).unwrap();
    symlink(f.p("secret/not-yet"), f.ws("dangling")).unwrap();
    symlink(f.ws("src"), f.ws("src-link")).unwrap();
    for path in [
        f.ws("beta-home/auth.json"),
        f.ws("beta-home"),
        f.ws("key"),
        f.ws("beta-home/new-file"),
    ] {
        assert_denied(
            &decide(&p, "fs/readFile", json!({ "path": path }), &f.roots),
            Class::Fs,
            "outside",
        );
    }
    // Writing through a dangling link would create its target outside.
    assert_denied(
        &decide(
            &p,
            "fs/writeFile",
            json!({ "path": f.ws("dangling"), "dataBase64": "" }),
            &f.roots,
        ),
        Class::Fs,
        "dangling symlink",
    );
    // A link that stays inside is fine.
    assert_eq!(
        decide(
            &p,
            "fs/readFile",
            json!({ "path": f.ws("src-link/main.rs") }),
            &f.roots
        ),
        Decision::Allow
    );
}

#[test]
fn malformed_params_are_denied_not_guessed() {
    let f = Fixture::new();
    let p = root_policy();
    let dup = format!(
        r#"{{"path":{:?},"path":{:?}}}"#,
        f.ws("src/main.rs"),
        f.p("secret/tls.key")
    );
    let d = p.check(
        "fs/readFile",
        Some(&RawValue::from_string(dup).unwrap()),
        &f.roots,
    );
    assert_denied(&d, Class::Fs, "duplicate key");
    // Positional params would deserialize into the worker's struct.
    assert_denied(
        &decide(&p, "fs/readFile", json!([f.p("secret/tls.key")]), &f.roots),
        Class::Fs,
        "must be an object",
    );
    // A field of the wrong type is malformed, not refused: `-32600` as app-server words it.
    assert_eq!(
        decide(&p, "fs/readFile", json!({ "path": 7 }), &f.roots),
        Decision::Invalid("Invalid request: invalid type: integer `7`, expected a string".into())
    );
    assert_eq!(
        decide(&p, "fs/readFile", json!("/etc/passwd"), &f.roots),
        Decision::Invalid(
            "Invalid request: invalid type: string \"/etc/passwd\", expected struct FsReadFileParams"
                .into()
        )
    );
    // A path-like field the table does not know (an alias, a new schema field).
    assert_denied(
        &decide(
            &p,
            "fs/readFile",
            json!({ "path": f.ws("src/main.rs"), "file_path": "/etc/passwd" }),
            &f.roots,
        ),
        Class::Fs,
        "file_path",
    );
}

#[test]
fn command_exec_is_confined_to_the_roots_and_the_sandbox() {
    let f = Fixture::new();
    let p = root_policy();
    let cmd = |extra: Value| {
        let mut v = json!({ "command": ["git", "status"] });
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    };
    // Neither sandboxPolicy nor permissionProfile: workspace-write over the roots is filled in.
    let Decision::Rewrite(text) = decide(
        &p,
        "command/exec",
        cmd(json!({ "cwd": f.ws("src") })),
        &f.roots,
    ) else {
        panic!("expected a rewrite");
    };
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["command"], json!(["git", "status"]));
    assert_eq!(v["cwd"], f.ws("src"));
    assert_eq!(
        v["sandboxPolicy"],
        json!({ "type": "workspaceWrite", "writableRoots": [f.ws("").trim_end_matches('/')], "networkAccess": false })
    );
    // Narrow enough as given.
    for extra in [
        json!({ "cwd": null, "sandboxPolicy": { "type": "readOnly" } }),
        json!({ "sandboxPolicy": { "type": "workspaceWrite", "writableRoots": [f.ws("src")] } }),
        json!({ "permissionProfile": ":read-only" }),
        json!({ "permissionProfile": ":workspace", "sandboxPolicy": null }),
    ] {
        assert_eq!(
            decide(&p, "command/exec", cmd(extra.clone()), &f.roots),
            Decision::Allow,
            "{extra}"
        );
    }
    // Wider than workspace-write, or outside the roots.
    for (extra, needle) in [
        (
            json!({ "sandboxPolicy": { "type": "dangerFullAccess" } }),
            "wider",
        ),
        (
            json!({ "sandboxPolicy": { "type": "externalSandbox", "networkAccess": "enabled" } }),
            "network",
        ),
        (
            json!({ "sandboxPolicy": { "type": "externalSandbox" } }),
            "wider",
        ),
        (
            json!({ "sandboxPolicy": { "type": "readOnly", "networkAccess": true } }),
            "network",
        ),
        (
            json!({ "sandboxPolicy": { "type": "workspaceWrite", "writableRoots": ["/"] } }),
            "writableRoots",
        ),
        (
            json!({ "permissionProfile": ":danger-full-access" }),
            "profile",
        ),
        (json!({ "permissionProfile": "my-wide-profile" }), "profile"),
        (json!({ "cwd": f.p("state/workspaces/beta") }), "`cwd`"),
    ] {
        assert_denied(
            &decide(&p, "command/exec", cmd(extra.clone()), &f.roots),
            Class::CommandExec,
            needle,
        );
    }
    // A sandbox policy that is not an object is malformed, and still never forwarded.
    assert!(matches!(
        decide(&p, "command/exec", cmd(json!({ "sandboxPolicy": "dangerFullAccess" })), &f.roots),
        Decision::Invalid(m) if m.starts_with("Invalid request: invalid type: string")
    ));
    // Follow-ups act on the connection's own processes.
    assert_eq!(
        decide(
            &p,
            "command/exec/terminate",
            json!({ "processId": "p" }),
            &f.roots
        ),
        Decision::Allow
    );
}

#[test]
fn thread_and_turn_working_directories_stay_inside() {
    let f = Fixture::new();
    let p = root_policy();
    // What the TUI and `codex exec` send.
    for (method, params) in [
        (
            "thread/start",
            json!({ "cwd": null, "sandbox": "read-only", "config": {}, "ephemeral": false }),
        ),
        (
            "thread/start",
            json!({ "cwd": f.ws("src"), "runtimeWorkspaceRoots": [f.ws("")], "permissions": ":read-only",
            "config": { "features.some_flag": false, "model": "m" } }),
        ),
        (
            "turn/start",
            json!({ "threadId": "t", "input": [], "cwd": f.ws("src"), "rootTurnId": null,
            "sandboxPolicy": { "type": "workspaceWrite" } }),
        ),
        (
            "thread/resume",
            json!({ "threadId": "t", "path": f.p("state/tenants/acme/sessions/2026/11/30/rollout-x.jsonl") }),
        ),
        ("thread/fork", json!({ "threadId": "t", "cwd": null })),
        (
            "thread/settings/update",
            json!({ "threadId": "t", "cwd": f.ws("") }),
        ),
    ] {
        assert_eq!(
            decide(&p, method, params.clone(), &f.roots),
            Decision::Allow,
            "{method} {params}"
        );
    }
    for (method, params, needle) in [
        (
            "thread/start",
            json!({ "cwd": f.p("state/workspaces/beta") }),
            "`cwd`",
        ),
        ("thread/start", json!({ "cwd": "/" }), "`cwd`"),
        (
            "thread/start",
            json!({ "runtimeWorkspaceRoots": [f.ws(""), "/"] }),
            "runtimeWorkspaceRoots",
        ),
        (
            "thread/start",
            json!({ "sandbox": "danger-full-access" }),
            "danger-full-access",
        ),
        (
            "thread/start",
            json!({ "permissions": ":danger-full-access" }),
            "profile",
        ),
        (
            "thread/start",
            json!({ "config": { "sandbox_mode": "danger-full-access" } }),
            "sandbox_mode",
        ),
        (
            "thread/start",
            json!({ "config": { "mcp_servers.x.command": "sh" } }),
            "mcp_servers",
        ),
        (
            "thread/start",
            json!({ "environments": [{ "environmentId": "e", "cwd": "/etc" }] }),
            "environments.cwd",
        ),
        (
            "thread/start",
            json!({ "selectedCapabilityRoots": [{ "id": "r", "location": { "type": "environment", "environmentId": "e", "path": "/" } }] }),
            "selectedCapabilityRoots",
        ),
        (
            "thread/resume",
            json!({ "threadId": "t", "path": f.p("state/tenants/beta/sessions/rollout-b.jsonl") }),
            "`path`",
        ),
        (
            "thread/resume",
            json!({ "threadId": "t", "path": f.p("state/tenants/acme/auth.json") }),
            "`path`",
        ),
        // Relative: the check would read it from CODEX_HOME, the worker from its workspace.
        (
            "thread/resume",
            json!({ "threadId": "t", "path": "sessions/2026/11/30/rollout-x.jsonl" }),
            "must be an absolute path",
        ),
        (
            "thread/fork",
            json!({ "threadId": "t", "sandbox": "danger-full-access" }),
            "danger-full-access",
        ),
        (
            "turn/start",
            json!({ "threadId": "t", "input": [], "cwd": f.p("secret") }),
            "`cwd`",
        ),
        (
            "turn/start",
            json!({ "threadId": "t", "input": [], "sandboxPolicy": { "type": "dangerFullAccess" } }),
            "wider",
        ),
        (
            "thread/settings/update",
            json!({ "threadId": "t", "sandboxPolicy": { "type": "externalSandbox" } }),
            "wider",
        ),
    ] {
        assert_denied(
            &decide(&p, method, params, &f.roots),
            Class::Workspace,
            needle,
        );
    }
}

#[test]
fn discovery_cwds_outside_the_roots_are_dropped() {
    let f = Fixture::new();
    let p = root_policy();
    // The TUI sends its own local cwd; on the worker's host it is dropped, not refused.
    let Decision::Rewrite(text) = decide(
        &p,
        "hooks/list",
        json!({ "cwds": ["/home/alice/project", f.ws("src")], "threadId": null }),
        &f.roots,
    ) else {
        panic!("expected a rewrite");
    };
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v, json!({ "cwds": [f.ws("src")], "threadId": null }));
    let Decision::Rewrite(text) = decide(
        &p,
        "config/read",
        json!({ "includeLayers": true, "cwd": f.p("state/workspaces/beta") }),
        &f.roots,
    ) else {
        panic!("expected a rewrite");
    };
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({ "includeLayers": true })
    );
    // Inside (relative paths start at the workspace, like the worker's cwd): unchanged.
    assert_eq!(
        decide(
            &p,
            "config/read",
            json!({ "includeLayers": true, "cwd": "." }),
            &f.roots
        ),
        Decision::Allow
    );
    assert_eq!(
        decide(&p, "skills/list", json!({ "forceReload": true }), &f.roots),
        Decision::Allow
    );
}

#[test]
fn shared_uid_defaults_deny_host_access() {
    let f = Fixture::new();
    let p = HostAccessPolicy::defaults(true);
    for (method, params, class) in [
        (
            "fs/readFile",
            json!({ "path": f.ws("src/main.rs") }),
            Class::Fs,
        ),
        (
            "fuzzyFileSearch",
            json!({ "query": "x", "roots": [f.ws("")] }),
            Class::Fs,
        ),
        (
            "command/exec",
            json!({ "command": ["ls"] }),
            Class::CommandExec,
        ),
        (
            "process/spawn",
            json!({ "command": ["ls"], "cwd": f.ws(""), "processHandle": "h" }),
            Class::Process,
        ),
        (
            "thread/shellCommand",
            json!({ "threadId": "t", "command": "ls" }),
            Class::ShellCommand,
        ),
        (
            "config/value/write",
            json!({ "keyPath": "model", "value": "m", "mergeStrategy": "replace" }),
            Class::ConfigWrite,
        ),
        (
            "account/login/start",
            json!({ "type": "apiKey" }),
            Class::Account,
        ),
        ("account/logout", Value::Null, Class::Account),
        (
            "plugin/install",
            json!({ "pluginName": "p" }),
            Class::Plugins,
        ),
        ("marketplace/add", json!({ "source": "x" }), Class::Plugins),
    ] {
        let d = decide(&p, method, params, &f.roots);
        assert_denied(&d, class, "disabled for this tenant");
    }
    // Threads still work, confined.
    assert_eq!(
        decide(&p, "thread/start", json!({ "cwd": null }), &f.roots),
        Decision::Allow
    );
    // Methods that never reach the host pass without their params being read.
    assert_eq!(p.check("thread/list", None, &f.roots), Decision::Allow);
    assert_eq!(
        decide(&p, "model/list", json!([1, 2]), &f.roots),
        Decision::Allow
    );
    // Per-tenant uids: fs and command/exec are confined, unsandboxed classes still denied.
    let root = root_policy();
    assert_eq!(root.mode(Class::Fs), Mode::Confine);
    assert_eq!(root.mode(Class::CommandExec), Mode::Confine);
    assert_eq!(root.mode(Class::Process), Mode::Deny);
    assert_eq!(root.mode(Class::ShellCommand), Mode::Deny);
}

#[test]
fn policy_config_overrides_defaults_and_refuses_nonsense() {
    let cfg: PolicyConfig =
        toml::from_str("fs = \"confine\"\nshell_command = \"allow\"\n").unwrap();
    let p = cfg.resolve(true).unwrap();
    assert_eq!(p.mode(Class::Fs), Mode::Confine);
    assert_eq!(p.mode(Class::ShellCommand), Mode::Allow);
    assert_eq!(p.mode(Class::CommandExec), Mode::Deny);
    assert!(toml::from_str::<PolicyConfig>("fss = \"allow\"\n").is_err());
    assert!(toml::from_str::<PolicyConfig>("fs = \"maybe\"\n").is_err());
    let confine_account: PolicyConfig = toml::from_str("account = \"confine\"\n").unwrap();
    assert_eq!(
        confine_account.resolve(false).unwrap_err(),
        PolicyError::CannotConfine("account")
    );
    let deny_ws: PolicyConfig = toml::from_str("workspace = \"deny\"\n").unwrap();
    assert_eq!(
        deny_ws.resolve(false).unwrap_err(),
        PolicyError::CannotDenyWorkspace
    );
    assert_eq!(
        PolicyConfig::default().resolve(false).unwrap(),
        root_policy()
    );
    // Allowing a class skips its checks.
    let open: PolicyConfig = toml::from_str("fs = \"allow\"\n").unwrap();
    let f = Fixture::new();
    assert_eq!(
        decide(
            &open.resolve(false).unwrap(),
            "fs/readFile",
            json!({ "path": "/etc/passwd" }),
            &f.roots
        ),
        Decision::Allow
    );
}

#[test]
fn the_error_has_the_documented_shape() {
    let f = Fixture::new();
    let Decision::Deny(denial) = decide(
        &HostAccessPolicy::defaults(true),
        "fs/readFile",
        json!({ "path": "/x" }),
        &f.roots,
    ) else {
        panic!()
    };
    let v: Value = serde_json::from_str(&denial.to_error_response(&RequestId::Int(9))).unwrap();
    assert_eq!(
        v,
        json!({ "id": 9, "error": {
            "code": -32003,
            "message": "Host access denied by policy: fs/readFile is disabled for this tenant",
            "data": { "reason": "hostAccessDenied", "policy": "fs", "method": "fs/readFile" }
        }})
    );
    // Refusals name the field, never the resolved path.
    symlink(f.p("secret"), f.ws("s")).unwrap();
    let Decision::Deny(d) = decide(
        &root_policy(),
        "fs/readFile",
        json!({ "path": f.ws("s/tls.key") }),
        &f.roots,
    ) else {
        panic!()
    };
    assert_eq!(
        d.message(),
        "Host access denied by policy: fs/readFile `path` is outside the tenant's workspace"
    );
    assert_eq!(d.to_error_data()["policy"], "fs");
}

#[test]
fn every_class_is_reachable_and_named() {
    for (method, class, name) in [
        ("fs/watch", Class::Fs, "fs"),
        ("command/exec/write", Class::CommandExec, "command_exec"),
        ("process/kill", Class::Process, "process"),
        ("thread/shellCommand", Class::ShellCommand, "shell_command"),
        (
            "experimentalFeature/enablement/set",
            Class::ConfigWrite,
            "config_write",
        ),
        ("accountSession/switch", Class::Account, "account"),
        ("plugin/uninstall", Class::Plugins, "plugins"),
        ("turn/start", Class::Workspace, "workspace"),
        (
            "remoteControl/enable",
            Class::RemoteControl,
            "remote_control",
        ),
        ("mcpServer/tool/call", Class::Mcp, "mcp"),
        ("memory/reset", Class::ConfigWrite, "config_write"),
        ("mcpServer/oauth/login", Class::Account, "account"),
        ("no/suchMethod", Class::Unclassified, "unclassified"),
    ] {
        assert_eq!(Class::of(method), Some(class), "{method}");
        assert_eq!(class.as_str(), name);
        assert_eq!(serde_json::to_value(class).unwrap(), name);
    }
    assert_eq!(Class::of("thread/read"), None);
    assert_eq!(Class::of("account/read"), None);
}

#[test]
fn roots_need_a_workspace_and_exclusions_win() {
    let f = Fixture::new();
    assert!(TenantRoots::new(&[], Path::new("/")).is_err());
    let wide = TenantRoots::new(&[f.root.join("state")], &f.root.join("state/tenants/acme"))
        .unwrap()
        .exclude(&f.root.join("state/tenants/beta"));
    assert!(wide.check(&f.ws("src/main.rs")).is_ok());
    assert_eq!(
        wide.check(&f.p("state/tenants/acme/auth.json")),
        Err(PathError::Outside)
    );
    assert_eq!(
        wide.check(&f.p("state/tenants/beta/auth.json")),
        Err(PathError::Outside)
    );
}

#[test]
fn turn_inputs_may_only_name_files_inside() {
    let f = Fixture::new();
    let p = root_policy();
    fs::create_dir_all(f.p("state/tenants/acme/skills/lint")).unwrap();
    fs::write(f.p("state/tenants/acme/skills/lint/SKILL.md"), "x").unwrap();
    let turn = |input: Value| json!({ "threadId": "t", "input": [ { "type": "text", "text": "hi" }, input ] });
    for input in [
        json!({ "type": "localImage", "path": f.ws("src/main.rs") }),
        json!({ "type": "skill", "name": "lint", "path": f.p("state/tenants/acme/skills/lint/SKILL.md") }),
        json!({ "type": "mention", "name": "app", "path": "app://calendar" }),
        json!({ "type": "image", "url": "https://example.com/x.png" }),
    ] {
        assert_eq!(
            decide(&p, "turn/start", turn(input.clone()), &f.roots),
            Decision::Allow,
            "{input}"
        );
    }
    for (method, input) in [
        (
            "turn/start",
            json!({ "type": "localImage", "path": f.p("secret/tls.key") }),
        ),
        (
            "turn/steer",
            json!({ "type": "localAudio", "path": f.p("state/workspaces/beta/code.rs") }),
        ),
        (
            "thread/queue/add",
            json!({ "type": "skill", "name": "x", "path": f.p("state/tenants/acme/auth.json") }),
        ),
        (
            "thread/queue/update",
            json!({ "type": "mention", "name": "x", "path": f.p("state/tenants/beta/auth.json") }),
        ),
        (
            "turn/start",
            json!({ "type": "skill", "name": "x", "path": f.p("state/tenants/beta/sessions/rollout-b.jsonl") }),
        ),
    ] {
        assert_denied(
            &decide(&p, method, turn(input), &f.roots),
            Class::Workspace,
            "`input`",
        );
    }
}

#[test]
fn a_rewrite_becomes_a_request_with_the_same_id() {
    let out =
        rewritten_request(&RequestId::Str("r1".into()), "hooks/list", r#"{"cwds":[]}"#).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        json!({ "id": "r1", "method": "hooks/list", "params": { "cwds": [] } })
    );
    assert_eq!(rewritten_request(&RequestId::Int(1), "m", "{nope"), None);
}

/// The longest existing ancestor as `resolve` found it before it searched by halves: walking up
/// from the path one ancestor at a time.
fn walked(path: &str, base: &Path) -> Result<PathBuf, PathError> {
    if path.is_empty() || path.contains('\0') {
        return Err(PathError::Unresolvable);
    }
    let full = base.join(path);
    for ancestor in full.ancestors() {
        match fs::canonicalize(ancestor) {
            Ok(canonical) => {
                let mut out = canonical;
                let rest = full.strip_prefix(ancestor).unwrap();
                let mut first = true;
                for c in rest.components() {
                    match c {
                        std::path::Component::Normal(n) => {
                            out.push(n);
                            if first && fs::symlink_metadata(&out).is_ok() {
                                return Err(PathError::DanglingSymlink);
                            }
                            first = false;
                        }
                        std::path::Component::CurDir => {}
                        std::path::Component::ParentDir => return Err(PathError::DotDot),
                        _ => return Err(PathError::Unresolvable),
                    }
                }
                return Ok(out);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return Err(PathError::Unresolvable),
        }
    }
    Err(PathError::Unresolvable)
}

#[test]
fn resolve_finds_the_longest_existing_ancestor_as_a_walk_up_would() {
    let f = Fixture::new();
    let ws = PathBuf::from(f.ws(""));
    let deep = (0..40)
        .map(|i| format!("d{i}"))
        .collect::<Vec<_>>()
        .join("/");
    fs::create_dir_all(ws.join(&deep)).unwrap();
    symlink(ws.join("src"), ws.join("to-src")).unwrap();
    symlink(ws.join("nowhere"), ws.join("dangling")).unwrap();
    symlink(ws.join("loop-b"), ws.join("loop-a")).unwrap();
    symlink(ws.join("loop-a"), ws.join("loop-b")).unwrap();
    let missing = "m/".repeat(300);
    let paths = [
        "src/main.rs".to_owned(),
        "src/new.rs".to_owned(),
        "src/a/b/c/new.rs".to_owned(),
        format!("{deep}/x"),
        format!("{deep}/x/y/z"),
        format!("{deep}/{missing}"),
        missing.clone(),
        "to-src/main.rs".to_owned(),
        "to-src/later/x.rs".to_owned(),
        "dangling".to_owned(),
        "dangling/x".to_owned(),
        "src/main.rs/inside".to_owned(),
        "src/main.rs/inside/deeper".to_owned(),
        "missing/../escape".to_owned(),
        "src/../../beta/code.rs".to_owned(),
        "loop-a/x".to_owned(),
        "/".to_owned(),
        f.p("secret/tls.key"),
        f.p("no/such/root/at/all"),
        "./src/./main.rs".to_owned(),
        String::new(),
    ];
    for path in &paths {
        assert_eq!(resolve(path, &ws), walked(path, &ws), "{path:?}");
    }
}

#[test]
fn a_check_too_costly_for_a_runtime_thread_is_handed_off_and_answers_the_same() {
    let f = Fixture::new();
    let p = root_policy();
    let turn = |paths: &[String]| {
        let input: Vec<Value> = paths
            .iter()
            .map(|path| json!({ "type": "localImage", "path": path }))
            .collect();
        raw(&json!({ "threadId": "t", "input": input }))
    };
    let inline = |params: &RawValue| p.check_inline("turn/start", Some(params), &f.roots);
    let full = |params: &RawValue| p.check("turn/start", Some(params), &f.roots);

    // An ordinary request is decided inline, as the full check decides it.
    let ordinary = turn(&[f.ws("src/main.rs"), "pictures/new.png".to_owned()]);
    assert_eq!(inline(&ordinary), Some(Decision::Allow));
    let outside = turn(&[f.ws("src/main.rs"), f.p("secret/tls.key")]);
    assert_eq!(inline(&outside), Some(full(&outside)));
    assert_denied(&full(&outside), Class::Workspace, "`input`");

    // Params over the inline size are never checked inline; the full check still answers.
    let many: Vec<String> = (0..INLINE_PARAMS_BYTES / 20)
        .map(|i| format!("p/{i}.png"))
        .collect();
    let big = turn(&many);
    assert!(big.get().len() > INLINE_PARAMS_BYTES);
    assert_eq!(inline(&big), None);
    assert_eq!(full(&big), Decision::Allow);
    let mut many_then_outside = many.clone();
    many_then_outside.push(f.p("secret/tls.key"));
    assert_denied(
        &full(&turn(&many_then_outside)),
        Class::Workspace,
        "`input`",
    );
    // The size alone does not hand off a method that is not confined.
    let listed = raw(&json!({ "cursor": "x".repeat(INLINE_PARAMS_BYTES) }));
    assert_eq!(
        p.check_inline("thread/list", Some(&listed), &f.roots),
        Some(Decision::Allow)
    );

    // Small params naming more path components than the inline budget: handed off, and after
    // that the thread's checks are unlimited again (the full check here is not cut short).
    let costly: Vec<String> = (0..1000).map(|i| format!("a/b/c/{i}.png")).collect();
    let costly = turn(&costly);
    assert!(costly.get().len() < INLINE_PARAMS_BYTES);
    assert_eq!(inline(&costly), None);
    assert_eq!(full(&costly), Decision::Allow);
    // One path through a deep tree that exists: a lookup a component, more than the inline
    // budget.
    let deep = "d/".repeat(INLINE_PATH_LOOKUPS);
    fs::create_dir_all(Path::new(&f.ws("")).join(&deep)).unwrap();
    let one_deep = turn(&[format!("{deep}x.png")]);
    assert_eq!(inline(&one_deep), None);
    assert_eq!(full(&one_deep), Decision::Allow);
    // A path of thousands of components that stops existing at the first is cheap to resolve.
    let missing = turn(&["m/".repeat(INLINE_PATH_LOOKUPS)]);
    assert_eq!(inline(&missing), Some(Decision::Allow));
    assert_eq!(inline(&ordinary), Some(Decision::Allow));
}

/// [`paths::canonical`] walks a path as the kernel's `realpath` does: the same answer, or an
/// error of the same kind (missing or not), for symlinks relative and absolute, chained, through
/// `..`, to files and to the root, dangling, looping, 40 deep and 41 deep, and files used as
/// directories.
#[test]
fn canonical_resolves_as_realpath_does() {
    let f = Fixture::new();
    let ws = PathBuf::from(f.ws(""));
    fs::create_dir_all(ws.join("a/b/c")).unwrap();
    fs::write(ws.join("a/b/c/file"), "x").unwrap();
    for (link, target) in [
        ("rel", "a/b"),
        ("abs", ws.join("a/b/c").to_str().unwrap()),
        ("chain", "rel/c/../c"),
        ("up", "a/b/../../a"),
        ("to-file", "a/b/c/file"),
        ("to-root", "/"),
        ("to-parent", ".."),
        ("dangling", "nowhere/at/all"),
        ("loop-a", "loop-b"),
        ("loop-b", "loop-a"),
        ("a/b/sideways", "../b/c"),
        ("to-file-slash", "a/b/c/file/"),
        ("to-dir-slash", "a/b/c/."),
    ] {
        symlink(target, ws.join(link)).unwrap();
    }
    // Chains of 40 links (followed) and 41 (too many, as the kernel says).
    for n in [40, 41] {
        for i in 0..n {
            let next = if i + 1 == n {
                "a".to_owned()
            } else {
                format!("c{n}-{}", i + 1)
            };
            symlink(next, ws.join(format!("c{n}-{i}"))).unwrap();
        }
    }
    let paths = [
        "a/b/c/file",
        "rel/c/file",
        "abs/file",
        "chain/file",
        "up/b/c",
        "to-file",
        "to-file/x",
        "a/b/c/file/.",
        "a/b/c/file/..",
        "a/b/c/file/",
        "a/b/c/",
        "to-file/",
        "to-file-slash",
        "to-dir-slash/file",
        "to-root/etc",
        "to-parent",
        "to-parent/acme/a",
        "dangling",
        "dangling/x",
        "loop-a",
        "loop-a/x",
        "a/b/sideways/file",
        "a/b/sideways/../../b/./c",
        "c40-0/b",
        "c41-0/b",
        "a/missing/x",
        "a/b/../../..",
        "./a/./b/",
        "",
    ];
    let kind = |r: &std::io::Result<PathBuf>| match r {
        Ok(p) => Ok(p.clone()),
        Err(e) => Err(e.kind() == std::io::ErrorKind::NotFound),
    };
    for path in paths {
        let full = ws.join(path);
        let ours = paths::canonical(&full);
        let kernel = fs::canonicalize(&full);
        assert_eq!(kind(&ours), kind(&kernel), "{path:?}: {ours:?} {kernel:?}");
    }
    assert!(paths::canonical(&ws.join("c40-0/b")).is_ok());
    assert!(paths::canonical(&ws.join("c41-0/b")).is_err());
}

/// procfs's links mean something else in the worker that opens the path than in the router that
/// checks it (`/proc/self/root` is the worker's root, `…/fd/N` the worker's descriptor): a path
/// through one is unresolvable, so refused, though `realpath` would have found it inside.
#[test]
fn paths_through_procfs_links_are_refused() {
    let f = Fixture::new();
    let inside = f.ws("src/main.rs");
    assert!(f.roots.check(&inside).is_ok());
    let ws = PathBuf::from(f.ws(""));
    symlink("/proc/self/root", ws.join("proc-root")).unwrap();
    let through_ws_link = format!("proc-root{inside}");
    for path in [
        format!("/proc/self/root{inside}"),
        format!("/proc/{}/root{inside}", std::process::id()),
        format!("/dev/fd/../../self/root{inside}"),
        through_ws_link,
    ] {
        assert!(
            fs::canonicalize(ws.join(&path)).is_ok(),
            "realpath resolves {path:?}"
        );
        assert_eq!(
            f.roots.check(&path),
            Err(PathError::Unresolvable),
            "{path:?}"
        );
    }
}

/// A short path through a chain of symlinks whose targets are long (`d/../` × 800, 40 links) is
/// tens of thousands of lookups, though the client wrote one component: the check is charged for
/// every component it walks, `..` included, so it is handed off the runtime (charged by what the
/// client wrote, 6 lookups a path here, 10 of them in a 0.5 KiB `turn/start` ran inline), and a
/// request that needs more than the bound is refused as invalid rather than checked for as long
/// as it takes.
#[test]
fn paths_through_long_symlinks_are_charged_what_resolving_them_costs() {
    let f = Fixture::new();
    let p = root_policy();
    let ws = PathBuf::from(f.ws(""));
    fs::create_dir_all(ws.join("d")).unwrap();
    let long = "d/../".repeat(800);
    for i in 0..40 {
        let next = if i == 39 {
            "d".to_owned()
        } else {
            format!("l{}", i + 1)
        };
        symlink(format!("{long}{next}"), ws.join(format!("l{i}"))).unwrap();
    }
    let turn = |n: usize| {
        let input: Vec<Value> = (0..n)
            .map(|_| json!({ "type": "localImage", "path": "l0" }))
            .collect();
        raw(&json!({ "threadId": "t", "input": input }))
    };
    let small = turn(10);
    assert!(small.get().len() < 2048, "{}", small.get().len());
    assert_eq!(p.check_inline("turn/start", Some(&small), &f.roots), None);
    // Off the runtime it resolves (into the workspace).
    let two = turn(2);
    assert_eq!(p.check("turn/start", Some(&two), &f.roots), Decision::Allow);
    // One path is tens of thousands of lookups (40 links of 1,601 components): a bound of that
    // many takes one, not two.
    let one = turn(1);
    let (answer, lookups) = paths::counted(|| {
        p.decide(
            rules::lookup("turn/start"),
            "turn/start",
            Some(&one),
            &f.roots,
        )
    });
    assert_eq!(answer, Decision::Allow);
    assert!(lookups > 40 * 1601, "{lookups}");
    assert_eq!(
        p.check_within(lookups, "turn/start", Some(&one), &f.roots),
        Decision::Allow
    );
    match p.check_within(lookups, "turn/start", Some(&two), &f.roots) {
        Decision::Invalid(m) => assert!(m.contains("path lookups"), "{m}"),
        other => panic!("{other:?}"),
    }
    // `..` is charged as any component: 80,000 of them as written (240 KB, under the inline
    // size), or at the root of a target, where they move nowhere.
    let ups = turn_of(&format!("{}nope/x", "../".repeat(80_000)));
    assert!(ups.get().len() < INLINE_PARAMS_BYTES);
    assert_eq!(p.check_inline("turn/start", Some(&ups), &f.roots), None);
    let (_, lookups) = paths::counted(|| resolve(&format!("{}x", "../".repeat(1000)), &ws));
    assert!(lookups >= 1000, "{lookups}");
    symlink(
        format!("{}{}", "../".repeat(1300), ws.join("d").display()),
        ws.join("up-and-back"),
    )
    .unwrap();
    let (resolved, lookups) = paths::counted(|| resolve("up-and-back", &ws));
    assert_eq!(resolved, Ok(ws.join("d")));
    assert!(lookups >= 1300, "{lookups}");
}

/// A `turn/start` naming `path` once.
fn turn_of(path: &str) -> Box<RawValue> {
    raw(&json!({ "threadId": "t", "input": [{ "type": "localImage", "path": path }] }))
}
