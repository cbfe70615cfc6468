//! Per-tenant Unix identities: which uid/gid each tenant's workers run as when codex-fleet is root.
//!
//! A tenant's `uid` comes from the config, or is allocated once from `workers.uid_range` and
//! remembered in `<state_dir>/tenant-uids` (0600), so a tenant keeps its uid — and the ownership
//! of its files — across restarts and config edits.
//!
//! A uid is one tenant's for good: a configured `uid` that another tenant already has in the
//! file is refused (it would move that tenant and hand its files over), and allocation skips
//! uids that something else on the host already uses (a passwd entry, a running process), so
//! two instances on one host sharing a range do not hand out a uid the other one's workers run as.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use anyhow::Context;

use crate::config::Config;
use crate::fsutil::write_private;

/// The file that remembers allocated uids.
pub const UID_FILE: &str = "tenant-uids";

/// Refuses a configured `uid` that `<state_dir>/tenant-uids` remembers for another tenant (also
/// one no longer configured: its files are still owned by that uid). Reads only; a missing file
/// remembers nothing.
pub fn check_remembered_uids(cfg: &Config) -> anyhow::Result<()> {
    let path = cfg.workers.state_dir.join(UID_FILE);
    let known = match read_uid_file(&path) {
        Ok(known) => known,
        // `check-config` by an unprivileged user: `serve` (root) checks again before using it.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) =>
        {
            return Ok(())
        }
        Err(e) => return Err(e),
    };
    check_against(cfg, &known, &path)
}

fn check_against(cfg: &Config, known: &BTreeMap<String, u32>, path: &Path) -> anyhow::Result<()> {
    for t in &cfg.tenants {
        let Some(uid) = t.uid else { continue };
        if let Some((other, _)) = known.iter().find(|(id, &u)| u == uid && **id != t.id) {
            anyhow::bail!(
                "tenant {:?}: uid {uid} is tenant {other:?}'s ({} remembers it); taking it would \
                 move {other:?} to another uid and give {:?} its files. Pick another uid, or \
                 remove {other:?}'s line from that file if {other:?} is gone for good and its \
                 files are deleted",
                t.id,
                path.display(),
                t.id
            );
        }
    }
    Ok(())
}

/// uids the host already uses outside this instance's tenants: a passwd entry or a running
/// process (the owner of `/proc/<pid>`).
fn uids_in_use() -> HashSet<u32> {
    use std::os::unix::fs::MetadataExt;
    let mut used: HashSet<u32> = fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .filter_map(|e| e.metadata().ok().map(|m| m.uid()))
                .collect()
        })
        .unwrap_or_default();
    if let Ok(passwd) = fs::read_to_string("/etc/passwd") {
        used.extend(
            passwd
                .lines()
                .filter_map(|l| l.split(':').nth(2).and_then(|u| u.parse::<u32>().ok())),
        );
    }
    used
}

/// Warns about tenants whose uid already runs processes at start-up: before any worker of this
/// instance exists, those belong to someone else — another codex-fleet with an overlapping
/// `workers.uid_range`, or a user of the host — or are leftovers of the tenant's own commands.
pub fn warn_about_foreign_processes(uids: &HashMap<String, (u32, u32)>) {
    let used = uids_in_use();
    for (tenant, (uid, _)) in uids {
        if used.contains(uid) {
            tracing::warn!(
                tenant,
                uid,
                "the tenant's uid already has processes or a passwd entry before its first worker \
                 started: another codex-fleet on this host may share workers.uid_range (give each \
                 instance its own range) or a host user has this uid"
            );
        }
    }
}

