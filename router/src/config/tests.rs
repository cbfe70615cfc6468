//! The configuration's unit tests: roles, defaults (against the docs' key tables) and refusals.

use super::*;

/// SHA-256 of the token `test`, the token of [`minimal`]'s tenant `acme`.
pub(crate) const DIGEST: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// The smallest valid configuration, `extra` after `[workers]`, then tenant `acme` (its
/// table is the last: lines appended to the result belong to it).
pub(crate) fn minimal(extra: &str) -> String {
    format!(
        r#"
[listen]
addr = "127.0.0.1:8443"
tls_cert = "/etc/c.crt"
tls_key = "/etc/c.key"

[workers]
state_dir = "/var/lib/codex-fleet"
{extra}
[[tenants]]
id = "acme"
token_sha256 = ["{DIGEST}"]
"#
    )
}

/// Two tenants on two nodes, with `tail` appended (a `[node]` or `[nodes]` section).
fn two_nodes(tail: &str) -> String {
    let other = DIGEST.replace('a', "b");
    format!(
        r#"
[listen]
addr = "127.0.0.1:8443"
tls_cert = "/etc/c.crt"
tls_key = "/etc/c.key"

[workers]
state_dir = "/var/lib/codex-fleet"

[[tenants]]
id = "acme"
token_sha256 = ["{DIGEST}"]
node = "n1"

[[tenants]]
id = "beta"
token_sha256 = ["{other}"]
node = "n2"
{tail}"#
    )
}

const NODES: &str = "[nodes]\nbackend = \"static\"\nca = \"/l/ca.pem\"\nclient_cert = \"/l/e.crt\"\nclient_key = \"/l/e.key\"\n\
                     [[nodes.static]]\nname = \"n1\"\naddr = \"10.0.0.1:7443\"\n\
                     [[nodes.static]]\nname = \"n2\"\naddr = \"10.0.0.2:7443\"\n";

#[test]
fn the_role_comes_from_the_file_and_a_node_runs_only_its_tenants() {
    let embedded = Config::parse(&minimal("")).expect("valid");
    assert_eq!(embedded.role(), Role::Embedded);
    assert_eq!(embedded.localized().tenants.len(), 1);
    let node = Config::parse(&two_nodes(
        "[node]\nname = \"n2\"\nedge_ca = \"/l/ca.pem\"\n",
    ))
    .expect("valid");
    assert_eq!(node.role(), Role::Node);
    let ids: Vec<_> = node.localized().tenants.into_iter().map(|t| t.id).collect();
    assert_eq!(ids, ["beta"]);
    let edge = Config::parse(&two_nodes(NODES)).expect("valid");
    assert_eq!(edge.role(), Role::Edge);
    let no_workers =
        two_nodes(NODES).replace("[workers]\nstate_dir = \"/var/lib/codex-fleet\"\n", "");
    assert!(
        Config::parse(&no_workers).is_ok(),
        "an edge needs no [workers]"
    );
    let e = Config::parse(
        &minimal("").replace("[workers]\nstate_dir = \"/var/lib/codex-fleet\"\n", ""),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("workers.state_dir is required"), "{e}");
    assert!(
        edge.localized().tenants.is_empty(),
        "an edge runs no worker"
    );
    assert_eq!(
        edge.nodes.as_ref().map(|n| n.connect_timeout_ms),
        Some(2000)
    );
}

#[test]
fn an_edge_needs_every_tenant_on_a_listed_node() {
    let unknown = two_nodes(NODES).replace("node = \"n2\"", "node = \"n9\"");
    let e = Config::parse(&unknown).unwrap_err().to_string();
    assert!(e.contains("\"n9\" is not in [[nodes.static]]"), "{e}");
    let missing = two_nodes(NODES).replace("node = \"n2\"\n", "");
    let e = Config::parse(&missing).unwrap_err().to_string();
    assert!(e.contains("tenants[].node"), "{e}");
    let twice = two_nodes(NODES).replace("name = \"n2\"", "name = \"n1\"");
    assert!(Config::parse(&twice)
        .unwrap_err()
        .to_string()
        .contains("listed twice"));
    let bad_addr = two_nodes(NODES).replace("10.0.0.2:7443", "10.0.0.2");
    assert!(Config::parse(&bad_addr)
        .unwrap_err()
        .to_string()
        .contains("host:port"));
    let both = two_nodes(&format!(
        "{NODES}[node]\nname = \"n1\"\nedge_ca = \"/l/ca.pem\"\n"
    ));
    assert!(Config::parse(&both)
        .unwrap_err()
        .to_string()
        .contains("one"));
}

