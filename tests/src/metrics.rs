//! Reading a fleet's numbers: samples of its Prometheus `/metrics`, and ready workers in its
//! `/readyz`.

use std::net::SocketAddr;

use anyhow::Context;
use serde_json::Value;

use crate::client::http_get;

/// The sum of the samples of `name` whose labels include every pair of `labels`, in a Prometheus
/// text exposition; 0 when there is none (a labelled series appears with its first event).
pub fn metric_in(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut total = 0.0;
    for line in text.lines().filter(|l| l.starts_with(name)) {
        let (series, value) = line.rsplit_once(' ').unwrap_or((line, "0"));
        let rest = &series[name.len()..];
        if !(rest.is_empty() || rest.starts_with('{')) {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")))
        {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

/// [`metric_in`] of the `/metrics` served on an admin address.
pub async fn metric_at(
    admin: SocketAddr,
    name: &str,
    labels: &[(&str, &str)],
) -> anyhow::Result<f64> {
    let (status, text) = http_get(admin, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    Ok(metric_in(&text, name, labels))
}

/// Ready workers per tenant in a `/readyz` body.
pub fn readyz_ready_workers(
    body: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, usize>> {
    let v: Value = serde_json::from_str(body).with_context(|| format!("/readyz body {body:?}"))?;
    let tenants = v["tenants"]
        .as_array()
        .with_context(|| format!("/readyz without tenants: {v}"))?;
    Ok(tenants
        .iter()
        .map(|t| {
            let ready = t["workers"]
                .as_array()
                .map_or(0, |ws| ws.iter().filter(|w| w["state"] == "ready").count());
            (t["id"].as_str().unwrap_or_default().to_owned(), ready)
        })
        .collect())
}
