//! Per-tenant Unix identities: which uid/gid each tenant's workers run as when codex-fleet is root.
//!
//! A tenant's `uid` comes from the config, or is allocated once from `workers.uid_range` and
//! remembered in `<state_dir>/tenant-uids` (0600), so a tenant keeps its uid — and the ownership
//! of its files — across restarts and config edits.
//!
//! A uid is one tenant's for good: a configured `uid` that another tenant already has in the
//! file is refused (it would move that tenant and hand its files over), and allocation skips
//! uids that something else on the host already uses (a passwd entry, a running process).
//!
//! A running instance also *claims* each of its tenants' uids host-wide: it holds a `flock` on
//! `/run/codex-fleet/uid-claims/<uid>`, which names the tenant and its state dir, for as long as
//! it runs. Allocation skips a uid another instance claims, and a configured or remembered uid
//! that another instance claims for another tenant stops the start. Only the same tenant on the
//! same files shares a claim (a replacement started while its predecessor is frozen, not gone). Without the claim, two instances on one host (two nodes, or a node beside `serve`)
//! sharing a range could hand the same uid to two tenants: one whose workers were idle (no process
//! to see) or still starting. Those tenants would then reach each other's processes and files,
//! and the sweep of one tenant's leftover processes (`worker::sweep`) would kill the other's
//! workers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

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

/// Refuses a configured tenant `uid`, or its gid (`gid`, else the uid), that belongs to one of
/// this host's login users (a passwd entry whose shell lets someone log in, see
/// `login_ids`). The tenant's workers would get that person's files — a home directory, its
/// keys — and the sweep after the tenant's last worker would stop that person's processes.
/// uids and gids with a passwd entry but no login shell (an operator naming tenant uids for
/// `ps`) are left alone; allocated uids never have a passwd entry. Reads `/etc/passwd`; a host
/// without one has no login users to protect.
pub fn check_login_users(cfg: &Config) -> anyhow::Result<()> {
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    refuse_login_ids(cfg, &passwd)
}

