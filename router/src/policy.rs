//! Host-access policy per tenant: allows, refuses or confines the methods that reach the
//! worker's host (files, commands, processes, config, accounts, plugins, working directories).
//!
//! Defence in depth behind the per-tenant Unix uid
//! (docs/decisions/0011-containment-by-the-os-first.md), and the only barrier when tenants share a
//! uid. The session asks the policy about every client request before routing it.
//! Every method of the pinned app-server has a row in the table (see `policy/rules.rs`): open
//! methods pass without their params being parsed, host methods take their class's mode, and a
//! method with no row is never forwarded: it gets app-server's own answer to a method it does not
//! know (`-32600 "Invalid request: unknown variant …"`), and the few methods app-server knows but
//! codex-fleet does not serve are refused (policy `"unclassified"`).
//!
//! A refusal is a JSON-RPC error with code [`HOST_ACCESS_DENIED`] (`-32003`), message
//! `"Host access denied by policy: <method> <detail>"` and
//! `data: {"reason": "hostAccessDenied", "policy": "<class>", "method": "<method>"}`.
//! Details name the offending params field, never a resolved path.
//!
//! A malformed request is not a refusal: a field of the wrong type, or params that are neither
//! an object nor an array, get [`Decision::Invalid`], answered `-32600` in app-server's own
//! words ("Invalid request: invalid type: integer `42`, expected a sequence"). Positional params
//! (an array) are still refused: the policy cannot check them safely.
//!
//! Use: for every client request, after admission and before routing, call
//! [`HostAccessPolicy::check_inline`] with the tenant's policy and [`TenantRoots`], and when it
//! declines, [`HostAccessPolicy::check`] off the runtime. `Allow` forwards
//! the frame unchanged; `Rewrite(params)` forwards [`rewritten_request`]; `Deny` answers
//! [`Denial::to_error_response`] and forwards nothing. Checks touch the filesystem (an `lstat`
//! per path component walked, symlinks' targets included), for the confined methods only,
//! charged per lookup; a session runs a costly one on the blocking pool
//! ([`HostAccessPolicy::check_inline`]), and one that needs more than [`MAX_PATH_LOOKUPS`]
//! refuses its request.

mod confine;
mod paths;
mod rules;
mod strict;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

use confine::Fault;
pub use paths::{resolve, PathError, TenantRoots};
use proto::rpc::{self, RequestId};
use rules::Entry;

/// JSON-RPC error code of a request refused by the host-access policy (defined in the
/// protocol core).
pub use proto::error::codes::HOST_ACCESS_DENIED;

/// A group of host-access methods sharing one mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// `fs/*`, `fuzzyFileSearch*`, `feedback/upload|save` (they read named log files).
    Fs,
    /// `command/exec` and its follow-ups: commands run in app-server's sandbox.
    CommandExec,
    /// `process/*`: processes app-server starts without any sandbox.
    Process,
    /// `thread/shellCommand`: a shell string app-server runs unsandboxed with full access.
    ShellCommand,
    /// Writes to the tenant's process-wide config and integrations (`config/value/write`,
    /// `config/batchWrite`, `skills/config/write`, `modelProvider/*` writes,
    /// `experimentalFeature/enablement/set`, `environment/add`, `externalAgentConfig/*`,
    /// `windowsSandbox/setupStart`, `memory/reset`, `rollout/compress`,
    /// `config/mcpServer/reload`).
    ConfigWrite,
    /// `account/login*`, `account/logout`, MCP OAuth logins, credits and other account or
    /// credential changes.
    Account,
    /// `remoteControl/*` changes: relaying the worker to an outside service. Also decides
    /// whether the tenant's workers start with app-server's remote control available at all.
    RemoteControl,
    /// `mcpServer/tool/call` and the other direct calls to the tenant's MCP servers.
    Mcp,
    /// Plugin and marketplace installs, removals and shares.
    Plugins,
    /// Working directories, workspace roots, sandbox and permission choices of threads and
    /// turns, and the discovery cwds of `config/read`, `skills/list`, `hooks/list`, ….
    Workspace,
    /// A method the table does not name: always refused.
    Unclassified,
}

