//! `codex-fleet top --admin URL`: the capacity dashboard's questions answered in a terminal from
//! the admin endpoints (`/readyz` and `/metrics`), refreshing like `top`, for an operator with a
//! shell and no Grafana. Plain text, one report per refresh, when the output is not a terminal.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

/// Samples of `/metrics`: (name, sorted labels) → value.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    values: BTreeMap<(String, Vec<(String, String)>), f64>,
}

impl Samples {
    /// Parses the Prometheus text format (comments skipped, escapes in label values kept).
    pub fn parse(text: &str) -> Samples {
        let mut values = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = match line.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, parse_labels(rest.trim_end_matches('}'))),
                None => (series, Vec::new()),
            };
            values.insert((name.to_owned(), labels), value);
        }
        Samples { values }
    }

    /// The sum of every series of `name` whose labels include all of `want`.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.values
            .iter()
            .filter(|((n, labels), _)| {
                n == name
                    && want
                        .iter()
                        .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, v)| *v)
            .sum()
    }

    /// The values of label `key` among the series of `name`.
    pub fn label_values(&self, name: &str, key: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .values
            .keys()
            .filter(|(n, _)| n == name)
            .flat_map(|(_, labels)| {
                labels
                    .iter()
                    .filter(|(k, _)| k == key)
                    .map(|(_, v)| v.clone())
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(n);
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key.trim_start_matches(',').trim().to_owned(), value));
        rest = &after[end..];
    }
    out.sort();
    out
}

/// One plain-HTTP GET on the admin port.
async fn get(addr: &str, path: &str) -> anyhow::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect to the admin port {addr}"))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default())
}

/// `http://host:port[/]` → `host:port`.
pub fn admin_addr(url: &str) -> anyhow::Result<String> {
    let Some(rest) = url.strip_prefix("http://") else {
        bail!("--admin must be http://host:port (the admin port is plain HTTP), got {url:?}");
    };
    Ok(rest.trim_end_matches('/').to_owned())
}

fn mib(bytes: f64) -> String {
    format!("{:.0} MiB", bytes / f64::from(1 << 20))
}

fn ratio(used: f64, limit: f64) -> String {
    if limit > 0.0 {
        format!("{used:.0}/{limit:.0} ({:.0}%)", 100.0 * used / limit)
    } else {
        format!("{used:.0}/-")
    }
}

