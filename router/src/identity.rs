//! Per-tenant Unix identities: which uid/gid each tenant's workers run as when codex-fleet is root.
//!
//! A tenant's `uid` comes from the config, or is allocated once from `workers.uid_range` and
//! remembered in `<state_dir>/tenant-uids` (0600), so a tenant keeps its uid — and the ownership
//! of its files — across restarts and config edits.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use anyhow::Context;

use crate::config::Config;
use crate::dev::write_private;

/// The file that remembers allocated uids.
pub const UID_FILE: &str = "tenant-uids";

/// uid/gid per tenant id, allocating and persisting what the config leaves open.
pub fn tenant_uids(cfg: &Config) -> anyhow::Result<HashMap<String, (u32, u32)>> {
    let state = &cfg.workers.state_dir;
    traversable_dirs(cfg)?;
    let path = state.join(UID_FILE);
    let mut known = read_uid_file(&path)?;
    let configured: HashSet<u32> = cfg.tenants.iter().filter_map(|t| t.uid).collect();
    let [lo, hi] = cfg.workers.uid_range;
    let mut out = HashMap::new();
    let mut changed = false;
    for t in &cfg.tenants {
        let uid = match t.uid {
            Some(uid) => uid,
            None => match known.get(&t.id) {
                Some(&uid) if !configured.contains(&uid) => uid,
                _ => {
                    let taken: HashSet<u32> = known
                        .values()
                        .copied()
                        .chain(configured.iter().copied())
                        .collect();
                    let uid = (lo..hi)
                        .find(|u| !taken.contains(u))
                        .context("workers.uid_range is exhausted")?;
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
}