impl Class {
    /// The name used in config and in error data, e.g. `"command_exec"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Fs => "fs",
            Class::CommandExec => "command_exec",
            Class::Process => "process",
            Class::ShellCommand => "shell_command",
            Class::ConfigWrite => "config_write",
            Class::Account => "account",
            Class::Plugins => "plugins",
            Class::Workspace => "workspace",
            Class::RemoteControl => "remote_control",
            Class::Mcp => "mcp",
            Class::Unclassified => "unclassified",
        }
    }

    /// The class of a method, if it reaches the host; [`Class::Unclassified`] if the table does
    /// not name it.
    pub fn of(method: &str) -> Option<Class> {
        match rules::lookup(method) {
            Some(Entry::Host(r)) => Some(r.class),
            Some(Entry::Open) => None,
            Some(Entry::Refused) | None => Some(Class::Unclassified),
        }
    }

    /// Whether the table names `method` (every method of the pinned app-server must be).
    pub fn is_classified(method: &str) -> bool {
        rules::lookup(method).is_some()
    }

    /// Whether `confine` means something for this class.
    fn confinable(self) -> bool {
        matches!(
            self,
            Class::Fs | Class::CommandExec | Class::Process | Class::Workspace
        )
    }
}

/// What to do with a class of methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Forward unchecked.
    Allow,
    /// Refuse every method of the class.
    Deny,
    /// Forward only when every path resolves inside the tenant's roots and no sandbox or
    /// permission choice is wider than workspace-write.
    Confine,
}

/// `[tenants.policy]` as written; unset keys take the defaults of
/// [`HostAccessPolicy::defaults`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// `fs/*` and other named-file methods.
    pub fs: Option<Mode>,
    /// `command/exec*`.
    pub command_exec: Option<Mode>,
    /// `process/*`.
    pub process: Option<Mode>,
    /// `thread/shellCommand` (`allow` or `deny`).
    pub shell_command: Option<Mode>,
    /// Config writes (`allow` or `deny`).
    pub config_write: Option<Mode>,
    /// Account changes (`allow` or `deny`).
    pub account: Option<Mode>,
    /// Plugin installs (`allow` or `deny`).
    pub plugins: Option<Mode>,
    /// `remoteControl/*` changes, and app-server's remote control in the workers (`allow` or
    /// `deny`).
    pub remote_control: Option<Mode>,
    /// Direct calls to MCP servers (`allow` or `deny`).
    pub mcp: Option<Mode>,
    /// Thread and turn working directories (`allow` or `confine`).
    pub workspace: Option<Mode>,
    /// Named permission profiles clients may select.
    pub permission_profiles: Option<Vec<String>>,
    /// Top-level keys allowed in a thread's `config` overrides.
    pub thread_config_keys: Option<Vec<String>>,
    /// Whether a sandbox policy may ask for network access.
    pub sandbox_network: Option<bool>,
}

/// A policy value that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// `confine` on a class the router has nothing to confine in.
    #[error("policy.{0}: only \"allow\" or \"deny\" are possible; the router cannot confine it")]
    CannotConfine(&'static str),
    /// `deny` on `workspace` would refuse every thread.
    #[error("policy.workspace: only \"allow\" or \"confine\" are possible")]
    CannotDenyWorkspace,
}

/// Params of a confined method longer than this are checked on the blocking pool
/// ([`HostAccessPolicy::check_inline`]): parsing them alone takes a while (a millisecond or so
/// at this size for the slowest JSON, small values; far less for a long prompt's text).
pub const INLINE_PARAMS_BYTES: usize = 256 << 10;

