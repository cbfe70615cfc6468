//! The table: every client method of the pinned app-server (`codex app-server
//! generate-json-schema --experimental`, 0.171), whether it reaches the host, its class, and
//! every host path or sandbox field in its params.
//!
//! A method absent from this table is never forwarded (default-deny,
//! docs/decisions/0012-trust-nothing-a-tenant-can-write.md): a codex upgrade or a tenant's own
//! worker `command` cannot bring a new method through unclassified. `router/tests/method_table.rs`
//! keeps the table complete against the pinned binary's schema.

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

/// How the table classifies a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// Never reaches the host or the tenant's process-wide state on a client's say-so
    /// (reads, and changes to the client's own threads): forwarded without a look at params.
    Open,
    /// Reaches the host: its class's mode applies.
    Host(Rule),
    /// Known to app-server, and never forwarded whatever the policy (`mock/experimentalMethod`,
    /// legacy methods).
    Refused,
}

const fn rule(class: Class, checks: &'static [Check]) -> Entry {
    Entry::Host(Rule { class, checks })
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

/// Looks a method up; `None` for a method the table does not name.
pub fn lookup(method: &str) -> Option<Entry> {
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
        | "externalAgentConfig/import/readHistories"
        | "windowsSandbox/setupStart"
        // Process-wide state of the tenant: every thread's memories, every rollout, MCP servers.
        | "memory/reset"
        | "rollout/compress"
        | "config/mcpServer/reload" => rule(Class::ConfigWrite, &[]),

        // Relays the worker to an outside service, around codex-fleet.
        "remoteControl/enable"
        | "remoteControl/disable"
        | "remoteControl/pairing/start"
        | "remoteControl/client/revoke" => rule(Class::RemoteControl, &[]),

        // Calls the tenant's MCP servers directly, outside any turn and its approvals.
        "mcpServer/tool/call"
        | "mcpServer/resource/read"
        | "mcpServer/event/stream/start"
        | "mcpServer/event/stream/stop" => rule(Class::Mcp, &[]),

        "account/login/start"
        | "account/login/cancel"
        | "account/logout"
        | "account/gatewayOAuth/login"
        | "account/gatewayOAuth/cancel"
        | "account/bedrock/setup"
        | "account/gcp/setup"
        | "accountSession/switch"
        | "account/bedrock/discover"
        | "account/rateLimitResetCredit/consume"
        | "account/sendAddCreditsNudgeEmail"
        | "mcpServer/oauth/login"
        | "userVerification/enroll"
        | "userVerification/delete"
        | "userVerification/verify"
        | "userVerification/cancel" => rule(Class::Account, &[]),

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

        // Known to app-server, not served: a test method and legacy methods outside its schema.
        "mock/experimentalMethod" | "getConversationSummary" | "gitDiffToRemote"
        | "getAuthStatus" => Entry::Refused,

        // The session and its threads: lifecycle, history, names, goals, queues, search.
        "initialize"
        | "thread/archive"
        | "thread/unarchive"
        | "thread/delete"
        | "thread/unsubscribe"
        | "thread/read"
        | "thread/list"
        | "thread/loaded/list"
        | "thread/turns/list"
        | "thread/items/list"
        | "thread/items/read"
        | "thread/timeline/list"
        | "thread/readState/update"
        | "thread/name/set"
        | "thread/metadata/update"
        | "thread/goal/set"
        | "thread/goal/get"
        | "thread/goal/clear"
        | "thread/queue/list"
        | "thread/queue/delete"
        | "thread/queue/reorder"
        | "thread/queue/start"
        | "thread/attachment/add"
        | "thread/attachment/list"
        | "thread/attachment/remove"
        | "thread/attachmentOwner/list"
        | "thread/section/move"
        | "thread/memoryMode/set"
        | "thread/memory/read"
        | "thread/compact/start"
        | "thread/revert"
        | "thread/inject_items"
        | "thread/sample"
        | "thread/sample/cancel"
        | "thread/prediction/request"
        | "thread/increment_elicitation"
        | "thread/decrement_elicitation"
        | "thread/guardianReview"
        | "thread/approveGuardianDeniedAction"
        | "thread/backgroundTerminals/list"
        | "thread/backgroundTerminals/clean"
        | "thread/backgroundTerminals/terminate"
        | "thread/search"
        | "thread/search/cancel"
        | "thread/search/stream"
        | "thread/search/stream/cancel"
        | "thread/searchOccurrences"
        | "thread/realtime/start"
        | "thread/realtime/stop"
        | "thread/realtime/appendAudio"
        | "thread/realtime/appendText"
        | "thread/realtime/appendSpeech"
        | "thread/realtime/list"
        | "thread/realtime/listVoices"
        | "turn/interrupt"
        | "review/start"
        | "threadSection/list"
        | "threadSection/create"
        | "threadSection/update"
        | "threadSection/delete"
        | "project/list"
        | "project/read"
        | "project/move"
        | "project/delete"
        // Catalogues and status reads.
        | "model/list"
        | "modelProvider/list"
        | "modelProvider/capabilities/read"
        | "collaborationMode/list"
        | "experimentalFeature/list"
        | "configRequirements/read"
        | "app/list"
        | "app/read"
        | "app/installed"
        | "plugin/skill/read"
        | "plugin/share/list"
        | "mcpServerStatus/list"
        | "memory/status"
        | "server/diagnostics"
        | "environment/info"
        | "environment/status"
        | "windowsSandbox/readiness"
        | "remoteControl/status/read"
        | "remoteControl/pairing/status"
        | "remoteControl/client/list"
        | "userVerification/status"
        | "account/read"
        | "account/rateLimits/read"
        | "account/usage/read"
        | "account/workspaceMessages/read"
        | "account/securitySetup/read"
        | "account/gatewayOAuth/read"
        | "account/bedrock/checkGovCloudRequirements"
        | "accountSession/list" => Entry::Open,

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
