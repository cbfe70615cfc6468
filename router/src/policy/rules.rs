//! The table: which methods reach the host, their class, and every host path or sandbox
//! field in their params (from `codex app-server generate-json-schema --experimental`, 0.171).
//!
//! A method absent from this table never touches the host on a client's say-so and passes.

use super::Class;

/// What to check in one params field when the class is confined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// A path string (or null): must be inside the roots.
    Path(&'static str),
    /// An array of path strings (or null): each must be inside the roots.
    Paths(&'static str),
    /// An array of `{ "path": … }` objects (project roots).
    PathObjects(&'static str),
    /// `selectedCapabilityRoots: [{ location: { path } }]`.
    CapabilityRoots,
    /// `environments: [{ cwd, runtimeWorkspaceRoots? }]`.
    Environments,
    /// A discovery cwd (or null): dropped when outside the roots, since the client's own
    /// working directory (as the TUI sends it) means nothing on the worker's host.
    FilterPath(&'static str),
    /// A list of discovery cwds: those outside the roots are dropped.
    FilterPaths(&'static str),
    /// A rollout file: must be in the tenant's own `sessions/` or `archived_sessions/`.
    Rollout(&'static str),
    /// `sandbox` (`SandboxMode`): `danger-full-access` is refused.
    SandboxMode,
    /// `sandboxPolicy` (`SandboxPolicy`): no wider than workspace-write inside the roots.
    SandboxPolicy,
    /// `sandboxPolicy` as above; when neither it nor `permissionProfile` is given, a
    /// workspace-write policy over the roots is filled in (`command/exec`).
    SandboxPolicyOrDefault,
    /// A named permissions profile (`permissions`, `permissionProfile`): must be allowed.
    Profile(&'static str),
    /// `config` overrides of a thread: only allowed keys.
    ConfigOverrides,
    /// `input: [UserInput]`: the host files a turn reads (`localImage`, `localAudio` paths
    /// inside the roots; `skill` and `mention` paths inside the roots or the tenant's own
    /// installed skills and plugins; `app://`-style mention URIs are not files).
    Inputs,
}

/// A method that reaches the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The class whose mode applies.
    pub class: Class,
    /// The fields to check under `confine`.
    pub checks: &'static [Check],
}

const fn rule(class: Class, checks: &'static [Check]) -> Rule {
    Rule { class, checks }
}

use Check::*;

const THREAD_START: &[Check] = &[
    Path("cwd"),
    Paths("runtimeWorkspaceRoots"),
    Environments,
    CapabilityRoots,
    SandboxMode,
    Profile("permissions"),
    ConfigOverrides,
];
const THREAD_FROM: &[Check] = &[
    Path("cwd"),
    Paths("runtimeWorkspaceRoots"),
    Rollout("path"),
    SandboxMode,
    Profile("permissions"),
    ConfigOverrides,
];
const TURN: &[Check] = &[
    Inputs,
    Path("cwd"),
    Paths("runtimeWorkspaceRoots"),
    Environments,
    SandboxPolicy,
    Profile("permissions"),
];

/// Looks a method up.
pub fn lookup(method: &str) -> Option<Rule> {
    let r = match method {
        "fs/readFile" | "fs/writeFile" | "fs/createDirectory" | "fs/getMetadata"
        | "fs/readDirectory" | "fs/remove" | "fs/watch" => rule(Class::Fs, &[Path("path")]),
        "fs/copy" => rule(Class::Fs, &[Path("sourcePath"), Path("destinationPath")]),
        "fuzzyFileSearch" | "fuzzyFileSearch/sessionStart" => rule(Class::Fs, &[Paths("roots")]),
        "feedback/upload" => rule(Class::Fs, &[Paths("extraLogFiles")]),
        "feedback/save" => rule(Class::Fs, &[Path("savePath"), Paths("extraLogFiles")]),
        "fs/unwatch" | "fuzzyFileSearch/sessionUpdate" | "fuzzyFileSearch/sessionStop" => {
            rule(Class::Fs, &[])
        }

        "command/exec" => rule(
            Class::CommandExec,
            &[
                Path("cwd"),
                SandboxPolicyOrDefault,
                Profile("permissionProfile"),
            ],
        ),
        "command/exec/write" | "command/exec/terminate" | "command/exec/resize" => {
            rule(Class::CommandExec, &[])
        }

        "process/spawn" => rule(Class::Process, &[Path("cwd")]),
        "process/writeStdin" | "process/kill" | "process/resizePty" => rule(Class::Process, &[]),

        "thread/shellCommand" => rule(Class::ShellCommand, &[]),

        "config/value/write"
        | "config/batchWrite"
        | "skills/config/write"
        | "modelProvider/config/write"
        | "modelProvider/default/set"
        | "experimentalFeature/enablement/set"
        | "environment/add"
        | "externalAgentConfig/detect"
        | "externalAgentConfig/import"
        | "externalAgentConfig/import/recordHistory"
        | "remoteControl/enable"
        | "remoteControl/disable"
        | "remoteControl/pairing/start"
        | "remoteControl/client/revoke"
        | "windowsSandbox/setupStart" => rule(Class::ConfigWrite, &[]),

        "account/login/start"
        | "account/login/cancel"
        | "account/logout"
        | "account/gatewayOAuth/login"
        | "account/gatewayOAuth/cancel"
        | "account/bedrock/setup"
        | "account/gcp/setup"
        | "accountSession/switch" => rule(Class::Account, &[]),

        "plugin/install"
        | "plugin/uninstall"
        | "plugin/reconcile"
        | "plugin/share/save"
        | "plugin/share/updateTargets"
        | "plugin/share/checkout"
        | "plugin/share/delete"
        | "marketplace/add"
        | "marketplace/remove"
        | "marketplace/upgrade" => rule(Class::Plugins, &[]),

        "thread/start" => rule(Class::Workspace, THREAD_START),
        "thread/resume" | "thread/fork" => rule(Class::Workspace, THREAD_FROM),
        "turn/start" => rule(Class::Workspace, TURN),
        "turn/steer" | "thread/queue/add" | "thread/queue/update" => {
            rule(Class::Workspace, &[Inputs])
        }
        "thread/settings/update" => rule(
            Class::Workspace,
            &[
                Path("cwd"),
                Environments,
                SandboxPolicy,
                Profile("permissions"),
            ],
        ),
        "turn/settings/update" => rule(Class::Workspace, &[Environments]),
        "thread/prepareApprovedPlan" => rule(Class::Workspace, &[Path("attachmentPath")]),
        "skills/extraRoots/set" => rule(Class::Workspace, &[Paths("extraRoots")]),
        "project/create" | "project/import" | "project/update" => {
            rule(Class::Workspace, &[PathObjects("roots")])
        }
        "plugin/read" => rule(Class::Workspace, &[Path("marketplacePath")]),
        "config/read" | "permissionProfile/list" => rule(Class::Workspace, &[FilterPath("cwd")]),
        "hooks/list" | "skills/list" | "plugin/list" | "plugin/installed" | "plugin/search" => {
            rule(Class::Workspace, &[FilterPaths("cwds")])
        }
        _ => return None,
    };
    Some(r)
}

/// Keys whose names look like paths but are not (checked against unknown path-like keys).
pub const NOT_PATHS: &[&str] = &["sortDirection", "rootTurnId", "recursive"];

/// Whether a params key looks like it names a host path.
pub fn looks_like_path(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["path", "cwd", "root", "dir", "file"]
        .iter()
        .any(|p| k.contains(p))
        && !NOT_PATHS.contains(&key)
}

/// The params keys a rule checks.
pub fn checked_keys(checks: &[Check]) -> impl Iterator<Item = &'static str> + '_ {
    checks.iter().map(|c| match *c {
        Path(k) | Paths(k) | PathObjects(k) | FilterPath(k) | FilterPaths(k) | Rollout(k)
        | Profile(k) => k,
        CapabilityRoots => "selectedCapabilityRoots",
        Environments => "environments",
        SandboxMode => "sandbox",
        SandboxPolicy | SandboxPolicyOrDefault => "sandboxPolicy",
        ConfigOverrides => "config",
        Inputs => "input",
    })
}
