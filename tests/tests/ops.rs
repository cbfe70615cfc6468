//! DESIGN decision 10: the dashboards, alert rules and Helm chart use only what codex-fleet exports
//! and configures. A running fleet's `/metrics` is the source of truth for metric names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use e2e::{Client, FleetBuilder};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

const DASHBOARD: &str = "ops/dashboards/codex-fleet.json";
const RULES: &str = "ops/alerts/codex-fleet.rules.yml";
const CHART: &str = "charts/codex-fleet";

/// Labels Prometheus (or the ServiceMonitor) attaches to every scraped series.
const TARGET_LABELS: &[&str] = &[
    "job",
    "instance",
    "namespace",
    "pod",
    "service",
    "container",
    "endpoint",
];

/// How long the fleet gets to export every referenced series before the check gives up.
const SERIES_DEADLINE: Duration = Duration::from_secs(30);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

// === PromQL ===

/// A metric selector in a PromQL expression: the metric name and the label names it matches on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Selector {
    metric: String,
    labels: Vec<String>,
}

/// Words that are not metric names when they are not followed by `(`.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// Modifiers followed by a list of label names in parentheses.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn skip_ws(s: &[char], mut i: usize) -> usize {
    while i < s.len() && s[i].is_whitespace() {
        i += 1;
    }
    i
}

/// `i` is at an opening quote; returns the index after the closing one.
fn skip_string(s: &[char], mut i: usize) -> Result<usize, String> {
    let quote = s[i];
    i += 1;
    while i < s.len() && s[i] != quote {
        if s[i] == '\\' && quote != '`' {
            i += 1;
        }
        i += 1;
    }
    if i >= s.len() {
        return Err("unterminated string".into());
    }
    Ok(i + 1)
}

/// Returns the index after the first `close` at or after `i`.
fn skip_past(s: &[char], i: usize, close: char) -> Result<usize, String> {
    s[i..]
        .iter()
        .position(|&c| c == close)
        .map(|p| i + p + 1)
        .ok_or_else(|| format!("missing {close:?}"))
}

/// `i` is at `{`: collects the label names of the matchers, returns the index after `}`.
fn matchers(s: &[char], mut i: usize, labels: &mut Vec<String>) -> Result<usize, String> {
    i += 1;
    loop {
        i = skip_ws(s, i);
        match s.get(i) {
            Some('}') => return Ok(i + 1),
            Some(&c) if is_ident_start(c) => {}
            other => {
                return Err(format!(
                    "expected a label name in matchers, found {other:?}"
                ))
            }
        }
        let start = i;
        while i < s.len() && is_ident(s[i]) {
            i += 1;
        }
        labels.push(s[start..i].iter().collect());
        i = skip_ws(s, i);
        while i < s.len() && matches!(s[i], '=' | '!' | '~') {
            i += 1;
        }
        i = skip_ws(s, i);
        if !matches!(s.get(i), Some('"' | '\'' | '`')) {
            return Err("expected a quoted label value".into());
        }
        i = skip_ws(s, skip_string(s, i)?);
        match s.get(i) {
            Some(',') => i += 1,
            Some('}') => return Ok(i + 1),
            other => return Err(format!("expected ',' or '}}' in matchers, found {other:?}")),
        }
    }
}

/// Every metric selector of a PromQL expression (Grafana `$variables` allowed).
fn selectors(expr: &str) -> Result<Vec<Selector>, String> {
    let s: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            i = s[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(s.len(), |p| i + p);
        } else if matches!(c, '"' | '\'' | '`') {
            i = skip_string(&s, i)?;
        } else if c == '[' {
            // Range or subquery: durations, `$__rate_interval`.
            i = skip_past(&s, i, ']')?;
        } else if c == '$' {
            i += 1;
            while i < s.len() && is_ident(s[i]) {
                i += 1;
            }
        } else if c.is_ascii_digit() || (c == '.' && s.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // Numbers and durations (`0.99`, `1e3`, `5m` after offset).
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < s.len() && is_ident(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let j = skip_ws(&s, i);
            let next = s.get(j).copied();
            if GROUPING.contains(&word.as_str()) {
                if next == Some('(') {
                    i = skip_past(&s, j, ')')?;
                }
            } else if next == Some('(') || KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                // A function, an aggregation or an operator.
            } else {
                let mut labels = Vec::new();
                if next == Some('{') {
                    i = matchers(&s, j, &mut labels)?;
                }
                out.push(Selector {
                    metric: word,
                    labels,
                });
            }
        } else if c == '{' {
            return Err("a selector without a metric name".into());
        } else {
            i += 1;
        }
    }
    Ok(out)
}

