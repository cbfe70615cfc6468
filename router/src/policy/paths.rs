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

use std::cell::Cell;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::{Mode, SFlag};

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
    /// Relative, where the worker would read it from its working directory (the workspace) and
    /// the check from the tenant's CODEX_HOME: the two would not be the same file.
    #[error("must be an absolute path")]
    Relative,
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

    /// `path` must be absolute (the worker reads a relative one from its working directory, not
    /// from CODEX_HOME) and resolve inside one of `subdirs` of the tenant's CODEX_HOME.
    fn check_home(&self, path: &str, subdirs: &[&str]) -> Result<PathBuf, PathError> {
        if !Path::new(path).is_absolute() {
            return Err(PathError::Relative);
        }
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
///
/// The longest existing ancestor is searched by halves (after the path and its parent, the
/// common cases): resolving an ancestor stops at the first missing component, so ancestors
/// resolve up to some length and fail beyond it. A path of `n` components that does not exist
/// therefore costs at most `2 + log2 n` resolutions, not `n` (a tenant's `a/a/a/…` of 2,000
/// components cost 2,000 resolutions of up to 2,000 components each).
pub fn resolve(path: &str, base: &Path) -> Result<PathBuf, PathError> {
    if path.is_empty() || path.contains('\0') {
        return Err(PathError::Unresolvable);
    }
    let full = base.join(path);
    // Longest first: `ancestors[0]` is `full`, the last is the root.
    let ancestors: Vec<&Path> = full.ancestors().collect();
    let found = |i: usize| -> Result<Option<PathBuf>, PathError> {
        match canonical(ancestors[i]) {
            Ok(canonical) => Ok(Some(canonical)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(_) => Err(PathError::Unresolvable),
        }
    };
    let joined = |i: usize, canonical: PathBuf| {
        let rest = full
            .strip_prefix(ancestors[i])
            .map_err(|_| PathError::Unresolvable)?;
        join_missing(canonical, rest)
    };
    let last = ancestors.len() - 1;
    for i in 0..=last.min(1) {
        if let Some(canonical) = found(i)? {
            return joined(i, canonical);
        }
    }
    // Ancestors `..missing` do not exist; find the first that does in `missing+1..=last`.
    let (mut missing, mut exists) = (1.min(last), None);
    let mut hi = last + 1;
    while missing + 1 < hi {
        let mid = missing + (hi - missing) / 2;
        match found(mid)? {
            Some(canonical) => {
                exists = Some((mid, canonical));
                hi = mid;
            }
            None => missing = mid,
        }
    }
    match exists {
        Some((i, canonical)) => joined(i, canonical),
        None => Err(PathError::Unresolvable),
    }
}

/// Symlinks one resolution follows at most, as Linux's own path walk (`ELOOP` beyond).
const MAX_SYMLINKS: usize = 40;

/// `realpath(3)` of the absolute `path`, within the budget of the check running on this thread
/// ([`within`]), charged one lookup per component walked, symlinks' targets and `..` included
/// (a target's components are charged once more as it is read). A symlink on procfs is not
/// followed: the path is unresolvable (its meaning depends on the process that opens it).
///
/// The walk holds the directory it has reached open (`O_PATH`) and looks up each component in
/// it alone (`openat` with `O_NOFOLLOW`, `fstat`, `readlinkat`): the kernel never walks a
/// prefix again, so a lookup's cost does not grow with the path's depth, and a directory the
/// tenant swaps for a symlink behind the walk costs it nothing more (the kernel's own walk would
/// follow it on every later lookup of the prefix). `fs::canonicalize` could be charged only what
/// the client wrote: a path written as one component through a chain of symlinks whose targets
/// are long (`d/../d/../…`) is tens of thousands of lookups, and a 1.2 KiB request of such paths
/// held a runtime thread for seconds.
pub(super) fn canonical(path: &Path) -> io::Result<PathBuf> {
    let root = || open_dir(None, Path::new("/"));
    let mut dir = root()?;
    let mut resolved = PathBuf::from("/");
    // What is left to walk: symlinks' targets' components (last first), then `path`'s.
    let mut rest = path.components();
    let mut expanded: Vec<PathBuf> = Vec::new();
    let mut links = 0;
    // A trailing `/` (or `/.`, which `components` drops) asks for a directory, as the kernel
    // reads it.
    let trailing = ends_as_directory(path);
    loop {
        let name = match expanded.pop() {
            Some(name) => name,
            None => match rest.next() {
                Some(c) => PathBuf::from(c.as_os_str()),
                None => break,
            },
        };
        spend(1)?;
        match name.components().next() {
            Some(Component::Normal(_)) => {}
            Some(Component::ParentDir) => {
                // The parent of the directory reached (the root's is the root).
                dir = open_dir(Some(&dir), Path::new(".."))?;
                resolved.pop();
                continue;
            }
            // `.` (the path so far is a directory: checked when it was walked), the root.
            _ => continue,
        }
        let fd = nix::fcntl::openat(
            &dir,
            &name,
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io::Error::from)?;
        let kind =
            nix::sys::stat::fstat(&fd).map_err(io::Error::from)?.st_mode & SFlag::S_IFMT.bits();
        if kind == SFlag::S_IFLNK.bits() {
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(io::Error::other("too many levels of symbolic links"));
            }
            // procfs's links (`/proc/self`, `/proc/<pid>/root`, `…/fd/N`, reached from
            // `/dev/fd` too) mean something else in the worker that opens the path than here.
            let fs = nix::sys::statfs::fstatfs(&fd).map_err(io::Error::from)?;
            if fs.filesystem_type() == nix::sys::statfs::PROC_SUPER_MAGIC {
                return Err(io::Error::other("a procfs link"));
            }
            let target =
                PathBuf::from(nix::fcntl::readlinkat(&fd, Path::new("")).map_err(io::Error::from)?);
            if target.as_os_str().is_empty() {
                return Err(io::Error::from(io::ErrorKind::NotFound));
            }
            // The target's components are charged as they are read, and again as they are
            // walked: a walk that stops early (at a missing component, at the 41st link) read
            // them all.
            spend(target.components().count())?;
            if target.has_root() {
                dir = root()?;
                resolved = PathBuf::from("/");
            }
            let at = expanded.len();
            expanded.extend(target.components().map(|c| PathBuf::from(c.as_os_str())));
            expanded[at..].reverse();
            if ends_as_directory(&target) {
                // Walked after the target's last component, which must then be a directory.
                expanded.insert(at, PathBuf::from("."));
            }
            continue;
        }
        resolved.push(&name);
        if kind == SFlag::S_IFDIR.bits() {
            dir = fd;
        } else if !expanded.is_empty() || rest.clone().next().is_some() || trailing {
            // More to walk below a file.
            return Err(io::Error::from(io::ErrorKind::NotADirectory));
        }
    }
    Ok(resolved)
}

/// The directory `path` names (in `at`, or from the working directory), held open for lookups
/// in it, not followed if it is a symlink.
fn open_dir(at: Option<&OwnedFd>, path: &Path) -> io::Result<OwnedFd> {
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match at {
        Some(dir) => nix::fcntl::openat(dir, path, flags, Mode::empty()),
        None => nix::fcntl::open(path, flags, Mode::empty()),
    }
    .map_err(io::Error::from)
}

/// Whether `path` ends in `/` or `/.`: its last component must be a directory.
fn ends_as_directory(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    bytes.len() > 1 && (bytes.ends_with(b"/") || bytes.ends_with(b"/."))
}

/// Runs `check` with no bound, and says how many path lookups it made (tests).
#[cfg(test)]
pub(super) fn counted<R>(check: impl FnOnce() -> R) -> (R, usize) {
    let all = usize::MAX;
    let before = BUDGET.replace(Budget::Left(all));
    let answer = check();
    let left = BUDGET.replace(before);
    match left {
        Budget::Left(n) => (answer, all - n),
        Budget::Unlimited | Budget::Spent => unreachable!("a budget of usize::MAX"),
    }
}

thread_local! {
    /// What the check running on this thread may still resolve.
    static BUDGET: Cell<Budget> = const { Cell::new(Budget::Unlimited) };
}

/// Path lookups a check may still make: a component walked (a system call or three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Budget {
    Unlimited,
    Left(usize),
    Spent,
}

/// Runs `check` making at most `lookups` path lookups in all ([`canonical`]); `None` if it
/// needed more (its answer is then meaningless: every resolution beyond the budget failed).
pub(super) fn within<R>(lookups: usize, check: impl FnOnce() -> R) -> Option<R> {
    /// Restores the caller's budget, even if `check` panics.
    struct Restore(Budget);
    impl Drop for Restore {
        fn drop(&mut self) {
            BUDGET.set(self.0);
        }
    }
    let restore = Restore(BUDGET.replace(Budget::Left(lookups)));
    let answer = check();
    let spent = BUDGET.get() == Budget::Spent;
    drop(restore);
    (!spent).then_some(answer)
}

/// Takes `lookups` from the budget, or fails once it is spent.
fn spend(lookups: usize) -> io::Result<()> {
    let left = match BUDGET.get() {
        Budget::Unlimited => return Ok(()),
        Budget::Left(n) if n >= lookups => Budget::Left(n - lookups),
        Budget::Left(_) | Budget::Spent => Budget::Spent,
    };
    BUDGET.set(left);
    if left == Budget::Spent {
        return Err(io::Error::other("the check's path budget is spent"));
    }
    Ok(())
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