fn refuse_login_ids(cfg: &Config, passwd: &str) -> anyhow::Result<()> {
    let (uids, gids) = login_ids(passwd);
    for t in &cfg.tenants {
        let Some(uid) = t.uid else { continue };
        if let Some(user) = uids.get(&uid) {
            anyhow::bail!(
                "tenant {:?}: uid {uid} is the login user {user:?}'s on this host; the tenant's \
                 workers would get {user:?}'s files and the sweep after its last worker would \
                 stop {user:?}'s processes. Give the tenant a uid no person uses (or leave it \
                 out: one is allocated from workers.uid_range)",
                t.id
            );
        }
        let gid = t.gid.unwrap_or(uid);
        if let Some(user) = gids.get(&gid) {
            anyhow::bail!(
                "tenant {:?}: gid {gid}{} is the login user {user:?}'s own group on this host; \
                 the tenant's workers would get every file of that group. Give the tenant a gid \
                 of its own",
                t.id,
                if t.gid.is_none() {
                    " (its uid, as gid is unset)"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

/// The uids and primary gids of `passwd`'s login users, each with the user's name. A login user
/// is an entry whose shell is not one that refuses a login (`nologin`, `false`, or the `sync` /
/// `shutdown` / `halt` accounts'); an empty shell is `/bin/sh`, so a login.
fn login_ids(passwd: &str) -> (HashMap<u32, String>, HashMap<u32, String>) {
    let (mut uids, mut gids) = (HashMap::new(), HashMap::new());
    for line in passwd.lines().filter(|l| !l.starts_with('#')) {
        let fields: Vec<&str> = line.split(':').collect();
        let [name, _, uid, gid, _, _, shell] = fields[..] else {
            continue;
        };
        let refuses = matches!(
            shell.rsplit('/').next().unwrap_or(""),
            "nologin" | "false" | "sync" | "shutdown" | "halt"
        );
        if refuses {
            continue;
        }
        if let Ok(uid) = uid.parse::<u32>() {
            uids.entry(uid).or_insert_with(|| name.to_owned());
        }
        if let Ok(gid) = gid.parse::<u32>() {
            gids.entry(gid).or_insert_with(|| name.to_owned());
        }
    }
    (uids, gids)
}

/// Where instances on this host claim uids: the same path for every instance, whatever its
/// `state_dir` (the chart mounts a writable `/run/codex-fleet`).
pub const HOST_CLAIMS: &str = "/run/codex-fleet/uid-claims";

/// The uids one instance has claimed host-wide, each held by an exclusive `flock` until the
/// instance ends (dropping the last clone releases them). Cloned across reloads, so a tenant's uid
/// is claimed once.
#[derive(Clone)]
pub struct UidClaims {
    dir: PathBuf,
    held: Arc<Mutex<HashMap<u32, Flock<File>>>>,
}

/// Whether [`UidClaims::claim`] got the uid.
enum Claim {
    /// This instance holds it (now or from before).
    Held,
    /// Another instance does, for another tenant; its pid, as it wrote it.
    Taken(String),
}

impl UidClaims {
    /// Claims in [`HOST_CLAIMS`].
    pub fn host() -> UidClaims {
        UidClaims::in_dir(HOST_CLAIMS)
    }

    /// Claims in `dir` (tests use a directory of their own as the "host").
    pub fn in_dir(dir: impl Into<PathBuf>) -> UidClaims {
        UidClaims {
            dir: dir.into(),
            held: Arc::default(),
        }
    }

    /// uids this instance holds.
    pub fn held(&self) -> Vec<u32> {
        let mut uids: Vec<u32> = self.held.lock().unwrap().keys().copied().collect();
        uids.sort_unstable();
        uids
    }

    /// Takes `uid` for `owner` (a tenant in a state dir) unless another instance holds it for
    /// another owner. The first holder takes the file's lock exclusively, writes the owner and
    /// its pid, and keeps it shared; an instance of the same owner (the same tenant on the same
    /// files: a replacement started while its predecessor is not gone yet, say a frozen one)
    /// shares it; any other owner is refused. The lock goes with the open file, so a second
    /// instance in the same process (tests) is treated as another process would be.
    fn claim(&self, uid: u32, owner: &str) -> anyhow::Result<Claim> {
        let mut held = self.held.lock().unwrap();
        if held.contains_key(&uid) {
            return Ok(Claim::Held);
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .with_context(|| {
                format!(
                    "creating {} (where instances on this host claim tenant uids)",
                    self.dir.display()
                )
            })?;
        let path = self.dir.join(uid.to_string());
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let locking =
            |e: Errno| anyhow::Error::from(e).context(format!("locking {}", path.display()));
        let lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                lock.set_len(0)?;
                write!(&mut *lock, "{owner}\n{}\n", std::process::id())?;
                match lock.relock(FlockArg::LockSharedNonblock) {
                    Ok(()) => lock,
                    // Another owner took it between the downgrade's two steps.
                    Err(Errno::EWOULDBLOCK) => return Ok(Claim::Taken(String::new())),
                    Err(e) => return Err(locking(e)),
                }
            }
            Err((file, Errno::EWOULDBLOCK)) => {
                match Flock::lock(file, FlockArg::LockSharedNonblock) {
                    Ok(lock) => lock,
                    // A first holder is writing its owner right now.
                    Err((_, Errno::EWOULDBLOCK)) => return Ok(Claim::Taken(String::new())),
                    Err((_, e)) => return Err(locking(e)),
                }
            }
            Err((_, e)) => return Err(locking(e)),
        };
        // Read under the shared lock (a downgrade is not atomic: another owner may have written
        // between), and kept only if it names this owner.
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut lines = text.lines();
        if lines.next() != Some(owner) {
            return Ok(Claim::Taken(lines.next().unwrap_or_default().to_owned()));
        }
        held.insert(uid, lock);
        Ok(Claim::Held)
    }

    /// Claims a uid this instance must have, waiting up to `wait` for another holder to let go
    /// (a predecessor still exiting as this instance starts); then refused with a clear error.
    fn claim_or_refuse(
        &self,
        tenant: &str,
        owner: &str,
        uid: u32,
        wait: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + wait;
        let holder = loop {
            match self.claim(uid, owner)? {
                Claim::Held => return Ok(()),
                Claim::Taken(_) if Instant::now() < deadline => {
                    std::thread::sleep(CLAIM_POLL);
                }
                Claim::Taken(holder) => break holder,
            }
        };
        anyhow::bail!(
            "tenant {tenant:?}: uid {uid} is claimed by another codex-fleet on this host (pid \
                 {holder:?}, {}); two instances must never run workers as one uid. Give each \
                 instance its own workers.uid_range and state_dir, or this tenant another uid",
            self.dir.join(uid.to_string()).display()
        )
    }
}

/// How often a start waiting for a uid's claim tries again.
const CLAIM_POLL: Duration = Duration::from_millis(50);

/// How long a starting instance waits for a configured or remembered uid's claim: an instance
/// restarted at once may overlap its predecessor's exit by a moment. A reload does not wait.
pub const START_CLAIM_WAIT: Duration = Duration::from_secs(5);

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

/// uid/gid per tenant id, allocating and persisting what the config leaves open, each uid claimed
/// in `claims` (a uid another instance claims is skipped when allocating, and otherwise waited
/// for up to `wait`, then refused).
pub fn tenant_uids(
    cfg: &Config,
    claims: &UidClaims,
    wait: Duration,
) -> anyhow::Result<HashMap<String, (u32, u32)>> {
    let state = &cfg.workers.state_dir;
    traversable_dirs(cfg)?;
    let path = state.join(UID_FILE);
    let mut known = read_uid_file(&path)?;
    check_against(cfg, &known, &path)?;
    check_login_users(cfg)?;
    let configured: HashSet<u32> = cfg.tenants.iter().filter_map(|t| t.uid).collect();
    let [lo, hi] = cfg.workers.uid_range;
    let mut out = HashMap::new();
    let mut changed = false;
    // Looked up once, and only when a uid has to be allocated.
    let mut in_use: Option<HashSet<u32>> = None;
    // A claim names its tenant and the state dir holding the tenant's files.
    let files = fs::canonicalize(state).unwrap_or_else(|_| state.clone());
    for t in &cfg.tenants {
        let owner = format!("tenant {:?} in {}", t.id, files.display());
        let uid = match t.uid {
            Some(uid) => {
                claims.claim_or_refuse(&t.id, &owner, uid, wait)?;
                uid
            }
            None => match known.get(&t.id) {
                Some(&uid) if !configured.contains(&uid) => {
                    claims.claim_or_refuse(&t.id, &owner, uid, wait)?;
                    uid
                }
                _ => {
                    let in_use = in_use.get_or_insert_with(uids_in_use);
                    let taken: HashSet<u32> = known
                        .values()
                        .copied()
                        .chain(configured.iter().copied())
                        .collect();
                    let mut free = (lo..hi).filter(|u| !taken.contains(u) && !in_use.contains(u));
                    let uid = loop {
                        let uid = free.next().context(
                            "workers.uid_range is exhausted (uids with a passwd entry, a running \
                             process or another instance's claim are skipped)",
                        )?;
                        if let Claim::Held = claims.claim(uid, &owner)? {
                            break uid;
                        }
                    };
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

/// The uids `<state_dir>/tenant-uids` remembers, by tenant id (empty when the file is missing).
pub fn read_uid_file(path: &Path) -> anyhow::Result<BTreeMap<String, u32>> {
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

    /// A "host" of its own per test: its claims directory under `dir`.
    fn host(dir: &Path) -> UidClaims {
        UidClaims::in_dir(dir.join("claims"))
    }

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

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        sync:x:4:65534:sync:/bin:/bin/sync\n\
        # a comment\n\
        alice:x:5001:5001:Alice:/home/alice:/bin/bash\n\
        bob:x:5002:6000::/home/bob:\n\
        svc:x:5003:5003:named tenant uid:/nonexistent:/usr/sbin/nologin\n\
        locked:x:5004:5004::/:/bin/false\n\
        broken line\n";

    #[test]
    fn a_tenant_never_runs_as_a_login_user_or_in_one_s_group() {
        let tmp = tempfile::tempdir().unwrap();
        let refused = |tenants: &str| {
            refuse_login_ids(&cfg(tmp.path(), tenants), PASSWD)
                .unwrap_err()
                .to_string()
        };
        let msg = refused(&tenant("a", 1, "uid = 5001\ngid = 7000"));
        assert!(
            msg.contains("tenant \"a\": uid 5001 is the login user \"alice\"'s"),
            "{msg}"
        );
        // bob's shell is empty: /bin/sh, a login.
        let msg = refused(&tenant("a", 1, "uid = 5002\ngid = 7000"));
        assert!(msg.contains("\"bob\""), "{msg}");
        // A gid that is a login user's own group, given or taken from the uid.
        let msg = refused(&tenant("a", 1, "uid = 7000\ngid = 6000"));
        assert!(
            msg.contains("gid 6000 is the login user \"bob\"'s own group"),
            "{msg}"
        );
        let msg =
            refused(&(tenant("a", 1, "uid = 7001") + &tenant("b", 2, "uid = 7002\ngid = 5001")));
        assert!(msg.contains("tenant \"b\": gid 5001"), "{msg}");
        // Accounts that cannot log in, unknown ids and allocated uids are accepted.
        for ok in [
            tenant("a", 1, "uid = 5003"),
            tenant("a", 1, "uid = 5004"),
            tenant("a", 1, "uid = 7000\ngid = 7005"),
            tenant("a", 1, "") + &tenant("b", 2, "uid = 7001"),
        ] {
            refuse_login_ids(&cfg(tmp.path(), &ok), PASSWD).unwrap();
        }
    }

    #[test]
    fn uids_are_allocated_once_and_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let claims = host(tmp.path());
        let c = cfg(
            tmp.path(),
            &(tenant("a", 1, "") + &tenant("b", 2, "uid = 5000")),
        );
        let first = tenant_uids(&c, &claims, Duration::ZERO).unwrap();
        assert_eq!(first["b"], (5000, 5000), "configured uid wins");
        assert_eq!(first["a"], (5001, 5001), "allocated around configured ones");
        // A new tenant listed first does not shift anyone.
        let c2 = cfg(
            tmp.path(),
            &(tenant("z", 3, "gid = 7000") + &tenant("a", 1, "") + &tenant("b", 2, "uid = 5000")),
        );
        let second = tenant_uids(&c2, &claims, Duration::ZERO).unwrap();
        assert_eq!(second["a"], (5001, 5001));
        assert_eq!(second["z"], (5002, 7000));
        let c3 = cfg(
            tmp.path(),
            &(tenant("y", 4, "")
                + &tenant("a", 1, "")
                + &tenant("b", 2, "uid = 5000")
                + &tenant("z", 3, "")),
        );
        assert!(tenant_uids(&c3, &claims, Duration::ZERO)
            .unwrap_err()
            .to_string()
            .contains("exhausted"));
    }

    #[test]
    fn a_configured_uid_never_takes_another_tenants_remembered_one() {
        let tmp = tempfile::tempdir().unwrap();
        let claims = host(tmp.path());
        let first = tenant_uids(
            &cfg(tmp.path(), &tenant("a", 1, "")),
            &claims,
            Duration::ZERO,
        )
        .unwrap();
        assert_eq!(first["a"], (5000, 5000));
        let c = cfg(
            tmp.path(),
            &(tenant("a", 1, "") + &tenant("b", 2, "uid = 5000")),
        );
        for err in [
            check_remembered_uids(&c).unwrap_err(),
            tenant_uids(&c, &claims, Duration::ZERO).unwrap_err(),
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
        assert_eq!(
            tenant_uids(&c, &claims, Duration::ZERO).unwrap()["a"],
            (5000, 5000)
        );
    }

    #[test]
    fn two_instances_on_one_host_never_share_a_uid() {
        let tmp = tempfile::tempdir().unwrap();
        let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
        // Two instances with their own state dirs and the same range; neither has a process yet.
        let first = host(tmp.path());
        assert_eq!(
            tenant_uids(&cfg(&one, &tenant("a", 1, "")), &first, Duration::ZERO).unwrap()["a"],
            (5000, 5000)
        );
        let second = host(tmp.path());
        assert_eq!(
            tenant_uids(&cfg(&two, &tenant("b", 2, "")), &second, Duration::ZERO).unwrap()["b"],
            (5001, 5001),
            "5000 is claimed by the first instance"
        );
        // A uid configured (or remembered) that the other instance claims stops the start.
        let msg = tenant_uids(
            &cfg(&two, &tenant("c", 3, "uid = 5000")),
            &second,
            Duration::ZERO,
        )
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("uid 5000 is claimed by another codex-fleet")
                && msg.contains(&std::process::id().to_string()),
            "{msg}"
        );
        // The instance itself takes its own claims again (a reload).
        assert_eq!(
            tenant_uids(
                &cfg(&one, &tenant("a", 1, "")),
                &first.clone(),
                Duration::ZERO
            )
            .unwrap()["a"],
            (5000, 5000)
        );
        assert_eq!(first.held(), vec![5000]);
        // Once the first instance is gone, its uid is free for a configured tenant.
        drop(first);
        assert_eq!(
            tenant_uids(
                &cfg(&two, &tenant("c", 3, "uid = 5000")),
                &second,
                Duration::ZERO
            )
            .unwrap()["c"],
            (5000, 5000)
        );
        assert_eq!(second.held(), vec![5000, 5001]);
    }

    #[test]
    fn a_start_waits_a_moment_for_another_tenant_s_holder_to_let_go() {
        let tmp = tempfile::tempdir().unwrap();
        let old = host(tmp.path());
        tenant_uids(
            &cfg(&tmp.path().join("one"), &tenant("a", 1, "uid = 5000")),
            &old,
            Duration::ZERO,
        )
        .unwrap();
        // The holder exits a moment into the new instance's waiting start.
        let (go, exit) = std::sync::mpsc::channel::<()>();
        let exiting = std::thread::spawn(move || {
            exit.recv().unwrap();
            std::thread::sleep(Duration::from_millis(200));
            drop(old);
        });
        let new = host(tmp.path());
        let c = cfg(&tmp.path().join("two"), &tenant("b", 2, "uid = 5000"));
        assert!(
            tenant_uids(&c, &new, Duration::ZERO).is_err(),
            "held: refused"
        );
        go.send(()).unwrap();
        tenant_uids(&c, &new, Duration::from_secs(30)).unwrap();
        assert_eq!(new.held(), vec![5000]);
        exiting.join().unwrap();
    }

    #[test]
    fn the_same_tenant_on_the_same_files_shares_its_claim() {
        let tmp = tempfile::tempdir().unwrap();
        let c = cfg(tmp.path(), &tenant("a", 1, ""));
        // A frozen predecessor and its replacement, both running tenant "a" on the same state
        // dir: the replacement takes the remembered uid at once.
        let frozen = host(tmp.path());
        assert_eq!(
            tenant_uids(&c, &frozen, Duration::ZERO).unwrap()["a"],
            (5000, 5000)
        );
        let replacement = host(tmp.path());
        assert_eq!(
            tenant_uids(&c, &replacement, Duration::ZERO).unwrap()["a"],
            (5000, 5000)
        );
        // Another tenant is kept out while either of them holds it.
        let other = cfg(&tmp.path().join("other"), &tenant("b", 2, "uid = 5000"));
        assert!(tenant_uids(&other, &host(tmp.path()), Duration::ZERO).is_err());
        drop(frozen);
        assert!(tenant_uids(&other, &host(tmp.path()), Duration::ZERO).is_err());
        // The same tenant name on other files is another tenant.
        let elsewhere = cfg(&tmp.path().join("elsewhere"), &tenant("a", 1, "uid = 5000"));
        assert!(tenant_uids(&elsewhere, &host(tmp.path()), Duration::ZERO).is_err());
        drop(replacement);
        let third = host(tmp.path());
        assert_eq!(
            tenant_uids(&other, &third, Duration::ZERO).unwrap()["b"],
            (5000, 5000)
        );
    }
}
