//! Which program a worker runs: a name on PATH or a path, and for the npm launcher of codex the
//! native binary beside it (workers never run under node).

use std::path::{Path, PathBuf};

/// Finds the worker program: a path, or a name on PATH. The npm package's `codex` is a node
/// launcher; the native binary inside the package is run instead, as the design requires.
pub fn resolve_program(name: &str) -> anyhow::Result<PathBuf> {
    let found = if name.contains('/') {
        PathBuf::from(name)
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
            .ok_or_else(|| anyhow::anyhow!("worker program {name:?} is not on PATH"))?
    };
    let real = std::fs::canonicalize(&found)
        .map_err(|e| anyhow::anyhow!("worker program {}: {e}", found.display()))?;
    if real.extension().is_some_and(|e| e == "js") {
        return native_codex_beside_launcher(&real);
    }
    Ok(real)
}

/// `<…>/node_modules/@openai/codex/bin/codex.js` → the platform package's native binary.
pub(super) fn native_codex_beside_launcher(launcher: &Path) -> anyhow::Result<PathBuf> {
    let triple = match std::env::consts::ARCH {
        "x86_64" => "x86_64-unknown-linux-musl",
        "aarch64" => "aarch64-unknown-linux-musl",
        other => anyhow::bail!("no native codex for architecture {other}"),
    };
    let platform_pkg = match std::env::consts::ARCH {
        "x86_64" => "codex-linux-x64",
        _ => "codex-linux-arm64",
    };
    let pkg = launcher
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| anyhow::anyhow!("unexpected launcher path {}", launcher.display()))?;
    let candidates = [
        pkg.join("node_modules/@openai").join(platform_pkg),
        pkg.parent()
            .map(|scope| scope.join(platform_pkg))
            .unwrap_or_default(),
        pkg.to_path_buf(),
    ];
    candidates
        .iter()
        .map(|p| p.join("vendor").join(triple).join("bin/codex"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{} is the node launcher and no native codex binary was found beside it",
                launcher.display()
            )
        })
}
