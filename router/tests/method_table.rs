//! The host-access table must name every client method of the pinned app-server: the method
//! list comes from the binary itself (`codex app-server generate-json-schema --experimental`),
//! so a codex upgrade that adds a method fails here, naming it, instead of the method being
//! refused in production without anyone having decided its class
//! (docs/decisions/0013-parse-once-one-method-table.md).
//!
//! Needs `CODEX_BIN` (the pinned native binary); the test command always sets it.

use std::path::PathBuf;
use std::process::Command;

use proto::placement::Placement;
use router::policy::{Class, Decision, HostAccessPolicy, TenantRoots};
use serde_json::Value;

/// Every `method` enum value of a schema's `oneOf` variants.
fn methods(schema: &Value) -> Vec<String> {
    schema["oneOf"]
        .as_array()
        .expect("a oneOf of message variants")
        .iter()
        .flat_map(|v| {
            v["properties"]["method"]["enum"]
                .as_array()
                .expect("each variant names its method")
                .iter()
                .map(|m| m.as_str().expect("a method name").to_owned())
        })
        .collect()
}

fn generated_schema(file: &str) -> Value {
    let bin = PathBuf::from(
        std::env::var_os("CODEX_BIN")
            .expect("CODEX_BIN must name the pinned codex binary (ops/test.sh sets it)"),
    );
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(&bin)
        .args([
            "app-server",
            "generate-json-schema",
            "--experimental",
            "--out",
        ])
        .arg(out.path())
        .env("CODEX_HOME", out.path())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    assert!(status.success(), "generate-json-schema failed: {status}");
    let text = std::fs::read_to_string(out.path().join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn every_method_of_the_pinned_app_server_has_a_rule() {
    let methods = methods(&generated_schema("ClientRequest.json"));
    // 0.171 with --experimental has 189 (docs/app-server-facts.md §1).
    assert!(methods.len() > 150, "only {} methods", methods.len());
    let missing: Vec<&str> = methods
        .iter()
        .map(String::as_str)
        .filter(|m| !Class::is_classified(m))
        .collect();
    assert!(
        missing.is_empty(),
        "methods of the pinned app-server with no row in router/src/policy/rules.rs \
         (decide each one's class): {missing:?}"
    );
}

#[test]
fn a_method_without_a_rule_is_refused_under_every_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let workspace = tmp.path().join("ws");
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&workspace).unwrap();
    std::fs::create_dir_all(&home).unwrap();
    let roots = TenantRoots::new(std::slice::from_ref(&workspace), &home).unwrap();
    let mut allow_all = router::policy::PolicyConfig::default();
    for mode in [
        &mut allow_all.fs,
        &mut allow_all.command_exec,
        &mut allow_all.process,
        &mut allow_all.shell_command,
        &mut allow_all.config_write,
        &mut allow_all.account,
        &mut allow_all.plugins,
        &mut allow_all.remote_control,
        &mut allow_all.mcp,
        &mut allow_all.workspace,
    ] {
        *mode = Some(router::policy::Mode::Allow);
    }
    for policy in [
        HostAccessPolicy::defaults(false),
        HostAccessPolicy::defaults(true),
        allow_all.resolve(false).unwrap(),
    ] {
        for method in ["mock/experimentalMethod", "getAuthStatus"] {
            let Decision::Deny(d) = policy.check(method, None, &roots) else {
                panic!("{method} passed");
            };
            assert_eq!(d.class, Class::Unclassified);
            assert_eq!(d.to_error_data()["policy"], "unclassified");
        }
        // Unknown to app-server too: its own answer, never forwarded.
        assert_eq!(
            policy.check("thread/notAMethodYet", None, &roots),
            Decision::Invalid(proto::method::unknown_method_message(
                "thread/notAMethodYet"
            ))
        );
    }
}

/// The methods app-server lists when it refuses an unknown one are its schema's, in order, and
/// three legacy ones; each has a row, so only a method app-server does not know gets its
/// unknown-method answer from codex-fleet.
#[test]
fn the_unknown_method_answer_names_the_pinned_app_servers_methods() {
    let schema = methods(&generated_schema("ClientRequest.json"));
    let legacy = ["getConversationSummary", "gitDiffToRemote", "getAuthStatus"];
    let listed: Vec<&str> = proto::method::APP_SERVER_METHODS
        .iter()
        .copied()
        .filter(|m| !legacy.contains(m))
        .collect();
    assert_eq!(listed, schema);
    for m in proto::method::APP_SERVER_METHODS {
        assert!(Class::is_classified(m), "{m} has no row");
    }
}

