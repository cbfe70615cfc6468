//! A tenant's filesystem roots, and canonical resolution of the paths clients name.
//!
//! A path is inside the roots when its canonical form (symlinks followed, `..` resolved by the
//! kernel) starts with a canonical root. A path that does not exist yet is resolved through its
//! longest existing ancestor; the rest may not contain `..` and may not start with a dangling
//! symlink (writing through one would create its target wherever it points).
//!
//! Checks run before the worker acts, so a tenant that can also run commands could swap a
//! checked file for a symlink in between; this is defence in depth, the per-tenant uid is the
//! boundary (docs/decisions/0011-containment-by-the-os-first.md).

use std::io;
use std::path::{Component, Path, PathBuf};

/// Where one tenant may point host-access methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantRoots {
    allowed: Vec<PathBuf>,
    codex_home: PathBuf,
    excluded: Vec<PathBuf>,
}

/// Why a path is refused; the message never shows the resolved path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Resolves outside every root, or into an excluded directory.
    #[error("is outside the tenant's workspace")]
    Outside,
    /// Empty, or not resolvable (permissions, a file used as a directory, …).
    #[error("cannot be resolved")]
    Unresolvable,
    /// `..` in the part that does not exist yet.
    #[error("climbs out of a directory that does not exist")]
    DotDot,
    /// The first missing component is a symlink to nowhere.
    #[error("goes through a dangling symlink")]
    DanglingSymlink,
}

impl TenantRoots {
    /// Roots from existing directories: the workspaces (the first is the workers' working
    /// directory) and the tenant's CODEX_HOME, which is never inside the roots even if a
    /// workspace contains it.
    pub fn new(workspaces: &[PathBuf], codex_home: &Path) -> io::Result<TenantRoots> {
        if workspaces.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a tenant needs at least one workspace root",
            ));
        }
        let allowed = workspaces
            .iter()
            .map(std::fs::canonicalize)
            .collect::<io::Result<Vec<_>>>()?;
        let codex_home = std::fs::canonicalize(codex_home)?;
        Ok(TenantRoots {
            allowed,
            excluded: vec![codex_home.clone()],
            codex_home,
        })
    }

    /// Also refuses everything under `path` (codex-fleet's own state, keys, sockets), even
    /// inside a root. A path that does not exist is excluded as written.
    pub fn exclude(mut self, path: &Path) -> TenantRoots {
        self.excluded
            .push(std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned()));
        self
    }

    /// The first workspace: the workers' working directory, and the base for relative paths.
    pub fn workspace(&self) -> &Path {
        // `new` refuses an empty list.
        self.allowed
            .first()
            .map_or(Path::new("/"), PathBuf::as_path)
    }

    /// The canonical workspace roots.
    pub fn allowed(&self) -> &[PathBuf] {
        &self.allowed
    }

    /// Resolves `path` and checks it lies inside a root and outside every exclusion.
    pub fn check(&self, path: &str) -> Result<PathBuf, PathError> {
        let resolved = resolve(path, self.workspace())?;
        let inside = self.allowed.iter().any(|r| resolved.starts_with(r));
        let excluded = self.excluded.iter().any(|x| resolved.starts_with(x));
        if inside && !excluded {
            Ok(resolved)
        } else {
            Err(PathError::Outside)
        }
    }

    /// Checks a rollout file named by `thread/resume` or `thread/fork` `path`: it must lie in
    /// the tenant's own `sessions/` or `archived_sessions/`.
    pub fn check_rollout(&self, path: &str) -> Result<PathBuf, PathError> {
        self.check_home(path, &["sessions", "archived_sessions"])
    }

    /// Checks a skill file named in a turn's input: inside the roots, or among the tenant's
    /// own installed skills and plugins in its CODEX_HOME.
    pub fn check_skill(&self, path: &str) -> Result<PathBuf, PathError> {
        self.check(path)
            .or_else(|_| self.check_home(path, &["skills", "plugins"]))
    }

    /// `path` must resolve inside one of `subdirs` of the tenant's CODEX_HOME.
    fn check_home(&self, path: &str, subdirs: &[&str]) -> Result<PathBuf, PathError> {
        let resolved = resolve(path, &self.codex_home)?;
        let ok = subdirs
            .iter()
            .any(|d| resolved.starts_with(self.codex_home.join(d)));
        if ok {
            Ok(resolved)
        } else {
            Err(PathError::Outside)
        }
    }
}

/// The canonical form of `path` (relative paths are taken from `base`), following symlinks;
/// for a path that does not exist yet, its longest existing ancestor's canonical form plus
/// the missing components.
pub fn resolve(path: &str, base: &Path) -> Result<PathBuf, PathError> {
    if path.is_empty() || path.contains('\0') {
        return Err(PathError::Unresolvable);
    }
    let full = base.join(path);
    for ancestor in full.ancestors() {
        match std::fs::canonicalize(ancestor) {
            Ok(canonical) => {
                let rest = full
                    .strip_prefix(ancestor)
                    .map_err(|_| PathError::Unresolvable)?;
                return join_missing(canonical, rest);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(_) => return Err(PathError::Unresolvable),
        }
    }
    Err(PathError::Unresolvable)
}

/// Appends the components that do not exist yet, refusing `..` and dangling symlinks.
fn join_missing(mut canonical: PathBuf, rest: &Path) -> Result<PathBuf, PathError> {
    let mut first = true;
    for component in rest.components() {
        match component {
            Component::Normal(name) => {
                canonical.push(name);
                // Only the first missing component can exist: as a symlink to nowhere.
                if first && std::fs::symlink_metadata(&canonical).is_ok() {
                    return Err(PathError::DanglingSymlink);
                }
                first = false;
            }
            Component::CurDir => {}
            Component::ParentDir => return Err(PathError::DotDot),
            Component::RootDir | Component::Prefix(_) => return Err(PathError::Unresolvable),
        }
    }
    Ok(canonical)
}