/// One report from the current samples and, when given, the previous ones `elapsed` ago (for
/// rates: refusals, CPU, turns, tokens).
pub fn report(
    now: &Samples,
    before: Option<(&Samples, Duration)>,
    readyz: &serde_json::Value,
) -> String {
    let mut out = String::new();
    let live = |s: &Samples, tenant: Option<&str>| {
        ["starting", "ready", "draining"]
            .iter()
            .map(|st| match tenant {
                Some(t) => s.sum("codex_fleet_workers", &[("tenant", t), ("state", st)]),
                None => s.sum("codex_fleet_workers", &[("state", st)]),
            })
            .sum::<f64>()
    };
    let limit = |name: &str| now.sum("codex_fleet_limit", &[("limit", name)]);
    let delta = |name: &str, want: &[(&str, &str)]| {
        before.map(|(b, _)| (now.sum(name, want) - b.sum(name, want)).max(0.0))
    };
    let secs = before.map_or(0.0, |(_, e)| e.as_secs_f64()).max(1e-9);
    let ready = readyz["ready"].as_bool().unwrap_or(false);
    let _ = writeln!(
        out,
        "codex-fleet  {}  workers {}  sessions {}  draining {}",
        if ready { "ready" } else { "NOT READY" },
        ratio(live(now, None), limit("max_workers")),
        ratio(
            now.sum("codex_fleet_sessions", &[]),
            limit("max_connections")
        ),
        readyz["draining"].as_bool().unwrap_or(false),
    );
    if let Some(reasons) = readyz["reasons"].as_array().filter(|r| !r.is_empty()) {
        for r in reasons {
            let _ = writeln!(out, "  ! {}", r.as_str().unwrap_or_default());
        }
    }
    let _ = writeln!(
        out,
        "\n{:<16} {:>8} {:>12} {:>12} {:>10} {:>8} {:>10} {:>12}  refused (last {:.0} s)",
        "TENANT", "SESSIONS", "WORKERS", "TURNS", "MEMORY", "CPU", "TURNS/MIN", "TOKENS/H", secs
    );
    let turn_limit = limit("max_active_turns_per_tenant");
    for tenant in now.label_values("codex_fleet_workers", "tenant") {
        let t = tenant.as_str();
        let max_workers = now.sum(
            "codex_fleet_tenant_limit",
            &[("tenant", t), ("limit", "max_workers")],
        );
        let cpu = delta("codex_fleet_worker_cpu_seconds_total", &[("tenant", t)])
            .map_or("-".to_owned(), |d| format!("{:.0}%", 100.0 * d / secs));
        let turns = delta("codex_fleet_turns_started_total", &[("tenant", t)])
            .map_or("-".to_owned(), |d| format!("{:.1}", d * 60.0 / secs));
        // The model's total: input and output. `cached_input` is part of `input` and
        // `reasoning_output` part of `output`; adding them would count those tokens twice.
        let tokens = ["input", "output"]
            .iter()
            .map(|kind| {
                delta(
                    "codex_fleet_model_tokens_total",
                    &[("tenant", t), ("kind", kind)],
                )
            })
            .sum::<Option<f64>>()
            .map_or("-".to_owned(), |d| format!("{:.0}", d * 3600.0 / secs));
        let refused: Vec<String> = now
            .label_values("codex_fleet_tenant_rejections_total", "reason")
            .into_iter()
            .filter_map(|reason| {
                let d = delta(
                    "codex_fleet_tenant_rejections_total",
                    &[("tenant", t), ("reason", &reason)],
                )?;
                (d > 0.0).then(|| format!("{reason} {d:.0}"))
            })
            .collect();
        let _ = writeln!(
            out,
            "{:<16} {:>8} {:>12} {:>12} {:>10} {:>8} {:>10} {:>12}  {}",
            t,
            now.sum("codex_fleet_sessions", &[("tenant", t)]),
            ratio(live(now, Some(t)), max_workers),
            ratio(
                now.sum("codex_fleet_worker_active_turns", &[("tenant", t)]),
                turn_limit
            ),
            mib(now.sum("codex_fleet_worker_resident_bytes", &[("tenant", t)])),
            cpu,
            turns,
            tokens,
            if refused.is_empty() {
                "-".to_owned()
            } else {
                refused.join(", ")
            },
        );
    }
    let guard = limit("max_worker_rss_bytes");
    if guard > 0.0 {
        let largest = now
            .label_values("codex_fleet_worker_largest_rss_bytes", "tenant")
            .iter()
            .map(|t| now.sum("codex_fleet_worker_largest_rss_bytes", &[("tenant", t)]))
            .fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "\nmemory guard: largest worker {} of {} ({:.0}%)",
            mib(largest),
            mib(guard),
            100.0 * largest / guard
        );
    }
    out
}