#[test]
fn client_notifications_are_not_requests_the_table_must_name() {
    // The only client notification is `initialized`; the session forwards notifications
    // without asking the policy, so it needs no row, but a new one should be looked at.
    assert_eq!(
        methods(&generated_schema("ClientNotification.json")),
        ["initialized"]
    );
}

/// Whether a request's params name a thread: `Some(true)` when `threadId` is required,
/// `Some(false)` when it is optional, `None` when there is none.
fn thread_id_param(schema: &Value, variant: &Value) -> Option<bool> {
    let resolve = |v: &Value| -> Value {
        match v["$ref"].as_str() {
            Some(r) => schema["definitions"][r.rsplit('/').next().unwrap_or_default()].clone(),
            None => v.clone(),
        }
    };
    let params = resolve(&variant["properties"]["params"]);
    let mut shapes = vec![params.clone()];
    for key in ["anyOf", "oneOf", "allOf"] {
        shapes.extend(params[key].as_array().into_iter().flatten().map(resolve));
    }
    let has = shapes
        .iter()
        .any(|s| s["properties"].get("threadId").is_some());
    let required = shapes.iter().any(|s| {
        s["required"]
            .as_array()
            .is_some_and(|r| r.iter().any(|k| k == "threadId"))
    });
    has.then_some(required)
}

/// The rows of the pool table in docs/architecture.md: placement name → the methods its row lists.
fn readme_rows() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/architecture.md"
    ))
    .expect("docs/architecture.md");
    let start = readme
        .find("## One app-server per tenant")
        .expect("docs/architecture.md has the section \"One app-server per tenant\"");
    readme[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("### ") && !l.starts_with("## "))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix("**")?.strip_suffix("**")?;
            Some((name.to_owned(), cells.get(2)?.to_string()))
        })
        .collect()
}

/// docs/decisions/0013-parse-once-one-method-table.md: every client method of the pinned app-server
/// is placed (how a tenant's pool answers it as one app-server), consistently with its params (a
/// method naming a thread is routed by it), and the table of docs/architecture.md lists it in its
/// placement's row: a codex upgrade that adds a method fails here until it is placed and
/// documented.
#[test]
fn every_method_of_the_pinned_app_server_is_placed_and_documented() {
    let schema = generated_schema("ClientRequest.json");
    let rows = readme_rows();
    let mut unplaced = Vec::new();
    let mut inconsistent = Vec::new();
    let mut undocumented = Vec::new();
    for variant in schema["oneOf"].as_array().expect("oneOf") {
        let method = variant["properties"]["method"]["enum"][0]
            .as_str()
            .expect("a method name");
        let Some(placement) = Placement::of(method) else {
            unplaced.push(method.to_owned());
            continue;
        };
        let consistent = match thread_id_param(&schema, variant) {
            Some(true) => placement == Placement::Thread,
            Some(false) => placement == Placement::ThreadOrShared,
            None => !matches!(placement, Placement::Thread | Placement::ThreadOrShared),
        };
        if !consistent {
            inconsistent.push(format!("{method} ({})", placement.as_str()));
        }
        let listed = rows.iter().any(|(name, methods)| {
            name == placement.as_str() && methods.contains(&format!("`{method}`"))
        });
        if !listed {
            undocumented.push(format!("{method} ({})", placement.as_str()));
        }
    }
    assert!(
        unplaced.is_empty(),
        "methods of the pinned app-server with no placement in proto/src/placement.rs: {unplaced:?}"
    );
    assert!(
        inconsistent.is_empty(),
        "placements that disagree with the method's threadId param: {inconsistent:?}"
    );
    assert!(
        undocumented.is_empty(),
        "methods missing from their row of docs/architecture.md's \"One app-server per tenant\" table: {undocumented:?}"
    );
    for placement in Placement::ALL {
        assert!(
            rows.iter().any(|(name, _)| name == placement.as_str()),
            "docs/architecture.md has no row for {}",
            placement.as_str()
        );
    }
}