/// Path lookups (a component walked, `..` and symlinks' targets included: a system call or three)
/// a check on a thread that serves sessions may make before it is run on the blocking pool
/// instead: about half a millisecond in a debug build, scaled from the 2–2.7 µs a lookup
/// measured there (BENCHMARKS.md, section 7). A request naming a few ordinary paths stays
/// below: a path 8 deep is 8 or 9.
pub const INLINE_PATH_LOOKUPS: usize = 256;

/// Path lookups one request's check may make at all (on the blocking pool, one of its tenant's
/// at a time): beyond, the request is refused as invalid. Without a bound, a `turn/start` of
/// paths through chains of symlinks would hold a thread, and its tenant's and the process's turn
/// at costly work, for hours. The 75,000 plain paths of the heaviest request the tests send are
/// 1.8 million lookups, 4.9 s in a debug build: the bound is about 10 s of checking there
/// (scaled, not measured).
pub const MAX_PATH_LOOKUPS: usize = 4 << 20;

/// Built-in profiles no wider than workspace-write.
const DEFAULT_PROFILES: &[&str] = &[":read-only", ":workspace"];
/// Thread config overrides that change the model's behaviour, not its reach.
const DEFAULT_CONFIG_KEYS: &[&str] = &[
    "model",
    "model_reasoning_effort",
    "model_reasoning_summary",
    "model_verbosity",
    "service_tier",
    "features",
    "personality",
    "web_search",
    "hide_agent_reasoning",
    "show_raw_agent_reasoning",
    // Switches the TUI sets for its hidden title thread; each only narrows what the thread does.
    "skills.include_instructions",
    "tools.update_plan.enabled",
    "tools.experimental_request_user_input.enabled",
    "cloud.skills.enabled",
];

/// The resolved policy of one tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostAccessPolicy {
    fs: Mode,
    command_exec: Mode,
    process: Mode,
    shell_command: Mode,
    config_write: Mode,
    account: Mode,
    plugins: Mode,
    remote_control: Mode,
    mcp: Mode,
    workspace: Mode,
    permission_profiles: Vec<String>,
    thread_config_keys: Vec<String>,
    sandbox_network: bool,
}

/// The policy's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Forward the frame as it is.
    Allow,
    /// Forward the request with these params (JSON text) instead.
    Rewrite(String),
    /// Answer with [`Denial::to_error_response`] and do not forward.
    Deny(Denial),
    /// The request is malformed (a field of the wrong type, params that are not an object):
    /// answer `-32600` with this message (`Invalid request: …`, as app-server words it) and do
    /// not forward. Not a policy refusal: app-server would refuse it the same way.
    Invalid(String),
}

/// The request frame to forward after [`Decision::Rewrite`]: the same id and method with the
/// new params. `None` only if `params` is not JSON (never for a rewrite's own output).
pub fn rewritten_request(id: &RequestId, method: &str, params: &str) -> Option<String> {
    let params = RawValue::from_string(params.to_owned()).ok()?;
    Some(rpc::request(id, method, Some(&params)))
}

/// A refused request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// The class whose mode refused.
    pub class: Class,
    /// The method.
    pub method: String,
    /// What was wrong, for the client (names params fields, never resolved paths).
    pub detail: String,
}

impl Denial {
    fn new(class: Class, method: &str, detail: impl Into<String>) -> Denial {
        Denial {
            class,
            method: method.to_owned(),
            detail: detail.into(),
        }
    }

    /// The error message: `Host access denied by policy: <method> <detail>`.
    pub fn message(&self) -> String {
        format!(
            "Host access denied by policy: {} {}",
            self.method, self.detail
        )
    }

    /// `{"reason": "hostAccessDenied", "policy": "<class>", "method": "<method>"}`
    pub fn to_error_data(&self) -> Value {
        proto::error::host_access_denied_data(self.class.as_str(), &self.method)
    }

    /// The whole JSON-RPC error response to request `id`.
    pub fn to_error_response(&self, id: &RequestId) -> String {
        proto::error::host_access_denied_response(
            id,
            &self.message(),
            self.class.as_str(),
            &self.method,
        )
    }
}