// === /metrics ===

/// Sample names in Prometheus text format, each with the label names seen on it. Histograms
/// appear as their `_bucket`, `_sum` and `_count` series, exactly as PromQL must name them.
fn exported(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = out.entry(line[..end].to_owned()).or_default();
        let Some(rest) = line[end..].strip_prefix('{') else {
            continue;
        };
        let s: Vec<char> = rest.chars().collect();
        let mut i = 0;
        while i < s.len() && s[i] != '}' {
            let start = i;
            while i < s.len() && s[i] != '=' {
                i += 1;
            }
            labels.insert(s[start..i].iter().collect::<String>().trim().to_owned());
            i += 1; // '='
            match skip_string(&s, i) {
                Ok(next) => i = next,
                Err(_) => break,
            }
            if s.get(i) == Some(&',') {
                i += 1;
            }
        }
    }
    out
}

/// Problems with one expression against the exported series; empty when it is sound.
fn check_expr(
    origin: &str,
    expr: &str,
    exported: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let sels = match selectors(expr) {
        Ok(s) => s,
        Err(e) => return vec![format!("{origin}: cannot parse {expr:?}: {e}")],
    };
    let mut problems = Vec::new();
    if sels.is_empty() {
        problems.push(format!("{origin}: no metric in {expr:?}"));
    }
    for sel in sels {
        let Some(labels) = exported.get(&sel.metric) else {
            problems.push(format!(
                "{origin}: metric {} is not exported by codex-fleet",
                sel.metric
            ));
            continue;
        };
        for l in &sel.labels {
            if !labels.contains(l) && !TARGET_LABELS.contains(&l.as_str()) {
                problems.push(format!(
                    "{origin}: {} has no label {l:?} (it has {labels:?})",
                    sel.metric
                ));
            }
        }
    }
    problems
}

// === dashboards and rules ===

