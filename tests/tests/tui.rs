//! The real Codex TUI (`codex --remote`, driven in tmux) stays in its thread
//! when the worker running its turn is killed, and its next prompt completes.

use std::path::Path;
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
    // The worker running the TUI's own thread. Not "a worker with a turn": during the user's
    // turn the TUI starts a second, ephemeral thread to make the title (the facts file, §6) and
    // runs a short turn on it, which placement may put on the other worker; a worker with a turn
    // picked while that one ran was the title thread's (seen once in CI). The user's thread is
    // the one with a rollout on disk.
    let home = fleet.home("acme");
    let busy = || {
        let thread = rollout_with(&home, "SLOW30 a long turn")?;
        let pool = &fleet.tenant("acme").pool;
        let owner = pool.owner(&thread)?;
        pool.workers()
            .into_iter()
            .find(|w| w.id == owner && w.active_turns > 0)
            .and_then(|w| w.pid)
    };
    assert!(
        wait_until(Duration::from_secs(30), || busy().is_some()).await,
        "the turn runs on a worker"
    );
    tmux.until_screen_has("esc to interrupt", Duration::from_secs(30))
        .await?;
    let pid = busy().context("busy worker")?;
    let turns: Vec<_> = (fleet.tenant("acme").pool.workers().into_iter())
        .map(|w| (w.id.to_string(), w.pid, w.active_turns))
        .collect();
    eprintln!(
        "measured: killing {pid}, the TUI thread's worker; active turns per worker: {turns:?}"
    );
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

/// The thread whose rollout (under `home`'s `sessions/`) holds `text`: its id, the uuid that ends
/// the file's name (`rollout-<time>-<id>.jsonl`). Ephemeral threads write no rollout.
fn rollout_with(home: &Path, text: &str) -> Option<String> {
    let mut dirs = vec![home.join("sessions")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).ok()?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let name = path.file_name()?.to_str()?;
            let Some(stem) = name.strip_suffix(".jsonl") else {
                continue;
            };
            if stem.len() > 36
                && std::fs::read_to_string(&path).is_ok_and(|body| body.contains(text))
            {
                return Some(stem[stem.len() - 36..].to_owned());
            }
        }
    }
    None
}