// === impl PolicyConfig ===

impl PolicyConfig {
    /// Fills unset keys from [`HostAccessPolicy::defaults`] and checks the modes.
    pub fn resolve(&self, shared_uid: bool) -> Result<HostAccessPolicy, PolicyError> {
        let d = HostAccessPolicy::defaults(shared_uid);
        let p = HostAccessPolicy {
            fs: self.fs.unwrap_or(d.fs),
            command_exec: self.command_exec.unwrap_or(d.command_exec),
            process: self.process.unwrap_or(d.process),
            shell_command: self.shell_command.unwrap_or(d.shell_command),
            config_write: self.config_write.unwrap_or(d.config_write),
            account: self.account.unwrap_or(d.account),
            plugins: self.plugins.unwrap_or(d.plugins),
            remote_control: self.remote_control.unwrap_or(d.remote_control),
            mcp: self.mcp.unwrap_or(d.mcp),
            workspace: self.workspace.unwrap_or(d.workspace),
            permission_profiles: self
                .permission_profiles
                .clone()
                .unwrap_or(d.permission_profiles),
            thread_config_keys: self
                .thread_config_keys
                .clone()
                .unwrap_or(d.thread_config_keys),
            sandbox_network: self.sandbox_network.unwrap_or(d.sandbox_network),
        };
        p.validate()?;
        Ok(p)
    }
}

// === impl HostAccessPolicy ===

impl HostAccessPolicy {
    /// The defaults. With a uid per tenant (`shared_uid == false`): `fs` and `command_exec`
    /// confined (the OS keeps other tenants' files out of reach, the policy keeps paths and
    /// sandboxes tidy); `process` and `shell_command` denied (app-server runs them without any
    /// sandbox); config writes, account changes and plugin installs denied (they change the
    /// tenant's process-wide state and credentials, which the operator provisions); remote
    /// control and direct MCP calls denied (they reach outside around the router); `workspace`
    /// confined. With one shared uid, `fs` and `command_exec` are denied too:
    /// app-server's read-only and workspace-write sandboxes still read the whole disk, so a
    /// confined command could read another tenant's files.
    pub fn defaults(shared_uid: bool) -> HostAccessPolicy {
        let confine_unless_shared = if shared_uid {
            Mode::Deny
        } else {
            Mode::Confine
        };
        HostAccessPolicy {
            fs: confine_unless_shared,
            command_exec: confine_unless_shared,
            process: Mode::Deny,
            shell_command: Mode::Deny,
            config_write: Mode::Deny,
            account: Mode::Deny,
            plugins: Mode::Deny,
            remote_control: Mode::Deny,
            mcp: Mode::Deny,
            workspace: Mode::Confine,
            permission_profiles: DEFAULT_PROFILES.iter().map(|s| (*s).to_owned()).collect(),
            thread_config_keys: DEFAULT_CONFIG_KEYS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            sandbox_network: false,
        }
    }

    fn validate(&self) -> Result<(), PolicyError> {
        for class in [
            Class::ShellCommand,
            Class::ConfigWrite,
            Class::Account,
            Class::Plugins,
            Class::RemoteControl,
            Class::Mcp,
        ] {
            if self.mode(class) == Mode::Confine && !class.confinable() {
                return Err(PolicyError::CannotConfine(class.as_str()));
            }
        }
        if self.workspace == Mode::Deny {
            return Err(PolicyError::CannotDenyWorkspace);
        }
        Ok(())
    }

    /// The mode of a class.
    pub fn mode(&self, class: Class) -> Mode {
        match class {
            Class::Fs => self.fs,
            Class::CommandExec => self.command_exec,
            Class::Process => self.process,
            Class::ShellCommand => self.shell_command,
            Class::ConfigWrite => self.config_write,
            Class::Account => self.account,
            Class::Plugins => self.plugins,
            Class::Workspace => self.workspace,
            Class::RemoteControl => self.remote_control,
            Class::Mcp => self.mcp,
            Class::Unclassified => Mode::Deny,
        }
    }