#[test]
fn minimal_config_gets_defaults() {
    let cfg = Config::parse(&minimal("")).expect("valid");
    assert_eq!(cfg.workers.thread_unload_delay_secs, 1800);
    assert_eq!(cfg.workers.command, ["codex", "app-server"]);
    assert_eq!(cfg.limits.max_message_bytes, 32 << 20);
    assert_eq!(cfg.tenants[0].max_workers, 4);
    assert_eq!(cfg.admin.addr.port(), 9464);
}

#[test]
fn max_processes_is_inherited_or_large_enough_for_app_server() {
    let tenant = |line: &str| format!("{}{line}\n", minimal(""));
    let cfg = Config::parse(&tenant("max_processes = 200")).expect("valid");
    assert_eq!(cfg.tenants[0].max_processes, Some(200));
    assert_eq!(cfg.workers.max_processes, 4096);
    let err = Config::parse(&tenant("max_processes = 10")).unwrap_err();
    assert!(err.to_string().contains("max_processes"), "{err}");
    let err = Config::parse(&minimal("max_processes = 63\n")).unwrap_err();
    assert!(err.to_string().contains("at least 64"), "{err}");
    assert!(Config::parse(&minimal("max_processes = 0\n")).is_ok());
}

#[test]
fn workers_run_at_the_fleets_priority_by_default_and_nice_stays_in_the_kernels_range() {
    assert_eq!(Config::parse(&minimal("")).expect("valid").workers.nice, 0);
    assert_eq!(
        Config::parse(&minimal("nice = 10\n"))
            .expect("valid")
            .workers
            .nice,
        10
    );
    assert_eq!(
        Config::parse(&minimal("nice = 19\n"))
            .expect("valid")
            .workers
            .nice,
        19
    );
    let err = Config::parse(&minimal("nice = 20\n")).unwrap_err();
    assert!(
        err.to_string().contains("workers.nice must be 0 to 19"),
        "{err}"
    );
    assert!(Config::parse(&minimal("nice = -1\n")).is_err());
}

#[test]
fn audit_keep_files_is_one_to_a_thousand() {
    let keep = |n: i64| Config::parse(&minimal(&format!("[audit]\nkeep_files = {n}\n")));
    assert_eq!(keep(1).expect("valid").audit.keep_files, 1);
    assert_eq!(keep(1000).expect("valid").audit.keep_files, 1000);
    for n in [0, 1001] {
        let err = keep(n).unwrap_err();
        assert!(
            err.to_string()
                .contains("audit.keep_files must be 1 to 1000"),
            "{err}"
        );
    }
}

#[test]
fn unknown_keys_are_refused_by_name() {
    let err = Config::parse(&minimal("bogus_key = 1\n")).unwrap_err();
    assert!(err.to_string().contains("bogus_key"), "{err}");
}

#[test]
fn bad_values_are_refused() {
    for (extra, needle) in [
        ("ready_timeout_secs = 0\n", "ready_timeout_secs"),
        ("config_overrides = [\"novalue\"]\n", "key=value"),
        (
            "restart_backoff_initial_ms = 5\nrestart_backoff_max_ms = 1\n",
            "restart_backoff",
        ),
    ] {
        let err = Config::parse(&minimal(extra)).unwrap_err();
        assert!(err.to_string().contains(needle), "{extra}: {err}");
    }
    let bad_digest = minimal("").replace(DIGEST, "abc");
    assert!(Config::parse(&bad_digest)
        .unwrap_err()
        .to_string()
        .contains("64 hex"));
    let bad_id = minimal("").replace("\"acme\"", "\"Acme/..\"");
    assert!(Config::parse(&bad_id)
        .unwrap_err()
        .to_string()
        .contains("tenant id"));
    let long_dir = minimal("").replace("/var/lib/codex-fleet", &format!("/{}", "x".repeat(90)));
    assert!(Config::parse(&long_dir)
        .unwrap_err()
        .to_string()
        .contains("too long"));
}

