//! codex-fleet over the app-server SIMULATOR (`ops/sim`, `codex-app-server-sim`), not the real
//! worker: a fast check at a worker count the real binary makes slow. 20 tenants × 2 simulated
//! workers all become ready, a turn per tenant completes through codex-fleet, and a worker that
//! stalls (the simulator SIGSTOPs itself on `STALL`) is detected by the health ping and replaced
//! while the other tenants keep working. The real-worker suites stay the reference.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{agent_text, reply_text, FleetBuilder};

const TENANTS: usize = 20;
const WORKERS: usize = 2;

/// `codex-app-server-sim`, built by `cargo build --bins` next to codex-fleet.
fn sim_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CODEX_SIM_BIN") {
        return PathBuf::from(p);
    }
    let p = testkit::fleet_bin().with_file_name("codex-app-server-sim");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --bins` first",
        p.display()
    );
    p
}

/// (ready workers, total restarts) of one tenant from `/readyz`.
fn tenant_workers(readyz: &Value, tenant: &str) -> (usize, u64) {
    let t = readyz["tenants"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["id"] == tenant);
    let workers = t
        .and_then(|t| t["workers"].as_array())
        .cloned()
        .unwrap_or_default();
    let ready = workers.iter().filter(|w| w["state"] == "ready").count();
    let restarts = workers.iter().filter_map(|w| w["restarts"].as_u64()).sum();
    (ready, restarts)
}

async fn readyz(fleet: &testkit::Fleet) -> anyhow::Result<Value> {
    let (_, body) = fleet.admin_get("/readyz").await?;
    Ok(serde_json::from_str(&body)?)
}

async fn one_turn(fleet: &testkit::Fleet, tenant: &str, text: &str) -> anyhow::Result<()> {
    let mut c = fleet.client(tenant).await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, text).await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(
        agent_text(&msgs).as_deref(),
        Some(reply_text(text).as_str()),
        "{tenant}"
    );
    c.close().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_fleet_ready_turns_and_stall_replaced() -> anyhow::Result<()> {
    let mut builder = FleetBuilder::new()
        .workers_toml(
            "per_tenant_uid = false\nmax_workers = 64\nhealth_interval_secs = 1\nhealth_timeout_secs = 1\n\
             restart_backoff_initial_ms = 50",
        )
        .limits_toml("handshakes_per_sec_per_ip = 10000\nhandshake_burst = 10000");
    for t in 0..TENANTS {
        builder = builder.tenant_pool(&format!("t{t}"), WORKERS, WORKERS);
    }
    let files = builder.prepare().await?;
    // Same configuration, simulated workers: swap the program in `workers.command`.
    let q = |p: &std::path::Path| serde_json::to_string(&p.display().to_string()).unwrap();
    let text = std::fs::read_to_string(&files.config)?;
    let swapped = text.replace(&q(&testkit::codex_bin()), &q(&sim_bin()));
    assert_ne!(text, swapped, "workers.command names the codex binary");
    std::fs::write(&files.config, swapped)?;
    let started = Instant::now();
    let fleet = files.start().await?;

    // Every simulated worker becomes ready.
    loop {
        let r = readyz(&fleet).await?;
        let ready: usize = (0..TENANTS)
            .map(|t| tenant_workers(&r, &format!("t{t}")).0)
            .sum();
        if ready == TENANTS * WORKERS {
            println!("{ready} simulated workers ready in {:?}", started.elapsed());
            break;
        }
        // Readiness is bounded here, not timed: `fleet-load` measures start-up (about 1 s for
        // these 40 on 2 idle cores); 60 s only stops a fleet that never gets there.
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "only {ready}/{} simulated workers ready: {r}",
            TENANTS * WORKERS
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A turn per tenant, through codex-fleet.
    for t in 0..TENANTS {
        one_turn(&fleet, &format!("t{t}"), &format!("hello from t{t}")).await?;
    }

    // t0's worker stalls mid-turn; the health ping must find it and the slot must restart.
    let mut victim = fleet.client("t0").await?;
    let thread = victim.start_thread().await?;
    victim.start_turn(&thread, "please STALL now").await?;
    let stalled_at = Instant::now();
    // Meanwhile the other tenants keep working; the stall is timed on its own clock, not after
    // their turns.
    let others = async {
        for t in 1..TENANTS {
            one_turn(&fleet, &format!("t{t}"), "still here").await?;
        }
        Ok::<_, anyhow::Error>(())
    };
    let told = async {
        let closed = victim
            .wait_for(|v| {
                v["method"] == "thread/closed" && v["params"]["threadId"] == thread.as_str()
            })
            .await?;
        Ok::<_, anyhow::Error>((closed, stalled_at.elapsed()))
    };
    let ((), (closed, detected)) = tokio::try_join!(others, told)?;
    println!("stall to thread/closed at the client: {detected:?}");
    // Worst case health_interval + health_timeout = 2 s; the rest is margin for 19 tenants'
    // turns on the same 2 cores.
    assert!(
        detected < Duration::from_secs(8),
        "stall detected after {detected:?}: {closed}"
    );
    assert!(
        victim
            .backlog
            .iter()
            .any(|v| v["method"] == "thread/status/changed"
                && v["params"]["status"]["type"] == "systemError"),
        "systemError before thread/closed: {:?}",
        victim.backlog
    );
    loop {
        let r = readyz(&fleet).await?;
        let (ready, restarts) = tenant_workers(&r, "t0");
        if ready == WORKERS && restarts >= 1 {
            break;
        }
        assert!(
            stalled_at.elapsed() < Duration::from_secs(30),
            "t0 not back to {WORKERS} ready workers: {r}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And t0 works again, on the same connection.
    let resp = victim.call("thread/start", json!({})).await?;
    let thread = resp["result"]["thread"]["id"]
        .as_str()
        .expect("thread id")
        .to_owned();
    victim.start_turn(&thread, "after the stall").await?;
    let msgs = victim.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("after the stall")));
    victim.close().await;
    fleet.stop().await?;
    // No bound on the whole run: it is a check, not a benchmark (`fleet-load` measures).
    println!("whole run {:?}", started.elapsed());
    Ok(())
}