/// uid/gid per tenant id, allocating and persisting what the config leaves open.
pub fn tenant_uids(cfg: &Config) -> anyhow::Result<HashMap<String, (u32, u32)>> {
    let state = &cfg.workers.state_dir;
    traversable_dirs(cfg)?;
    let path = state.join(UID_FILE);
    let mut known = read_uid_file(&path)?;
    check_against(cfg, &known, &path)?;
    let configured: HashSet<u32> = cfg.tenants.iter().filter_map(|t| t.uid).collect();
    let [lo, hi] = cfg.workers.uid_range;
    let mut out = HashMap::new();
    let mut changed = false;
    // Looked up once, and only when a uid has to be allocated.
    let mut in_use: Option<HashSet<u32>> = None;
    for t in &cfg.tenants {
        let uid = match t.uid {
            Some(uid) => uid,
            None => match known.get(&t.id) {
                Some(&uid) if !configured.contains(&uid) => uid,
                _ => {
                    let in_use = in_use.get_or_insert_with(uids_in_use);
                    let taken: HashSet<u32> = known
                        .values()
                        .copied()
                        .chain(configured.iter().copied())
                        .collect();
                    let uid = (lo..hi)
                        .find(|u| !taken.contains(u) && !in_use.contains(u))
                        .context(
                            "workers.uid_range is exhausted (uids with a passwd entry or a \
                             running process are skipped)",
                        )?;
                    known.insert(t.id.clone(), uid);
                    changed = true;
                    uid
                }
            },
        };
        out.insert(t.id.clone(), (uid, t.gid.unwrap_or(uid)));
    }
    if changed {
        let text: String = known
            .iter()
            .map(|(id, uid)| format!("{id} {uid}\n"))
            .collect();
        write_private(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(out)
}

fn read_uid_file(path: &Path) -> anyhow::Result<BTreeMap<String, u32>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (id, uid) = l
                .split_once(' ')
                .with_context(|| format!("{}: bad line {l:?}", path.display()))?;
            Ok((id.to_owned(), uid.trim().parse()?))
        })
        .collect()
}

/// The state dir and the parents of tenant directories must be passable (not listable) by every
/// tenant uid: 0711, owned by codex-fleet.
fn traversable_dirs(cfg: &Config) -> anyhow::Result<()> {
    let state = &cfg.workers.state_dir;
    for dir in [
        state.clone(),
        state.join("tenants"),
        state.join("workspaces"),
    ] {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
            .with_context(|| format!("chmod {}", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, tenants: &str) -> Config {
        let text = format!(
            "[listen]\naddr = \"127.0.0.1:0\"\ntls_cert = \"/x\"\ntls_key = \"/y\"\n\
             [workers]\nstate_dir = {:?}\nuid_range = [5000, 5003]\n{tenants}",
            dir.display().to_string()
        );
        Config::parse(&text).unwrap()
    }

    const D: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a0";

    fn tenant(id: &str, n: u32, extra: &str) -> String {
        format!("[[tenants]]\nid = \"{id}\"\ntoken_sha256 = [\"{D}{n}\"]\n{extra}\n")
    }

    #[test]
    fn uids_are_allocated_once_and_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let c = cfg(
            tmp.path(),
            &(tenant("a", 1, "") + &tenant("b", 2, "uid = 5000")),
        );
        let first = tenant_uids(&c).unwrap();
        assert_eq!(first["b"], (5000, 5000), "configured uid wins");
        assert_eq!(first["a"], (5001, 5001), "allocated around configured ones");
        // A new tenant listed first does not shift anyone.
        let c2 = cfg(
            tmp.path(),
            &(tenant("z", 3, "gid = 7") + &tenant("a", 1, "") + &tenant("b", 2, "uid = 5000")),
        );
        let second = tenant_uids(&c2).unwrap();
        assert_eq!(second["a"], (5001, 5001));
        assert_eq!(second["z"], (5002, 7));
        let c3 = cfg(
            tmp.path(),
            &(tenant("y", 4, "")
                + &tenant("a", 1, "")
                + &tenant("b", 2, "uid = 5000")
                + &tenant("z", 3, "")),
        );
        assert!(tenant_uids(&c3)
            .unwrap_err()
            .to_string()
            .contains("exhausted"));
    }

    #[test]
    fn a_configured_uid_never_takes_another_tenants_remembered_one() {
        let tmp = tempfile::tempdir().unwrap();
        let first = tenant_uids(&cfg(tmp.path(), &tenant("a", 1, ""))).unwrap();
        assert_eq!(first["a"], (5000, 5000));
        let c = cfg(
            tmp.path(),
            &(tenant("a", 1, "") + &tenant("b", 2, "uid = 5000")),
        );
        for err in [
            check_remembered_uids(&c).unwrap_err(),
            tenant_uids(&c).unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(msg.contains("\"b\"") && msg.contains("\"a\"'s"), "{msg}");
        }
        // Also when the remembering tenant is no longer configured: its files keep that uid.
        let c = cfg(tmp.path(), &tenant("b", 2, "uid = 5000"));
        assert!(check_remembered_uids(&c).is_err());
        // A tenant may take its own remembered uid explicitly.
        let c = cfg(tmp.path(), &tenant("a", 1, "uid = 5000"));
        check_remembered_uids(&c).unwrap();
        assert_eq!(tenant_uids(&c).unwrap()["a"], (5000, 5000));
    }
}