/// A tenant's uid or gid is never one the host itself uses on every system: a system account's
/// or group's (below 1000), `nobody`'s or `(uid_t) -1`; nor can `workers.uid_range` reach them.
#[test]
fn a_tenant_never_gets_a_host_s_own_uid_or_gid() {
    for (line, needle) in [
        ("uid = 33", "uid 33 is the host's"),
        ("uid = 999", "uid 999 is the host's"),
        ("uid = 65534", "uid 65534 is the host's"),
        ("uid = 4294967295", "uid 4294967295 is the host's"),
        ("gid = 4", "gid 4 is the host's"),
        ("uid = 200000\ngid = 65534", "gid 65534 is the host's"),
    ] {
        let err = Config::parse(&format!("{}{line}\n", minimal("")))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{line}: {err}");
        assert!(err.contains("tenant \"acme\""), "{line}: {err}");
    }
    for range in ["[500, 2000]", "[60000, 70000]", "[999, 1000]"] {
        let err = Config::parse(&minimal(&format!("uid_range = {range}\n")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("reaches the host's ids"), "{range}: {err}");
    }
    for ok in ["uid = 1000\ngid = 1000", "uid = 65533\ngid = 65535"] {
        Config::parse(&format!("{}{ok}\n", minimal(""))).expect(ok);
    }
    Config::parse(&minimal("uid_range = [1000, 65534]\n")).expect("up to nobody's, not it");
}

#[test]
fn limits_take_admission_keys_by_name_and_refuse_unknown_ones() {
    let text = minimal("").replace(
        "[[tenants]]",
        "[limits]\nmax_connections = 7\ntenant_rps = 3\nclient_queue = 64\n\n[[tenants]]",
    );
    let cfg = Config::parse(&text).expect("valid");
    assert_eq!(cfg.limits.admission.max_connections, 7);
    assert_eq!(cfg.limits.admission.tenant_rps, 3);
    assert_eq!(cfg.limits.client_queue, 64);
    assert_eq!(cfg.limits.client_queue_soft_mark(), 32);
    assert_eq!(
        cfg.limits.admission.conn_fps,
        AdmissionConfig::default().conn_fps
    );
    assert_eq!(
        Config::parse(&minimal("")).expect("valid").limits,
        Limits::default()
    );
    let typo = text.replace("tenant_rps", "tenant_rsp");
    let err = Config::parse(&typo).unwrap_err().to_string();
    assert!(err.contains("tenant_rsp"), "{err}");
    let zero = text.replace("tenant_rps = 3", "tenant_rps = 0");
    let err = Config::parse(&zero).unwrap_err().to_string();
    assert!(err.contains("tenant_rps"), "{err}");
}

#[test]
fn queue_byte_bounds_hold_a_largest_message() {
    let with = |lines: &str| {
        minimal("").replace("[[tenants]]", &format!("[limits]\n{lines}\n\n[[tenants]]"))
    };
    let cfg = Config::parse(&with(
        "client_queue_bytes = 2048\ntenant_queue_bytes = 4096\nmax_message_bytes = 1024",
    ))
    .expect("valid");
    assert_eq!(cfg.limits.client_queue_bytes, 2048);
    assert_eq!(cfg.limits.tenant_queue_bytes, 4096);
    let small = with("client_queue_bytes = 1024\nmax_message_bytes = 2048");
    let err = Config::parse(&small).unwrap_err().to_string();
    assert!(err.contains("client_queue_bytes"), "{err}");
    let tenant = with("client_queue_bytes = 67108864\ntenant_queue_bytes = 1048576");
    let err = Config::parse(&tenant).unwrap_err().to_string();
    assert!(err.contains("tenant_queue_bytes"), "{err}");
}

#[test]
fn a_token_names_one_tenant() {
    let two = format!(
        "{}\n[[tenants]]\nid = \"other\"\ntoken_sha256 = [\"{DIGEST}\"]\n",
        minimal("")
    );
    assert!(Config::parse(&two)
        .unwrap_err()
        .to_string()
        .contains("used twice"));
}

/// The defaults the docs' key tables document (docs/configuration.md, and the edge and node
/// keys in docs/architecture.md), for every key with a literal default: a minimal file gets
/// exactly those (not whatever `Default` says), and no documented literal default goes
/// unchecked.
#[test]
fn a_minimal_config_gets_the_documented_defaults() {
    let cfg = Config::parse(&minimal("")).expect("valid");
    let (w, a, t) = (&cfg.workers, &cfg.limits.admission, &cfg.tenants[0]);
    let opt = |v: Option<u64>| v.map_or("unset".to_owned(), |v| v.to_string());
    let actual: Vec<(&str, String)> = vec![
        (
            "listen.handshake_timeout_secs",
            cfg.listen.handshake_timeout_secs.to_string(),
        ),
        ("admin.addr", format!("`{}`", cfg.admin.addr)),
        ("workers.command", format!("`{:?}`", w.command)),
        (
            "workers.thread_unload_delay_secs",
            w.thread_unload_delay_secs.to_string(),
        ),
        ("workers.worker_idle_secs", w.worker_idle_secs.to_string()),
        ("workers.load_mark", w.load_mark.to_string()),
        ("workers.max_workers", w.max_workers.to_string()),
        (
            "workers.config_overrides",
            format!("`{:?}`", w.config_overrides),
        ),
        ("workers.pass_env", format!("`{:?}`", w.pass_env)),
        (
            "workers.ready_timeout_secs",
            w.ready_timeout_secs.to_string(),
        ),
        (
            "workers.health_interval_secs",
            w.health_interval_secs.to_string(),
        ),
        (
            "workers.health_timeout_secs",
            w.health_timeout_secs.to_string(),
        ),
        ("workers.stop_grace_secs", w.stop_grace_secs.to_string()),
        ("workers.per_tenant_uid", w.per_tenant_uid.to_string()),
        (
            "workers.uid_range",
            format!("`[{}, {}]`", w.uid_range[0], w.uid_range[1]),
        ),
        ("workers.rlimit_nofile", opt(w.rlimit_nofile)),
        ("workers.rlimit_as_bytes", opt(w.rlimit_as_bytes)),
        ("workers.rlimit_cpu_secs", opt(w.rlimit_cpu_secs)),
        ("workers.max_processes", w.max_processes.to_string()),
        ("workers.nice", w.nice.to_string()),
        ("tenants[].max_processes", opt(t.max_processes)),
        ("workers.max_worker_rss_bytes", opt(w.max_worker_rss_bytes)),
        (
            "workers.restart_backoff_initial_ms",
            w.restart_backoff_initial_ms.to_string(),
        ),
        (
            "workers.restart_backoff_max_ms",
            w.restart_backoff_max_ms.to_string(),
        ),
        ("drain.settle_secs", cfg.drain.settle_secs.to_string()),
        ("drain.timeout_secs", cfg.drain.timeout_secs.to_string()),
        (
            "limits.max_message_bytes",
            cfg.limits.max_message_bytes.to_string(),
        ),
        ("limits.client_queue", cfg.limits.client_queue.to_string()),
        (
            "limits.client_queue_bytes",
            cfg.limits.client_queue_bytes.to_string(),
        ),
        (
            "limits.tenant_queue_bytes",
            cfg.limits.tenant_queue_bytes.to_string(),
        ),
        ("limits.max_connections", a.max_connections.to_string()),
        (
            "limits.max_connections_per_tenant",
            a.max_connections_per_tenant.to_string(),
        ),
        (
            "limits.handshakes_per_sec_per_ip",
            a.handshakes_per_sec_per_ip.to_string(),
        ),
        ("limits.handshake_burst", a.handshake_burst.to_string()),
        ("limits.conn_fps", a.conn_fps.to_string()),
        (
            "tenants[].node",
            t.node.clone().unwrap_or_else(|| "unset".to_owned()),
        ),
        (
            "tenants[].kubernetes.resources",
            if t.kubernetes.is_none() {
                "unset".to_owned()
            } else {
                "set".to_owned()
            },
        ),
        ("limits.conn_burst", a.conn_burst.to_string()),
        ("limits.tenant_rps", a.tenant_rps.to_string()),
        ("limits.tenant_burst", a.tenant_burst.to_string()),
        (
            "limits.turn_start_per_min",
            a.turn_start_per_min.to_string(),
        ),
        ("limits.turn_start_burst", a.turn_start_burst.to_string()),
        (
            "limits.max_active_turns_per_tenant",
            a.max_active_turns_per_tenant.to_string(),
        ),
        (
            "limits.max_in_flight_per_worker",
            a.max_in_flight_per_worker.to_string(),
        ),
        (
            "limits.max_in_flight_per_connection",
            a.max_in_flight_per_connection.to_string(),
        ),
        ("limits.in_flight_wait_ms", a.in_flight_wait_ms.to_string()),
        (
            "limits.cap_retry_after_ms",
            a.cap_retry_after_ms.to_string(),
        ),
        (
            "limits.active_turn_ttl_secs",
            a.active_turn_ttl_secs.to_string(),
        ),
        ("tenants[].min_workers", t.min_workers.to_string()),
        ("tenants[].max_workers", t.max_workers.to_string()),
        (
            "tenants[].config_overrides",
            format!("`{:?}`", t.config_overrides),
        ),
        (
            "tenants[].workspace_roots",
            format!("`{:?}`", t.workspace_roots),
        ),
        ("tenants[].token_files", format!("`{:?}`", t.token_files)),
        (
            "tenants[].allowed_origins",
            format!("`{:?}`", t.allowed_origins),
        ),
        ("tenants[].close_on_expiry", t.close_on_expiry.to_string()),
        (
            "auth.expiry_grace_secs",
            cfg.auth.expiry_grace_secs.to_string(),
        ),
        ("auth.jwt", format!("`{:?}`", cfg.auth.jwt)),
        ("audit.path", "unset".to_owned()),
        ("audit.queue", cfg.audit.queue.to_string()),
        ("audit.max_file_bytes", cfg.audit.max_file_bytes.to_string()),
        ("audit.keep_files", cfg.audit.keep_files.to_string()),
    ];
    let docs = [
        include_str!("../../../docs/configuration.md"),
        include_str!("../../../docs/architecture.md"),
    ];
    let documented: Vec<(String, String)> = docs
        .iter()
        .flat_map(|d| d.lines())
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let key = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            let known = [
                "listen.",
                "admin.",
                "workers.",
                "drain.",
                "limits.",
                "tenants[].",
                "auth.",
                "audit.",
            ];
            known.iter().any(|p| key.starts_with(p)).then(|| {
                (
                    key.to_owned(),
                    cells.get(2).copied().unwrap_or("").to_owned(),
                )
            })
        })
        .collect();
    for (key, value) in &actual {
        let doc = documented
            .iter()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("the docs document no default for {key}"));
        assert_eq!(&doc.1, value, "the docs' default for {key}");
    }
    // Every other documented default is not a literal (required, allocated, another key's).
    for (key, doc) in &documented {
        if !actual.iter().any(|(k, _)| k == key) {
            assert!(
                ["required", "allocated", "see Security", "`workers.command`"]
                    .contains(&doc.as_str()),
                "{key}: documented default {doc} is not checked here"
            );
        }
    }
}
