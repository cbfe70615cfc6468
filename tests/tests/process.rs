//! codex-fleet as a real process: signals (SIGTERM, SIGINT, a second one, SIGKILL) leave no
//! worker behind; workers get only the allowlisted environment; start-up warnings; the npm launcher;
//! one tenant taking every file descriptor the process may open; one tenant's worker flooding its
//! stderr; the exec shim workers start through.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use testkit::{
    agent_text, open_files, reply_text, workers_under, Client, FleetBuilder, FleetFiles,
    FleetProcess, LoweredLimit,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Waits up to `within` for `pids` to be gone; those still alive.
async fn wait_gone(pids: &[i32], within: Duration) -> Vec<i32> {
    let alive = || -> Vec<i32> {
        pids.iter()
            .copied()
            .filter(|p| testkit::process_alive(*p))
            .collect()
    };
    testkit::wait_until(within, || alive().is_empty()).await;
    alive()
}

async fn fleet_with_a_busy_worker() -> anyhow::Result<(FleetFiles, Child, Client)> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let proc = FleetProcess::spawn(&files).await?;
    let mut c = proc.client(&files, &files.token("acme")).await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "a turn before the signal").await?;
    c.until_turn_completed(&thread).await?;
    Ok((files, proc.child, c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_every_worker_and_exits_zero() -> anyhow::Result<()> {
    let (files, mut child, mut client) = fleet_with_a_busy_worker().await?;
    let workers = workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker should be running");
    let pid = Pid::from_raw(child.id().context("pid")? as i32);
    kill(pid, Signal::SIGTERM)?;
    let code = client.recv_close(Duration::from_secs(15)).await?;
    assert_eq!(code, Some(1001), "sessions close with 1001 on shutdown");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    assert!(status.success(), "codex-fleet exited with {status:?}");
    let left = wait_gone(&workers, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "workers outlived codex-fleet: {left:?}");
    assert!(testkit::processes_under(files.dir.path()).is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_leaves_no_worker_behind() -> anyhow::Result<()> {
    let (files, mut child, _client) = fleet_with_a_busy_worker().await?;
    let workers = workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker should be running");
    child.start_kill()?;
    child.wait().await?;
    let left = wait_gone(&workers, Duration::from_secs(5)).await;
    assert!(
        left.is_empty(),
        "workers outlived a SIGKILLed codex-fleet: {left:?}"
    );
    assert!(testkit::processes_under(files.dir.path()).is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_names_the_bad_key() -> anyhow::Result<()> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let ok = Command::new(testkit::fleet_bin())
        .arg("check-config")
        .arg(&files.config)
        .output()
        .await?;
    assert!(ok.status.success(), "{ok:?}");
    let bad = files.dir.path().join("bad.toml");
    let text = std::fs::read_to_string(&files.config)? + "\n[limits]\nmax_conections = 5\n";
    std::fs::write(&bad, text)?;
    let out = Command::new(testkit::fleet_bin())
        .arg("check-config")
        .arg(&bad)
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("max_conections"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_serves_a_turn_with_the_printed_credentials() -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("cfdev")
        .tempdir_in("/tmp")?;
    let state = dir.path().join("dev");
    let mut child = Command::new(testkit::fleet_bin())
        .args(["dev", "--port", "0", "--admin-port", "0", "--state-dir"])
        .arg(&state)
        .env("CODEX_BIN", testkit::codex_bin())
        .env("CODEX_FLEET_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut banner = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !banner.contains("codex exec --remote") {
        let line = tokio::time::timeout_at(deadline, lines.next_line())
            .await
            .context("dev did not print its banner")??
            .context("dev exited early")?;
        banner.push_str(&line);
        banner.push('\n');
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let token = std::fs::read_to_string(state.join("token"))?
        .trim()
        .to_owned();
    assert!(
        banner.contains(&token),
        "the token is printed once:\n{banner}"
    );
    assert!(banner.contains("offline mock model"), "{banner}");
    let exec_line = banner
        .lines()
        .find(|l| l.contains("codex exec --remote"))
        .context("no exec line")?;
    let url = exec_line
        .split_whitespace()
        .find(|w| w.starts_with("wss://"))
        .context("no url")?;
    assert!(exec_line.contains(&format!("SSL_CERT_FILE={}", state.join("ca.pem").display())));
    let out = testkit::codex_exec_remote(url, &state.join("ca.pem"), &token, "hello dev").await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains(&testkit::reply_text("hello dev")),
        "{stdout}"
    );
    kill(
        Pid::from_raw(child.id().context("pid")? as i32),
        Signal::SIGTERM,
    )?;
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    assert!(status.success(), "{status:?}");
    Ok(())
}

/// A fleet process with a turn running on `thread` (SLOW`secs`), and its worker pids.
async fn fleet_mid_turn(
    secs: u64,
) -> anyhow::Result<(FleetFiles, FleetProcess, Client, String, Vec<i32>)> {
    let files = FleetBuilder::new()
        .tenant("acme")
        .drain_toml("settle_secs = 0\ntimeout_secs = 60")
        .prepare()
        .await?;
    let proc = FleetProcess::spawn(&files).await?;
    let mut c = proc.client(&files, &files.token("acme")).await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, &format!("SLOW{secs} a turn across the signal"))
        .await?;
    c.notification("turn/started").await?;
    let workers = workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker should be running");
    Ok((files, proc, c, thread, workers))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_drains_like_sigterm() -> anyhow::Result<()> {
    let (files, mut proc, mut c, thread, workers) = fleet_mid_turn(3).await?;
    proc.signal(Signal::SIGINT)?;
    // The running turn finishes, then the session closes with 1001 and codex-fleet exits 0.
    let msgs = c.until_turn_completed(&thread).await?;
    let done = msgs.last().context("turn/completed")?;
    assert_eq!(done["params"]["turn"]["status"], "completed", "{done}");
    assert_eq!(
        agent_text(&msgs),
        Some(reply_text("SLOW3 a turn across the signal"))
    );
    assert_eq!(c.recv_close(Duration::from_secs(15)).await?, Some(1001));
    let status = proc.wait(Duration::from_secs(30)).await?;
    assert!(status.success(), "{status:?}: {}", proc.stderr());
    let left = wait_gone(&workers, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "workers outlived codex-fleet: {left:?}");
    assert!(testkit::processes_under(files.dir.path()).is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_exits_at_once_with_130() -> anyhow::Result<()> {
    let (files, mut proc, _c, _thread, workers) = fleet_mid_turn(60).await?;
    proc.signal(Signal::SIGTERM)?;
    // The drain waits for the 60 s turn: codex-fleet is still running a moment later.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        proc.child.try_wait()?.is_none(),
        "codex-fleet must still be draining: {}",
        proc.stderr()
    );
    proc.signal(Signal::SIGTERM)?;
    // "At once": far below the 60 s turn and the 60 s drain timeout.
    let status = proc.wait(Duration::from_secs(10)).await?;
    assert_eq!(status.code(), Some(130), "{status:?}: {}", proc.stderr());
    let left = wait_gone(&workers, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "workers outlived codex-fleet: {left:?}");
    assert!(testkit::processes_under(files.dir.path()).is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_only_the_allowlisted_environment_and_pass_env() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .workers_toml("pass_env = [\"FLEET_TEST_PASSED\"]")
        .tenant("acme")
        .prepare()
        .await?;
    let proc = FleetProcess::spawn_with(&files, |cmd| {
        cmd.env("FLEET_TEST_PASSED", "passed-value")
            .env("FLEET_TEST_SECRET", "must-not-leak");
    })
    .await?;
    let _c = proc.client(&files, &files.token("acme")).await?;
    let workers = workers_under(files.dir.path());
    assert!(!workers.is_empty(), "a worker should be running");
    let allowed = [
        "PATH",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "HOME",
        "CODEX_HOME",
        "FLEET_TEST_PASSED",
        // codex-fleet's own switch that keeps remote control off (Security).
        "CODEX_INTERNAL_APP_SERVER_REMOTE_CONTROL_DISABLED",
    ];
    for pid in workers {
        let env = std::fs::read(format!("/proc/{pid}/environ"))?;
        let vars: Vec<String> = env
            .split(|b| *b == 0)
            .filter(|kv| !kv.is_empty())
            .map(|kv| String::from_utf8_lossy(kv).into_owned())
            .collect();
        assert!(
            vars.iter().any(|kv| kv == "FLEET_TEST_PASSED=passed-value"),
            "pass_env reaches the worker: {vars:?}"
        );
        for kv in &vars {
            let name = kv.split('=').next().unwrap_or_default();
            assert!(allowed.contains(&name), "worker {pid} has {kv}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_warns_about_its_own_files_readable_by_others() -> anyhow::Result<()> {
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let warning = "readable by other users";
    // As written by the fixture (0600): no warning.
    let quiet = FleetProcess::spawn(&files).await?;
    quiet.client(&files, &files.token("acme")).await?;
    assert!(!quiet.stderr().contains(warning), "{}", quiet.stderr());
    drop(quiet);
    let key = files.dir.path().join("tls.key");
    for path in [&files.config, &key] {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    }
    let loud = FleetProcess::spawn(&files).await?;
    assert!(
        loud.wait_for_stderr(warning, Duration::from_secs(10)).await,
        "no start-up warning: {}",
        loud.stderr()
    );
    let text = loud.stderr();
    for path in [&files.config, &key] {
        assert!(
            text.lines()
                .any(|l| l.contains(warning) && l.contains(&path.display().to_string())),
            "no warning naming {}: {text}",
            path.display()
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_npm_launcher_is_resolved_to_the_native_binary() -> anyhow::Result<()> {
    // CODEX_BIN is <modules>/@openai/codex-linux-x64/vendor/<triple>/bin/codex; the npm
    // launcher of the same install is <modules>/@openai/codex/bin/codex.js.
    let native = std::fs::canonicalize(testkit::codex_bin())?;
    let scope = native
        .ancestors()
        .nth(5)
        .context("CODEX_BIN is not inside an npm install")?;
    let launcher = scope.join("codex/bin/codex.js");
    assert!(
        launcher.is_file(),
        "{} is missing: CODEX_BIN must come from `npm install @openai/codex` (ops/install-codex.sh)",
        launcher.display()
    );
    let files = FleetBuilder::new().tenant("acme").prepare().await?;
    let q = |p: &std::path::Path| serde_json::to_string(&p.display().to_string()).expect("string");
    let text = std::fs::read_to_string(&files.config)?;
    let swapped = text.replace(&q(&testkit::codex_bin()), &q(&launcher));
    assert_ne!(text, swapped, "workers.command names the codex binary");
    std::fs::write(&files.config, swapped)?;
    let fleet = files.start().await?;
    let mut c = fleet.client("acme").await?;
    let thread = c.start_thread().await?;
    c.start_turn(&thread, "through the launcher").await?;
    let msgs = c.until_turn_completed(&thread).await?;
    assert_eq!(agent_text(&msgs), Some(reply_text("through the launcher")));
    let workers = workers_under(fleet.files.dir.path());
    assert!(!workers.is_empty());
    for pid in workers {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
        assert_eq!(exe, native, "worker {pid} runs {}", exe.display());
    }
    fleet.stop().await
}

/// One tenant takes every file descriptor the process lets connections open (its open-files
/// limit lowered under it with `prlimit`, so the per-tenant connection cap does not stop it
/// first: connections stop [`router::descriptors::RESERVE`] under the limit), and bare TCP
/// connections wait behind it: the accept loop defers them, counts every deferral, logs at most
/// one line a second and keeps going. Meanwhile the admin port answers its liveness probe and
/// a scrape from the reserve (before it, the kubelet restarted the pod under every tenant);
/// another tenant's session already open keeps working, a turn included; once the hog lets go,
/// a new session of the other tenant connects and runs on a new leg. Nothing is refused for
/// good and the process does not exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_takes_every_file_descriptor_does_not_stop_another() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .tenant_pool("hog", 1, 1)
        .limits_toml(
            "handshakes_per_sec_per_ip = 100000\nhandshake_burst = 100000\nmax_connections_per_tenant = 10000",
        )
        .prepare()
        .await?;
    let proc = FleetProcess::spawn(&files).await?;
    let pid = proc.pid().context("pid")?;
    let mut acme = proc.client(&files, &files.token("acme")).await?;
    let thread = acme.start_thread().await?;
    acme.start_turn(&thread, "before the hog").await?;
    acme.until_turn_completed(&thread).await?;
    // The hog opens sessions, each told to open a leg to its worker, until three cannot: the
    // answer is app-server's overloaded error (the leg could not be opened), or nothing while
    // the TLS handshake waits in the listen queue because the accept loop defers it (or, when
    // the last session's leg took the last descriptor after the accept loop looked, accepted
    // but unserved: never closed without a word).
    let hog_session = || async {
        // Every error is a refusal here: the upgrade's, or the leg's answer to the request.
        let session = async {
            let mut c = proc.client(&files, &files.token("hog")).await?;
            c.request("thread/loaded/list", serde_json::json!({}))
                .await?;
            anyhow::Ok(c)
        };
        anyhow::Ok(session.await.map_err(|e| e.to_string()))
    };
    let refusals_hold = |hog: usize, refused: &[String]| {
        assert_eq!(
            refused.len(),
            3,
            "the hog never ran out of descriptors: {hog} sessions"
        );
        for r in refused {
            assert!(
                r.contains("\"code\":-32001") && r.contains("workerUnreachable")
                    || r == "no answer within 3 s",
                "{r}"
            );
        }
    };
    // The limit is lowered under the running process: connections get a little room above
    // what it holds now, and the reserve stays above that. First at a room of the other
    // parity (a session takes two descriptors), so that both endings are exercised (which
    // room gives which depends on what the process held before); then the hog lets go.
    let settled = open_files(pid);
    let (hog, refused) = LoweredLimit::set(pid, 25)?.fill(hog_session).await?;
    eprintln!(
        "measured: at one room the hog holds {} sessions; refused: {refused:?}",
        hog.len()
    );
    refusals_hold(hog.len(), &refused);
    for c in hog {
        c.close().await;
    }
    testkit::until_open_files_at_most(pid, settled).await?;
    let lowered = LoweredLimit::set(pid, 24)?;
    let LoweredLimit { limit, line } = lowered;
    let (hog, refused) = lowered.fill(hog_session).await?;
    refusals_hold(hog.len(), &refused);
    eprintln!(
        "measured: the hog holds {} sessions, the process {} descriptors (limit {limit}, line {line}); refused: {refused:?}",
        hog.len(),
        open_files(pid)
    );
    // Connections that never start TLS (anyone's, before any token) wait in the listen queue
    // behind the hog. The log says so once a second at most, however often the accept loop
    // tries (every 50 ms).
    let failures_logged = || {
        proc.stderr()
            .lines()
            .filter(|l| l.contains("accept failed") && l.contains("listener=\"client\""))
            .count()
    };
    let logged_before = failures_logged();
    let mut raw = Vec::new();
    for _ in 0..8 {
        raw.push(tokio::net::TcpStream::connect(proc.addr).await?);
    }
    let held = tokio::time::Instant::now();
    // The admin port answers from the reserve: the liveness probe, every time, and a scrape
    // that says how close the process is (what the alert CodexFleetOpenFilesNearLimit watches).
    let open = lowered.admin_answers(proc.admin).await?;
    eprintln!("measured: at the line /metrics says {open} of {limit} descriptors open");
    // The other tenant's open session keeps working meanwhile: a request and a whole turn.
    let read = acme
        .request("thread/read", serde_json::json!({"threadId": thread}))
        .await?;
    assert_eq!(read["thread"]["id"], thread.as_str());
    acme.start_turn(&thread, "while the hog holds everything")
        .await?;
    let msgs = acme.until_turn_completed(&thread).await?;
    assert_eq!(
        agent_text(&msgs).as_deref(),
        Some(reply_text("while the hog holds everything").as_str())
    );
    tokio::time::sleep_until(held + Duration::from_secs(3)).await;
    let lines = failures_logged() - logged_before;
    let held = held.elapsed().as_secs_f64();
    eprintln!("measured: {lines} accept-failure lines logged in {held:.1} s at the line");
    assert!(
        lines >= 1 && lines as f64 <= held.ceil() + 1.0,
        "{lines} lines in {held:.1} s: {}",
        proc.stderr()
    );
    assert!(
        proc.stderr()
            .contains("every file descriptor below the open-files limit's reserve is in use"),
        "{}",
        proc.stderr()
    );
    // The hog lets go; a new session of the other tenant gets in and opens a new leg.
    drop(raw);
    for c in hog {
        c.close().await;
    }
    let mut again = None;
    for _ in 0..20 {
        let attempt = tokio::time::timeout(Duration::from_secs(3), async {
            let mut c = proc.client(&files, &files.token("acme")).await?;
            c.request("thread/read", serde_json::json!({"threadId": thread}))
                .await?;
            anyhow::Ok(c)
        })
        .await;
        if let Ok(Ok(c)) = attempt {
            again = Some(c);
            break;
        }
    }
    assert!(
        again.is_some(),
        "no new session after the hog let go: {}",
        proc.stderr()
    );
    let (ready, detail) = testkit::http_get(proc.admin, "/readyz").await?;
    assert_eq!(ready, 200, "ready again once the hog let go: {detail}");
    // Every deferred accept was counted, not only those logged.
    let (_, metrics) = testkit::http_get(proc.admin, "/metrics").await?;
    let failed = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("codex_fleet_accept_errors_total{listener=\"client\"} ")?
                .parse::<f64>()
                .ok()
        })
        .context("codex_fleet_accept_errors_total")?;
    eprintln!("measured: {failed} deferred accepts counted");
    assert!(failed > lines as f64, "{failed} counted, {lines} logged");
    assert!(testkit::process_alive(i32::try_from(pid)?));
    Ok(())
}

/// A tenant's `command`: the real app-server, with `yes` beside it writing warnings to its stderr as
/// fast as the pipe takes them.
fn flooding_command() -> String {
    format!(
        "command = [\"/bin/sh\", \"-c\", \"/usr/bin/yes 'WARN flood' >&2 & exec \\\"$0\\\" \\\"$@\\\"\", {:?}, \"app-server\"]",
        testkit::codex_bin().display().to_string()
    )
}

/// One tenant's worker floods its stderr (`yes`, started beside app-server, writing warnings as
/// fast as the pipe takes them). codex-fleet reads a worker's output at its pace and logs it
/// within its budget: the flood costs codex-fleet a few percent of a core, its log at most the
/// budget's lines per worker process, and another tenant's requests and turns go on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_flooding_its_stderr_costs_the_fleet_little_and_another_tenant_goes_on(
) -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .limits_toml("turn_start_per_min = 6000\nturn_start_burst = 100")
        .tenant_pool("hog", 1, 1)
        .tenant_toml(&flooding_command())
        .prepare()
        .await?;
    let spawned = std::time::Instant::now();
    let proc = FleetProcess::spawn(&files).await?;
    let pid = proc.pid().context("pid")?;
    let flood_lines = || {
        proc.stderr()
            .lines()
            .filter(|l| l.contains("WARN flood"))
            .count()
    };
    anyhow::ensure!(
        testkit::wait_until(Duration::from_secs(20), || flood_lines() > 0).await,
        "the hog's flood never reached the log: {}",
        proc.stderr()
    );
    let mut acme = proc.client(&files, &files.token("acme")).await?;
    let thread = acme.start_thread().await?;
    let cpu_before = testkit::process::cpu_secs(pid).context("cpu")?;
    let started = std::time::Instant::now();
    let window = Duration::from_secs(6);
    let mut turns = 0;
    while started.elapsed() < window {
        let prompt = format!("during the flood {turns}");
        acme.start_turn(&thread, &prompt).await?;
        let msgs = acme.until_turn_completed(&thread).await?;
        assert_eq!(
            agent_text(&msgs).as_deref(),
            Some(reply_text(&prompt).as_str())
        );
        acme.request("thread/read", serde_json::json!({"threadId": thread}))
            .await?;
        turns += 1;
    }
    let elapsed = started.elapsed();
    let cpu = testkit::process::cpu_secs(pid).context("cpu")? - cpu_before;
    let share = cpu / elapsed.as_secs_f64();
    let log = proc.stderr();
    let lines = log.lines().filter(|l| l.contains("WARN flood")).count() as u64;
    let counted: u64 = log
        .lines()
        .filter(|l| l.contains("over the log budget"))
        .filter_map(|l| {
            l.rsplit_once("lines=")
                .and_then(|(_, n)| n.trim().parse::<u64>().ok())
        })
        .sum();
    // Every process of the hog's worker (a restart is a new one) has its own budget.
    let processes = testkit::metric_at(
        proc.admin,
        "codex_fleet_worker_starts_total",
        &[("tenant", "hog")],
    )
    .await? as u64;
    let allowed = processes * (200 + (spawned.elapsed().as_secs_f64() * 20.0).ceil() as u64);
    eprintln!(
        "measured: {turns} turns of acme in {elapsed:?} while the hog flooded; codex-fleet used {:.1}% of a core; {lines} flood lines logged from {processes} worker process(es) (at most {allowed}), {counted} counted and left out",
        share * 100.0
    );
    // The lines left out are the hog's, counted under its name only.
    let metric = "codex_fleet_worker_log_lines_dropped_total";
    let hog_dropped = testkit::metric_at(proc.admin, metric, &[("tenant", "hog")]).await?;
    let acme_dropped = testkit::metric_at(proc.admin, metric, &[("tenant", "acme")]).await?;
    eprintln!("measured: codex_fleet_worker_log_lines_dropped_total hog {hog_dropped}, acme {acme_dropped}");
    assert!(hog_dropped >= counted as f64, "{hog_dropped} < {counted}");
    assert_eq!(acme_dropped, 0.0);
    assert!(turns >= 3, "acme ran {turns} turns in {elapsed:?}");
    assert!(lines <= allowed, "{lines} flood lines logged");
    assert!(counted > lines, "the flood was read and counted: {counted}");
    assert!(
        share < 0.25,
        "codex-fleet used {:.1}% of a core",
        share * 100.0
    );
    Ok(())
}

/// codex-fleet's stderr is not read (a stalled log collector, a full pipe) while one tenant's two
/// workers flood their stderr into codex-fleet's log. Log lines are written by a thread of their
/// own from a bounded queue: they are dropped and counted, never waited for, so no thread that
/// serves sessions stops on the log, and another tenant's turns go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stderr_nobody_reads_drops_log_lines_and_never_stops_the_fleet() -> anyhow::Result<()> {
    let files = FleetBuilder::new()
        .tenant_pool("acme", 1, 1)
        .tenant_pool("hog", 2, 2)
        .tenant_toml(&flooding_command())
        .prepare()
        .await?;
    let (unread, stderr) = nix::unistd::pipe()?;
    // The smallest pipe the kernel allows: a few log lines fill it.
    nix::fcntl::fcntl(&stderr, nix::fcntl::FcntlArg::F_SETPIPE_SZ(4096))?;
    let proc = FleetProcess::spawn_with(&files, |cmd| {
        // A queue the flood fills at once (1,024 lines by default).
        cmd.stderr(Stdio::from(stderr))
            .env("CODEX_FLEET_LOG_QUEUE_LINES", "64");
    })
    .await?;
    // A fleet stuck on its log answers no scrape either.
    let dropped = || async {
        let scrape = testkit::metric_at(proc.admin, "codex_fleet_log_lines_dropped_total", &[]);
        match tokio::time::timeout(Duration::from_secs(5), scrape).await {
            Ok(Ok(n)) => n,
            _ => 0.0,
        }
    };
    anyhow::ensure!(
        testkit::wait_until_async(Duration::from_secs(30), || async { dropped().await > 0.0 })
            .await,
        "no log line was dropped"
    );
    let before = dropped().await;
    let mut acme = proc.client(&files, &files.token("acme")).await?;
    let thread = acme.start_thread().await?;
    for turn in 0..3 {
        let prompt = format!("while nobody reads the log {turn}");
        acme.start_turn(&thread, &prompt).await?;
        let msgs =
            tokio::time::timeout(Duration::from_secs(30), acme.until_turn_completed(&thread))
                .await
                .context("a turn stopped behind the log")??;
        assert_eq!(
            agent_text(&msgs).as_deref(),
            Some(reply_text(&prompt).as_str())
        );
    }
    // The log is still stalled, and lines still dropped. The hog's workers may be between a
    // restart and the next (app-server blocks on a stderr `yes` fills, and is found hung), so
    // their lines may come in bursts: waited for, not sampled once.
    let still_dropped = testkit::wait_until_async(Duration::from_secs(30), || async {
        dropped().await > before
    })
    .await;
    let after = dropped().await;
    eprintln!("measured: {before} log lines dropped before acme's turns, {after} after");
    assert!(still_dropped, "no more lines were dropped after {before}");
    drop(unread);
    Ok(())
}

/// The binary as the exec shim its workers start through (`worker::process::exec`), as codex-fleet
/// runs it: `parent` and the steps, then the worker's command; its exit status, pid and output.
fn shim(
    parent: u32,
    steps: &[&str],
    worker: &[&str],
) -> anyhow::Result<(Option<i32>, u32, String, String)> {
    // Through a shell that sets a umask other than the worker's and then becomes the shim (same
    // pid, same parent), so the umask the worker reports is the shim's doing, whatever the test
    // runner's own umask is.
    let child = std::process::Command::new("/bin/sh")
        .args(["-c", "umask 022 && exec \"$@\"", "sh"])
        .arg(testkit::fleet_bin())
        .arg(worker::process::exec::SHIM_ARG)
        .arg(parent.to_string())
        .args(steps)
        // The worker's working directory, which the shim enters.
        .arg("/tmp")
        .arg("--")
        .args(worker)
        .env_clear()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let out = child.wait_with_output()?;
    Ok((
        out.status.code(),
        pid,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The exec shim applies a worker's steps and then becomes it (same pid, so the supervisor's
/// child, its process group and its pipes are the worker's): CPU priority, open-files and process
/// limits, umask, working directory and, as root, the tenant's uid and gid. It refuses, with exit 126 and the reason
/// on stderr, a parent that is not the supervisor named (it died meanwhile), a command line it
/// cannot read, and a worker it cannot execute; it never runs the worker unconfined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exec_shim_applies_a_workers_steps_then_becomes_it_or_says_why_not(
) -> anyhow::Result<()> {
    let me = std::process::id();
    let own_nice: i32 = std::fs::read_to_string("/proc/self/stat")?
        .rsplit_once(')')
        .and_then(|(_, s)| s.split_whitespace().nth(16)?.parse().ok())
        .context("nice")?;
    let report = "echo $$; cut -d' ' -f19 /proc/self/stat; ulimit -n; umask; id -u; id -g; \
                  grep '^Max processes' /proc/self/limits; pwd";
    let root = nix::unistd::geteuid().is_root();
    // A process limit the shim may set (at most the hard limit it inherits) and that no shared
    // host's processes of the uid come near.
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NPROC)?;
    let nproc = hard.min(99_999).to_string();
    let user = if root { "65534:65533" } else { "-" };
    let (code, pid, out, err) = shim(
        me,
        &["3", user, "77", "-", "-", &nproc],
        &["/bin/sh", "-c", report],
    )?;
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines.first(),
        Some(&pid.to_string().as_str()),
        "the same process: {out}"
    );
    assert_eq!(
        lines.get(1),
        Some(&(own_nice + 3).min(19).to_string().as_str()),
        "{out}"
    );
    assert_eq!(lines.get(2), Some(&"77"), "{out}");
    assert_eq!(lines.get(3), Some(&"0077"), "{out}");
    if root {
        assert_eq!(lines.get(4..6), Some(&["65534", "65533"][..]), "{out}");
    }
    let limits: Vec<&str> = lines.get(6).context("limits")?.split_whitespace().collect();
    assert_eq!(
        limits.get(2..4),
        Some(&[nproc.as_str(), nproc.as_str()][..]),
        "{out}"
    );
    assert_eq!(lines.get(7), Some(&"/tmp"), "{out}");

    // Refused: a parent that is not ours, a command line it cannot read, a worker it cannot run.
    let steps = ["0", "-", "-", "-", "-", "-"];
    let cases: [(u32, &[&str], &[&str], &str); 4] = [
        (1, &steps, &["/bin/sh", "-c", "echo ran"], "No such process"),
        (
            me,
            &steps[1..],
            &["/bin/sh", "-c", "echo ran"],
            "bad shim arguments",
        ),
        (
            me,
            &["0", "-", "-", "-", "-", "x"],
            &["/bin/sh", "-c", "echo ran"],
            "bad shim arguments",
        ),
        (
            me,
            &steps,
            &["/nonexistent/codex"],
            "exec /nonexistent/codex",
        ),
    ];
    for (parent, steps, worker, why) in cases {
        let (code, _, out, err) = shim(parent, steps, worker)?;
        assert_eq!(code, Some(worker::process::exec::SHIM_FAILED), "{err}");
        assert!(out.is_empty(), "the worker ran: {out}");
        assert!(
            err.contains("starting the worker") && err.contains(why),
            "{why}: {err}"
        );
    }
    Ok(())
}