    /// Whether the tenant's workers may run app-server's remote control (`remote_control =
    /// "allow"`); otherwise they start with it switched off.
    pub fn allows_remote_control(&self) -> bool {
        self.remote_control == Mode::Allow
    }

    /// [`check`](Self::check), if it is cheap enough for a thread that serves other sessions;
    /// `None` when it is not and must run on the blocking pool. A confined method's check parses
    /// its params and resolves the paths they name, one system call or so per path component:
    /// a tenant's 8 MB `turn/start` of 200,000 file inputs took 1.2 s, 2,000 paths of 2,000
    /// components 7.3 s. So params over [`INLINE_PARAMS_BYTES`] are never checked inline, and a
    /// check that needs more than [`INLINE_PATH_LOOKUPS`] path lookups gives up and is run again
    /// off the runtime.
    pub fn check_inline(
        &self,
        method: &str,
        params: Option<&RawValue>,
        roots: &TenantRoots,
    ) -> Option<Decision> {
        let entry = rules::lookup(method);
        match entry {
            // Only a confined method's check parses params and touches the filesystem.
            Some(Entry::Host(rule)) if self.mode(rule.class) == Mode::Confine => {
                if params.is_some_and(|p| p.get().len() > INLINE_PARAMS_BYTES) {
                    return None;
                }
                paths::within(INLINE_PATH_LOOKUPS, || {
                    self.decide(entry, method, params, roots)
                })
            }
            _ => Some(self.decide(entry, method, params, roots)),
        }
    }

    /// Decides one client request (`params`: its raw `params`), making at most
    /// [`MAX_PATH_LOOKUPS`] path lookups.
    pub fn check(&self, method: &str, params: Option<&RawValue>, roots: &TenantRoots) -> Decision {
        self.check_within(MAX_PATH_LOOKUPS, method, params, roots)
    }

    /// [`check`](Self::check) with at most `lookups` path lookups: a request that needs more is
    /// refused as invalid.
    fn check_within(
        &self,
        lookups: usize,
        method: &str,
        params: Option<&RawValue>,
        roots: &TenantRoots,
    ) -> Decision {
        paths::within(lookups, || {
            self.decide(rules::lookup(method), method, params, roots)
        })
        .unwrap_or_else(|| {
            Decision::Invalid(format!(
                "Invalid request: the paths it names take more than {lookups} path lookups to \
                 resolve, more than codex-fleet checks for one request"
            ))
        })
    }

    /// [`check`](Self::check) of a method the table classifies as `entry`.
    fn decide(
        &self,
        entry: Option<Entry>,
        method: &str,
        params: Option<&RawValue>,
        roots: &TenantRoots,
    ) -> Decision {
        let rule = match entry {
            Some(Entry::Open) => return Decision::Allow,
            Some(Entry::Host(rule)) => rule,
            Some(Entry::Refused) => {
                return Decision::Deny(Denial::new(
                    Class::Unclassified,
                    method,
                    "is not served by codex-fleet",
                ))
            }
            // Unknown to app-server as well: its own answer, and nothing forwarded.
            None => return Decision::Invalid(proto::method::unknown_method_message(method)),
        };
        match self.mode(rule.class) {
            Mode::Allow => Decision::Allow,
            Mode::Deny => Decision::Deny(Denial::new(
                rule.class,
                method,
                "is disabled for this tenant",
            )),
            Mode::Confine => match self.confine(rule, method, params, roots) {
                Ok(None) => Decision::Allow,
                Ok(Some(params)) => Decision::Rewrite(params.to_string()),
                Err(Fault::Deny(detail)) => Decision::Deny(Denial::new(rule.class, method, detail)),
                Err(Fault::Invalid(detail)) => {
                    Decision::Invalid(format!("Invalid request: {detail}"))
                }
            },
        }
    }
}

#[cfg(test)]
mod tests;
