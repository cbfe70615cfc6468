//! Who a worker runs as and what it may use: a per-tenant Unix uid/gid, resource limits, and the
//! directories prepared for it (docs/decisions/0011-containment-by-the-os-first.md).

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use nix::sys::resource::Resource;

use crate::error::StartError;

/// The Unix identity a tenant's workers run as (numeric; no passwd entry is needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerUser {
    /// User id.
    pub uid: u32,
    /// Primary group id; supplementary groups are dropped.
    pub gid: u32,
}

/// Resource limits set (soft = hard) in the worker before exec; `None` leaves a limit inherited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rlimits {
    /// `RLIMIT_NOFILE`: open files.
    pub nofile: Option<u64>,
    /// `RLIMIT_AS`: address space, in bytes.
    pub address_space: Option<u64>,
    /// `RLIMIT_CPU`: CPU time, in seconds (SIGXCPU, then SIGKILL).
    pub cpu_secs: Option<u64>,
    /// `RLIMIT_NPROC`: processes (on Linux, threads) of the worker's real uid, all of them
    /// counted, each fork or thread of the worker's tree refused (`EAGAIN`) at the limit. With
    /// a uid of its own, a tenant's wall; under a shared uid, a wall on everything of that uid
    /// (codex-fleet keeps its own limit, and root is exempt). Set before the uid changes, so a
    /// tenant already at its limit cannot start another worker (`execve` fails with `EAGAIN`).
    pub processes: Option<u64>,
}

// === impl Rlimits ===

impl Rlimits {
    /// The limits as `(resource, value)` pairs, fixed-size so the child can walk them without
    /// allocating.
    pub(crate) fn pairs(&self) -> [(Resource, Option<u64>); 4] {
        [
            (Resource::RLIMIT_NOFILE, self.nofile),
            (Resource::RLIMIT_AS, self.address_space),
            (Resource::RLIMIT_CPU, self.cpu_secs),
            (Resource::RLIMIT_NPROC, self.processes),
        ]
    }
}

/// Creates `dir` (and missing parents) for a worker: mode 0700, owned by `owner` when set. Parents
/// it creates are 0711 when `owner` is set (traversable, not listable) and 0700 otherwise.
pub(crate) async fn prepare_dir(
    dir: &Path,
    owner: Option<WorkerUser>,
    enforce: bool,
) -> Result<(), StartError> {
    let prepare = |source| StartError::Prepare {
        path: dir.to_path_buf(),
        source,
    };
    if let Some(parent) = dir.parent() {
        let mode = if owner.is_some() { 0o711 } else { 0o700 };
        tokio::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(parent)
            .await
            .map_err(prepare)?;
    }
    tokio::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .await
        .map_err(prepare)?;
    if let Some(user) = owner {
        std::os::unix::fs::chown(dir, Some(user.uid), Some(user.gid)).map_err(prepare)?;
    }
    if enforce || owner.is_some() {
        set_mode(dir, 0o700).await?;
    }
    Ok(())
}

/// The shared socket folder: owned by codex-fleet, never listable by others. With `traversable`,
/// others may pass through it (0711) to reach their own 0700 tenant folder inside.
pub(crate) async fn prepare_socket_root(dir: &Path, traversable: bool) -> Result<(), StartError> {
    let prepare = |source| StartError::Prepare {
        path: dir.to_path_buf(),
        source,
    };
    tokio::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .await
        .map_err(prepare)?;
    let mode = tokio::fs::metadata(dir).await.map_err(prepare)?.mode() & 0o777;
    // Another pool may need 0711; never take that away, never allow more.
    let want = if traversable || mode == 0o711 {
        0o711
    } else {
        0o700
    };
    if mode != want {
        set_mode(dir, want).await?;
    }
    Ok(())
}

async fn set_mode(path: &Path, mode: u32) -> Result<(), StartError> {
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .await
        .map_err(|source| StartError::Prepare {
            path: path.to_path_buf(),
            source,
        })
}

/// Checks that `user` can reach `dir`: every ancestor must grant it search (x) permission.
pub(crate) fn check_reachable(dir: &Path, user: WorkerUser) -> Result<(), StartError> {
    for ancestor in dir.ancestors().skip(1) {
        let meta = std::fs::metadata(ancestor).map_err(|source| StartError::Prepare {
            path: ancestor.to_path_buf(),
            source,
        })?;
        let bit = if meta.uid() == user.uid {
            0o100
        } else if meta.gid() == user.gid {
            0o010
        } else {
            0o001
        };
        if meta.mode() & bit == 0 {
            return Err(StartError::Prepare {
                path: ancestor.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "not traversable by the worker's uid {} (needs search permission)",
                        user.uid
                    ),
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn private_dirs_are_0700() {
        let dir = tempfile::Builder::new()
            .prefix("cf")
            .tempdir_in("/tmp")
            .unwrap();
        let nested = dir.path().join("a/b");
        prepare_dir(&nested, None, false).await.unwrap();
        let mode = std::fs::metadata(&nested).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_dir(&open, None, true).await.unwrap();
        let mode = std::fs::metadata(&open).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[tokio::test]
    async fn socket_root_is_never_listable() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("s");
        let mode = || std::fs::metadata(&root).unwrap().mode() & 0o777;
        prepare_socket_root(&root, false).await.unwrap();
        assert_eq!(mode(), 0o700);
        prepare_socket_root(&root, true).await.unwrap();
        assert_eq!(mode(), 0o711);
        // A pool without a uid leaves the traversal bit another pool needs.
        prepare_socket_root(&root, false).await.unwrap();
        assert_eq!(mode(), 0o711);
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_socket_root(&root, false).await.unwrap();
        assert_eq!(mode(), 0o700);
    }

    #[test]
    fn reachability_needs_search_permission() {
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join("a/b");
        std::fs::create_dir_all(&inner).unwrap();
        let a = dir.path().join("a");
        let stranger = WorkerUser {
            uid: 64_999,
            gid: 64_999,
        };
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o700)).unwrap();
        let err = check_reachable(&inner, stranger).unwrap_err();
        assert!(err.to_string().contains("not traversable"), "{err}");
        assert!(err.to_string().contains(&a.display().to_string()), "{err}");
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o711)).unwrap();
        check_reachable(&inner, stranger).unwrap();
    }

    #[test]
    fn limits_walk_in_a_fixed_order() {
        let r = Rlimits {
            nofile: Some(64),
            ..Rlimits::default()
        };
        let pairs = r.pairs();
        assert_eq!(pairs[0], (Resource::RLIMIT_NOFILE, Some(64)));
        assert!(pairs[1..].iter().all(|(_, v)| v.is_none()));
    }
}
