//! The real Codex TUI in a tmux server of a test's own: start it, type into it, read its screen.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use crate::process::codex_bin;

/// A tmux server of our own (`-L`), so nothing else on the machine is touched.
pub struct Tmux {
    socket: String,
    /// The TUI's CODEX_HOME and working directory, kept while it runs.
    dirs: Vec<tempfile::TempDir>,
}

// === impl Tmux ===

impl Tmux {
    /// A tmux server named after this process and `name`.
    pub fn new(name: &str) -> Tmux {
        Tmux {
            socket: format!("cf-{name}-{}", std::process::id()),
            dirs: Vec::new(),
        }
    }

    /// Starts the real Codex TUI (`codex --remote url`, trusting `ca`, with `token`) in the
    /// pane `tui`, in fresh directories, and waits for its prompt. When it exits the pane shows
    /// `TUI-EXITED`.
    pub async fn start_tui(&mut self, url: &str, ca: &Path, token: &str) -> anyhow::Result<()> {
        let home = tempfile::tempdir()?;
        let work = tempfile::tempdir()?;
        let command = format!(
            "cd {work} && SSL_CERT_FILE={ca} CODEX_HOME={home} FLEET_TOKEN={token} {codex} \
             --remote {url} --remote-auth-token-env FLEET_TOKEN; echo TUI-EXITED $?; sleep 600",
            work = work.path().display(),
            ca = ca.display(),
            home = home.path().display(),
            codex = codex_bin().display(),
        );
        self.dirs.extend([home, work]);
        self.run(&[
            "new-session",
            "-d",
            "-s",
            "tui",
            "-x",
            "160",
            "-y",
            "45",
            &command,
        ])?;
        self.until_screen_has("Ask Codex to do anything", Duration::from_secs(60))
            .await?;
        Ok(())
    }

    /// Runs a tmux command on this server.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .context("tmux must be installed (ops/test.sh installs it)")?;
        if !out.status.success() {
            anyhow::bail!("tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The pane `tui` as text.
    pub fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "tui"])
            .unwrap_or_default()
    }

    /// Types `text` into the pane `tui`, then Enter.
    pub fn type_line(&self, text: &str) -> anyhow::Result<()> {
        self.run(&["send-keys", "-t", "tui", "-l", text])?;
        std::thread::sleep(Duration::from_millis(300));
        self.run(&["send-keys", "-t", "tui", "Enter"])?;
        Ok(())
    }

    /// Waits until the pane shows `needle`; returns the screen.
    pub async fn until_screen_has(&self, needle: &str, within: Duration) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let screen = self.screen();
            if screen.contains(needle) {
                return Ok(screen);
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("the TUI never showed {needle:?}; screen:\n{screen}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}