/// Runs `top` until interrupted; with `once`, prints one report (two samples `every` apart, so
/// rates have a base) and returns.
pub async fn run(admin: &str, every: Duration, once: bool) -> anyhow::Result<()> {
    let addr = admin_addr(admin)?;
    let terminal = std::io::stdout().is_terminal();
    let mut before: Option<(Samples, Instant)> = None;
    if once {
        before = Some((
            Samples::parse(&get(&addr, "/metrics").await?),
            Instant::now(),
        ));
        tokio::time::sleep(every).await;
    }
    loop {
        let metrics = Samples::parse(&get(&addr, "/metrics").await?);
        let readyz: serde_json::Value =
            serde_json::from_str(&get(&addr, "/readyz").await?).unwrap_or_default();
        let at = Instant::now();
        let text = report(
            &metrics,
            before.as_ref().map(|(s, t)| (s, at.duration_since(*t))),
            &readyz,
        );
        let mut stdout = std::io::stdout().lock();
        if terminal && !once {
            // Clear the screen and go home, as top does.
            write!(stdout, "\x1b[2J\x1b[H")?;
        }
        writeln!(stdout, "{text}")?;
        stdout.flush()?;
        drop(stdout);
        if once {
            return Ok(());
        }
        before = Some((metrics, at));
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = r#"
# HELP codex_fleet_workers Worker slots by state.
codex_fleet_workers{state="ready",tenant="acme"} 2
codex_fleet_workers{state="starting",tenant="acme"} 1
codex_fleet_workers{state="stopped",tenant="acme"} 1
codex_fleet_workers{state="ready",tenant="beta"} 1
codex_fleet_limit{limit="max_workers"} 8
codex_fleet_limit{limit="max_active_turns_per_tenant"} 4
codex_fleet_limit{limit="max_connections"} 100
codex_fleet_limit{limit="max_worker_rss_bytes"} 1073741824
codex_fleet_tenant_limit{limit="max_workers",tenant="acme"} 4
codex_fleet_sessions{tenant="acme"} 3
codex_fleet_worker_active_turns{tenant="acme"} 2
codex_fleet_worker_resident_bytes{tenant="acme"} 314572800
codex_fleet_worker_largest_rss_bytes{tenant="acme"} 536870912
codex_fleet_worker_cpu_seconds_total{tenant="acme"} 10
codex_fleet_tenant_rejections_total{reason="activeTurnLimit",tenant="acme"} 5
codex_fleet_turns_started_total{tenant="acme"} 10
codex_fleet_model_tokens_total{kind="input",tenant="acme"} 1000
codex_fleet_model_tokens_total{kind="cached_input",tenant="acme"} 400
codex_fleet_model_tokens_total{kind="output",tenant="acme"} 70
codex_fleet_model_tokens_total{kind="reasoning_output",tenant="acme"} 30
"#;

    #[test]
    fn the_report_answers_the_capacity_questions() {
        let before = Samples::parse(METRICS);
        let now = Samples::parse(
            &METRICS
                .replace(
                    "cpu_seconds_total{tenant=\"acme\"} 10",
                    "cpu_seconds_total{tenant=\"acme\"} 15",
                )
                .replace(
                    "reason=\"activeTurnLimit\",tenant=\"acme\"} 5",
                    "reason=\"activeTurnLimit\",tenant=\"acme\"} 12",
                )
                .replace(
                    "turns_started_total{tenant=\"acme\"} 10",
                    "turns_started_total{tenant=\"acme\"} 20",
                )
                // One model call more: 100 input (40 of them cached), 7 output (3 reasoning).
                .replace(
                    "kind=\"input\",tenant=\"acme\"} 1000",
                    "kind=\"input\",tenant=\"acme\"} 1100",
                )
                .replace(
                    "kind=\"cached_input\",tenant=\"acme\"} 400",
                    "kind=\"cached_input\",tenant=\"acme\"} 440",
                )
                .replace(
                    "kind=\"output\",tenant=\"acme\"} 70",
                    "kind=\"output\",tenant=\"acme\"} 77",
                )
                .replace(
                    "kind=\"reasoning_output\",tenant=\"acme\"} 30",
                    "kind=\"reasoning_output\",tenant=\"acme\"} 33",
                ),
        );
        let readyz = serde_json::json!({"ready": true, "draining": false, "reasons": []});
        let text = report(&now, Some((&before, Duration::from_secs(10))), &readyz);
        assert!(text.contains("workers 4/8 (50%)"), "{text}");
        assert!(text.contains("sessions 3/100 (3%)"), "{text}");
        let acme = text
            .lines()
            .find(|l| l.starts_with("acme"))
            .expect("acme row");
        assert!(acme.contains("3/4 (75%)"), "workers of acme: {acme}");
        assert!(acme.contains("2/4 (50%)"), "turns of acme: {acme}");
        assert!(acme.contains("300 MiB"), "{acme}");
        assert!(acme.contains("50%"), "CPU: 5 s over 10 s: {acme}");
        assert!(acme.contains("60.0"), "turns per minute: {acme}");
        // 107 tokens (input and output; the cached and reasoning ones are part of them) over
        // 10 s.
        assert!(acme.contains(" 38520 "), "tokens per hour: {acme}");
        assert!(acme.contains("activeTurnLimit 7"), "{acme}");
        assert!(
            text.contains("memory guard: largest worker 512 MiB of 1024 MiB (50%)"),
            "{text}"
        );
        let first = report(&now, None, &readyz);
        assert!(first.lines().any(|l| l.starts_with("beta")), "{first}");
    }

    #[test]
    fn labels_with_escapes_and_the_admin_url_are_read() {
        let s = Samples::parse("m{a=\"x\\\"y\",b=\"z\"} 2\nm{a=\"q\"} 3\n");
        assert_eq!(s.sum("m", &[("a", "x\"y")]), 2.0);
        assert_eq!(s.sum("m", &[]), 5.0);
        assert_eq!(
            admin_addr("http://127.0.0.1:9464/").unwrap(),
            "127.0.0.1:9464"
        );
        assert!(admin_addr("127.0.0.1:9464").is_err());
    }
}
