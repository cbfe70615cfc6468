//! The real Codex TUI (`codex --remote`, driven in tmux) stays in its thread
//! when the worker running its turn is killed, and its next prompt completes.

use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use testkit::{wait_until, FleetBuilder, Tmux};

use testkit::FAST_FAULTS as FAST;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tui_stays_in_its_thread_when_its_worker_dies_mid_turn() -> anyhow::Result<()> {
    let fleet = FleetBuilder::new()
        .tenant_pool("acme", 2, 2)
        .workers_toml(FAST)
        .start()
        .await?;
    assert!(testkit::pools_ready(&fleet, &[("acme", 2)]).await);
    let mut tmux = Tmux::new("tui");
    tmux.start_tui(&fleet.url(), &fleet.files.ca, &fleet.files.token("acme"))
        .await?;
    tmux.type_line("SLOW30 a long turn")?;
    // The worker running the turn.
    let busy = || {
        fleet
            .tenant("acme")
            .pool
            .workers()
            .into_iter()
            .find(|w| w.active_turns > 0)
            .and_then(|w| w.pid)
    };
    assert!(
        wait_until(Duration::from_secs(30), || busy().is_some()).await,
        "the turn runs on a worker"
    );
    tmux.until_screen_has("esc to interrupt", Duration::from_secs(30))
        .await?;
    let pid = busy().context("busy worker")?;
    kill(Pid::from_raw(i32::try_from(pid)?), Signal::SIGKILL)?;
    let screen = tmux
        .until_screen_has("Conversation interrupted", Duration::from_secs(30))
        .await?;
    eprintln!("measured: the TUI right after its worker was killed mid-turn:\n{screen}");
    assert!(
        screen.contains("the worker running this turn ended unexpectedly"),
        "{screen}"
    );
    assert!(!screen.contains("Disconnected"), "{screen}");
    assert!(!screen.contains("TUI-EXITED"), "{screen}");
    // The next prompt completes, in the same TUI, on the thread's new worker.
    tmux.type_line("after the crash")?;
    let screen = tmux
        .until_screen_has(
            &testkit::reply_text("after the crash"),
            Duration::from_secs(60),
        )
        .await?;
    assert!(!screen.contains("TUI-EXITED"), "{screen}");
    assert!(
        screen.contains("SLOW30 a long turn"),
        "still the same thread: {screen}"
    );
    drop(tmux);
    fleet.stop().await
}