/// Every PromQL expression of a Grafana dashboard: panel targets and query variables.
fn dashboard_exprs(dash: &Value) -> Vec<(String, String)> {
    fn walk(v: &Value, path: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                let title = m.get("title").and_then(Value::as_str).unwrap_or("");
                let here = if title.is_empty() {
                    path.to_owned()
                } else {
                    format!("{path}/{title}")
                };
                if let Some(e) = m.get("expr").and_then(Value::as_str) {
                    out.push((here.clone(), e.to_owned()));
                }
                if m.get("type").and_then(Value::as_str) == Some("query") {
                    let name = m.get("name").and_then(Value::as_str).unwrap_or("?");
                    let q = m.get("query").map(|q| q.get("query").unwrap_or(q));
                    if let Some(q) = q.and_then(Value::as_str) {
                        out.push((format!("{path}/variable {name}"), variable_expr(q)));
                    }
                }
                for (k, child) in m {
                    if k != "query" {
                        walk(child, &here, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|c| walk(c, path, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dash, "dashboard", &mut out);
    out
}

/// The PromQL inside a Grafana Prometheus variable query (`label_values(SELECTOR, label)`,
/// `query_result(EXPR)`).
fn variable_expr(q: &str) -> String {
    let q = q.trim();
    if let Some(inner) = q
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
    {
        return inner.rsplit_once(',').map_or("", |(sel, _)| sel).to_owned();
    }
    if let Some(inner) = q
        .strip_prefix("query_result(")
        .and_then(|r| r.strip_suffix(')'))
    {
        return inner.to_owned();
    }
    q.to_owned()
}

/// One alerting rule as the rules file spells it.
#[derive(Debug, Default)]
struct Rule {
    alert: String,
    expr: String,
    runbook_url: Option<String>,
}

fn unquote(v: &str) -> String {
    let v = v.trim();
    for q in ['"', '\''] {
        if let Some(inner) = v.strip_prefix(q).and_then(|r| r.strip_suffix(q)) {
            return inner.to_owned();
        }
    }
    v.to_owned()
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// A small reader for Prometheus rule files: `- alert:` starts a rule; `expr:` is a plain,
/// quoted or block (`|`, `>`) scalar; `runbook_url:` is a plain or quoted scalar.
fn parse_rules(text: &str) -> Vec<Rule> {
    let lines: Vec<&str> = text.lines().collect();
    let mut rules: Vec<Rule> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let t = line.trim_start();
        i += 1;
        if t.starts_with('#') {
            continue;
        }
        if let Some(name) = t.strip_prefix("- alert:") {
            rules.push(Rule {
                alert: unquote(name),
                ..Rule::default()
            });
        } else if let Some(v) = t.strip_prefix("expr:") {
            let Some(rule) = rules.last_mut() else {
                continue;
            };
            let v = v.trim();
            if v.starts_with('|') || v.starts_with('>') {
                let mut block = Vec::new();
                while i < lines.len()
                    && (lines[i].trim().is_empty() || indent(lines[i]) > indent(line))
                {
                    block.push(lines[i].trim());
                    i += 1;
                }
                rule.expr = block.join("\n").trim().to_owned();
            } else {
                rule.expr = unquote(v);
            }
        } else if let Some(v) = t.strip_prefix("runbook_url:") {
            if let Some(rule) = rules.last_mut() {
                rule.runbook_url = Some(unquote(v));
            }
        }
    }
    rules
}

fn all_exprs() -> Vec<(String, String)> {
    let dash: Value = serde_json::from_str(&read(DASHBOARD)).expect("dashboard is JSON");
    let mut exprs = dashboard_exprs(&dash);
    for r in parse_rules(&read(RULES)) {
        exprs.push((format!("{RULES}/{}", r.alert), r.expr));
    }
    exprs
}

// === the proof against a running fleet ===

/// Runs real traffic so every series the binary can export exists: a turn, a refused upgrade, an
/// invalid frame, a closed session, and a worker crash with its restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_and_alerts_use_only_exported_metrics() -> anyhow::Result<()> {
    let exprs = all_exprs();
    assert!(exprs.len() > 20, "too few expressions found: {exprs:?}");

    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "hello metrics").await?;
    c.until_turn_completed(&thread).await?;

    // A client error (invalid JSON is answered with -32700 and counted).
    c.send_text("{not json").await?;
    let err = c.wait_for(|v| v["error"]["code"] == -32700).await?;
    assert!(err["id"].is_null(), "{err}");

    // A refused upgrade.
    let refused = Client::connect(&fleet.url(), &fleet.files.ca, Some("not-a-token")).await;
    assert!(refused.is_err(), "a wrong token must be refused");

    // A worker crash and the restart of its slot.
    let pid = worker_pid(&fleet).await?;
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;
    c.close().await;
    let deadline = tokio::time::Instant::now() + e2e::STEP;
    loop {
        let attempt = async {
            let mut c = fleet.client("acme").await?;
            c.start_thread().await?;
            c.close().await;
            anyhow::Ok(())
        };
        match attempt.await {
            Ok(()) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "worker not back yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.context("the crashed worker's slot never came back")),
        }
    }

    // An edge exports the link series (sessions relayed, link failures, connect time): one edge
    // in front of one node, a session through it, and a node that is not there.
    let split = e2e::Split::start(&[("acme", "n1")], 1, "").await?;
    split.client(0, "acme").await?.close().await;
    if let Some(n2) = &split.nodes[1].process {
        n2.signal(Signal::SIGKILL)?;
    }
    let edge_series = {
        let (_, body) = e2e::http_get(split.edges[0].admin, "/metrics").await?;
        exported(&body)
    };

    // Counters appear as their events are booked; give them a moment, then judge.
    let deadline = tokio::time::Instant::now() + SERIES_DEADLINE;
    let problems = loop {
        let (status, body) = fleet.admin_get("/metrics").await?;
        assert_eq!(status, 200, "{body}");
        let mut series = exported(&body);
        for (name, labels) in &edge_series {
            series
                .entry(name.clone())
                .or_default()
                .extend(labels.iter().cloned());
        }
        let problems: Vec<String> = exprs
            .iter()
            .flat_map(|(origin, e)| check_expr(origin, e, &series))
            .collect();
        if problems.is_empty() || tokio::time::Instant::now() >= deadline {
            break problems;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    fleet.stop().await?;
    assert!(
        problems.is_empty(),
        "dashboards and alert rules reference what codex-fleet does not export:\n{}",
        problems.join("\n")
    );
    Ok(())
}

async fn worker_pid(fleet: &e2e::Fleet) -> anyhow::Result<i32> {
    let (status, body) = fleet.admin_get("/readyz").await?;
    if status != 200 {
        bail!("/readyz answered {status}: {body}");
    }
    let v: Value = serde_json::from_str(&body).context("/readyz is JSON")?;
    let pid = v["tenants"][0]["workers"][0]["pid"]
        .as_i64()
        .ok_or_else(|| anyhow!("no worker pid in /readyz: {v}"))?;
    Ok(i32::try_from(pid)?)
}

// === static checks ===

#[test]
fn the_checker_finds_what_does_not_exist() {
    let series = exported(
        "# TYPE codex_fleet_sessions gauge\ncodex_fleet_sessions{tenant=\"a,b\\\"}\"} 1\n\
         codex_fleet_x_bucket{tenant=\"a\",le=\"0.5\"} 1\ncodex_fleet_draining 0\n",
    );
    assert_eq!(
        series["codex_fleet_sessions"],
        BTreeSet::from(["tenant".to_owned()])
    );
    let ok = "histogram_quantile(0.99, sum by (tenant, le) (rate(codex_fleet_x_bucket{tenant=~\"$tenant\"}[$__rate_interval])))\n\
              unless on (tenant) sum without (instance) (codex_fleet_sessions offset 5m) > 0 or vector(0) and max(codex_fleet_draining)";
    assert_eq!(check_expr("ok", ok, &series), Vec::<String>::new());
    for (bad, needle) in [
        (
            "sum(rate(codex_fleet_bogus_total[5m]))",
            "codex_fleet_bogus_total",
        ),
        ("codex_fleet_x", "codex_fleet_x is not exported"),
        ("codex_fleet_x_count", "codex_fleet_x_count"),
        ("codex_fleet_sessions{reason=\"x\"}", "no label \"reason\""),
        ("up == 0", "metric up"),
        ("vector(1)", "no metric"),
    ] {
        let problems = check_expr("bad", bad, &series);
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "{bad}: {problems:?}"
        );
    }
    assert_eq!(
        variable_expr("label_values(codex_fleet_workers{state=\"ready\"}, tenant)"),
        "codex_fleet_workers{state=\"ready\"}"
    );
}

#[test]
fn every_alert_has_an_expression_and_a_runbook() {
    let rules = parse_rules(&read(RULES));
    assert!(rules.len() >= 7, "{rules:?}");
    let mut seen = BTreeSet::new();
    for r in &rules {
        assert!(seen.insert(r.alert.clone()), "{} appears twice", r.alert);
        assert!(!r.expr.is_empty(), "{} has no expr", r.alert);
        let url = r
            .runbook_url
            .as_deref()
            .unwrap_or_else(|| panic!("{} has no runbook_url", r.alert));
        let rel = &url[url
            .find("ops/runbooks/")
            .unwrap_or_else(|| panic!("{}: runbook_url {url} is not in ops/runbooks/", r.alert))..];
        let runbook = read(rel);
        assert!(
            runbook.contains(&r.alert),
            "{rel} does not name {}",
            r.alert
        );
    }
    // The block scalar reader keeps multi-line expressions whole.
    let no_ready = rules
        .iter()
        .find(|r| r.alert == "CodexFleetNoReadyWorkers")
        .expect("CodexFleetNoReadyWorkers");
    assert!(no_ready.expr.contains("unless on (tenant)"), "{no_ready:?}");
}

#[test]
fn the_chart_ships_the_same_rules_and_dashboard() {
    assert_eq!(
        read(&format!("{CHART}/files/codex-fleet.rules.yml")),
        read(RULES),
        "copy {RULES} to {CHART}/files/"
    );
    assert_eq!(
        read(&format!("{CHART}/files/codex-fleet.json")),
        read(DASHBOARD),
        "copy {DASHBOARD} to {CHART}/files/"
    );
}

/// Config keys from the README's configuration table: `table.key` or `tenants[].key`.
fn readme_config_keys() -> Vec<String> {
    let readme = read("README.md");
    let section = readme
        .split("\n## Configuration")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README has a Configuration section");
    let keys: Vec<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    assert!(keys.len() > 20, "too few config keys in README: {keys:?}");
    keys
}

/// `top: {second: …}` keys of a YAML file, read by indentation (two spaces).
fn yaml_keys(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut top = None;
    for line in text.lines() {
        let t = line.trim_start();
        if t.is_empty() || t.starts_with('#') || t.starts_with('-') {
            continue;
        }
        let Some((key, _)) = t.split_once(':') else {
            continue;
        };
        match indent(line) {
            0 => {
                top = Some(key.to_owned());
                out.entry(key.to_owned()).or_default();
            }
            2 => {
                if let Some(top) = &top {
                    out.entry(top.clone()).or_default().insert(key.to_owned());
                }
            }
            _ => {}
        }
    }
    out
}

#[test]
fn chart_values_and_configmap_cover_every_config_key() {
    let keys = readme_config_keys();
    let values = yaml_keys(&read(&format!("{CHART}/values.yaml")));
    let configmap = read(&format!("{CHART}/templates/configmap.yaml"));
    let mut missing = Vec::new();
    for key in &keys {
        if let Some(field) = key.strip_prefix("tenants[].") {
            if !values.contains_key("tenants") {
                missing.push("values.yaml: tenants".to_owned());
            }
            let needle = format!("$tenant.{field}");
            if !configmap.contains(&needle) {
                missing.push(format!("configmap.yaml: {needle}"));
            }
            continue;
        }
        let (table, field) = key
            .split_once('.')
            .unwrap_or_else(|| panic!("README key {key} has no table"));
        if !values.get(table).is_some_and(|t| t.contains(field)) {
            missing.push(format!("values.yaml: {table}.{field}"));
        }
        let needle = format!(".Values.{table}.{field}");
        if !configmap.contains(&needle) {
            missing.push(format!("configmap.yaml: {needle}"));
        }
    }
    assert!(
        missing.is_empty(),
        "config keys missing from the chart: {missing:?}"
    );
}

/// Series whose labels are all known (configured tenants, fixed reasons) exist at zero before
/// their first event, so a dashboard or an alert sees 0 rather than no data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_with_known_labels_start_at_zero() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new().tenant("acme").start().await?;
    let (_, text) = fleet.admin_get("/metrics").await?;
    let zero = |series: &str| {
        text.lines()
            .any(|l| l.strip_prefix(series).is_some_and(|v| v.trim() == "0"))
    };
    for reason in [
        "crash",
        "hang",
        "stopped",
        "startfail",
        "idle",
        "memory",
        "fault",
    ] {
        let series =
            format!("codex_fleet_worker_exits_total{{reason=\"{reason}\",tenant=\"acme\"}}");
        assert!(zero(&series), "{series} missing:\n{text}");
    }
    for series in [
        "codex_fleet_worker_restarts_total{tenant=\"acme\"}",
        "codex_fleet_resume_retries_total{tenant=\"acme\"}",
        "codex_fleet_worker_starts_total{tenant=\"acme\"}",
        "codex_fleet_sessions_closed_total{reason=\"slow_client\"}",
        "codex_fleet_sessions_closed_total{reason=\"client\"}",
        "codex_fleet_client_errors_total{reason=\"no_worker\"}",
        "codex_fleet_client_errors_total{reason=\"duplicate_id\"}",
        "codex_fleet_thread_rehomes_total{cause=\"crash\",outcome=\"rehomed\",tenant=\"acme\"}",
        "codex_fleet_thread_rehomes_total{cause=\"retired\",outcome=\"no_worker\",tenant=\"acme\"}",
        "codex_fleet_thread_rehome_duration_seconds_count{tenant=\"acme\"}",
    ] {
        assert!(zero(series), "{series} missing:\n{text}");
    }
    fleet.stop().await
}

// === promtool (Debian `prometheus`; ops/test.sh installs it) ===

fn promtool(args: &[&str]) -> std::process::Output {
    std::process::Command::new("promtool")
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("promtool must be installed (ops/test.sh installs Debian's prometheus package)")
}

/// `promtool check rules` accepts the alert rules, and `promtool test rules` runs their unit
/// tests, in which every alert fires at least once.
#[test]
fn promtool_checks_the_rules_and_every_alert_has_a_unit_test_that_fires() {
    let check = promtool(&["check", "rules", RULES]);
    assert!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let tests = "ops/alerts/codex-fleet.rules.test.yml";
    let run = promtool(&["test", "rules", tests]);
    assert!(
        run.status.success(),
        "promtool test rules: {}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    // Each alert is expected to fire somewhere (its name followed by expected alerts).
    let text = read(tests);
    for rule in parse_rules(&read(RULES)) {
        let fires = format!("alertname: {}\n        exp_alerts:", rule.alert);
        assert!(
            text.contains(&fires),
            "{} has no promtool unit test in which it fires",
            rule.alert
        );
    }
}

/// Issue 14: the configured limits are gauges, and each tenant's workers' memory and CPU are
/// sampled from their process groups at every health ping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_worker_resources_are_exported_per_tenant() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 1, 3)
        .workers_toml("health_interval_secs = 1\nhealth_timeout_secs = 1\nmax_workers = 7\nmax_worker_rss_bytes = 2000000000")
        .limits_toml("max_active_turns_per_tenant = 5")
        .start()
        .await?;
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "use some CPU").await?;
    c.until_turn_completed(&thread).await?;
    for (labels, want) in [
        (vec![("limit", "max_workers")], 7.0),
        (vec![("limit", "max_active_turns_per_tenant")], 5.0),
        (vec![("limit", "max_worker_rss_bytes")], 2e9),
    ] {
        assert_eq!(
            fleet.metric("codex_fleet_limit", &labels).await?,
            want,
            "{labels:?}"
        );
    }
    let tenant_max = fleet
        .metric(
            "codex_fleet_tenant_limit",
            &[("limit", "max_workers"), ("tenant", "acme")],
        )
        .await?;
    assert_eq!(tenant_max, 3.0);
    let acme = [("tenant", "acme")];
    let sampled = e2e::wait_until_async(Duration::from_secs(10), || async {
        let rss = fleet
            .metric("codex_fleet_worker_resident_bytes", &acme)
            .await
            .unwrap_or(0.0);
        let largest = fleet
            .metric("codex_fleet_worker_largest_rss_bytes", &acme)
            .await
            .unwrap_or(0.0);
        let cpu = fleet
            .metric("codex_fleet_worker_cpu_seconds_total", &acme)
            .await
            .unwrap_or(0.0);
        // An app-server with a thread is far above 20 MiB, and a turn costs CPU.
        rss > 20e6 && largest > 20e6 && largest <= rss && cpu > 0.0
    })
    .await;
    let (_, metrics) = fleet.admin_get("/metrics").await?;
    assert!(
        sampled,
        "worker memory and CPU sampled: {}",
        metrics
            .lines()
            .filter(|l| l.starts_with("codex_fleet_worker_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    c.close().await;
    fleet.stop().await
}
